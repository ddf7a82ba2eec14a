"""Seal et al.'s Frontier runs predicted at their scale: phantom (PP) against tensor parallelism
(TP, ``tensor-t1``) on the FFN, at the paper's widths on 32-256 MI250X GCDs (4-32 Frontier nodes
of 8), from programs XLA compiled for the MI250X, played by :mod:`jphantom.predict`.

The paper (Seal et al., Frontier, PyTorch + RCCL, one rank per GCD) measured:

- Table I (n = 16384, L = 2; k = 4, 2, 2, 4 at p = 32, 64, 128, 256): PP / TP energy per epoch
  0.51, 0.61, 0.82, 1.01, and to a fixed loss 0.30, 0.49, 0.88, 0.52 (PP's epochs / TP's);
- Fig. 5c (n = 16384, L = 2): PP faster than TP at every p;
- Fig. 5a (n = 65536, L = 6, k = 64, p = 32-128): PP's communication per epoch "significantly
  lower" than TP's;
- Fig. 6 (n = 131072, k = 64, L not stated, p = 32-256): PP faster up to p = 128, TP faster at
  p = 256, blamed on PP's p - 1 small decompressor GEMMs.

For each (n, p) this script builds the FFN step exactly as ``jphantom train`` would (one
``shard_map`` over ``model=p``; float32 as the paper's PyTorch; SGD, so no optimizer state; a
global batch of 1024 rows by default, ``--batch``: the paper gives none), compiles it for p
MI250X GCDs (``jphantom.costs.aot.Target.parse("rocm:mi250x", nodes=p // 8)``: jax's ROCm compiler,
no GPU) and predicts one iteration on ``mi250x-gcd.toml`` (peaks and efficiencies per GCD,
Infinity Fabric inside a node, 4 Slingshot NICs per node, busy A = 560 W and idle B = 90 W: Seal
et al.'s Eq. 1 constants): seconds split into compute, exposed and hidden communication, and joules over all p
GCDs. At n = 131072 it also compiles ``phantom-unfused`` (the paper's p - 1 decompressor GEMMs).
Beside the simulator's network it prices the same compiled collectives with the paper's own
Eq. 26 and Table III (RCCL on Frontier, measured), one after another with no overlap, as the
paper's model does: energy = p (A compute + B comm26).

Everything here is modelled; nothing ran on a GPU. ``--target gpu:h100`` compiles for H100s
instead (the program XLA writes for NVIDIA, priced on the MI250X's numbers: labelled so), for a
machine without the ROCm compiler. ``--quick`` compiles tiny FFNs for this machine's CPU devices
(8 simulated, in 2 "nodes" of 4) and prices them the same way: the pipeline, not the paper's sizes,
in seconds and with no compiler extra.

Usage::

    .venv-rocm/bin/python experiments/seal_frontier.py            # rocm:mi250x, ~9 min
    .venv-rocm/bin/python experiments/seal_frontier.py --widths 16384 --batch 256 --out DIR
    .venv-aot/bin/python experiments/seal_frontier.py --target gpu:h100
    python experiments/seal_frontier.py --quick                   # CPU, seconds

Writes ``<out>/results.json`` and ``<out>/seal_frontier.png`` (default
``experiments/results/seal_frontier/``; ``--quick``: a scratch folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from jphantom.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

DEFAULT_OUT = REPO / "experiments" / "results" / "seal_frontier"
GPUS = (32, 64, 128, 256)
BATCH = 1024  # global rows per iteration: Seal et al. give none (our choice)
# width -> (L, k by p or one k, the paper's figure); L = 2 at n = 131072 is our choice
WIDTHS = {16384: (2, {8: 16, 16: 6, 32: 4, 64: 2, 128: 2, 256: 4}, "Table I, Fig. 5c"),
          65536: (6, 64, "Fig. 5a"),
          131072: (2, 64, "Fig. 6")}
UNFUSED_AT = (131072,)
# Table I (n = 16384, L = 2): p -> (PP / TP energy per epoch, PP / TP epochs to the loss)
TABLE_I = {8: (74.6 / 181.2, 157 / 453), 16: (158.0 / 333.6, 175 / 453),
           32: (333.6 / 658.4, 267 / 453), 64: (779.2 / 1281.6, 362 / 453),
           128: (2131.2 / 2611.2, 488 / 453), 256: (6950.4 / 6873.6, 232 / 453)}
QUICK = dict(widths={256: (2, 2, "plumbing")}, gpus=(8,), batch=64, gpus_per_node=4)
PAPER = {
    "source": "Seal et al., phantom parallelism (arXiv:2508.00960), Frontier MI250X GCDs",
    "table_i": "n = 16384, L = 2: PP/TP energy per epoch 0.41, 0.47, 0.51, 0.61, 0.82, 1.01 "
               "and to the fixed loss 0.14, 0.18, 0.30, 0.49, 0.88, 0.52 at p = 8..256",
    "fig_5a": "n = 65536, L = 6, k = 64, p = 32-128: PP's communication per epoch significantly "
              "lower than TP's",
    "fig_5c": "n = 16384, L = 2: PP faster than TP at every p (k = 4 at p = 256)",
    "fig_6": "n = 131072, k = 64, p = 32-256: PP faster up to p = 128, TP faster at p = 256 "
             "(the p - 1 small decompressor GEMMs)",
}


def ghost_width(width: int, p: int) -> int:
    k = WIDTHS.get(width, QUICK["widths"].get(width))[1]
    return k[p] if isinstance(k, dict) else k


# --------------------------------------------------------------------------------------------------
# Compile one program and price it
# --------------------------------------------------------------------------------------------------


def flags_of(strategy: str, width: int, depth: int, p: int, k: int, batch: int) -> dict:
    flags = {"model": "ffn", "width": width, "depth": depth, "batch": batch,
             "strategy": strategy, "mesh": f"model={p}", "optimizer": "sgd",
             "precision": "float32"}
    if strategy.startswith("phantom"):
        flags["ghost_width"] = k
    return flags


def compile_for_target(flags: dict, p: int, target_name: str, device, pool: dict) -> dict:
    """``flags`` compiled for ``p // 8`` nodes of ``target_name`` and predicted on ``device``
    (``jphantom.costs.aot.compile_report(predict_on=device)``); the target's devices are fetched once
    per p (``pool``)."""
    import tempfile

    from jphantom.costs import aot

    nodes = max(1, p // 8)
    if p not in pool:
        target = aot.Target.parse(target_name, nodes=nodes)
        pool[p] = (target, target.devices())
    target, devices = pool[p]
    with tempfile.TemporaryDirectory(prefix="seal-frontier-") as folder:
        hlo = Path(folder) / "step.hlo"
        started = time.perf_counter()
        report = aot.compile_report(flags, target, devices=devices, hlo_out=hlo,
                                    predict_on=device)
        seconds = time.perf_counter() - started
        text = hlo.read_text()
    return {"hlo": text, "prediction": report["prediction"], "compile_seconds": seconds,
            "peak_bytes": report["memory"]["peak_bytes"], "kernels": report["kernels"],
            "params": report["params"], "target": report["target"]["name"]}


def compile_for_cpu(flags: dict, p: int, device, gpus_per_node: int) -> dict:
    """``flags`` compiled for this machine's first ``p`` CPU devices and predicted on ``device``
    with ``gpus_per_node`` devices to a node (``--quick``)."""
    import jax

    from jphantom.analysis.compiled import compile_built, compiled_memory
    from jphantom.analysis.hlo import kernels
    from jphantom.costs.aot import memory_peak
    from jphantom.config import RunConfig
    from jphantom.runtime.mesh import device_pool
    from jphantom.predict import predict

    started = time.perf_counter()
    with device_pool(jax.devices()[:p]):
        config = RunConfig.from_flags(**flags)
        built = config.build()
        compiled, _ = compile_built(config, built.program, built.step)
    seconds = time.perf_counter() - started
    text = compiled.as_text()
    peak = memory_peak(compiled_memory(compiled))
    prediction = predict(text, device, devices=p, gpus_per_node=gpus_per_node,
                         tokens_per_step=flags["batch"], peak_memory_bytes=peak)
    return {"hlo": text, "prediction": prediction.as_dict(), "compile_seconds": seconds,
            "peak_bytes": peak, "kernels": kernels(text), "params": built.program.param_count,
            "target": f"cpu x {p} (simulated; priced as {gpus_per_node} per node)"}


def eq26(hlo_text: str, p: int) -> dict:
    """The compiled step's collectives priced by Seal et al.'s Eq. 26 with Table III's Frontier
    constants (``jphantom.perf.comm_model.FRONTIER``), one after another: seconds and bytes."""
    from jphantom.analysis.hlo import collectives
    from jphantom.perf.comm_model import FRONTIER

    moving = [c for c in collectives(hlo_text) if not c.trivial]
    return {"seconds": FRONTIER.step_time_us(moving, p) * 1e-6,
            "collectives": sum(c.count for c in moving),
            "bytes": float(sum(c.total_bytes for c in moving)),
            "by_kind": {kind: sum(c.count for c in moving if c.kind == kind)
                        for kind in sorted({c.kind for c in moving})},
            "by_kind_s": {kind: FRONTIER.step_time_us([c for c in moving if c.kind == kind], p)
                          * 1e-6 for kind in sorted({c.kind for c in moving})}}


def run_of(strategy: str, width: int, depth: int, p: int, k: int, compiled: dict,
           device) -> dict:
    """One compiled program's row: the simulator's prediction and the Eq. 26 pricing."""
    pr = compiled["prediction"]
    comm26 = eq26(compiled["hlo"], p)
    busy, idle = device["power.busy_watts"], device["power.idle_watts"]
    return {
        "strategy": strategy, "width": width, "depth": depth, "p": p, "nodes": max(1, p // 8),
        "ghost_width": k if strategy.startswith("phantom") else None,
        "params": compiled["params"], "target": compiled["target"],
        "compile_seconds": compiled["compile_seconds"],
        "peak_gib": compiled["peak_bytes"] / 2**30,
        "fits": compiled["peak_bytes"] <= device.memory_bytes,
        "step_s": pr["step_s"], "compute_s": pr["compute_s"],
        "exposed_comm_s": pr["exposed_comm_s"], "hidden_comm_s": pr["hidden_comm_s"],
        "comm_s": pr["exposed_comm_s"] + pr["hidden_comm_s"],
        "joules": pr["joules_per_step"], "collective_bytes": pr["collective_bytes"],
        "gemm_kernels": compiled["kernels"]["gemms"]["by_kind"],
        "by_kind_s": pr["by_kind_s"], "top_ops": pr["top_ops"][:5],
        "eq26_comm_s": comm26["seconds"], "eq26_collectives": comm26["by_kind"],
        "eq26_by_kind_s": comm26["by_kind_s"],
        "eq26_step_s": pr["compute_s"] + comm26["seconds"],
        "eq26_joules": p * (busy * pr["compute_s"] + idle * comm26["seconds"]),
    }


# --------------------------------------------------------------------------------------------------
# The grid, the ratios and the paper's numbers
# --------------------------------------------------------------------------------------------------


def grid(widths: dict, gpus: Sequence[int], batch: int, compile_one, device, log) -> list[dict]:
    runs = []
    for width, (depth, _, _) in widths.items():
        for p in gpus:
            k = ghost_width(width, p)
            strategies = ["tensor-t1", "phantom"] + (
                ["phantom-unfused"] if width in UNFUSED_AT else [])
            for strategy in strategies:
                compiled = compile_one(flags_of(strategy, width, depth, p, k, batch), p)
                run = run_of(strategy, width, depth, p, k, compiled, device)
                log(f"n={width:>6} L={depth} p={p:>3} k={k:>2} {strategy:<15} compiled in "
                    f"{run['compile_seconds']:5.1f} s: step {run['step_s'] * 1e3:8.3f} ms "
                    f"(compute {run['compute_s'] * 1e3:.3f}, exposed "
                    f"{run['exposed_comm_s'] * 1e3:.3f}), {run['joules']:9.2f} J, peak "
                    f"{run['peak_gib']:.2f} GiB; Eq. 26 comm {run['eq26_comm_s'] * 1e3:.3f} ms")
                runs.append(run)
    return runs


def pairs(runs: list[dict]) -> list[dict]:
    """PP / TP per (n, p): time, energy, communication, by the simulator and by Eq. 26, with the
    paper's Table I numbers where it has them."""
    by = {(r["width"], r["p"], r["strategy"]): r for r in runs}
    rows = []
    for (width, p, strategy), tp in sorted(by.items()):
        if strategy != "tensor-t1":
            continue
        pp = by[(width, p, "phantom")]
        row = {"width": width, "depth": tp["depth"], "p": p, "nodes": tp["nodes"],
               "ghost_width": pp["ghost_width"],
               "time_ratio": pp["step_s"] / tp["step_s"],
               "energy_ratio": pp["joules"] / tp["joules"],
               "comm_ratio": pp["comm_s"] / tp["comm_s"] if tp["comm_s"] else None,
               "eq26_time_ratio": pp["eq26_step_s"] / tp["eq26_step_s"],
               "eq26_comm_ratio": pp["eq26_comm_s"] / tp["eq26_comm_s"] if tp["eq26_comm_s"]
               else None,
               "eq26_energy_ratio": pp["eq26_joules"] / tp["eq26_joules"],
               "tp_step_ms": tp["step_s"] * 1e3, "pp_step_ms": pp["step_s"] * 1e3,
               "tp_joules": tp["joules"], "pp_joules": pp["joules"]}
        unfused = by.get((width, p, "phantom-unfused"))
        if unfused is not None:
            extra = (sum(unfused["gemm_kernels"].values())
                     - sum(pp["gemm_kernels"].values()))  # the p - 1 GEMMs' kernels, per step
            row |= {"unfused_time_ratio": unfused["step_s"] / tp["step_s"],
                    "unfused_energy_ratio": unfused["joules"] / tp["joules"],
                    "unfused_eq26_time_ratio": unfused["eq26_step_s"] / tp["eq26_step_s"],
                    "unfused_extra_gemm_kernels": extra,
                    # what each of those kernels would have to cost on top of its prediction
                    # (a framework's dispatch, say) for TP to be the faster
                    "unfused_break_even_us": (tp["step_s"] - unfused["step_s"]) / extra * 1e6
                    if extra > 0 else None,
                    "unfused_eq26_break_even_us": (tp["eq26_step_s"] - unfused["eq26_step_s"])
                    / extra * 1e6 if extra > 0 else None}
        if width == 16384 and p in TABLE_I:
            per_epoch, epochs = TABLE_I[p]
            row |= {"paper_energy_per_epoch_ratio": per_epoch, "paper_epoch_ratio": epochs,
                    "paper_total_energy_ratio": per_epoch * epochs,
                    "to_the_loss_energy_ratio": row["energy_ratio"] * epochs}
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'n':>6} {'L':>2} {'p':>4} {'k':>3} {'TP ms':>9} {'PP ms':>9} {'time PP/TP':>10} "
            f"{'energy':>7} {'comm':>6} {'Eq.26 t':>8} {'Eq.26 E':>8} {'unfused t':>9} "
            f"{'paper E/epoch':>13} {'E to loss':>9} {'paper':>6}")
    lines = [head]
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)
    for r in rows:
        lines.append(
            f"{r['width']:>6} {r['depth']:>2} {r['p']:>4} {r['ghost_width']:>3} "
            f"{r['tp_step_ms']:>9.3f} {r['pp_step_ms']:>9.3f} {r['time_ratio']:>10.2f} "
            f"{r['energy_ratio']:>7.2f} {fmt(r['comm_ratio']):>6} {r['eq26_time_ratio']:>8.2f} "
            f"{r['eq26_energy_ratio']:>8.2f} {fmt(r.get('unfused_time_ratio')):>9} "
            f"{fmt(r.get('paper_energy_per_epoch_ratio')):>13} "
            f"{fmt(r.get('to_the_loss_energy_ratio')):>9} "
            f"{fmt(r.get('paper_total_energy_ratio')):>6}")
    return "\n".join(lines)


def claims(rows: list[dict]) -> dict:
    """Each of the paper's claims against the prediction (the simulator and Eq. 26)."""
    out = {}
    at = lambda n: [r for r in rows if r["width"] == n]
    if at(16384):
        out["fig_5c"] = {"paper": PAPER["fig_5c"], "pp_faster_at": {
            r["p"]: {"simulator": r["time_ratio"] < 1, "eq26": r["eq26_time_ratio"] < 1}
            for r in at(16384)}}
        out["table_i"] = {"paper": PAPER["table_i"], "energy_per_iteration": {
            r["p"]: {"predicted": r["energy_ratio"], "eq26": r["eq26_energy_ratio"],
                     "paper_per_epoch": r.get("paper_energy_per_epoch_ratio")}
            for r in at(16384)}}
    if at(65536):
        out["fig_5a"] = {"paper": PAPER["fig_5a"], "comm_ratio": {
            r["p"]: {"simulator": r["comm_ratio"], "eq26": r["eq26_comm_ratio"]} for r in at(65536)}}
    if at(131072):
        out["fig_6"] = {"paper": PAPER["fig_6"], "time_ratio": {
            r["p"]: {"fused": r["time_ratio"], "unfused": r.get("unfused_time_ratio"),
                     "unfused_eq26": r.get("unfused_eq26_time_ratio")} for r in at(131072)}}
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({r["width"] for r in rows})
    fig, axes = plt.subplots(1, len(widths), figsize=(5.2 * len(widths), 4.2), squeeze=False)
    for ax, width in zip(axes[0], widths):
        mine = [r for r in rows if r["width"] == width]
        ps = [r["p"] for r in mine]
        ax.plot(ps, [r["time_ratio"] for r in mine], "o-", label="time (simulator)")
        ax.plot(ps, [r["energy_ratio"] for r in mine], "s-", label="energy (simulator, Eq. 1)")
        ax.plot(ps, [r["eq26_time_ratio"] for r in mine], "o:", label="time (Eq. 26, Table III)")
        if any("unfused_time_ratio" in r for r in mine):
            ax.plot(ps, [r.get("unfused_time_ratio") for r in mine], "x--",
                    label="time, unfused decompressor")
        paper = [(r["p"], r["paper_energy_per_epoch_ratio"]) for r in mine
                 if "paper_energy_per_epoch_ratio" in r]
        if paper:
            ax.plot(*zip(*paper), "k^--", label="paper: energy per epoch (Table I)")
        ax.axhline(1.0, color="grey", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ps, [str(p) for p in ps])
        ax.set(xlabel="GCDs p", ylabel="phantom / tensor-t1",
               title=f"n = {width}, L = {mine[0]['depth']}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="rocm:mi250x",
                        help="compile target (default rocm:mi250x; gpu:h100 where the ROCm "
                             "compiler is not installed)")
    parser.add_argument("--device", default="mi250x-gcd",
                        help="device description to price on (default mi250x-gcd)")
    parser.add_argument("--widths", default=None,
                        help="comma-separated subset of 16384,65536,131072 (default all)")
    parser.add_argument("--gpus", default=None, help="comma-separated p (default 32,64,128,256)")
    parser.add_argument("--batch", type=int, default=BATCH,
                        help=f"global rows per iteration (default {BATCH}: our choice)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny FFNs compiled for this machine's CPU devices (seconds)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    from jphantom.analysis.machine import output_folder

    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="seal_frontier")
    return args


def _ints(text: str | None, default, what: str, allowed=None) -> list[int]:
    if text is None:
        return list(default)
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--{what} {text!r}: give comma-separated whole numbers") from None
    bad = [v for v in values if (allowed is not None and v not in allowed) or v < 1
           or (allowed is None and v % 8)]
    if bad or not values:
        raise ConfigError(f"--{what} {text!r}: " + (f"choose from {sorted(allowed)}" if allowed
                          else "give multiples of 8 (whole Frontier nodes)"))
    return values


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    from jphantom.analysis.machine import machine_info, source_revision
    from jphantom.predict import load

    started = time.perf_counter()
    try:
        device = load(args.device)
        if args.quick:
            from jphantom.runtime.mesh import simulate_cpu_devices

            simulate_cpu_devices(max(QUICK["gpus"]))
            widths, gpus, batch = QUICK["widths"], QUICK["gpus"], QUICK["batch"]
            compile_one = lambda flags, p: compile_for_cpu(flags, p, device,
                                                           QUICK["gpus_per_node"])
            label = "compiled for CPU devices (--quick: the pipeline, not the paper's sizes)"
        else:
            chosen = _ints(args.widths, WIDTHS, "widths", allowed=set(WIDTHS))
            widths = {n: WIDTHS[n] for n in chosen}
            gpus, batch, pool = _ints(args.gpus, GPUS, "gpus"), args.batch, {}
            if batch < 1:
                raise ConfigError(f"--batch {batch}: give a whole number of rows >= 1")
            compile_one = lambda flags, p: compile_for_target(flags, p, args.target, device, pool)
            label = (f"compiled for {args.target}, priced on {device.name}" + (
                "" if args.target.startswith("rocm:") else
                " (an NVIDIA program on the MI250X's numbers)"))
        runs = grid(widths, gpus, batch, compile_one, device, lambda *a: print(*a, flush=True))
    except ConfigError as error:
        raise SystemExit(f"seal_frontier.py: {error}") from None
    rows = pairs(runs)
    table = format_table(rows)
    print(f"\nphantom / tensor-t1 per iteration ({label}; modelled):")
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    import jax

    results = {
        "experiment": "seal_frontier", "paper": PAPER,
        "labels": {"modelled": "every time, energy and ratio: jphantom.predict on the compiled "
                               "program, and Eq. 26 (Table III) on its collectives",
                   "compiled": "collectives, kernels, peak memory: XLA's, for the target",
                   "paper": "Table I ratios as printed; the figures' claims as stated"},
        "config": {"quick": args.quick, "target": "cpu" if args.quick else args.target,
                   "label": label, "batch": batch, "precision": "float32", "optimizer": "sgd",
                   "widths": {str(n): {"depth": d, "ghost_width": k, "figure": f}
                              for n, (d, k, f) in widths.items()},
                   "gpus": list(gpus), "gpus_per_node": QUICK["gpus_per_node"] if args.quick
                   else 8, "energy": f"Seal et al. Eq. 1 on every GCD: A = "
                   f"{device['power.busy_watts']:g} W while computing, B = "
                   f"{device['power.idle_watts']:g} W while waiting on a collective "
                   f"({device.name}'s power)",
                   "choices": f"batch {batch} rows, SGD, float32, L = 2 at n = 131072 are ours "
                              "(the paper gives none of them); k per p from Table I at n = 16384 "
                              "and 64 at n = 65536 and 131072 (Figs. 5a, 6)"},
        "device": device.as_dict(), "runs": runs, "rows": rows, "claims": claims(rows),
        "table": table, "seconds": time.perf_counter() - started,
        "machine": machine_info(), "revision": source_revision(REPO), "jax": jax.__version__,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(rows, args.out / "seal_frontier.png", f"phantom / tensor-t1 per iteration: {label}")
    print(f"wrote {args.out}/results.json and seal_frontier.png in "
          f"{results['seconds']:.0f} s")
    return results


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
