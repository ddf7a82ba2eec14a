"""Long sequences: per-device memory and step time against sequence length, with and without
context parallelism.

The same Llama (grouped-query attention, 2 blocks, h = 64, 4 query and 2 key/value heads of 16)
trains one sequence per step at each sequence length S, on 8 simulated CPU devices, as

* ``none``: the whole sequence on one device (``--strategy dense``), the unsplit step;
* ``ring C``: ``--mesh context=C`` with ring attention (:mod:`jphantom.nn.attention`), C = 4, 8;
* ``all-gather C``: the same mesh with K/V all-gathered.

For each it compiles the training step and reads XLA's temporary memory per device (the
activations, attention blocks and gradients the step allocates; arguments excluded), and, up to
``--time-up-to`` tokens, runs ``--steps`` steps and reports the median step time (the compile step
excluded). Simulated devices share 2 CPU cores: the times show the work per device and the
per-step overheads of a ring on one host, not a GPU cluster's speed.

Run: ``.venv/bin/python experiments/long_context.py`` (about 5 minutes on 2 cores); writes
``experiments/results/long_context/results.json`` and ``long_context.png``. ``--quick`` (one
length of 64 tokens) for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jphantom.registry import program as programs  # noqa: E402
from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.runtime.mesh import first_devices  # noqa: E402
from jphantom.models.llama import LlamaConfig  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "long_context"
LAYOUTS = [("none", 1, None), ("ring", 4, "ring"), ("ring", 8, "ring"),
           ("all-gather", 4, "all-gather"), ("all-gather", 8, "all-gather")]


def build(seq: int, context: int, algorithm: str | None):
    config = LlamaConfig(vocab_size=256, hidden=64, intermediate=128, layers=2, heads=4,
                         kv_heads=2, max_positions=seq)
    if context == 1:
        program = programs.build(config, "dense", "model=1")
    else:
        program = programs.build(config, "tensor", f"context={context}",
                                 context_attention=algorithm)
    mesh = program.mesh.build(first_devices(program.mesh.device_count))
    return program, program.train_step(mesh, optax.adamw(1e-3), donate=True)


def measure(seq: int, context: int, algorithm: str | None, steps: int, timed: bool) -> dict:
    program, step = build(seq, context, algorithm)
    batch = [jax.ShapeDtypeStruct((1, seq), np.int32,
                                  sharding=jax.sharding.NamedSharding(step.mesh, s))
             for s in step.specs_of_batch(2)]
    compiled = step.lower(step.abstract_state(), *batch).compile()
    memory = compiled.memory_analysis()
    row = {"seq_len": seq, "context": context, "attention": algorithm or "none",
           "temp_bytes_per_device": int(memory.temp_size_in_bytes),
           "argument_bytes_per_device": int(memory.argument_size_in_bytes)}
    if timed:
        rng = np.random.default_rng(0)
        tokens, targets = (rng.integers(0, 256, (1, seq)).astype(np.int32) for _ in range(2))
        state = program.init(step, seed=0)
        times = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            state, loss = step(state, tokens, targets)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
        row["step_seconds"] = statistics.median(times[1:])
        row["loss"] = float(loss)
    return row


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, context, _ in LAYOUTS:
        label = "none (1 device)" if context == 1 else f"{name}, context={context}"
        mine = [r for r in rows if r["attention"] == (name if context > 1 else "none")
                and r["context"] == context]
        left.plot([r["seq_len"] for r in mine], [r["temp_bytes_per_device"] / 2**20 for r in mine],
                  "o-", label=label)
        timed = [r for r in mine if "step_seconds" in r]
        if timed:
            right.plot([r["seq_len"] for r in timed], [r["step_seconds"] for r in timed], "o-",
                       label=label)
    for axis, what in ((left, "temporary memory per device (MiB)"),
                       (right, "step time (s, 8 simulated devices on 2 cores)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("sequence length")
        axis.set_ylabel(what)
        axis.legend(fontsize=8)
    fig.suptitle("Llama (2 blocks, h=64, GQA 4/2): context parallelism")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="1024,2048,4096,8192",
                        help="comma-separated sequence lengths (multiples of 16)")
    parser.add_argument("--time-up-to", type=int, default=4096,
                        help="run and time the steps up to this sequence length (compile only "
                             "above it)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per point")
    parser.add_argument("--quick", action="store_true", help="one short length, for the tests")
    parser.add_argument("--out", default=None, help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="long_context")
    seqs = [64] if args.quick else [int(s) for s in args.seq_lens.split(",")]
    limit = 128 if args.quick else args.time_up_to
    steps = 1 if args.quick else args.steps
    rows = []
    for seq in seqs:
        for name, context, algorithm in LAYOUTS:
            row = measure(seq, context, algorithm, steps, seq <= limit)
            rows.append(row)
            print(f"S={seq:6d}  {row['attention']:>10s}  C={context}  temp "
                  f"{row['temp_bytes_per_device'] / 2**20:9.1f} MiB"
                  + (f"  step {row['step_seconds']:.3f} s" if "step_seconds" in row else ""),
                  flush=True)
    ratios = {}
    for seq in seqs:
        base = next(r for r in rows if r["seq_len"] == seq and r["context"] == 1)
        for r in rows:
            if r["seq_len"] == seq and r["context"] > 1:
                key = f"{r['attention']}, context={r['context']}, S={seq}"
                ratios[key] = {"temp_memory": r["temp_bytes_per_device"]
                               / base["temp_bytes_per_device"]}
                if "step_seconds" in r and "step_seconds" in base:
                    ratios[key]["step_time"] = r["step_seconds"] / base["step_seconds"]
    results = {"settings": {"model": "llama layers=2 hidden=64 heads=4 kv_heads=2 vocab=256",
                            "batch": 1, "devices": 8, "platform": jax.devices()[0].platform,
                            "jax": jax.__version__},
               "rows": rows, "ratios_to_unsplit": ratios}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(rows, args.out / "long_context.png")
    print(f"wrote {args.out / 'results.json'} and long_context.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
