"""Plain data parallelism against ZeRO-1, 2 and 3, side by side on 8 simulated devices.

One process, one run: Seal et al.'s FFN (``jphantom.models.ffn``, ``tensor`` with ``model=1``, so only
the ``data`` axis shards) on
``data=<devices>``, one jitted AdamW step per ZeRO stage, median wall time over ``--steps``
round-robin rounds after ``--warmup`` (``jphantom.analysis.timing``), with per device: the
parameter, gradient-free optimizer-state and batch bytes the step takes (``argument_bytes``), the
compiled temp bytes, and the bytes of each collective kind over ``data`` (HLO, trip counts
applied). Model-state bytes at rest per device are compared with Cheng et al.'s 16P (mixed precision:
here float32 parameters and Adam's two float32 moments, 12P per device for DP, (4 + 8/D)P for
ZeRO-1/2 and 12P/D for ZeRO-3, gradients excluded since they live inside the step).

Target, printed PASS/MISS, never asserted in tests: ZeRO-3 step time <= 1.10x plain
DP's.

Usage::

    python benchmarks/zero_stages.py            # width 1024, depth 8, batch 256
    python benchmarks/zero_stages.py --quick    # tiny, seconds

Results: ``<out>/results.json`` (default ``benchmarks/results/zero_stages/``; ``--quick``: a
scratch folder).
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

from jphantom.analysis.compiled import per_device_bytes  # noqa: E402
from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.analysis.timing import build_run_step, time_round_robin  # noqa: E402
from jphantom.config import RunConfig  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "zero_stages"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="width 64, depth 2, 3 rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.batch, args.steps = 64, 2, 32, 3
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="zero_stages")
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((args.batch, args.width)).astype(np.float32) for _ in range(2)]
    runners, rows = [], {}
    for zero in (0, 1, 2, 3):
        config = RunConfig.from_flags(model="ffn", strategy="tensor",
                                      mesh=f"data={args.devices},model=1", width=args.width,
                                      depth=args.depth, batch=args.batch, zero=zero, out=None,
                                      progress=False)
        runner, report = build_run_step(config, tuple(host), label=f"zero-{zero}",
                                        optimizer=optax.adamw(1e-3))
        params, opt_state = runner.state[0].params, runner.state[0].opt_state
        over_data = {}  # model=1: every collective is over data
        for c in report["collectives"]:
            over_data[c["kind"]] = over_data.get(c["kind"], 0) + c["bytes"]
        rows[zero] = {
            "params_bytes": per_device_bytes(params),
            "optimizer_bytes": per_device_bytes(opt_state),
            "temp_bytes": report["memory"]["temp_bytes"],
            "collective_bytes_over_data": over_data,
        }
        runners.append(runner)
    times = time_round_robin(runners, args.steps, args.warmup)
    total_params = config.program().param_count
    print(f"FFN width {args.width}, depth {args.depth}, batch {args.batch}, data={args.devices}, "
          f"AdamW float32; P = {total_params:,} parameters")
    print(f"{'':8}{'step ms':>9}{'x DP':>7}{'params MB':>11}{'Adam MB':>9}{'temp MB':>9}"
          "  collectives over data (MB)")
    for zero in (0, 1, 2, 3):
        r = rows[zero]
        r["step_seconds"] = times[f"zero-{zero}"]
        r["time_vs_dp"] = times[f"zero-{zero}"] / times["zero-0"]
        coll = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(r["collective_bytes_over_data"].items()))
        print(f"zero-{zero:<3}{r['step_seconds'] * 1e3:>9.2f}{r['time_vs_dp']:>7.3f}"
              f"{r['params_bytes'] / 1e6:>11.3f}{r['optimizer_bytes'] / 1e6:>9.3f}"
              f"{r['temp_bytes'] / 1e6:>9.2f}  {coll}")
    state = {z: rows[z]["params_bytes"] + rows[z]["optimizer_bytes"] for z in rows}
    D = args.devices
    expected = {0: 12 * total_params, 1: (4 + 8 / D) * total_params,
                2: (4 + 8 / D) * total_params, 3: 12 * total_params / D}
    for zero in rows:
        rows[zero]["model_state_bytes"] = state[zero]
        rows[zero]["model_state_formula_bytes"] = expected[zero]
        print(f"zero-{zero}: parameters + Adam per device {state[zero] / 1e6:.3f} MB; formula "
              f"{expected[zero] / 1e6:.3f} MB ({state[zero] / expected[zero]:.3f}x)")
    ratio = rows[3]["time_vs_dp"]
    print(f"target: ZeRO-3 step time <= 1.10x DP: {ratio:.3f}x {'PASS' if ratio <= 1.10 else 'MISS'}")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"settings": vars(args) | {"out": str(args.out)}, "parameters": total_params,
              "stages": {f"zero-{z}": rows[z] for z in rows},
              "machine": {"cpu_count": os.cpu_count(), "devices": jax.device_count(),
                          "platform": jax.devices()[0].platform}}
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    print(f"Wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
