"""Pipeline schedules at small scale: memory, time, bubble and point-to-point bytes.

Narayanan et al. 2021 (Sec. 2.2) and Singh's thesis (ch. 3) make four claims this script measures on jphantom's
executor (:mod:`jphantom.pipeline.runner`: the whole pipelined step is one ``jax.jit`` of one
``shard_map``):

1. **Bubble.** GPipe and 1F1B idle a fraction (P - 1)/(M + P - 1) of the devices' time;
   interleaved 1F1B with V chunks per device (P - 1)/(P - 1 + V M). The discrete-event simulator
   (:func:`jphantom.pipeline.schedule.simulate`) and the lock-step tables the executor runs
   (:func:`~jphantom.pipeline.schedule.lockstep`) are printed beside the formulas.
2. **Memory.** GPipe stashes all M micro-batches' activations, 1F1B at most a bounded number, so
   at a fixed micro-batch size GPipe's activation memory grows with M and 1F1B's does not. Measured:
   the compiled step's ``temp_bytes`` (XLA's ``memory_analysis``: every buffer live inside the
   step), per device, for M = P, 2P, 4P, 8P.
3. **Time.** 1F1B costs the same time as GPipe (same bubble); interleaving shortens the bubble.
   Measured: median step time of the three schedules side by side (round robin, one run each per
   round), and against the ideal time x (1 + bubble), the ideal being M x the unpipelined step of
   one micro-batch on one device (the same GEMM shapes), divided by the stages that can run at
   once (P, at most this machine's cores).
4. **Point-to-point bytes.** At a fixed device count, more stages mean more activation traffic per
   device (Singh's thesis ch. 3): counted from the compiled HLO's collective-permutes (loop trip counts
   applied) on ``stage=P,data=8/P`` for P = 1, 2, 4, 8, same global batch and M = 8.

The model is Seal et al.'s FFN (``jphantom.models.ffn``, ``tensor`` strategy with ``model=1``: plain
layers in each stage, the stack of layer pairs cut over ``stage`` by :class:`jphantom.TrainStep`),
float32, SGD, with a fixed micro-batch of ``--microbatch`` rows: the batch is M x microbatch.

Run: ``.venv/bin/python experiments/pipeline_schedules.py`` (about 3 minutes on 2 CPU cores);
writes ``experiments/results/pipeline_schedules/results.json`` and ``pipeline_schedules.png``.
``--quick`` runs a reduced grid (for the tests), into a scratch folder unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jphantom.analysis.hlo import collectives  # noqa: E402
from jphantom.analysis.compiled import compile_step, compiled_memory  # noqa: E402
from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.analysis.timing import build_run_step, time_round_robin  # noqa: E402
from jphantom.config import RunConfig  # noqa: E402
from jphantom.pipeline.schedule import lockstep, simulate  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pipeline_schedules"
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))


def formula(schedule: str, P: int, M: int, V: int) -> float:
    """Narayanan et al.'s bubble as a fraction of device time."""
    return (P - 1) / (P - 1 + V * M) if schedule == "interleaved-1f1b" else (P - 1) / (M + P - 1)


def _batch(rows: int, width: int, seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((rows, width)).astype(np.float32) for _ in range(2))


def _config(mesh_text: str, width: int, depth: int, batch: int, schedule: str = "1f1b",
            microbatches: int | None = None, virtual_stages: int = 1) -> RunConfig:
    """The FFN under ``tensor`` on ``mesh_text`` (with a ``stage`` axis: the pipeline of
    ``schedule``, ``microbatches`` per step and data rank, ``virtual_stages``), SGD."""
    return RunConfig.from_flags(model="ffn", strategy="tensor", mesh=mesh_text, width=width,
                                depth=depth, batch=batch, schedule=schedule,
                                microbatches=microbatches, virtual_stages=virtual_stages,
                                optimizer="sgd", learning_rate=1e-3, warmup_steps=0, out=None,
                                progress=False)


def bubbles(stages: list[int], factors: list[int]) -> list[dict]:
    rows = []
    for P in stages:
        for f in factors:
            M = f * P
            for schedule, V in SCHEDULES:
                rows.append({
                    "stages": P, "microbatches": M, "schedule": schedule, "virtual_stages": V,
                    "formula": formula(schedule, P, M, V),
                    "simulated": simulate(schedule, P, M, V, backward_cost=2.0).bubble_fraction,
                    "lockstep": lockstep(schedule, P, M, V).bubble_fraction(2.0),
                    "peak_in_flight": list(lockstep(schedule, P, M, V).peak_in_flight),
                })
    return rows


def memory_and_time(stages: list[int], factors: list[int], *, width: int, depth: int,
                    microbatch: int, steps: int, warmup: int) -> list[dict]:
    rows = []
    cores = os.cpu_count() or 1
    for P in stages:
        for f in factors:
            M = f * P
            batch_rows = M * microbatch
            runners, reports = [], {}
            for schedule, V in SCHEDULES:
                config = _config(f"stage={P}", width, depth, batch_rows, schedule, M, V)
                runner, report = build_run_step(config, _batch(batch_rows, width),
                                                label=schedule)
                runners.append(runner)
                reports[schedule] = report
            # One micro-batch, unpipelined, on one device: the work of every stage on it, one
            # after another, at the GEMM shapes the pipeline runs.
            runner, _ = build_run_step(_config("model=1", width, depth, microbatch),
                                       _batch(microbatch, width), label="unpipelined")
            runners.append(runner)
            times = time_round_robin(runners, steps, warmup)
            ideal = M * times["unpipelined"] / min(P, cores)
            for schedule, V in SCHEDULES:
                report = reports[schedule]
                permutes = [c for c in report["collectives"] if c["kind"] == "collective-permute"]
                bubble_over_ideal = formula(schedule, P, M, V) / (1 - formula(schedule, P, M, V))
                rows.append({
                    "stages": P, "microbatches": M, "batch": batch_rows, "schedule": schedule,
                    "virtual_stages": V, "temp_bytes": report["memory"]["temp_bytes"],
                    "argument_bytes": report["memory"]["argument_bytes"],
                    "step_seconds": times[schedule],
                    "unpipelined_microbatch_seconds": times["unpipelined"],
                    "ideal_seconds": ideal,
                    "predicted_seconds": ideal * (1 + bubble_over_ideal),
                    "permute_bytes": sum(c["bytes"] for c in permutes),
                    "compile_seconds": report["compile_seconds"],
                })
                print(f"P={P} M={M:>2} {schedule:<17} temp {rows[-1]['temp_bytes'] / 1e6:7.2f} MB"
                      f"  step {times[schedule] * 1e3:8.2f} ms  ideal x (1 + bubble) "
                      f"{rows[-1]['predicted_seconds'] * 1e3:8.2f} ms", flush=True)
    return rows


def point_to_point(stage_counts: list[int], *, width: int, depth: int, batch: int,
                   microbatches: int, devices: int = 8) -> list[dict]:
    """Collective bytes per device of one 1F1B step at a fixed device count (HLO, trip counts)."""
    rows = []
    for P in stage_counts:
        data = devices // P
        mesh_text = f"stage={P},data={data}" if P > 1 else f"data={data},model=1"
        config = _config(mesh_text, width, depth, batch, "1f1b", microbatches if P > 1 else None)
        compiled, _ = compile_step(config)  # abstract parameters: nothing allocated
        found = collectives(compiled.as_text())
        by_kind: dict[str, int] = {}
        for c in found:
            by_kind[c.kind] = by_kind.get(c.kind, 0) + c.total_bytes
        rows.append({"stages": P, "data": data, "mesh": str(config.program().mesh),
                     "permute_bytes_per_device": by_kind.get("collective-permute", 0),
                     "bytes_per_device_by_kind": by_kind,
                     "temp_bytes": compiled_memory(compiled)["temp_bytes"]})
        print(f"{rows[-1]['mesh']:<28} collective-permute "
              f"{rows[-1]['permute_bytes_per_device'] / 1e6:7.3f} MB/device/step; "
              f"all kinds {by_kind}", flush=True)
    return rows


def ratios(rows: list[dict]) -> dict:
    """The benchmark's figures: temp memory from M = P to M = 8P per schedule, and step time
    against GPipe at each (P, M)."""
    out = {}
    for P in sorted({r["stages"] for r in rows}):
        ms = sorted({r["microbatches"] for r in rows if r["stages"] == P})
        for schedule, _ in SCHEDULES:
            temp = {r["microbatches"]: r["temp_bytes"] for r in rows
                    if r["stages"] == P and r["schedule"] == schedule}
            out[f"P={P} {schedule} temp M={ms[-1]}/M={ms[0]}"] = temp[ms[-1]] / temp[ms[0]]
            if len(ms) > 1:
                out[f"P={P} {schedule} temp M={ms[-1]}/M={ms[1]}"] = temp[ms[-1]] / temp[ms[1]]
        for M in ms:
            t = {r["schedule"]: r["step_seconds"] for r in rows
                 if r["stages"] == P and r["microbatches"] == M}
            for schedule in ("1f1b", "interleaved-1f1b"):
                out[f"P={P} M={M} {schedule} time / gpipe"] = t[schedule] / t["gpipe"]
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["memory_and_time"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for P, style in zip(sorted({r["stages"] for r in rows}), ("-", "--")):
        for (schedule, _), color in zip(SCHEDULES, ("C0", "C1", "C2")):
            sel = sorted((r for r in rows if r["stages"] == P and r["schedule"] == schedule),
                         key=lambda r: r["microbatches"])
            ms = [r["microbatches"] for r in sel]
            axes[0].plot(ms, [r["temp_bytes"] / 1e6 for r in sel], style, color=color, marker="o",
                         label=f"{schedule} P={P}")
            axes[1].plot(ms, [r["step_seconds"] / r["predicted_seconds"] for r in sel], style,
                         color=color, marker="o", label=f"{schedule} P={P}")
    axes[0].set(xlabel="micro-batches M", ylabel="compiled temp MB per device",
                title="activation memory at a fixed micro-batch")
    axes[1].set(xlabel="micro-batches M", ylabel="measured / (ideal x (1 + bubble))",
                title="step time against the bubble model")
    p2p = results["point_to_point"]
    axes[2].bar([str(r["stages"]) for r in p2p], [r["permute_bytes_per_device"] / 1e6 for r in p2p])
    axes[2].set(xlabel="stages P (8 devices, data = 8/P)", ylabel="collective-permute MB/device/step",
                title="point-to-point bytes grow with P")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.legend(fontsize=7)
    fig.suptitle("jphantom pipelines, FFN, 2 CPU cores (simulated devices)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512, help="FFN width n (default 512)")
    parser.add_argument("--depth", type=int, default=16,
                        help="FFN layers (Megatron pairs: a multiple of 2 P V; default 16)")
    parser.add_argument("--microbatch", type=int, default=32, help="rows per micro-batch (default 32)")
    parser.add_argument("--steps", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    parser.add_argument("--quick", action="store_true", help="P = 2, M in {P, 4P}, 2 rounds")
    args = parser.parse_args(argv)
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="pipeline_schedules")
    stages, factors = ([2], [1, 4]) if args.quick else ([2, 4], [1, 2, 4, 8])
    steps = 2 if args.quick else args.steps
    start = time.perf_counter()
    results = {
        "machine": {"cpu_count": os.cpu_count(), "devices": jax.device_count(),
                    "platform": jax.devices()[0].platform},
        "settings": {"width": args.width, "depth": args.depth, "microbatch": args.microbatch,
                     "steps": steps, "warmup": args.warmup, "strategy": "tensor (model=1)",
                     "optimizer": "sgd", "dtype": "float32"},
        "bubbles": bubbles(stages, factors),
        "memory_and_time": memory_and_time(stages, factors, width=args.width, depth=args.depth,
                                           microbatch=args.microbatch, steps=steps,
                                           warmup=args.warmup),
        "point_to_point": point_to_point([1, 2] if args.quick else [1, 2, 4, 8], width=args.width,
                                         depth=args.depth, batch=8 * args.microbatch,
                                         microbatches=8),
    }
    results["ratios"] = ratios(results["memory_and_time"])
    results["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "pipeline_schedules.png")
    for key, value in results["ratios"].items():
        print(f"{key:<40} {value:6.3f}")
    print(f"wrote {out}/results.json and pipeline_schedules.png ({results['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
