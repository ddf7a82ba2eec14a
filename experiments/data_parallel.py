"""Cheng et al.'s bottom-up breakdown of a data-parallel step, and its speedup prediction (Eqs. 2-4).

Weak scaling of the GPT-2 transformer (``jphantom.models.gpt2``, ``tensor`` with ``model=1``:
plain data parallelism; a fixed batch per device) on ``data=n`` for n = 1, 2, 4, 8. For each n, side
by side (round robin):

- ``t_iter``: the training step (AdamW) as it trains;
- ``t_compute``: the same step compiled without its collectives (``jphantom.experimental.compute_only``:
  no gradient or loss reduction; measurement only) -- both from
  :func:`jphantom.analysis.timing.breakdown`, as ``jphantom inspect --breakdown`` reports them;
- ``t_comm = t_iter - t_compute`` and the shares r_compute, r_comm (Cheng et al.'s breakdown counts
  communication first; here the difference of two compiled programs);
- ``t_allreduce``: the gradient's all-reduce alone (a buffer of the step's parameter count, one
  jitted ``psum`` over ``data``): the "collective benchmark" that gives the network efficiency
  eff_{g->n} = t_allreduce(g) / t_allreduce(n), g = 2 the baseline;
- the Eq. 26 cost model of that all-reduce (Seal et al. Table III's Frontier constants), for scale.

Prediction (Eq. 4 with the baseline g = 2): speedup_{g->n} = (r_c + r_m) / (r_c + r_m / eff),
against the measured per-iteration time ratio t_iter(g) / t_iter(n). Cheng et al. assume a device's
compute is the same at every n (one GPU per rank); here the n simulated devices share 2 CPU
cores, so compute per step grows with n. The script therefore also predicts with the measured
compute at n: t_iter(n) ~ t_compute(n) + t_comm(g) / eff_{g->n}, which tests the part of the model
that carries over (communication scaling like the standalone collective).

Run: ``.venv/bin/python experiments/data_parallel.py`` (about 2 minutes); writes
``experiments/results/data_parallel/results.json`` (``--quick``: a scratch folder).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jphantom.analysis.timing import breakdown  # noqa: E402
from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.analysis.timing import Runner, time_round_robin  # noqa: E402
from jphantom.config import RunConfig  # noqa: E402
from jphantom.runtime.mesh import MeshConfig, first_devices  # noqa: E402
from jphantom.perf.comm_model import FRONTIER  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "data_parallel"


def _allreduce_seconds(n: int, elements: int, steps: int, warmup: int) -> float:
    """The gradient all-reduce alone: one psum over data of a float32 buffer per device."""
    mesh = MeshConfig.parse(f"data={n}").build(first_devices(n))
    fn = jax.jit(jax.shard_map(lambda x: lax.psum(x, "data"), mesh=mesh, in_specs=P("data"),
                               out_specs=P()))
    x = jax.device_put(jnp.ones((n * elements,), jnp.float32), NamedSharding(mesh, P("data")))
    runner = Runner("allreduce", fn.lower(x).compile(), (x,), threads_state=False,
                    flops_per_device=0, devices=n)
    return time_round_robin([runner], steps, warmup)["allreduce"]


def measure(n: int, args) -> dict:
    """``jphantom.analysis.timing.breakdown`` of the step on ``data=n``, and the all-reduce."""
    config = RunConfig.from_flags(model="gpt2", strategy="tensor", mesh=f"data={n},model=1",
                                  layers=args.layers, hidden=args.hidden, heads=4,
                                  seq_len=args.seq_len, vocab=256, batch=n * args.per_device,
                                  optimizer="adamw", out=None, progress=False)
    result = breakdown(config, steps=args.steps, warmup=args.warmup)
    elements = config.program().param_count
    allreduce = _allreduce_seconds(n, elements, args.steps, args.warmup) if n > 1 else 0.0
    modelled = FRONTIER.time_us("all-reduce", elements, n) * 1e-6 if n > 1 else 0.0
    return {"data": n, "params": elements, "t_iter": result["t_iter"],
            "t_compute": result["t_compute"], "t_comm": result["t_comm"],
            "r_compute": result["r_compute"], "r_comm": result["r_comm"],
            "t_allreduce": allreduce, "t_allreduce_eq26_frontier": modelled}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--per-device", type=int, default=2, help="sequences per device")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny model, data = 1, 2, 4")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    args.out = str(output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="data_parallel"))
    sizes = (1, 2, 4) if args.quick else (1, 2, 4, 8)
    if args.quick:
        args.layers, args.hidden, args.seq_len, args.steps = 1, 32, 16, 3
    start = time.perf_counter()
    rows = [measure(n, args) for n in sizes]
    base = next(r for r in rows if r["data"] == 2)
    print(f"GPT L={args.layers} h={args.hidden} S={args.seq_len}, {args.per_device} sequences per "
          f"device, AdamW; P = {rows[0]['params']:,}; baseline g = 2")
    print(f"{'n':>3}{'t_iter ms':>11}{'t_comp ms':>11}{'t_comm ms':>11}{'r_comm':>8}"
          f"{'allreduce ms':>14}{'eff':>7}{'meas. g->n':>12}{'Eq. 4':>8}{'w/ t_comp(n)':>14}")
    for r in rows:
        if r["data"] >= 2:
            eff = base["t_allreduce"] / r["t_allreduce"]
            r["eff_from_g"] = eff
            r["measured_speedup_from_g"] = base["t_iter"] / r["t_iter"]
            r["eq4_speedup_from_g"] = ((base["r_compute"] + base["r_comm"])
                                       / (base["r_compute"] + base["r_comm"] / eff))
            predicted_iter = r["t_compute"] + base["t_comm"] / eff
            r["predicted_t_iter_with_measured_compute"] = predicted_iter
            r["speedup_with_measured_compute"] = base["t_iter"] / predicted_iter
        print(f"{r['data']:>3}{r['t_iter'] * 1e3:>11.2f}{r['t_compute'] * 1e3:>11.2f}"
              f"{r['t_comm'] * 1e3:>11.2f}{r['r_comm']:>8.3f}{r['t_allreduce'] * 1e3:>14.2f}"
              + (f"{r['eff_from_g']:>7.3f}{r['measured_speedup_from_g']:>12.3f}"
                 f"{r['eq4_speedup_from_g']:>8.3f}{r['speedup_with_measured_compute']:>14.3f}"
                 if r["data"] >= 2 else ""))
    errors = [(r["speedup_with_measured_compute"] - r["measured_speedup_from_g"]) ** 2
              for r in rows if r["data"] > 2]
    errors_eq4 = [(r["eq4_speedup_from_g"] - r["measured_speedup_from_g"]) ** 2
                  for r in rows if r["data"] > 2]
    summary = {"mse_with_measured_compute": float(np.mean(errors)) if errors else None,
               "mse_eq4": float(np.mean(errors_eq4)) if errors_eq4 else None}
    print(f"MSE of predicted vs measured speedup: Eq. 4 {summary['mse_eq4']:.4f}, with measured "
          f"compute {summary['mse_with_measured_compute']:.4f} (Cheng et al.: < 0.02)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({
        "rows": rows, "summary": summary, "settings": vars(args),
        "machine": {"cpu_count": os.cpu_count(), "platform": jax.devices()[0].platform},
        "seconds": time.perf_counter() - start}, indent=1))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
