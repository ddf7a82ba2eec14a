"""Seal et al. Fig. 6 and experiment E10 at the paper's sizes, from the analytic step model.

The paper (Sec. VI-A, Fig. 6) trains the FFN with n = 131072 and 262144, k = 64, on p = 32, 64,
128 and 256 GCDs of Frontier (AMD MI250X) and reports time per epoch (= iteration); L and B are not
stated. Its claims:

(i)   phantom uses less memory than TP in every configuration;
(ii)  n = 262144: TP ran out of memory at p = 32 while phantom ran; phantom is faster at every p;
(iii) n = 131072: phantom is faster up to p = 128, TP is faster at p = 256, which the paper blames
      on the p-1 small decompressor GEMMs (their efficiency drops and their number grows with p).

These sizes cannot run here (TP at n = 262144, p = 32 holds 8 GiB of weights per layer and rank), so
this script evaluates ``jphantom.perf.step_model`` for every (n, p) and for TP (layout T1), phantom
with the fused decompressor (jphantom's default, a design improvement over the paper, labelled so)
and phantom unfused (the paper's p-1 GEMMs). Per rank and iteration it reports memory (parameters,
gradients, optimizer state, batch: exact array sizes; saved activations and workspace: modelled
rule) against the 64 GiB of one MI250X GCD, and *modelled* time: compute = GEMM FLOPs (exact) /
(FP32 matrix peak 47.9 TFLOP/s x efficiency 0.5, an assumption), comm = Eq. 26 with Seal et al.'s Table
III Frontier constants on the step's exact collectives, and for the unfused decompressor a fixed cost
per small GEMM (``--gemm-overhead-us``, a GPU kernel launch; 3 (p-1) L of them per step). No overlap.

For claim (ii) it sweeps L = 1..6 and SGD / momentum / Adam (0 / 1 / 2 optimizer states) and says in
which the TP step at n = 262144, p = 32 exceeds 64 GiB while TP at p >= 64 and phantom fit. For claim
(iii) it computes the break-even overhead per small GEMM at which unfused phantom becomes slower than
TP, at every (n, p): the paper's timing claims hold together for overheads between the break-even at
n = 131072, p = 256 and the smallest break-even of the configurations where phantom won. Batch
B = 256 and L = 2 are our choices (the paper states neither); ``--quick`` skips the sensitivity
sweeps (break-even vs B, L, efficiency and the TP baseline); both take about 2 s, mostly imports.

Usage::

    python experiments/large_width.py                 # n = 131072, 262144; p = 32..256; k = 64
    python experiments/large_width.py --quick         # same grid, no sensitivity sweeps
    python experiments/large_width.py --optimizer sgd --depth 4 --batch 1024

Results: ``<out>/results.json`` and ``<out>/large_width.png`` (default
``experiments/results/large_width/``; ``--quick``: a scratch folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from jphantom.errors import ConfigError  # noqa: E402
from jphantom.perf.comm_model import FRONTIER  # noqa: E402
from jphantom.perf.step_model import (  # noqa: E402
    GIB,
    MI250X_GCD,
    OPTIMIZER_STATES,
    StepShape,
    break_even_gemm_overhead,
    estimate_step,
)

DEFAULT_OUT = REPO / "experiments" / "results" / "large_width"
VARIANTS = (("tensor-t1", True), ("phantom", True), ("phantom", False))
LABELS = {("tensor-t1", True): "tensor (T1)", ("phantom", True): "phantom (fused)",
          ("phantom", False): "phantom (unfused)"}
LAUNCH_RANGE_US = (5.0, 20.0)  # a plausible cost of one small GEMM kernel on a GPU, launch included
PAPER = {
    "figure": "Seal et al. Fig. 6 (Sec. VI-A); experiment E10 (and E11's cause)",
    "setup": "n = 131072 and 262144, k = 64, p = 32, 64, 128, 256 MI250X GCDs, time per epoch "
             "(= iteration), first epoch excluded; L and B not stated",
    "claims": {
        "i": "phantom uses less memory than TP in every configuration",
        "ii": "n = 262144: TP ran out of memory at p = 32, phantom did not; phantom faster at every p",
        "iii": "n = 131072: phantom faster up to p = 128, TP faster at p = 256 (blamed on the p-1 "
               "small decompressor GEMMs)",
    },
}


def parse_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is empty")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--widths", type=parse_list, default=[131072, 262144], help="n values; default 131072,262144")
    add("--shards", type=parse_list, default=[32, 64, 128, 256], help="p values; default 32,64,128,256")
    add("--ghost-width", type=int, default=64, help="k; default 64 (the paper's Fig. 6)")
    add("--batch", type=int, default=256, help="B; default 256 (our choice, the paper gives none)")
    add("--depth", type=int, default=2, help="L; default 2 (our choice, the paper gives none)")
    add("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adam",
        help="optimizer state to hold: sgd 0, momentum 1, adam 2 arrays per parameter; default adam")
    add("--gemm-overhead-us", type=float, default=10.0,
        help="cost of each small decompressor GEMM of unfused phantom [us]; default 10")
    add("--efficiency", type=float, default=MI250X_GCD.efficiency,
        help=f"fraction of the GCD's FP32 matrix peak the GEMMs reach; default {MI250X_GCD.efficiency}")
    add("--sweep-depths", type=parse_list, default=[1, 2, 3, 4, 5, 6],
        help="L values of the out-of-memory sweep (claim ii); default 1..6")
    add("--quick", action="store_true", help="skip the sensitivity sweeps (the grid is the same)")
    add("--out", type=Path, default=None,
        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    if args.gemm_overhead_us < 0:
        parser.error(f"--gemm-overhead-us {args.gemm_overhead_us}: must be >= 0")
    from jphantom.analysis.machine import output_folder

    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="large_width")
    return args


# --------------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------------


def shape_of(strategy, fused, n, p, args, *, depth=None, batch=None, optimizer=None) -> StepShape:
    return StepShape(
        strategy, n, depth or args.depth, p, batch or args.batch,
        ghost_width=args.ghost_width if strategy == "phantom" else None, fused=fused,
        optimizer_states=OPTIMIZER_STATES[optimizer or args.optimizer])


def estimate(strategy, fused, n, p, args, device, **overrides):
    overhead = args.gemm_overhead_us * 1e-6 if not fused else 0.0
    return estimate_step(shape_of(strategy, fused, n, p, args, **overrides), device=device,
                         comm_model=FRONTIER, gemm_overhead_s=overhead)


def row_of(est, tp_est) -> dict:
    mem = est.memory
    return {
        "width": est.shape.width,
        "num_shards": est.shape.num_shards,
        "strategy": est.shape.label,
        "memory_gib": {key: value / GIB for key, value in mem.items()},
        "memory_bytes": mem,
        "fits_in_memory": est.fits_in_memory,
        "flops": est.flops["total"],
        "gemms": est.flops["gemms"],
        "collective_bytes": est.collective_bytes,
        "seconds": est.seconds,
        "ratio_to_tp": est.total_seconds / tp_est.total_seconds,
        "estimate": est.as_dict(),
    }


def grid(args, device) -> tuple[list[dict], dict]:
    """Every (n, p, variant) row and the break-even overhead per (n, p)."""
    rows, break_even = [], {}
    for n in args.widths:
        for p in args.shards:
            ests = {v: estimate(*v, n, p, args, device) for v in VARIANTS}
            tp = ests[("tensor-t1", True)]
            rows += [row_of(ests[v], tp) for v in VARIANTS]
            break_even[(n, p)] = break_even_gemm_overhead(tp, ests[("phantom", False)])
    return rows, break_even


def find(rows, n, p, label) -> dict:
    return next(r for r in rows if (r["width"], r["num_shards"], r["strategy"]) == (n, p, label))


# --------------------------------------------------------------------------------------------------
# The paper's claims
# --------------------------------------------------------------------------------------------------


def oom_sweep(args, device) -> list[dict]:
    """Claim (ii)'s memory part for every (L, optimizer): TP and phantom at the largest n."""
    n = max(args.widths)
    small_p, larger_p = min(args.shards), sorted(args.shards)[1:]
    table = []
    for depth in args.sweep_depths:
        for optimizer in OPTIMIZER_STATES:
            def total(strategy, fused, p):
                return estimate(strategy, fused, n, p, args, device, depth=depth,
                                optimizer=optimizer).memory["total"]
            tp_small = total("tensor-t1", True, small_p)
            tp_larger = [total("tensor-t1", True, p) for p in larger_p]
            tp_other_widths = [estimate("tensor-t1", True, w, p, args, device, depth=depth,
                                        optimizer=optimizer).memory["total"]
                               for w in args.widths if w != n for p in args.shards]
            phantom_max = max(total("phantom", fused, p) for fused in (True, False)
                              for p in args.shards)
            tp_oom_small = tp_small > device.memory_bytes
            tp_fits_larger = all(t <= device.memory_bytes for t in tp_larger)
            table.append({
                "depth": depth,
                "optimizer": optimizer,
                "width": n,
                "tp_gib_at_smallest_p": tp_small / GIB,
                "tp_exceeds_64_gib_at_smallest_p": tp_oom_small,
                "tp_exceeds_64e9_bytes_at_smallest_p": tp_small > 64e9,
                "tp_gib_at_larger_p": [t / GIB for t in tp_larger],
                "tp_fits_at_larger_p": tp_fits_larger,
                "tp_fits_at_other_widths": all(t <= device.memory_bytes for t in tp_other_widths),
                "phantom_max_gib": phantom_max / GIB,
                "phantom_fits_everywhere": phantom_max <= device.memory_bytes,
                "matches_paper": (tp_oom_small and tp_fits_larger and phantom_max <= device.memory_bytes
                                  and all(t <= device.memory_bytes for t in tp_other_widths)),
            })
    return table


def claims(rows, break_even, oom, args, device) -> dict:
    """Which of the paper's three claims the model reproduces, and under what."""
    big, small = max(args.widths), min(args.widths)
    top_p = max(args.shards)
    labels_ph = ("phantom (fused)", "phantom (unfused)")
    capacity = device.memory_bytes
    # (i) memory: every phantom variant below TP at every (n, p) of the grid and of the L/optimizer sweep.
    grid_less = all(find(rows, r["width"], r["num_shards"], label)["memory_bytes"]["total"]
                    < r["memory_bytes"]["total"]
                    for r in rows if r["strategy"] == "tensor (T1)" for label in labels_ph)
    sweep_less = all(o["phantom_max_gib"] < o["tp_gib_at_smallest_p"] for o in oom)
    ratios = [find(rows, r["width"], r["num_shards"], "phantom (fused)")["memory_bytes"]["total"]
              / r["memory_bytes"]["total"] for r in rows if r["strategy"] == "tensor (T1)"]
    claim_i = {
        "reproduced": grid_less and sweep_less,
        "phantom_over_tp_memory": {"min": min(ratios), "max": max(ratios)},
        "note": "per rank, phantom holds n^2/p^2 + k n (+ k n/p own slot) weights per layer vs TP's "
                "n^2/p; its ratio is ~1/p + k p/n",
    }
    # (ii) n = 262144: TP OOM at the smallest p (depends on L and the optimizer), phantom faster at
    # every p where TP runs.
    tp_big = [find(rows, big, p, "tensor (T1)") for p in args.shards]
    oom_default = not tp_big[0]["fits_in_memory"]
    matching = [f"L={o['depth']} {o['optimizer']}" for o in oom if o["matches_paper"]]
    faster_big = {label: all(find(rows, big, p, label)["seconds"]["total"]
                             < find(rows, big, p, "tensor (T1)")["seconds"]["total"]
                             for p in args.shards) for label in labels_ph}
    claim_ii = {
        "tp_oom_at_smallest_p_in_default_config": oom_default,
        "tp_gib_at_smallest_p": tp_big[0]["memory_gib"]["total"],
        "capacity_gib": capacity / GIB,
        "configs_matching_paper_oom": matching,
        "phantom_faster_at_every_p": faster_big,
        "reproduced_default_config": oom_default and all(
            r["fits_in_memory"] for r in tp_big[1:]) and faster_big["phantom (fused)"]
            and faster_big["phantom (unfused)"],
    }
    # (iii) n = 131072: phantom faster up to the second-largest p, TP faster at the largest.
    lower = break_even[(small, top_p)]
    below_top = [break_even[(small, p)] for p in args.shards if p != top_p]
    upper_iii = min(below_top) if below_top else math.inf
    upper_ii = min(break_even[(big, p)] for p in args.shards)
    joint = (max(lower, 0.0), min(upper_iii, upper_ii))
    pattern = {label: {p: find(rows, small, p, label)["ratio_to_tp"] < 1 for p in args.shards}
               for label in labels_ph}
    nominal = args.gemm_overhead_us * 1e-6
    claim_iii = {
        "break_even_us": {f"n={n},p={p}": be * 1e6 for (n, p), be in break_even.items()},
        "break_even_us_at_smallest_width_largest_p": lower * 1e6,
        "overhead_interval_us_for_iii": [max(lower, 0.0) * 1e6, upper_iii * 1e6],
        "overhead_interval_us_for_ii_and_iii": [joint[0] * 1e6, joint[1] * 1e6],
        "plausible_launch_range_us": list(LAUNCH_RANGE_US),
        "interval_overlaps_launch_range": joint[0] * 1e6 < LAUNCH_RANGE_US[1]
        and joint[1] * 1e6 > LAUNCH_RANGE_US[0] and joint[0] < joint[1],
        "phantom_faster_by_p": {label: {str(p): v for p, v in by_p.items()}
                                for label, by_p in pattern.items()},
        "reproduced_with_nominal_overhead": lower < nominal < upper_iii,
        "reproduced_with_fused": all(pattern["phantom (fused)"][p] for p in args.shards if p != top_p)
        and not pattern["phantom (fused)"][top_p],
        "nominal_overhead_us": args.gemm_overhead_us,
    }
    return {"i": claim_i, "ii": claim_ii, "iii": claim_iii}


def sensitivity(args, device) -> dict:
    """Break-even overhead at (smallest n, largest p) as B, L, efficiency and the TP baseline vary."""
    n, p = min(args.widths), max(args.shards)

    def be(device_=device, **overrides):
        tp = estimate("tensor-t1", True, n, p, args, device_, **overrides)
        ph = estimate("phantom", False, n, p, args, device_, **overrides)
        return break_even_gemm_overhead(tp, ph) * 1e6

    out = {
        "at": {"width": n, "num_shards": p},
        "break_even_us_by_batch": {str(b): be(batch=b) for b in (64, 128, 256, 512, 1024)},
        "break_even_us_by_depth": {str(d): be(depth=d) for d in (1, 2, 4, 6)},
        "break_even_us_by_efficiency": {
            str(e): be(dataclasses.replace(device, efficiency=e)) for e in (0.25, 0.5, 0.75, 1.0)},
    }
    # The paper's own TP (Table II) also broadcasts n B forward and all-reduces n B backward per layer.
    tp = estimate("tensor-t1", True, n, p, args, device)
    ph = estimate("phantom", False, n, p, args, device)
    L, B = args.depth, args.batch
    extra = [{"kind": "broadcast", "count": L, "bytes": L * 4 * n * B},
             {"kind": "all-reduce", "count": L, "bytes": L * 4 * n * B}]
    extra_s = FRONTIER.step_time_us(extra, p) * 1e-6
    gemms = ph.flops["decompressor_gemms"]
    out["tp_table2"] = {
        "what": "TP paying Seal et al. Table II's broadcast (n B, forward) and all-reduce (n B, "
                "backward) per layer on top of T1's all-gather / reduce-scatter",
        "extra_comm_s": extra_s,
        "tp_total_s": tp.total_seconds + extra_s,
        "break_even_us": (tp.total_seconds + extra_s - ph.seconds["compute"] - ph.seconds["comm"])
        / gemms * 1e6,
    }
    return out


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def format_table(rows, break_even, oom, claim, args, device) -> str:
    lines = [
        f"Seal et al. Fig. 6 from the step model: k={args.ghost_width}, B={args.batch}, L={args.depth}, "
        f"{args.optimizer} ({OPTIMIZER_STATES[args.optimizer]} optimizer states), fp32, per rank",
        f"MODELLED times: {device.name}, {device.peak_flops / 1e12:.1f} TFLOP/s FP32 matrix peak x "
        f"{device.efficiency:g} efficiency; comm Eq. 26 with Table III (Frontier); unfused overhead "
        f"{args.gemm_overhead_us:g} us per small GEMM; memory vs {device.memory_bytes / GIB:g} GiB",
        f"{'n':>7} {'p':>4} {'strategy':<18} {'param':>7} {'grad':>7} {'optim':>7} {'act+ws':>7} "
        f"{'total':>7} {'fits':>4} {'compute':>8} {'comm':>7} {'ovhd':>7} {'total':>8} {'vs TP':>6}",
        f"{'':>7} {'':>4} {'':<18} {'GiB':>7} {'GiB':>7} {'GiB':>7} {'GiB':>7} {'GiB':>7} {'':>4} "
        f"{'ms':>8} {'ms':>7} {'ms':>7} {'ms':>8} {'':>6}",
    ]
    for r in rows:
        g, s = r["memory_gib"], r["seconds"]
        lines.append(
            f"{r['width']:>7} {r['num_shards']:>4} {r['strategy']:<18} {g['parameters']:>7.2f} "
            f"{g['gradients']:>7.2f} {g['optimizer_state']:>7.2f} "
            f"{g['activations'] + g['workspace']:>7.2f} {g['total']:>7.2f} "
            f"{'yes' if r['fits_in_memory'] else 'OOM':>4} {s['compute'] * 1e3:>8.2f} "
            f"{s['comm'] * 1e3:>7.2f} {s['gemm_overhead'] * 1e3:>7.2f} {s['total'] * 1e3:>8.2f} "
            f"{r['ratio_to_tp']:>6.2f}")
    lines.append("")
    lines.append("Break-even cost per small decompressor GEMM (unfused phantom = TP), us:")
    lines.append("  " + "   ".join(f"n={n} p={p}: {be * 1e6:.2f}" for (n, p), be in break_even.items()))
    lines.append("")
    big = max(args.widths)
    lines.append(f"TP at n={big}, p={min(args.shards)} (GiB per rank; > {device.memory_bytes / GIB:g} "
                 f"= OOM) and whether the paper's OOM pattern follows (TP OOM only there, phantom fits):")
    lines.append(f"  {'L':>2} " + " ".join(f"{o:>18}" for o in OPTIMIZER_STATES))
    for depth in args.sweep_depths:
        cells = []
        for optimizer in OPTIMIZER_STATES:
            o = next(x for x in oom if x["depth"] == depth and x["optimizer"] == optimizer)
            mark = "OOM" if o["tp_exceeds_64_gib_at_smallest_p"] else "fits"
            cells.append(f"{o['tp_gib_at_smallest_p']:7.1f} {mark:<4} {'paper' if o['matches_paper'] else '':<5}")
        lines.append(f"  {depth:>2} " + " ".join(f"{c:>18}" for c in cells))
    lines.append("")
    c1, c2, c3 = claim["i"], claim["ii"], claim["iii"]
    lines.append(f"(i)   phantom < TP memory everywhere: {'REPRODUCED' if c1['reproduced'] else 'NOT reproduced'}"
                 f" (phantom/TP memory {c1['phantom_over_tp_memory']['min']:.3f}.."
                 f"{c1['phantom_over_tp_memory']['max']:.3f})")
    lines.append(f"(ii)  n={big}: TP OOM at p={min(args.shards)} "
                 f"({c2['tp_gib_at_smallest_p']:.2f} GiB): {c2['tp_oom_at_smallest_p_in_default_config']}; "
                 f"phantom faster at every p: fused {c2['phantom_faster_at_every_p']['phantom (fused)']}, "
                 f"unfused {c2['phantom_faster_at_every_p']['phantom (unfused)']}; "
                 f"{'REPRODUCED' if c2['reproduced_default_config'] else 'NOT reproduced'} in this "
                 f"config; OOM pattern holds for: {', '.join(c2['configs_matching_paper_oom']) or 'none'}")
    lo, hi = c3["overhead_interval_us_for_iii"]
    jlo, jhi = c3["overhead_interval_us_for_ii_and_iii"]
    lines.append(f"(iii) n={min(args.widths)}: unfused phantom loses at p={max(args.shards)} and wins "
                 f"below iff the per-GEMM cost is in ({lo:.2f}, {hi:.2f}) us; with (ii)'s timing too: "
                 f"({jlo:.2f}, {jhi:.2f}) us; plausible launch cost {LAUNCH_RANGE_US[0]:g}-"
                 f"{LAUNCH_RANGE_US[1]:g} us: {'overlaps' if c3['interval_overlaps_launch_range'] else 'no overlap'}; "
                 f"at {args.gemm_overhead_us:g} us: "
                 f"{'REPRODUCED' if c3['reproduced_with_nominal_overhead'] else 'NOT reproduced'}; "
                 f"fused phantom reproduces it: {c3['reproduced_with_fused']}")
    return "\n".join(lines)


def plot(rows, args, device, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    styles = {"tensor (T1)": ("C3", "o", "-"), "phantom (fused)": ("C0", "s", "-"),
              "phantom (unfused)": ("C2", "^", "--")}
    fig, axes = plt.subplots(2, len(args.widths), figsize=(6 * len(args.widths), 9), squeeze=False)
    for col, n in enumerate(args.widths):
        ax_t, ax_m = axes[0, col], axes[1, col]
        for label, (color, marker, ls) in styles.items():
            mine = [r for r in rows if r["width"] == n and r["strategy"] == label]
            ps = [r["num_shards"] for r in mine]
            total = [r["seconds"]["total"] * 1e3 for r in mine]
            comm = [r["seconds"]["comm"] * 1e3 for r in mine]
            name = label if label != "phantom (unfused)" else f"{label}, {args.gemm_overhead_us:g} us/GEMM"
            ax_t.plot(ps, total, ls, color=color, marker=marker, label=name)
            ax_t.plot(ps, comm, ":", color=color, lw=1)
            if label == "phantom (unfused)":  # the plausible launch-cost range as a band
                base = [r["seconds"]["compute"] + r["seconds"]["comm"] for r in mine]
                gemms = [r["estimate"]["exact"]["flops"]["decompressor_gemms"] for r in mine]
                low, high = ([(b + g * us * 1e-6) * 1e3 for b, g in zip(base, gemms)]
                             for us in LAUNCH_RANGE_US)
                ax_t.fill_between(ps, low, high, color=color, alpha=0.15,
                                  label=f"unfused, {LAUNCH_RANGE_US[0]:g}-{LAUNCH_RANGE_US[1]:g} us/GEMM")
            oom = [(r["num_shards"], r["seconds"]["total"] * 1e3) for r in mine if not r["fits_in_memory"]]
            if oom:
                ax_t.plot(*zip(*oom), "x", color="k", ms=12, mew=2, label=f"{label}: out of memory")
            ax_m.plot(ps, [r["memory_gib"]["total"] for r in mine], ls, color=color, marker=marker,
                      label=label)
        ax_t.set(yscale="log", xlabel="p (GCDs)", ylabel="modelled time per iteration [ms]",
                 title=f"n = {n}, k = {args.ghost_width}: time (lines), comm only (dotted)")
        ax_m.axhline(device.memory_bytes / GIB, color="k", lw=1, ls="--", label="64 GiB per GCD")
        ax_m.set(yscale="log", xlabel="p (GCDs)", ylabel="memory per rank [GiB]",
                 title=f"n = {n}: params + grads + {args.optimizer} state + activations")
        for ax in (ax_t, ax_m):
            ax.set_xscale("log", base=2)
            ax.set_xticks(args.shards, [str(p) for p in args.shards])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"Seal et al. Fig. 6, MODELLED ({device.name}, Eq. 26 Table III; B={args.batch}, "
                 f"L={args.depth}, {args.optimizer})", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        device = dataclasses.replace(MI250X_GCD, efficiency=args.efficiency)
        rows, break_even = grid(args, device)
        oom = oom_sweep(args, device)
    except ConfigError as error:
        raise SystemExit(f"large_width.py: {error}") from None
    claim = claims(rows, break_even, oom, args, device)
    sens = None if args.quick else sensitivity(args, device)
    table = format_table(rows, break_even, oom, claim, args, device)
    print(table)
    if sens:
        print()
        print(f"Sensitivity of the break-even at n={sens['at']['width']}, p={sens['at']['num_shards']} [us]:")
        for key in ("break_even_us_by_batch", "break_even_us_by_depth", "break_even_us_by_efficiency"):
            name = key.removeprefix("break_even_us_by_")
            print(f"  by {name:<10}: " + ", ".join(f"{k}: {v:.2f}" for k, v in sens[key].items()))
        t2 = sens["tp_table2"]
        print(f"  TP with Table II's broadcast + all-reduce of n B per layer: +{t2['extra_comm_s'] * 1e3:.1f} ms"
              f" per step, break-even {t2['break_even_us']:.1f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "experiment": "large_width",
        "paper": PAPER,
        "labels": {
            "exact": "GEMM FLOPs and counts, collective kinds/counts/bytes, parameter/gradient/"
                     "optimizer/batch bytes (array sizes of jphantom's code)",
            "modelled": "activation and workspace bytes (rule in jphantom.perf.step_model), peak "
                        "memory and fits_in_memory, every time and ratio, break-even overheads",
        },
        "config": {
            "widths": args.widths, "shards": args.shards, "ghost_width": args.ghost_width,
            "batch": args.batch, "depth": args.depth, "optimizer": args.optimizer,
            "optimizer_states": OPTIMIZER_STATES[args.optimizer], "dtype": "float32",
            "gemm_overhead_us": args.gemm_overhead_us, "sweep_depths": args.sweep_depths,
            "quick": args.quick, "choices": "B = 256 and L = 2 are ours; the paper states neither",
        },
        "device": device.as_dict(),
        "comm_model": {"name": FRONTIER.name,
                       "constants": {k: dataclasses.asdict(c) for k, c in FRONTIER.costs.items()}},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "note": "pure arithmetic; no device was used"},
        "rows": rows,
        "break_even_us": {f"n={n},p={p}": be * 1e6 for (n, p), be in break_even.items()},
        "oom_sweep": oom,
        "claims": {key: {"paper": PAPER["claims"][key], "ours": value} for key, value in claim.items()},
        "sensitivity": sens,
        "table": table,
        "wall_s": time.perf_counter() - started,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(rows, args, device, args.out / "large_width.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'large_width.png'} "
          f"in {time.perf_counter() - started:.1f} s")
    return results


if __name__ == "__main__":
    main()
