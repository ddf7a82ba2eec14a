"""MoE against the dense transformer: step time per active-parameter FLOP, side by side.

One process, one run, 8 simulated devices (or the GPUs): the GPT-2 model (``jphantom.models.
gpt2``, ``--strategy tensor`` with ``model=1``) as a
dense model on ``data=8`` and with every other block a top-k MoE on ``expert=8`` (experts split
over the 8 ranks, the dense blocks data-parallel over them), one jitted AdamW step each, median
wall time over ``--steps`` round-robin rounds after ``--warmup``
(:mod:`jphantom.analysis.timing`). The active-parameter FLOPs of a step are
``TransformerConfig.flops_per_token() x tokens`` (an MoE block counts its router and the k experts
a token visits); the compiled step's own GEMM FLOPs (loops by trip count) are printed beside them:
their excess over the active FLOPs is the dispatch and combine (one-hot einsums of the capacity
buffers) and the capacity's padding.

Target, printed PASS/MISS, never asserted in tests: MoE seconds per active FLOP
<= 1.3x the dense transformer's.

Usage::

    python benchmarks/moe.py            # L=4, h=256, S=128, batch 32, E=8, top-1
    python benchmarks/moe.py --quick    # tiny, seconds

Results: ``<out>/results.json`` (default ``benchmarks/results/moe/``; ``--quick``: a scratch
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

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "moe"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="L=2, h=32, S=16, 3 rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq_len, args.batch, args.steps = 2, 32, 16, 16, 3
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="moe")
    base = dict(model="gpt2", strategy="tensor", vocab=256, seq_len=args.seq_len,
                hidden=args.hidden, heads=4, layers=args.layers, batch=args.batch, out=None,
                progress=False)
    models = {
        "dense": RunConfig.from_flags(**base, mesh=f"data={args.devices},model=1"),
        "moe": RunConfig.from_flags(**base, mesh=f"expert={args.devices},model=1", moe_every=2,
                                    experts=args.experts, top_k=args.top_k,
                                    capacity_factor=args.capacity_factor),
    }
    rng = np.random.default_rng(0)
    host = [rng.integers(0, 256, (args.batch, args.seq_len)).astype(np.int32) for _ in range(2)]
    tokens = args.batch * args.seq_len
    runners, rows = [], {}
    for name, run_config in models.items():
        runner, report = build_run_step(run_config, tuple(host), label=name,
                                        optimizer=optax.adamw(1e-3))
        runners.append(runner)
        config = run_config.family_config()  # the TransformerConfig: counts by formula
        rows[name] = {"mesh": run_config.parallel.mesh, "params": config.param_count(),
                      "active_params": config.param_count(active=True),
                      "active_flops_step": config.flops_per_token() * tokens,
                      "compiled_gemm_flops_step": report["flops_step"],
                      "collectives": report["collectives"]}
    times = time_round_robin(runners, args.steps, args.warmup)
    print(f"GPT L={args.layers} h={args.hidden} S={args.seq_len} batch {args.batch}; MoE every "
          f"2nd block, E={args.experts}, top-{args.top_k}, capacity factor "
          f"{args.capacity_factor}; {args.devices} devices ({jax.devices()[0].platform})")
    print(f"{'':7}{'mesh':>18}{'params':>12}{'active':>12}{'step ms':>9}"
          f"{'active GFLOP':>14}{'compiled GFLOP':>16}{'ns/active kFLOP':>17}")
    for name, row in rows.items():
        row["step_seconds"] = times[name]
        row["seconds_per_active_flop"] = times[name] / row["active_flops_step"]
        print(f"{name:7}{row['mesh']:>18}{row['params']:>12,}{row['active_params']:>12,}"
              f"{times[name] * 1e3:>9.2f}{row['active_flops_step'] / 1e9:>14.3f}"
              f"{row['compiled_gemm_flops_step'] / 1e9:>16.3f}"
              f"{row['seconds_per_active_flop'] * 1e12:>17.3f}")
    ratio = rows["moe"]["seconds_per_active_flop"] / rows["dense"]["seconds_per_active_flop"]
    print(f"target: MoE step time per active FLOP <= 1.3x dense: {ratio:.3f}x "
          f"{'PASS' if ratio <= 1.3 else 'MISS'}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"settings": vars(args) | {"out": str(args.out)}, "models": rows,
              "moe_over_dense_per_active_flop": ratio,
              "machine": {"cpu_count": os.cpu_count(), "devices": jax.device_count(),
                          "platform": jax.devices()[0].platform,
                          "device_kind": jax.devices()[0].device_kind}}
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"Wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
