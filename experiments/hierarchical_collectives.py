"""Ring vs recursive doubling/halving, and PCCL's round counts, on simulated CPU devices (Singh's thesis ch. 6).

Singh's thesis ch. 6 (PCCL) replaces the ring all-gather / reduce-scatter of RCCL and Cray-MPICH, (p-1)
sequential steps, by recursive doubling / halving across nodes, log2(p) steps, inside a two-level
hierarchy (:mod:`jphantom.runtime.collectives`). Digest 7.5 asks for two small-scale reproductions,
which this script runs:

1. **Round counts in HLO.** For nodes N in --shards, the hierarchical all-gather and reduce-scatter
   on a (node=N, local=max(--shards)/N) mesh compile to log2(N) collective-permutes over the node axis
   plus one in-node collective over local; a ring written with ``lax.ppermute`` over p = N ranks
   compiles to p-1 permutes. Counted with :func:`jphantom.analysis.hlo.collectives` and compared
   with :func:`jphantom.runtime.collectives.rounds`.
2. **Timing map.** Per kind (all-gather, reduce-scatter), group size p in --shards and full buffer n
   in --sizes (bytes per rank: the all-gather's output, the reduce-scatter's input, PCCL's
   convention; float32): the ring (p-1 ppermute rounds, below) against recursive doubling/halving
   (:func:`~jphantom.runtime.collectives.hierarchical_all_gather` /
   :func:`~jphantom.runtime.collectives.hierarchical_reduce_scatter` on a (node=p, local=1) mesh:
   log2 p ppermute rounds, no in-node phase), and XLA's own collective (``lax.all_gather`` /
   ``lax.psum_scatter``, one HLO op) for reference. All three of a cell are compiled first, then
   timed side by side: --repeats rounds, each calling every method once in a rotating order, each
   call ended by ``block_until_ready``; the median is reported. Every result is checked against
   numpy before timing. Each cell also gets the alpha-beta model's choice
   (:func:`~jphantom.runtime.collectives.choose` with nodes = p, local = 1, its Frontier-like
   defaults) and the model's ring/recursive speedup with alpha and beta fitted to this run's ring
   medians (least squares on T = (p-1) alpha + (p-1)/p n / beta, relative errors).

**There is no network here.** Simulated CPU devices are threads of one process that share this
machine's cores and memory; a "send" is a memcpy. The times reflect the host's memory traffic and
thread scheduling (p devices contending for 2 cores here), not link bandwidth or latency, so the
numbers say nothing about Frontier's (PCCL's 7-30x come from NIC mapping and latency at 2048 GCDs).
The script prints this next to its table. What can carry over is the round structure: a ring pays
a synchronisation per step, p-1 of them, recursive doubling log2 p.

The ring, per rank r of p (``ring_all_gather``, ``ring_reduce_scatter``): all-gather passes blocks
to r+1 for p-1 steps (step s delivers rank r-s-1's block) and reorders once at the end;
reduce-scatter starts from its block r-1, and at step s receives from r-1 the partial sum of block
r-s-2 and adds its own part, so after p-1 steps it holds the full sum of block r.

Usage::

    python experiments/hierarchical_collectives.py              # n = 2^10..2^22 B, p = 2,4,8 (~40 s)
    python experiments/hierarchical_collectives.py --quick      # n = 2^10,2^14 B, p = 2,4
    python experiments/hierarchical_collectives.py --sizes 10,22,2 --repeats 30

Results: ``<out>/results.json`` and ``<out>/hierarchical_collectives.png`` (``--out``, default
``experiments/results/hierarchical_collectives/``; ``--quick``: a scratch folder).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.analysis import hlo
from jphantom.analysis.machine import output_folder
from jphantom.runtime.mesh import simulate_cpu_devices
from jphantom.runtime import collectives as hc

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "hierarchical_collectives"
NODE, LOCAL = "node", "local"
RANKS = P((NODE, LOCAL))
KINDS = ("all-gather", "reduce-scatter")
METHODS = ("ring", "recursive", "xla")
NO_NETWORK = ("simulated CPU devices: no network; times reflect this host's memory traffic and "
              "thread scheduling, not link bandwidth or latency")


# --------------------------------------------------------------------------------------------------
# The ring, per rank (the baseline PCCL replaces across nodes).
# --------------------------------------------------------------------------------------------------


def _to_next(p: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % p) for i in range(p)]


def ring_all_gather(x: jax.Array, axis_name: str) -> jax.Array:
    """x [m] -> [p·m] in rank order, by p-1 ppermute steps to the next rank."""
    p, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    blocks = [x]  # blocks[k]: rank (me - k)'s x
    for _ in range(p - 1):
        blocks.append(lax.ppermute(blocks[-1], axis_name, _to_next(p)))  # [m] one step of the ring
    stacked = jnp.stack(blocks)  # [p, m]
    return jnp.take(stacked, (me - jnp.arange(p)) % p, axis=0).reshape(-1)  # [p·m] rank order


def ring_reduce_scatter(x: jax.Array, axis_name: str) -> jax.Array:
    """x [p·c] -> [c], the sum over ranks of block r, by p-1 ppermute steps to the next rank."""
    p, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    blocks = x.reshape(p, -1)  # [p, c]
    acc = lax.dynamic_index_in_dim(blocks, (me - 1) % p, keepdims=False)  # [c] block r-1
    for s in range(p - 1):
        acc = lax.ppermute(acc, axis_name, _to_next(p))  # [c] one step of the ring
        acc = acc + lax.dynamic_index_in_dim(blocks, (me - s - 2) % p, keepdims=False)  # + own part
    return acc  # [c] block r, summed over all p ranks


def per_rank(kind: str, method: str):
    """The per-rank function of (kind, method) on a (node=p, local=1) mesh, x 1-D."""
    if method == "ring":  # one axis of p ranks: the node axis (local has size 1)
        fn = ring_all_gather if kind == "all-gather" else ring_reduce_scatter
        return lambda x: fn(x, NODE)
    if method == "recursive":
        fn = hc.hierarchical_all_gather if kind == "all-gather" else hc.hierarchical_reduce_scatter
        return lambda x: fn(x, NODE, LOCAL)
    fn = hc.flat_all_gather if kind == "all-gather" else hc.flat_reduce_scatter
    return lambda x: fn(x, NODE, LOCAL)


@functools.lru_cache(maxsize=None)
def mesh_of(nodes: int, local: int):
    return jax.make_mesh((nodes, local), (NODE, LOCAL), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[: nodes * local])


def compile_cell(kind: str, method: str, nodes: int, local: int, x: jax.Array):
    fn = jax.jit(jax.shard_map(per_rank(kind, method), mesh=mesh_of(nodes, local), in_specs=RANKS,
                               out_specs=RANKS, check_vma=True))
    return fn.lower(x).compile()


def make_input(kind: str, nbytes: int, p: int) -> jax.Array:
    """Global float32 input of small integers (exact sums), per rank [n/(4p)] (all-gather) or
    [n/4] (reduce-scatter)."""
    floats = nbytes // 4 // (p if kind == "all-gather" else 1)
    values = (np.arange(p * floats, dtype=np.int64) * 7919 % 17 - 8).astype(np.float32)
    return jax.device_put(values, NamedSharding(mesh_of(p, 1), RANKS))


def expected(kind: str, x: np.ndarray, p: int) -> np.ndarray:
    """Every rank's result stacked along dim 0, as out_specs P(('node', 'local')) returns it."""
    if kind == "all-gather":
        return np.tile(x, p)  # every rank holds the whole input
    return x.reshape(p, p, -1).sum(axis=0).reshape(-1)  # [rank, block, c] summed over ranks


# --------------------------------------------------------------------------------------------------
# 1. Round counts.
# --------------------------------------------------------------------------------------------------


def round_counts(shards: Sequence[int]) -> list[dict]:
    """HLO collectives of the hierarchical collectives on (N, devices/N) and of the ring on N."""
    devices = max(shards)
    rows = []
    for nodes in shards:
        local = devices // nodes
        axes = {NODE: nodes, LOCAL: local}
        row = {"nodes": nodes, "local": local, "log2_nodes": int(math.log2(nodes))}
        for kind in KINDS:
            x = jnp.ones(nodes * local * 4 * nodes * local, jnp.float32)
            x = jax.device_put(x, NamedSharding(mesh_of(nodes, local), RANKS))
            found = hlo.collectives(compile_cell(kind, "recursive", nodes, local, x).as_text())
            permutes = [c for c in found if c.kind == "collective-permute"]
            row[kind] = {
                "permutes_over_node": sum(c.count for c in permutes if c.mesh_axes(axes) == (NODE,)),
                "permutes_other": sum(c.count for c in permutes if c.mesh_axes(axes) != (NODE,)),
                "permute_bytes": [c.bytes for c in permutes],
                "in_node": [(c.kind, list(c.mesh_axes(axes))) for c in found if c not in permutes],
                "rounds()": hc.rounds(kind, nodes, local),
            }
            ring_x = make_input(kind, 4 * nodes * nodes, nodes)
            ring = hlo.collectives(compile_cell(kind, "ring", nodes, 1, ring_x).as_text())
            row[kind]["ring_permutes_p_equals_nodes"] = sum(
                c.count for c in ring if c.kind == "collective-permute")
        rows.append(row)
    return rows


def format_rounds(rows: list[dict]) -> str:
    lines = ["Collective-permute rounds in HLO (hierarchical on node x local; ring over p = nodes)",
             f"{'nodes':>5} {'local':>5} {'log2 N':>6} | {'AG permutes':>11} {'RS permutes':>11} "
             f"{'in-node ops (AG; RS)':<48} | {'ring AG':>7} {'ring RS':>7}"]
    for r in rows:
        ag, rs = r["all-gather"], r["reduce-scatter"]
        in_node = "; ".join(f"{k} over {'x'.join(a) or '-'}" for k, a in ag["in_node"] + rs["in_node"])
        lines.append(f"{r['nodes']:>5} {r['local']:>5} {r['log2_nodes']:>6} | "
                     f"{ag['permutes_over_node']:>11} {rs['permutes_over_node']:>11} "
                     f"{in_node or 'none':<48} | {ag['ring_permutes_p_equals_nodes']:>7} "
                     f"{rs['ring_permutes_p_equals_nodes']:>7}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# 2. Timing map.
# --------------------------------------------------------------------------------------------------


def time_cell(kind: str, p: int, nbytes: int, args) -> dict:
    """Compile the three methods of one cell, check them, time them side by side."""
    x = make_input(kind, nbytes, p)
    want = expected(kind, np.asarray(x), p)
    compiled = {}
    for method in METHODS:
        compiled[method] = compile_cell(kind, method, p, 1, x)
        got = np.asarray(compiled[method](x))
        if not np.array_equal(got, want):
            raise RuntimeError(f"{kind} {method} p={p} n={nbytes} B: wrong result")
        for _ in range(args.warmup):
            compiled[method](x).block_until_ready()
    times = {method: [] for method in METHODS}
    for rep in range(args.repeats):
        order = METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]  # rotate who goes first
        for method in order:
            start = time.perf_counter()
            compiled[method](x).block_until_ready()
            times[method].append((time.perf_counter() - start) * 1e6)
    medians = {m: statistics.median(t) for m, t in times.items()}
    return {"kind": kind, "p": p, "nbytes": nbytes, "times_us": times, "median_us": medians,
            "speedup_recursive_over_ring": medians["ring"] / medians["recursive"],
            "model_choice": hc.choose(kind, nbytes, p, 1)}


def fit_alpha_beta(cells: list[dict]) -> dict:
    """alpha [us], beta [GB/s] of T = (p-1) alpha + (p-1)/p n / beta on the ring medians, least
    squares in relative error; with the fitted model's recursive time log2 p alpha + same volume."""
    rows = [(c["p"] - 1, (c["p"] - 1) / c["p"] * c["nbytes"], c["median_us"]["ring"]) for c in cells]
    a = np.array([[lat, vol] for lat, vol, _ in rows]) / np.array([[t] for *_, t in rows])
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    beta = 1.0 / inv_beta / 1e3 if inv_beta > 0 else math.inf  # bytes/us -> GB/s
    for c in cells:
        p, n = c["p"], c["nbytes"]
        ring = (p - 1) * alpha + (p - 1) / p * n * inv_beta
        recursive = math.log2(p) * alpha + (p - 1) / p * n * inv_beta
        c["fitted_model_us"] = {"ring": ring, "recursive": recursive}
        c["fitted_model_speedup"] = ring / recursive
    return {"alpha_us": float(alpha), "beta_GBps": float(beta)}


def format_map(cells: list[dict], kind: str) -> str:
    sizes = sorted({c["nbytes"] for c in cells})
    shards = sorted({c["p"] for c in cells})
    by = {(c["p"], c["nbytes"]): c for c in cells if c["kind"] == kind}
    head = " ".join(f"{_size(n):>8}" for n in sizes)
    lines = [f"{kind}: median us ring / recursive / xla, speedup ring/recursive, model choice "
             "(h = hierarchical i.e. recursive, f = flat ring)", f"{'p':>3} {'':<10} {head}"]
    for p in shards:
        cs = [by[p, n] for n in sizes]
        for label, cell in (("ring us", lambda c: f"{c['median_us']['ring']:.0f}"),
                            ("recur us", lambda c: f"{c['median_us']['recursive']:.0f}"),
                            ("xla us", lambda c: f"{c['median_us']['xla']:.0f}"),
                            ("speedup", lambda c: f"{c['speedup_recursive_over_ring']:.2f}"),
                            ("fit model", lambda c: f"{c['fitted_model_speedup']:.2f}"),
                            ("choice", lambda c: c["model_choice"][0])):
            lines.append(f"{p if label == 'ring us' else '':>3} {label:<10} "
                         + " ".join(f"{cell(c):>8}" for c in cs))
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n >> 20}M" if n >= 2**20 else f"{n >> 10}K"


def plot(cells: list[dict], path: Path) -> None:
    """Heat maps of the measured ring/recursive speedup per kind, model choice in each cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({c["nbytes"] for c in cells})
    shards = sorted({c["p"] for c in cells})
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.75 * len(sizes) + 2), 7), squeeze=False)
    for ax, kind in zip(axes[:, 0], KINDS):
        by = {(c["p"], c["nbytes"]): c for c in cells if c["kind"] == kind}
        grid = np.array([[by[p, n]["speedup_recursive_over_ring"] for n in sizes] for p in shards])
        limit = max(1.0, float(np.abs(np.log2(grid)).max()))  # symmetric colour scale, log2 units
        image = ax.imshow(np.log2(grid), cmap="RdBu", vmin=-limit, vmax=limit,
                          aspect="auto", origin="lower")
        for i, p in enumerate(shards):
            for j, n in enumerate(sizes):
                c = by[p, n]
                ax.text(j, i, f"{grid[i, j]:.2f}\n{c['model_choice'][0]}", ha="center", va="center",
                        fontsize=7)
        ax.set(xticks=range(len(sizes)), xticklabels=[_size(n) for n in sizes], yticks=range(len(shards)),
               yticklabels=shards, xlabel="n, full buffer per rank [bytes]", ylabel="p",
               title=f"{kind}: ring time / recursive time (blue: recursive faster)\n"
                     "letter: the alpha-beta model's choice, h = recursive, f = ring")
        fig.colorbar(image, ax=ax, label="log2 speedup")
    fig.suptitle(NO_NETWORK, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# CLI.
# --------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--sizes", type=_ints, default=[10, 22], help="min,max[,step] exponents of n in bytes; 10,22")
    add("--shards", type=_ints, default=[2, 4, 8], help="group sizes p (powers of two); 2,4,8")
    add("--repeats", type=int, default=25, help="timed calls per method and cell; default 25")
    add("--warmup", type=int, default=2, help="untimed calls per method after compile; default 2")
    add("--quick", action="store_true", help="n = 2^10, 2^14 B, p = 2,4, 3 repeats, 1 warm-up")
    add("--out", type=Path, default=None,
        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.shards, args.repeats, args.warmup = [10, 14, 4], [2, 4], 3, 1
    if len(args.sizes) not in (2, 3) or not 0 <= args.sizes[0] <= args.sizes[1] <= 28:
        parser.error(f"--sizes {args.sizes}: give min,max[,step] exponents in 0..28, e.g. 10,22")
    lo, hi, step = (*args.sizes, 1)[:3]
    args.nbytes = [2**e for e in range(lo, hi + 1, max(1, step))]
    if not args.shards or any(p < 2 or p & (p - 1) for p in args.shards):
        parser.error(f"--shards {args.shards}: powers of two >= 2 (recursive doubling needs them)")
    if any(n < 4 * p for n in args.nbytes for p in args.shards):
        parser.error("--sizes: the smallest n must hold one float per rank (n >= 4 p bytes)")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick,
                             name="hierarchical_collectives")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run both parts, print the tables, write results.json and hierarchical_collectives.png.

    Needs max(--shards) devices in this process (the ``__main__`` entry point simulates them)."""
    args = parse_args(argv)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    print(NO_NETWORK)
    rounds_rows = round_counts(args.shards)
    print(format_rounds(rounds_rows))
    cells = []
    for p in args.shards:
        for nbytes in args.nbytes:
            for kind in KINDS:
                cells.append(time_cell(kind, p, nbytes, args))
    fit = fit_alpha_beta(cells)
    tables = [format_map(cells, kind) for kind in KINDS]
    fitted = (f"alpha-beta fit to the ring medians: alpha = {fit['alpha_us']:.1f} us per step, "
              f"beta = {fit['beta_GBps']:.2f} GB/s (this host's memcpy and scheduling, not a link)")
    for table in tables:
        print(table)
    print(fitted)
    print(NO_NETWORK)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "experiment": "hierarchical_collectives",
        "paper": "Singh's thesis ch. 6 (PCCL), digest 3.3 and 7.5",
        "note": NO_NETWORK,
        "config": {"nbytes": args.nbytes, "shards": args.shards, "repeats": args.repeats,
                   "warmup": args.warmup, "quick": args.quick, "dtype": "float32",
                   "model_defaults": {"alpha_us": hc.ALPHA_US, "beta_inter_GBps": hc.BETA_INTER,
                                      "beta_intra_GBps": hc.BETA_INTRA}},
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "devices": jax.device_count()},
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "rounds": rounds_rows,
        "fit_on_ring": fit,
        "cells": cells,
        "tables": [format_rounds(rounds_rows), *tables, fitted],
    }
    results["wall_s"] = time.perf_counter() - started
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(cells, args.out / "hierarchical_collectives.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'hierarchical_collectives.png'} "
          f"in {results['wall_s']:.1f} s")
    return results


if __name__ == "__main__":
    simulate_cpu_devices(max(parse_args(sys.argv[1:]).shards))
    main(sys.argv[1:])
