"""AxoNN's 3D parallel matrix multiply against Megatron tensor parallelism, side by side.

One process, one run, 8 simulated devices (or the GPUs): the same GPT-2 model
(``jphantom.models.gpt2``) under ``tensor`` on
``data=8,model=1`` and ``data=4,model=2`` and under ``pmm3d`` on several (G_x, G_y, G_z, G_data)
grids, one jitted AdamW step each, median wall time over ``--steps`` round-robin rounds after
``--warmup`` (:mod:`jphantom.analysis.timing`). Every layout runs the same model, so the step's
model FLOPs (``TransformerConfig.flops_per_token() x tokens``) are the same for all and the time
per FLOP is the step time over them; the compiled GEMM FLOPs and the collective bytes per device
(HLO, trip counts applied) are printed beside.

Target, printed PASS/MISS, never asserted in tests: the fastest pmm3d grid's step time
per FLOP <= 1.15x the fastest tensor layout's. On simulated CPU devices there is no network: time
follows FLOPs and the host's threads, not bandwidth.

Usage::

    python benchmarks/pmm3d.py            # L=4, h=256, S=128, batch 32
    python benchmarks/pmm3d.py --quick    # tiny, seconds

Results: ``<out>/results.json`` (default ``benchmarks/results/pmm3d/``; ``--quick``: a scratch
folder).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.analysis.timing import build_run_step, time_round_robin  # noqa: E402
from jphantom.config import RunConfig  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pmm3d"
LAYOUTS = [("tensor", "data=8,model=1"), ("tensor", "data=4,model=2"),
           ("pmm3d", "data=8,z=1,y=1,x=1"), ("pmm3d", "data=4,z=2,y=1,x=1"),
           ("pmm3d", "data=4,z=1,y=1,x=2"), ("pmm3d", "data=2,z=2,y=1,x=2"),
           ("pmm3d", "data=2,z=1,y=2,x=2"), ("pmm3d", "data=1,z=2,y=2,x=2")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="L=2, h=32, S=16, 3 rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq_len, args.batch, args.steps = 2, 32, 16, 16, 3
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="pmm3d")
    shape = dict(model="gpt2", vocab=256, seq_len=args.seq_len, hidden=args.hidden,
                 heads=args.heads, layers=args.layers, batch=args.batch, out=None, progress=False)
    config = RunConfig.from_flags(**shape, strategy="tensor", mesh=LAYOUTS[0][1]).family_config()
    rng = np.random.default_rng(0)
    host = [rng.integers(0, 256, (args.batch, args.seq_len)).astype(np.int32) for _ in range(2)]
    flops = config.flops_per_token() * args.batch * args.seq_len
    runners, rows = [], {}
    for name, mesh_text in LAYOUTS:
        label = f"{name} {mesh_text}"
        runner, report = build_run_step(
            RunConfig.from_flags(**shape, strategy=name, mesh=mesh_text), tuple(host),
            label=label, optimizer=optax.adamw(1e-3))
        runners.append(runner)
        rows[label] = {"strategy": name, "mesh": mesh_text,
                       "compiled_gemm_flops_step": report["flops_step"],
                       "collective_bytes_per_device": report["collective_bytes_per_device"]}
    times = time_round_robin(runners, args.steps, args.warmup)
    print(f"GPT L={args.layers} h={args.hidden} heads={args.heads} S={args.seq_len} batch "
          f"{args.batch}: {flops / 1e9:.2f} model GFLOP per step; {jax.device_count()} devices "
          f"({jax.devices()[0].platform})")
    print(f"{'layout':32}{'step ms':>10}{'ns/kFLOP':>10}{'GEMM GFLOP':>12}{'coll. MB/dev':>14}")
    for label, row in rows.items():
        row["step_seconds"] = times[label]
        row["seconds_per_flop"] = times[label] / flops
        print(f"{label:32}{times[label] * 1e3:>10.2f}{row['seconds_per_flop'] * 1e12:>10.3f}"
              f"{row['compiled_gemm_flops_step'] / 1e9:>12.3f}"
              f"{row['collective_bytes_per_device'] / 1e6:>14.3f}")
    best = {s: min((r for r in rows.values() if r["strategy"] == s),
                   key=lambda r: r["step_seconds"]) for s in ("tensor", "pmm3d")}
    ratio = best["pmm3d"]["seconds_per_flop"] / best["tensor"]["seconds_per_flop"]
    print(f"fastest tensor: {best['tensor']['mesh']}; fastest pmm3d: {best['pmm3d']['mesh']}")
    print(f"target: pmm3d step time per FLOP <= 1.15x tensor's: {ratio:.3f}x "
          f"{'PASS' if ratio <= 1.15 else 'MISS'}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"settings": vars(args) | {"out": str(args.out)}, "model_flops_step": flops,
              "layouts": rows, "pmm3d_over_tensor_per_flop": ratio,
              "best": {s: r["mesh"] for s, r in best.items()},
              "machine": {"cpu_count": os.cpu_count(), "devices": jax.device_count(),
                          "platform": jax.devices()[0].platform,
                          "device_kind": jax.devices()[0].device_kind}}
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"Wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
