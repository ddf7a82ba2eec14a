"""The module step (:class:`jphantom.TrainStep`): its compile time flat in depth, and the cost of
running the optax update on the global arrays.

One process, 8 simulated CPU devices (``--devices``), mesh ``data=2,model=4`` (``--mesh``), the
GPT-2 model (:mod:`jphantom.models.gpt2`) under Megatron tensor parallelism
(``--strategy tensor``, :func:`jphantom.registry.program.build`):

- *compile time* of the step at 2 and ``--compile-layers`` (default 12) layers
  (:func:`jphantom.analysis.compiled.compile_step`: lower and compile on abstract parameters, SGD).
  The blocks are a :class:`jphantom.nn.Stacked` under ``lax.scan``, so it stays flat in depth
  (target: 12 layers < 5 s, printed PASS/MISS, never asserted in tests);
- *the optimizer update*: the median wall time of one jitted step with ``optax.sgd`` and with
  ``optax.adamw`` side by side, over ``--steps`` round-robin rounds after ``--warmup``
  (:func:`jphantom.analysis.timing.time_round_robin`), and their ratio. The step runs the update
  after its ``shard_map``, inside the same ``jax.jit``, on the global gradient arrays with the
  parameters' shardings kept (what makes every optax transformation exact, global-norm clipping
  included); an element-wise update adds no collective, so both steps move the same bytes
  (``collective_bytes_per_device``, from the compiled HLO) and AdamW's extra time is its update's
  arithmetic and memory traffic.

Usage::

    python benchmarks/nnx_step.py            # L=4, h=256, 8 heads, S=128, B=16
    python benchmarks/nnx_step.py --quick    # tiny, seconds

Results: ``<out>/results.json`` (default ``benchmarks/results/nnx_step/``; ``--quick``: a scratch
folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "nnx_step"
COMPILE_SECONDS = 5.0
OPTIMIZERS = ("sgd", "adamw")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument("--mesh", default="data=2,model=4", help="mesh (default data=2,model=4)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="width h (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (128)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    parser.add_argument("--compile-layers", type=int, default=12, help="layers of the compile "
                                                                        "time check (default 12)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run (results "
                                                             "go to a scratch folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq_len, args.batch = 1, 64, 16, 4
        args.steps, args.warmup, args.compile_layers = 2, 1, 2
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from jphantom.runtime.mesh import ensure_devices

    ensure_devices(args.devices)
    import jax
    import numpy as np
    import optax

    from jphantom.analysis.compiled import compile_step
    from jphantom.analysis.machine import output_folder
    from jphantom.analysis.timing import build_run_step, time_round_robin
    from jphantom.config import RunConfig

    out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="nnx_step")
    shape = dict(model="gpt2", strategy="tensor", mesh=args.mesh, hidden=args.hidden,
                 heads=args.heads, seq_len=args.seq_len, vocab=256, batch=args.batch,
                 warmup_steps=0, out=None, progress=False)
    rng = np.random.default_rng(0)
    tokens, targets = (rng.integers(0, 256, (args.batch, args.seq_len)).astype(np.int32)
                       for _ in range(2))
    config = RunConfig.from_flags(**shape, layers=args.layers)
    optimizers = {"sgd": optax.sgd(1e-3), "adamw": optax.adamw(1e-3)}
    runners, reports = [], {}
    for name in OPTIMIZERS:
        runner, reports[name] = build_run_step(config, (tokens, targets), label=name,
                                               optimizer=optimizers[name])
        runners.append(runner)
    times = time_round_robin(runners, args.steps, args.warmup)
    compiles = {}
    for layers in sorted({2, args.compile_layers}):
        compiles[layers] = compile_step(RunConfig.from_flags(**shape, layers=layers,
                                                             optimizer="sgd"))[1]
    ratio = times["adamw"] / times["sgd"]
    results = {
        "machine": {"host": platform.node(), "jax": jax.__version__,
                    "devices": jax.device_count(), "platform": jax.devices()[0].platform,
                    "cpu_count": os.cpu_count()},
        "shape": {"model": "gpt2", "strategy": "tensor", "layers": args.layers,
                  "hidden": args.hidden, "heads": args.heads, "seq_len": args.seq_len,
                  "batch": args.batch, "mesh": args.mesh, "params": reports["sgd"]["params"]},
        "median_step_seconds": times, "adamw_over_sgd": ratio,
        "step_seconds_all": {r.name: r.times for r in runners},
        "collective_bytes_per_device": {name: reports[name]["collective_bytes_per_device"]
                                        for name in OPTIMIZERS},
        "compile_seconds": {**{f"{name}_main": reports[name]["compile_seconds"]
                               for name in OPTIMIZERS},
                            **{f"{k}_layers": v for k, v in compiles.items()}},
        "targets": {f"compile_{args.compile_layers}_layers_under_5s":
                    compiles[args.compile_layers] < COMPILE_SECONDS},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"GPT-2 L={args.layers} h={args.hidden} heads={args.heads} S={args.seq_len} "
          f"B={args.batch}, tensor on {args.mesh}, {jax.device_count()} devices "
          f"({jax.devices()[0].platform})")
    print(f"step time  sgd {times['sgd'] * 1e3:8.1f} ms   adamw {times['adamw'] * 1e3:8.1f} ms   "
          f"adamw/sgd {ratio:.3f}")
    print("collective bytes per device  " + "   ".join(
        f"{name} {reports[name]['collective_bytes_per_device']:,}" for name in OPTIMIZERS))
    for layers, seconds in compiles.items():
        print(f"step compile, {layers} layers: {seconds:.2f} s")
    verdict = "PASS" if compiles[args.compile_layers] < COMPILE_SECONDS else "MISS"
    print(f"target: {args.compile_layers}-layer compile < {COMPILE_SECONDS:.0f} s: {verdict}")
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
