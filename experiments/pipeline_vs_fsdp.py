"""Pipelines against FSDP: the same Llama on 8 devices as ZeRO-3 over ``data=8`` and as
``stage=P x data=8/P`` pipelines under each executed schedule, with the zero-bubble schedules
priced from their lock-step tables.

For every layout the script compiles the training step and reads, per device, XLA's temporary
memory, the collective bytes of the optimized HLO per mesh axis (loop trip counts applied) and
the GEMM FLOPs; it runs ``--steps`` steps and reports the median step time (8 simulated CPU
devices on 2 cores: the sum of every device's work, not a cluster's time). Then, **modelled**,
the step time on a GPU node whose devices sustain ``--tflops`` and whose links move
``--slow-gbps`` or ``--fast-gbps``: compute = the busiest device's GEMM FLOPs / TFLOP/s, stretched
by the schedule's lock-step cost over its ideal (``jphantom.pipeline.schedule``: GPipe and 1F1B
(M + P - 1)(t_f + t_b); ZB-H1 and ZB-V from ``lockstep_split``, whose backward split the executor
does not run yet: their rows reuse 1F1B's compiled bytes and memory), plus every collective byte
/ bandwidth, no overlap. The point is where a pipeline pays: on slow links, where FSDP's
per-layer gathers of the whole model cost more than a pipeline's activations.

Run: ``.venv/bin/python experiments/pipeline_vs_fsdp.py`` (about 4 minutes on 2 cores); writes
``experiments/results/pipeline_vs_fsdp/results.json`` and ``pipeline_vs_fsdp.png``. ``--quick``
for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jphantom import program as programs  # noqa: E402
from jphantom.analysis.hlo import collectives, dot_flops  # noqa: E402
from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.mesh import first_devices  # noqa: E402
from jphantom.models.llama import LlamaConfig  # noqa: E402
from jphantom.pipeline import schedule as schedules  # noqa: E402
from jphantom.pipeline.runner import PipelineConfig  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pipeline_vs_fsdp"


def layouts(quick: bool):
    yield "fsdp (zero-3)", "data=8", None, 1
    for stages in ((2,) if quick else (2, 4)):
        for name in ("gpipe", "1f1b") + (() if quick else ("interleaved-1f1b",)):
            yield f"{name} P={stages}", f"stage={stages},data={8 // stages}", name, stages


def measure(config, mesh, schedule, stages, batch, steps):
    program = programs.build(config, "tensor", mesh)
    devices = program.mesh.build(first_devices(program.mesh.device_count))
    # one sequence per micro-batch: M = the data rank's batch (4P here, the M)
    options = {"zero": 3} if schedule is None else {"pipeline": PipelineConfig(
        schedule, batch // (8 // stages), 2 if schedule == "interleaved-1f1b" else 1)}
    step = program.train_step(devices, optax.adamw(1e-3), **options)
    seq = config.max_positions
    specs = step._specs_of_batch(2)
    shapes = [jax.ShapeDtypeStruct((batch, seq), np.int32,
                                   sharding=jax.sharding.NamedSharding(step.mesh, s))
              for s in specs]
    compiled = step.lower(step.abstract_state(), *shapes).compile()
    hlo = compiled.as_text()
    axes = dict(step.mesh.shape)
    by_axis = {}
    for c in collectives(hlo):
        key = "+".join(c.mesh_axes(axes)) or "none"
        by_axis[key] = by_axis.get(key, 0) + c.total_bytes
    row = {"mesh": mesh, "schedule": schedule or "none",
           "microbatches": options.get("pipeline").microbatches if schedule else None,
           "temp_bytes_per_device": int(compiled.memory_analysis().temp_size_in_bytes),
           "collective_bytes_by_axis": by_axis,
           "gemm_flops_per_device": dot_flops(hlo)[0]}
    rng = np.random.default_rng(0)
    tokens, targets = (rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32)
                       for _ in range(2))
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


def stretch(schedule: str | None, stages: int, microbatches: int | None) -> float:
    """The schedule's lock-step time over its ideal M (t_f + t_b) (t_b = 2 t_f)."""
    if schedule is None:
        return 1.0
    ideal = microbatches * 3.0
    if schedule in schedules.SPLIT_SCHEDULES:
        return schedules.lockstep_split(schedule, stages, microbatches).cost() / ideal
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    return schedules.lockstep(schedule, stages, microbatches, virtual).cost(2.0) / ideal


def modelled(row, stages, tflops, gbps) -> float:
    compute = row["gemm_flops_per_device"] / (tflops * 1e12)
    compute *= stretch(None if row["schedule"] == "none" else row["schedule"], stages,
                       row["microbatches"])
    return compute + sum(row["collective_bytes_by_axis"].values()) / (gbps * 1e9)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    parser.add_argument("--tflops", type=float, default=400.0,
                        help="modelled sustained TFLOP/s per GPU (default 400, an H100's bf16)")
    parser.add_argument("--slow-gbps", type=float, default=12.5,
                        help="modelled slow link, GB/s per GPU (default 12.5: 100 Gb/s Ethernet)")
    parser.add_argument("--fast-gbps", type=float, default=450.0,
                        help="modelled fast link, GB/s per GPU (default 450: NVLink 4)")
    parser.add_argument("--quick", action="store_true", help="tiny model, two layouts")
    parser.add_argument("--out", default=None, help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="pipeline_vs_fsdp")
    if args.quick:
        config = LlamaConfig(vocab_size=128, hidden=32, intermediate=64, layers=4, heads=4,
                             kv_heads=2, max_positions=16)
        batch, steps = 16, 1
    else:
        config = LlamaConfig(vocab_size=1024, hidden=256, intermediate=704, layers=8, heads=8,
                             kv_heads=4, max_positions=128)
        batch, steps = 32, args.steps
    rows = []
    for label, mesh, schedule, stages in layouts(args.quick):
        row = measure(config, mesh, schedule, stages, batch, steps)
        row.update(label=label, stages=stages)
        rows.append(row)
        if schedule == "1f1b":  # the split schedules, priced on 1F1B's compiled program
            for split in schedules.SPLIT_SCHEDULES:
                rows.append({**row, "label": f"{split} P={stages} (modelled)",
                             "schedule": split, "step_seconds": None, "loss": None,
                             "executed": False})
    for row in rows:
        row.setdefault("executed", True)
        row["stretch"] = stretch(None if row["schedule"] == "none" else row["schedule"],
                                 row["stages"], row["microbatches"])
        row["modelled_seconds"] = {
            "slow": modelled(row, row["stages"], args.tflops, args.slow_gbps),
            "fast": modelled(row, row["stages"], args.tflops, args.fast_gbps)}
        step = f"{row['step_seconds']:.3f} s" if row["step_seconds"] else "  (not run)"
        print(f"{row['label']:<28} {step:>11}  temp {row['temp_bytes_per_device'] / 2**20:7.1f} "
              f"MiB  bytes {sum(row['collective_bytes_by_axis'].values()) / 2**20:8.2f} MiB  "
              f"stretch {row['stretch']:.3f}  modelled slow {row['modelled_seconds']['slow']*1e3:8.3f}"
              f" ms fast {row['modelled_seconds']['fast']*1e3:7.3f} ms", flush=True)
    results = {"settings": {"model": {k: getattr(config, k) for k in (
        "vocab_size", "hidden", "intermediate", "layers", "heads", "kv_heads", "max_positions")},
        "batch": batch, "devices": 8, "tflops": args.tflops, "slow_gbps": args.slow_gbps,
        "fast_gbps": args.fast_gbps, "jax": jax.__version__,
        "modelled": "compute = GEMM FLOPs / TFLOP/s x the schedule's lock-step stretch; "
                    "communication = collective bytes / GB/s; no overlap"},
        "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(rows, args.out / "pipeline_vs_fsdp.png")
    print(f"wrote {args.out / 'results.json'} and pipeline_vs_fsdp.png")
    return 0


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in rows]
    x = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    left.bar(x - 0.2, [r["modelled_seconds"]["slow"] * 1e3 for r in rows], 0.4, label="slow link")
    left.bar(x + 0.2, [r["modelled_seconds"]["fast"] * 1e3 for r in rows], 0.4, label="fast link")
    left.set_ylabel("modelled step time (ms)")
    left.legend()
    right.bar(x, [r["temp_bytes_per_device"] / 2**20 for r in rows])
    right.set_ylabel("compiled temporary memory per device (MiB)")
    for axis in (left, right):
        axis.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    fig.suptitle("Llama on 8 devices: FSDP (ZeRO-3) against pipelines")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
