"""E11: the paper's p-1 separate decompressor GEMMs against one fused GEMM, at the paper's per-rank shapes.

Seal et al. Fig. 6 (n = 131072, k = 64): phantom beats TP up to p = 128 but loses at p = 256, which the
paper blames on the decompression: each rank multiplies the p-1 received k-wide phantom layers by p-1
separate [n/p, k] decompressors (one ``torch.nn.Linear`` each), so it runs p-1 small GEMMs forward and
2(p-1) backward, and GEMM efficiency falls as they shrink while their number grows with p. The
decompressor's FLOPs do not fall with p at all: 2·B·(p-1)·k·(n/p) ~ 2·B·n·k per layer and pass, while
the local block's 2·B·(n/p)^2 falls as 1/p^2, so at p = 256 decompression is most of a rank's work.

jphantom decompresses with one [B, p·k] x [p·k, n/p] GEMM (``phantom.forward(fused=True)``, the
default; a design improvement over the paper, labelled as such) and keeps the paper's scheme as
``fused=False``. This script times both on one device at the per-rank shapes of the paper's Fig. 6
runs, which are too large to run as a whole here (n·k·p floats of decompressors): it calls
``phantom.rank_compute``, one rank's exact arithmetic of a layer, forward and backward, with the two
collectives cut out (their results are inputs), jitted. Fused and unfused run round-robin (the order
alternating) so that load from other processes hits both alike; the time is the median of
``--repeats`` calls, each ended by ``block_until_ready``, after a warm-up call. Also reported, from
the compiled HLO: the number of dot (GEMM) ops and their FLOPs, and XLA's FLOP count.

Measured here on a CPU: the *ratio* unfused / fused and how it grows with p is the result. A GPU adds
a kernel-launch latency per GEMM (several μs) that a CPU does not have, so the unfused penalty on a
GPU is larger than here; where a GPU is available run this script there (``--out`` to keep both).

Usage::

    python experiments/decompressor_fusion.py             # n=131072, k=64, p=32,64,128,256, B=256
    python experiments/decompressor_fusion.py --quick     # n=4096, k=16, p=8,16, B=32: seconds

Results: ``<out>/results.json`` and ``<out>/decompressor_fusion.png`` (default
``experiments/results/decompressor_fusion/``; ``--quick``: a scratch folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from jphantom.analysis import hlo  # noqa: E402
from jphantom.analysis.compiled import xla_flops  # noqa: E402
from jphantom.analysis.machine import machine_info, output_folder  # noqa: E402
from jphantom.nn.phantom import ops as phantom  # noqa: E402

DEFAULT_OUT = REPO / "experiments" / "results" / "decompressor_fusion"
PAPER = {
    "figure": "Seal et al. Fig. 6, n = 131072, k = 64, p = 32..256; experiment E11",
    "claim": "phantom beats TP up to p = 128 but TP is faster at p = 256; the paper attributes it "
             "to the p-1 small decompressor GEMMs, whose efficiency drops as they shrink and whose "
             "count grows with p (decompression time grows ~linearly with p)",
}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="E11: fused vs the paper's unfused phantom decompressor at per-rank shapes.",
        epilog=__doc__.split("Usage::")[1].split("Results:")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, help="n (default 131072; 4096 with --quick)")
    parser.add_argument("--ghost-width", type=int, help="k (default 64; 16 with --quick)")
    parser.add_argument("--shards", type=str, help="comma-separated p (default 32,64,128,256)")
    parser.add_argument("--batch", type=int, help="B (default 256, our choice: the paper omits it)")
    parser.add_argument("--repeats", type=int, help="timed calls per variant (default 7)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds (tests)")
    args = parser.parse_args(argv)
    defaults = {"width": 4096 if args.quick else 131072, "ghost_width": 16 if args.quick else 64,
                "shards": "8,16" if args.quick else "32,64,128,256",
                "batch": 32 if args.quick else 256, "repeats": 3 if args.quick else 7}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.shard_list = [int(p) for p in args.shards.split(",")]
    except ValueError:
        parser.error(f"--shards {args.shards!r}: give comma-separated integers, e.g. 32,64,128,256")
    for p in args.shard_list:
        if p < 2 or args.width % p:
            parser.error(f"--shards: p={p} must be >= 2 and divide --width {args.width}")
        if args.ghost_width >= phantom.max_ghost_width(args.width, p):
            parser.error(f"--ghost-width {args.ghost_width} breaks Eq. 8 at p={p} (bound "
                         f"{phantom.max_ghost_width(args.width, p):g}): pick a smaller k or p")
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats must be >= 1")
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="decompressor_fusion")
    return args


def analytic_flops(width, ghost_width, num_shards, batch):
    """Matmul FLOPs of one rank's layer, forward + backward (2 per multiply-add): the local block,
    the compressor and the p-1 decompressors, each a forward product and two backward ones."""
    block = width // num_shards
    local = 3 * 2 * batch * block * block
    compress = 3 * 2 * batch * ghost_width * block
    decompress = 3 * 2 * batch * (num_shards - 1) * ghost_width * block
    return {"local": local, "compress": compress, "decompress": decompress,
            "total": local + compress + decompress}


def rank_inputs(width, ghost_width, num_shards, batch, key):
    """Random per-rank operands at rank 1's shapes (values do not matter for time)."""
    block = width // num_shards
    keys = jax.random.split(key, 7)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
    return (normal(keys[0], (batch, block)),                             # y
            normal(keys[1], (num_shards, batch, ghost_width)),           # gathered ghosts
            normal(keys[2], (batch, ghost_width)),                       # gamma
            normal(keys[3], (batch, block)),                             # dz
            normal(keys[4], (block, block)),                             # local
            normal(keys[5], (ghost_width, block)),                       # compress
            normal(keys[6], (num_shards, block, ghost_width)),           # decompress
            jnp.zeros((block,), jnp.float32))                            # bias


def compile_variant(inputs, fused):
    fn = jax.jit(lambda *a: phantom.rank_compute(*a, rank=1, fused=fused))
    start = time.perf_counter()
    compiled = fn.lower(*inputs).compile()
    compile_s = time.perf_counter() - start
    dot_flops, dot_ops = hlo.dot_flops(compiled.as_text())
    return compiled, {"compile_seconds": compile_s, "dot_ops": dot_ops, "dot_flops": dot_flops,
                      "xla_flops": xla_flops(compiled)}


def time_round_robin(compiled, inputs, repeats):
    """Median seconds per call of each variant, alternating their order every round."""
    times = {name: [] for name in compiled}
    for name, fn in compiled.items():  # warm-up
        jax.block_until_ready(fn(*inputs))
    names = list(compiled)
    for round_ in range(repeats):
        for name in (names if round_ % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*inputs))
            times[name].append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "all_s": t}
            for name, t in times.items()}


def run(args) -> dict:
    rows = []
    key = jax.random.PRNGKey(0)
    for p in tqdm(args.shard_list, desc="E11 shapes", unit="p"):
        inputs = rank_inputs(args.width, args.ghost_width, p, args.batch, key)
        compiled, info = {}, {}
        for name, fused in (("fused", True), ("unfused", False)):
            compiled[name], info[name] = compile_variant(inputs, fused)
        times = time_round_robin(compiled, inputs, args.repeats)
        flops = analytic_flops(args.width, args.ghost_width, p, args.batch)
        row = {"shards": p, "block": args.width // p, "flops": flops,
               "decompress_flop_share": flops["decompress"] / flops["total"]}
        for name in compiled:
            t = times[name]["median_s"]
            row[name] = {**info[name], **times[name], "gflops_per_s": flops["total"] / t / 1e9}
        row["unfused_over_fused"] = row["unfused"]["median_s"] / row["fused"]["median_s"]
        rows.append(row)
        del inputs, compiled
    return {
        "experiment": "E11 decompressor fusion",
        "config": {"width": args.width, "ghost_width": args.ghost_width, "shards": args.shard_list,
                   "batch": args.batch, "repeats": args.repeats, "dtype": "float32",
                   "what": "one rank's phantom layer, forward + backward, collectives cut out "
                           "(phantom.rank_compute), one device"},
        "machine": machine_info(),
        "source": "measured (CPU)" if jax.devices()[0].platform == "cpu" else "measured (GPU)",
        "paper": PAPER,
        "rows": rows,
    }


def format_table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"E11 at n={cfg['width']}, k={cfg['ghost_width']}, B={cfg['batch']}, one rank's layer "
             f"(forward + backward), {result['machine']['device_kind']}, median of {cfg['repeats']}",
             f"{'p':>5}{'n/p':>7}{'decomp. FLOP':>13}{'dots fused':>11}{'unfused':>8}"
             f"{'fused ms':>10}{'unfused ms':>11}{'unf/fused':>10}{'fused GF/s':>11}{'unf. GF/s':>10}"]
    for r in result["rows"]:
        lines.append(
            f"{r['shards']:>5}{r['block']:>7}{r['decompress_flop_share']:>12.1%} "
            f"{r['fused']['dot_ops']:>10}{r['unfused']['dot_ops']:>8}"
            f"{r['fused']['median_s'] * 1e3:>10.1f}{r['unfused']['median_s'] * 1e3:>11.1f}"
            f"{r['unfused_over_fused']:>10.2f}{r['fused']['gflops_per_s']:>11.1f}"
            f"{r['unfused']['gflops_per_s']:>10.1f}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    p = [r["shards"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in (("fused", "-o"), ("unfused", "--s")):
        left.plot(p, [r[name]["median_s"] * 1e3 for r in rows], style,
                  label=f"{name} ({'1 GEMM' if name == 'fused' else 'p-1 GEMMs'} per product)")
        right.plot(p, [r[name]["gflops_per_s"] for r in rows], style, label=name)
    cfg = result["config"]
    left.set_title(f"one rank's layer, fwd+bwd (n={cfg['width']}, k={cfg['ghost_width']}, "
                   f"B={cfg['batch']})")
    left.set_ylabel("ms (measured, " + result["machine"]["device_kind"] + ")")
    right.set_title("achieved GFLOP/s")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shards p (per-rank shapes of the paper's run)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print(format_table(result))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    plot(result, args.out / "decompressor_fusion.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'decompressor_fusion.png'}")
    return result


if __name__ == "__main__":
    main()
