"""Pipelines against FSDP: the same Llama on 8 devices as ZeRO-3 over ``data=8`` and as
``stage=P x data=8/P`` pipelines under every executed schedule (GPipe, 1F1B, interleaved 1F1B,
and the zero-bubble ZB-H1 and ZB-V, whose backward the executor splits into B and W).

For every layout the script compiles the training step and reads, per device, XLA's temporary
memory, the collective bytes of the optimized HLO per mesh axis (loop trip counts applied) and
the GEMM FLOPs; it runs ``--steps`` steps and reports the median step time (8 simulated CPU
devices on 2 cores: the sum of every device's work, not a cluster's time -- an idle device costs
nothing here, so no bubble shows and a schedule's measured time is its total work).

Because the bubble is invisible here, the script also times, on one device, each task of a stage
(``--task-costs``): the forward with its residuals (F), the whole backward (1F1B's), and the
split B and W (:mod:`jphantom.pipeline.split`), and prices every schedule's lock-step table with
them: ``lockstep_ms`` = the sum over slots of the slowest task in it (what P parallel devices in
lock-step would take, **modelled from measured task times, no per-slot overhead**). The per-slot
overhead is reported from the measured total work: ``extra_work`` = measured step time over
1F1B's, against ``task_work`` = the same ratio of the tasks' own times.

Then, **modelled**, the step time on a GPU node whose devices sustain ``--tflops`` and whose
links move ``--slow-gbps`` or ``--fast-gbps``: compute = the busiest device's GEMM FLOPs (all
schedules do the same: 1F1B's) / TFLOP/s, stretched by the schedule's lock-step cost over its
ideal (``jphantom.pipeline.schedule``, t_b = 2 t_f, B = W), plus every collective byte /
bandwidth, no overlap. The point is where a pipeline pays: on slow links, where FSDP's per-layer
gathers of the whole model cost more than a pipeline's activations.

Run: ``.venv/bin/python experiments/pipeline_vs_fsdp.py`` (about 12 minutes on 2 cores); writes
``experiments/results/pipeline_vs_fsdp/results.json`` and ``pipeline_vs_fsdp.png``. ``--quick``
for the tests.
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
from jphantom.analysis.hlo import collectives, dot_flops  # noqa: E402
from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.runtime.mesh import first_devices  # noqa: E402
from jphantom.models.llama import LlamaConfig  # noqa: E402
from jphantom.pipeline import schedule as schedules  # noqa: E402
from jphantom.pipeline.runner import PipelineConfig  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pipeline_vs_fsdp"


def layouts(quick: bool):
    yield "fsdp (zero-3)", "data=8", None, 1
    for stages in ((2,) if quick else (2, 4)):
        names = ("1f1b", "zb-h1") if quick else ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1",
                                                  "zb-v")
        for name in names:
            yield f"{name} P={stages}", f"stage={stages},data={8 // stages}", name, stages


def measure(config, mesh, schedule, stages, batch, steps):
    program = programs.build(config, "tensor", mesh)
    devices = program.mesh.build(first_devices(program.mesh.device_count))
    # one sequence per micro-batch: M = the data rank's batch (4P here, the M)
    options = {"zero": 3} if schedule is None else {"pipeline": PipelineConfig(
        schedule, batch // (8 // stages), 2 if schedule == "interleaved-1f1b" else 1)}
    step = program.train_step(devices, optax.adamw(1e-3), **options)
    seq = config.max_positions
    specs = step.specs_of_batch(2)
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


def task_costs(config, stages: int, repeats: int = 10) -> dict[str, float]:
    """Milliseconds, on one device, of a stage's tasks for one micro-batch (one sequence): F (the
    forward keeping its residuals), the whole backward, and the split B and W."""
    from flax import nnx

    from jphantom.models.llama import Llama
    from jphantom.nn.stack import apply_blocks
    from jphantom.pipeline import split
    from jphantom.pipeline.buffers import rebuilder, vjp_residuals

    layers = config.layers // stages
    graph, state = nnx.split(Llama(config, rngs=nnx.Rngs(0)).layers.block)
    state = jax.tree.map(lambda a: a[:layers], state)
    x = jax.numpy.ones((1, config.max_positions, config.hidden), np.float32)
    body = lambda st, x: apply_blocks(graph, st, x)  # noqa: E731
    _, pullback = jax.vjp(body, state, x)
    treedef, stash, is_param = vjp_residuals(pullback, jax.tree.leaves(state))

    rebuild = rebuilder(treedef, is_param)
    how = split.weight_only_residuals(rebuild(state), stash, state, x)
    known = split.pick(stash, how.weight_only, False)
    weight_only = split.pick(stash, how.weight_only, True)
    _, _, linear = split.backward_input(rebuild(state), how, known, x, weight_only)
    linear_leaves, linear_tree = jax.tree.flatten(linear)

    def b(st, known, g):
        dx, b_leaves, linear = split.backward_input(rebuild(st), how, known, g, weight_only)
        return dx, b_leaves, jax.tree.leaves(linear)

    def w(leaves, weight_only):
        return split.backward_weight(jax.tree.unflatten(linear_tree, leaves), weight_only)

    def ms(f, *args):
        f = jax.jit(f)
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    return {"F": ms(lambda st, x: jax.tree.leaves(jax.vjp(body, st, x)[1]), state, x),
            "backward": ms(lambda st, res, g: rebuild(st)(res)(g), state, stash, x),
            "B": ms(b, state, known, x), "W": ms(w, linear_leaves, weight_only)}


def lockstep_ms(schedule: str, stages: int, microbatches: int, costs: dict) -> float:
    """The schedule's lock-step table priced with measured task times (modelled: P parallel
    devices, no per-slot overhead): a tick of 1F1B / GPipe / interleaved costs its forward slot
    plus its backward slot; a split schedule's slot its slowest task. A chunk of a device with
    two (interleaved, zb-v) costs half the stage's task."""
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    per = 1.0 / (virtual * schedules.chunks_of(schedule, stages))
    split = schedule in schedules.SPLIT_SCHEDULES
    table = schedules.lockstep(schedule, stages, microbatches, virtual)
    cost = {"F": costs["F"] * per, "B": costs["B" if split else "backward"] * per,
            "W": costs["W"] * per}
    return sum(max((cost[op[0]] for op in slot if op), default=0.0) for slot in table.slots)


def stretch(schedule: str | None, stages: int, microbatches: int | None) -> float:
    """The schedule's lock-step time over its ideal M (t_f + t_b) (t_b = 2 t_f)."""
    if schedule is None:
        return 1.0
    ideal = microbatches * 3.0
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
    rows, costs, one_f1b = [], {}, {}
    for label, mesh, schedule, stages in layouts(args.quick):
        row = measure(config, mesh, schedule, stages, batch, steps)
        row.update(label=label, stages=stages)
        rows.append(row)
        if schedule is None:
            continue
        if stages not in costs:
            costs[stages] = task_costs(config, stages, repeats=3 if args.quick else 10)
            print(f"P={stages}: one stage's tasks per micro-batch on one device (ms): " + ", ".join(
                f"{k} {v:.2f}" for k, v in costs[stages].items()), flush=True)
        row["task_ms"] = costs[stages]
        row["lockstep_ms"] = lockstep_ms(schedule, stages, row["microbatches"], costs[stages])
        if schedule == "1f1b":
            one_f1b[stages] = row
        elif schedule in schedules.SPLIT_SCHEDULES and stages in one_f1b:
            base, c = one_f1b[stages], costs[stages]
            # the HLO's GEMM count includes every branch of the slot switch; the GEMMs executed
            # are 1F1B's (B + W = the backward, tests/pipeline/test_zero_bubble_run.py)
            row["gemm_flops_counted_all_branches"] = row["gemm_flops_per_device"]
            row["gemm_flops_per_device"] = base["gemm_flops_per_device"]
            row["vs_1f1b"] = {
                "lockstep_time": row["lockstep_ms"] / base["lockstep_ms"],
                "temp_memory": row["temp_bytes_per_device"] / base["temp_bytes_per_device"],
                "extra_work": row["step_seconds"] / base["step_seconds"],
                "task_work": (c["F"] + c["B"] + c["W"]) / (c["F"] + c["backward"]),
                "slots": len(schedules.lockstep(schedule, stages, row["microbatches"]).slots),
                "ticks_1f1b": len(schedules.lockstep("1f1b", stages,
                                                     row["microbatches"]).ticks)}
    for row in rows:
        row["stretch"] = stretch(None if row["schedule"] == "none" else row["schedule"],
                                 row["stages"], row["microbatches"])
        row["modelled_seconds"] = {
            "slow": modelled(row, row["stages"], args.tflops, args.slow_gbps),
            "fast": modelled(row, row["stages"], args.tflops, args.fast_gbps)}
        step = f"{row['step_seconds']:.3f} s"
        lock = f"lock-step {row['lockstep_ms']:7.1f} ms" if "lockstep_ms" in row else " " * 20
        print(f"{row['label']:<22} {step:>8}  {lock}  temp {row['temp_bytes_per_device'] / 2**20:7.1f} "
              f"MiB  bytes {sum(row['collective_bytes_by_axis'].values()) / 2**20:8.2f} MiB  "
              f"stretch {row['stretch']:.3f}  modelled slow {row['modelled_seconds']['slow']*1e3:8.3f}"
              f" ms fast {row['modelled_seconds']['fast']*1e3:7.3f} ms", flush=True)
        if "vs_1f1b" in row:
            v = row["vs_1f1b"]
            print(f"{'':<22} vs 1F1B: lock-step time {v['lockstep_time']:.3f}x (modelled from "
                  f"task times), temp memory {v['temp_memory']:.3f}x, measured total work "
                  f"{v['extra_work']:.3f}x (the tasks' own {v['task_work']:.3f}x; {v['slots']} "
                  f"slots against 1F1B's {v['ticks_1f1b']} ticks)", flush=True)
    results = {"settings": {"model": {k: getattr(config, k) for k in (
        "vocab_size", "hidden", "intermediate", "layers", "heads", "kv_heads", "max_positions")},
        "batch": batch, "devices": 8, "tflops": args.tflops, "slow_gbps": args.slow_gbps,
        "fast_gbps": args.fast_gbps, "jax": jax.__version__,
        "modelled": "compute = GEMM FLOPs / TFLOP/s x the schedule's lock-step stretch; "
                    "communication = collective bytes / GB/s; no overlap. lockstep_ms: the "
                    "lock-step table priced with task times measured on one device, no "
                    "per-slot overhead",
        "measured": "step_seconds: 8 simulated devices on this machine's cores (total work: "
                    "bubbles are free); task_ms: one stage's tasks on one device"},
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
