"""Seal et al. Fig. 5 (and E5): communication and time per iteration of TP and phantom, for p and k.

The paper trains for a fixed number of epochs and plots, per epoch (= iteration here):
Fig. 5a, n = 65536, L = 6, k = 64, p = 32, 64, 128: communication time, phantom "significantly lower";
Fig. 5b, n = 4096, L = 2, p = 8..256, several k (k = 3 at p = 256): total time, phantom faster, the gap
closing as p grows (the small model becomes communication bound); Fig. 5c, n = 16384, L = 2: phantom
faster at every p, even with larger k (k = 4 at p = 256).

Two parts, each labelled:

**measured** (this machine, simulated CPU devices): n = 4096, L = 2, p = 2, 4, 8, k = 2, 4, 16, 64,
B = 256: one SGD training step per configuration, compiled, timed round-robin with the TP (T1) step
of the same p (median of ``--steps``, warm-up excluded, as the paper drops its first epoch), with its
FLOPs (XLA's count) and its collectives parsed from the compiled HLO (exact bytes). On simulated
devices a collective is a memcpy between threads sharing 2 cores, so the measured time is set by
FLOPs, not by communication; the bytes are what a network would carry. The comm time of the same
inventory on Frontier is then *modelled* with Eq. 26 and Table III.

**modelled** (the paper's sizes, which do not fit here): the three panels of Fig. 5 from the analytic
step model ``jphantom.perf.step_model`` (exact FLOPs and collective inventory, formulas checked against
compiled HLO in the tests; time = FLOPs / an MI250X GCD's rate + Eq. 26 with Table III's constants).
B is not stated in the paper; we use ``--batch`` (256) for both parts.

Usage::

    python experiments/fixed_iteration.py              # both parts (a few minutes)
    python experiments/fixed_iteration.py --quick      # n = 256, p = 2, 4, k = 2, 4, B = 32: seconds

Results: ``<out>/results.json`` and ``<out>/fixed_iteration.png`` (default
``experiments/results/fixed_iteration/``; ``--quick``: a scratch folder).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DEFAULT_OUT = REPO / "experiments" / "results" / "fixed_iteration"
TP = "tensor-t1"

# The paper's Fig. 5 panels (Seal et al. Sec. VI-A). k per p for 5c: Table I's (the same n and L).
PANELS = {
    "5a": {"width": 65536, "depth": 6, "shards": [32, 64, 128], "ghost_widths": {"all": [64]},
           "metric": "communication time per iteration",
           "claim": "phantom's communication per epoch is significantly lower than TP's at every p"},
    "5b": {"width": 4096, "depth": 2, "shards": [8, 16, 32, 64, 128, 256],
           "ghost_widths": {"all": [3, 16]},
           "metric": "total time per iteration",
           "claim": "phantom faster than TP over a wide range of p; the gap closes as p grows "
                    "(communication bound); k = 3 at p = 256"},
    "5c": {"width": 16384, "depth": 2, "shards": [8, 16, 32, 64, 128, 256],
           "ghost_widths": {8: [16], 16: [6], 32: [4], 64: [2], 128: [2], 256: [4]},
           "metric": "total time per iteration",
           "claim": "phantom faster than TP at every p even with larger k (k = 4 at p = 256)"},
}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Seal et al. Fig. 5: communication and time per iteration, TP vs phantom.",
        epilog=__doc__.split("Usage::")[1].split("Results:")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, help="n of the measured part (default 4096; 256 quick)")
    parser.add_argument("--depth", type=int, default=2, help="L of the measured part (default 2)")
    parser.add_argument("--shards", type=str, help="p of the measured part (default 2,4,8)")
    parser.add_argument("--ghost-widths", type=str, help="k of the measured part (default 2,4,16,64)")
    parser.add_argument("--batch", type=int, help="B (default 256; 32 with --quick)")
    parser.add_argument("--steps", type=int, help="timed steps per configuration (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate")
    parser.add_argument("--skip-measured", action="store_true", help="only the modelled panels")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds (tests)")
    args = parser.parse_args(argv)
    defaults = {"width": 256 if args.quick else 4096, "shards": "2,4" if args.quick else "2,4,8",
                "ghost_widths": "2,4" if args.quick else "2,4,16,64",
                "batch": 32 if args.quick else 256, "steps": 3 if args.quick else 10}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.shard_list = [int(v) for v in str(args.shards).split(",")]
        args.ghost_list = [int(v) for v in str(args.ghost_widths).split(",")]
    except ValueError:
        parser.error(f"--shards {args.shards!r} / --ghost-widths {args.ghost_widths!r}: give "
                     "comma-separated integers, e.g. --shards 2,4,8 --ghost-widths 2,4,16")
    if min(args.shard_list) < 1 or min(args.ghost_list) < 1 or args.batch < 1 or args.steps < 1:
        parser.error("--shards, --ghost-widths, --batch and --steps must be >= 1")
    from jphantom.analysis.machine import output_folder

    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="fixed_iteration")
    return args


def measured_part(args) -> list[dict]:
    """Time TP and phantom steps side by side at each p on simulated devices (see module doc)."""
    import jax
    from tqdm.auto import tqdm

    from jphantom.analysis.timing import build_step, time_round_robin
    from jphantom.runtime.mesh import first_devices, make_mesh
    from jphantom.perf.comm_model import FRONTIER
    from jphantom.nn.phantom import ops as phantom

    rows = []
    key = jax.random.PRNGKey(0)
    for p in tqdm(args.shard_list, desc="measured p", unit="p"):
        mesh = make_mesh({"model": p}, first_devices(p))
        ks = [k for k in args.ghost_list if k < phantom.max_ghost_width(args.width, p)]
        configs = [(TP, None)] + [("phantom", k) for k in ks]
        runners, reports = [], []
        for name, k in configs:
            label = name if k is None else f"{name}-k{k}"
            runner, report = build_step(name, mesh, width=args.width, depth=args.depth,
                                        ghost_width=k, batch=args.batch, learning_rate=args.lr,
                                        key=key, label=label)
            runners.append(runner)
            reports.append(report | {"ghost_width": k, "label": label})
        medians = time_round_robin(runners, args.steps, args.warmup)
        for runner, report in zip(runners, reports):
            rows.append({
                "part": "measured", "width": args.width, "depth": args.depth, "shards": p,
                "strategy": report["strategy"],
                "ghost_width": report["ghost_width"], "batch": args.batch,
                "params": report["params"],
                "flops_per_device": report["flops_per_device"],
                "collectives": report["collectives"],
                "collective_bytes_per_device": report["collective_bytes_per_device"],
                "seconds_per_iteration_measured": medians[runner.name],
                "step_seconds_all": runner.times,
                "comm_seconds_modelled_frontier": FRONTIER.step_time_us(report["collectives"], p)
                * 1e-6,
            })
    for row in rows:  # ratios against TP at the same p
        tp = next(r for r in rows if r["shards"] == row["shards"] and r["strategy"] == TP)
        row["time_ratio_vs_tp_measured"] = (row["seconds_per_iteration_measured"]
                                            / tp["seconds_per_iteration_measured"])
        row["bytes_ratio_vs_tp"] = (row["collective_bytes_per_device"]
                                    / tp["collective_bytes_per_device"])
        row["flop_ratio_vs_tp"] = row["flops_per_device"] / tp["flops_per_device"]
        row["comm_ratio_vs_tp_modelled"] = (row["comm_seconds_modelled_frontier"]
                                            / tp["comm_seconds_modelled_frontier"])
    return rows


def table_two_tp_comm_seconds(width: int, depth: int, num_shards: int, batch: int) -> float:
    """Eq. 26 (Frontier) for the TP of the paper's Table II: per layer an all-gather and a
    reduce-scatter of (n/p) B floats per rank *and* a broadcast and an all-reduce of n B (its PyTorch
    TP keeps every layer's full output on every rank). Modelled only: jphantom's TP (T1) needs
    neither of the latter two, since its data stay sharded (README, "TP against Table II")."""
    from jphantom.perf.comm_model import FRONTIER

    n, p, b = width, num_shards, batch
    per_layer = (FRONTIER.time_us("all-gather", n // p * b, p)
                 + FRONTIER.time_us("reduce-scatter", n // p * b, p)
                 + FRONTIER.time_us("broadcast", n * b, p)
                 + FRONTIER.time_us("all-reduce", n * b, p))
    return depth * per_layer * 1e-6


def modelled_part(batch: int) -> list[dict]:
    """Fig. 5's panels at the paper's sizes from the analytic step model (module doc)."""
    from jphantom.perf.step_model import StepShape, estimate_step
    from jphantom.nn.phantom import ops as phantom

    rows = []
    for panel, spec in PANELS.items():
        n, depth = spec["width"], spec["depth"]
        for p in spec["shards"]:
            ks = spec["ghost_widths"].get(p, spec["ghost_widths"].get("all", []))
            shapes = [StepShape(TP, n, depth, p, batch)]
            shapes += [StepShape("phantom", n, depth, p, batch, ghost_width=k) for k in ks
                       if k < phantom.max_ghost_width(n, p)]
            estimates = [estimate_step(shape) for shape in shapes]
            tp = estimates[0]
            table2_comm = table_two_tp_comm_seconds(n, depth, p, batch)
            table2_total = tp.seconds["compute"] + table2_comm
            # result buffers per layer: all-gather n B, reduce-scatter (n/p) B, broadcast and
            # all-reduce n B each (float32)
            table2_bytes = 4 * depth * batch * (3 * n + n // p)
            rows.append({
                "part": "modelled", "panel": panel, "width": n, "depth": depth, "shards": p,
                "strategy": "tensor-table2", "ghost_width": None, "batch": batch,
                "flops_per_device": tp.flops["total"],
                "collective_bytes_per_device": table2_bytes,
                "comm_seconds_modelled": table2_comm,
                "compute_seconds_modelled": tp.seconds["compute"],
                "total_seconds_modelled": table2_total,
                "comm_ratio_vs_tp": table2_comm / tp.seconds["comm"],
                "total_ratio_vs_tp": table2_total / tp.total_seconds,
                "bytes_ratio_vs_tp": table2_bytes / tp.collective_bytes,
            })
            for shape, est in zip(shapes, estimates):
                rows.append({
                    "part": "modelled", "panel": panel, "width": n, "depth": depth, "shards": p,
                    "strategy": shape.strategy, "ghost_width": shape.ghost_width, "batch": batch,
                    "flops_per_device": est.flops["total"],
                    "collective_bytes_per_device": est.collective_bytes,
                    "comm_seconds_modelled": est.seconds["comm"],
                    "compute_seconds_modelled": est.seconds["compute"],
                    "total_seconds_modelled": est.total_seconds,
                    "comm_ratio_vs_tp": est.seconds["comm"] / tp.seconds["comm"],
                    "total_ratio_vs_tp": est.total_seconds / tp.total_seconds,
                    "bytes_ratio_vs_tp": est.collective_bytes / tp.collective_bytes,
                    "comm_ratio_vs_tp_table2": est.seconds["comm"] / table2_comm,
                    "total_ratio_vs_tp_table2": est.total_seconds / table2_total,
                })
    return rows


def verdicts(modelled: list[dict]) -> dict:
    """Each panel's claim checked against the model (which ratios are < 1, and the trend)."""
    out = {}
    for panel, spec in PANELS.items():
        rows = [r for r in modelled if r["panel"] == panel and r["strategy"] == "phantom"]
        key = "comm_ratio_vs_tp" if panel == "5a" else "total_ratio_vs_tp"
        out[panel] = {"paper": spec["claim"], "metric": key}
        for baseline, suffix in (("t1", ""), ("table2", "_table2")):
            by_p = {}
            for r in rows:
                by_p.setdefault(r["shards"], []).append(r[key + suffix])
            best = {p: min(v) for p, v in sorted(by_p.items())}
            out[panel][baseline] = {"best_phantom_over_tp_by_p": best,
                                    "phantom_faster_at_every_p": all(v < 1 for v in best.values())}
    return out


def format_tables(result: dict) -> str:
    lines = []
    measured = [r for r in result["rows"] if r["part"] == "measured"]
    if measured:
        r0 = measured[0]
        lines += [f"measured: n={r0['width']}, L={r0['depth']}, B={r0['batch']}, one SGD step on "
                  f"simulated CPU devices ({result['machine']['cpu_count']} cores), median; "
                  "comm modelled with Eq. 26 (Frontier)",
                  f"{'p':>3} {'strategy':<10}{'k':>4}{'ms/iter':>9}{'vs TP':>7}{'FLOPs vs TP':>12}"
                  f"{'KB/iter':>10}{'bytes vs TP':>12}{'Frontier comm ms':>17}{'vs TP':>7}"]
        for r in measured:
            lines.append(
                f"{r['shards']:>3} {r['strategy']:<10}{r['ghost_width'] or '-':>4}"
                f"{r['seconds_per_iteration_measured'] * 1e3:>9.2f}{r['time_ratio_vs_tp_measured']:>7.3f}"
                f"{r['flop_ratio_vs_tp']:>12.3f}{r['collective_bytes_per_device'] / 1e3:>10.1f}"
                f"{r['bytes_ratio_vs_tp']:>12.4f}{r['comm_seconds_modelled_frontier'] * 1e3:>17.3f}"
                f"{r['comm_ratio_vs_tp_modelled']:>7.3f}")
        lines.append("")
    modelled = [r for r in result["rows"] if r["part"] == "modelled"]
    lines.append(f"modelled at the paper's sizes (B={result['config']['batch']}; MI250X GCD "
                 f"{result['device']['sustained_flops'] / 1e12:.1f} TFLOP/s sustained; Eq. 26 Frontier)")
    lines.append(f"{'panel':<6}{'n':>7}{'L':>3}{'p':>5} {'strategy':<14}{'k':>4}{'comm ms':>9}"
                 f"{'compute ms':>11}{'total ms':>10}{'comm/TP':>8}{'total/TP':>9}")
    for r in modelled:
        lines.append(
            f"{r['panel']:<6}{r['width']:>7}{r['depth']:>3}{r['shards']:>5} {r['strategy']:<14}"
            f"{r['ghost_width'] or '-':>4}{r['comm_seconds_modelled'] * 1e3:>9.3f}"
            f"{r['compute_seconds_modelled'] * 1e3:>11.3f}{r['total_seconds_modelled'] * 1e3:>10.3f}"
            f"{r['comm_ratio_vs_tp']:>8.3f}{r['total_ratio_vs_tp']:>9.3f}")
    lines.append("tensor-t1 = Seal et al.'s TP (T1); tensor-table2 = the TP of the paper's Table II (T1 + a "
                 "broadcast and an all-reduce of n B per layer), comm modelled only")
    for panel, v in result["verdicts"].items():
        lines.append(f"Fig. {panel}: paper: {v['paper']}.")
        for baseline in ("t1", "table2"):
            best = ", ".join(f"p={p}: {x:.3f}"
                             for p, x in v[baseline]["best_phantom_over_tp_by_p"].items())
            lines.append(f"    model, best phantom / TP({baseline}) {v['metric'].split('_')[0]}: {best}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in result["rows"] if r["part"] == "measured"]
    panels = list(PANELS) + (["here"] if measured else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4))
    for ax, panel in zip(axes, panels):
        if panel == "here":
            rows, key, unit = measured, "seconds_per_iteration_measured", "measured"
            title = f"here: n={rows[0]['width']}, L={rows[0]['depth']}, time/iter (simulated CPU)"
        else:
            rows = [r for r in result["rows"] if r.get("panel") == panel]
            key = "comm_seconds_modelled" if panel == "5a" else "total_seconds_modelled"
            unit = "modelled"
            spec = PANELS[panel]
            title = (f"Fig. {panel}: n={spec['width']}, L={spec['depth']}, "
                     f"{'comm' if panel == '5a' else 'total'}/iter")
        series = {}
        for r in rows:
            label = "TP (T1)" if r["strategy"] == TP else "TP (Table II)" if r[
                "strategy"] == "tensor-table2" else (
                "phantom (Table I k)" if panel == "5c" else f"phantom k={r['ghost_width']}")
            series.setdefault(label, []).append(r)
        for label, group in series.items():
            group = sorted(group, key=lambda r: r["shards"])
            ax.plot([r["shards"] for r in group], [r[key] * 1e3 for r in group],
                    "k-o" if label == "TP (T1)" else "k--^" if label.startswith("TP") else "-s",
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("shards p")
        ax.set_ylabel(f"ms ({unit})")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.skip_measured:
        from jphantom.runtime.mesh import ensure_devices

        ensure_devices(max(args.shard_list))
    from jphantom.analysis.machine import machine_info
    from jphantom.perf.step_model import MI250X_GCD

    rows = [] if args.skip_measured else measured_part(args)
    modelled = modelled_part(args.batch)
    result = {
        "experiment": "Seal et al. Fig. 5 (E5): fixed-iteration communication and time",
        "config": {"width": args.width, "depth": args.depth, "shards": args.shard_list,
                   "ghost_widths": args.ghost_list, "batch": args.batch, "steps": args.steps,
                   "warmup": args.warmup, "tp_strategy": TP},
        "machine": machine_info(),
        "device": MI250X_GCD.as_dict(),
        "comm_model": "frontier (Seal et al. Table III)",
        "panels": PANELS,
        "rows": rows + modelled,
        "verdicts": verdicts(modelled),
    }
    print(format_tables(result))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    plot(result, args.out / "fixed_iteration.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'fixed_iteration.png'}")
    return result


if __name__ == "__main__":
    main()
