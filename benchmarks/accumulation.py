"""Gradient accumulation that bounds memory and time: each layout compiled for one node of 8 H100
with one micro-batch per step (``accumulate = 1``) and with the same micro-batch accumulated k = 4
times (4 x the batch, ``accumulate = 4``), from a CPU-only machine (``jphantom compile --target
gpu:h100 --predict``).

Per layout and k: XLA's temporaries per device (``memory_analysis()``), the predicted step (the
compiled program played on the H100 description, :mod:`jphantom.predict`: modelled, not
measured) and the ``while`` loops and GEMM kernels of the optimised HLO. The claims: the
temporaries of k micro-batches stay within 1.1x of one micro-batch's plus the float32 gradient
accumulator (one gradient-sized buffer, which a step without accumulation does not need), and the
predicted step within 1.1x of k one-micro-batch steps (:func:`jphantom.step.grads.accumulate`
says why the accumulation loop hides its bound from XLA).

Model: Llama-3-8B's layer shapes (hidden 4096, 32 heads, 8 key/value heads, SwiGLU 14336,
vocabulary 128256), 4 layers (the headline TP + SP row: 32 layers, S = 8192, as in the issue
that found the blow-up), S = 4096, float32 master weights, bf16 compute, AdamW, ``--remat none``.

    python benchmarks/accumulation.py           # 14 compiles, about 5 minutes on 2 cores
    python benchmarks/accumulation.py --quick   # hidden 512, 2 layers, for a check

Needs XLA's GPU compiler: ``pip install 'jphantom[aot]'`` (``make test-aot`` builds .venv-aot).
Writes ``benchmarks/results/accumulation/accumulation.json`` and a table ``accumulation.txt``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

OUT = Path(__file__).resolve().parent / "results" / "accumulation"
K = 4
LLAMA = dict(model="llama", layers=4, hidden=4096, heads=32, kv_heads=8, intermediate=14336,
             vocab=128256, seq_len=4096, dtype="float32", precision="bf16", optimizer="adamw",
             remat="none")
QUICK = dict(LLAMA, layers=2, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=4096,
             seq_len=512)
LAYOUTS = [  # (name, flags, micro-batch sequences per step)
    ("tensor+sp 32 layers S=8192", dict(strategy="tensor", mesh="data=2,model=4",
                                        sequence_parallel=True, layers=32, seq_len=8192), 4),
    ("data", dict(strategy="tensor", mesh="data=8"), 8),
    ("tensor+sp", dict(strategy="tensor", mesh="data=2,model=4", sequence_parallel=True), 4),
    ("zero-3", dict(strategy="tensor", mesh="data=8", zero=3), 8),
    ("pmm3d", dict(strategy="pmm3d", mesh="data=2,z=2,y=1,x=2"), 4),
    ("experts", dict(strategy="tensor", mesh="data=2,expert=4", moe_every=1, experts=8,
                     top_k=2), 8),
    ("context", dict(strategy="tensor", mesh="data=2,context=4"), 2),
]


def row_of(report: dict, hlo: str) -> dict:
    memory, prediction = report["memory"], report["prediction"]
    return {"temp_gib": memory["temp_bytes"] / 2**30, "peak_gib": memory["peak_bytes"] / 2**30,
            "argument_gib": memory["argument_bytes"] / 2**30, "fits": memory["fits"],
            "predicted_s": prediction["step_s"],
            "while_loops": len(re.findall(r"\swhile\(", hlo)),
            "gemm_kernels": report["kernels"]["gemms"]["total"],
            "compile_seconds": report["compile_seconds"]}


def compare(name: str, one: dict, many: dict) -> dict:
    """The k-micro-batch step against one micro-batch's: temporaries (also less the float32
    gradient accumulator, a third of the arguments: parameters, and Adam's two moments) and the
    predicted step against k one-micro-batch steps."""
    accumulator = one["argument_gib"] / 3
    return {"layout": name, "k": K, "one": one, "accumulated": many,
            "temp_ratio": many["temp_gib"] / one["temp_gib"],
            "temp_ratio_less_accumulator": (many["temp_gib"] - accumulator) / one["temp_gib"],
            "time_ratio": many["predicted_s"] / (K * one["predicted_s"])}


def line(r: dict) -> str:
    one, many = r["one"], r["accumulated"]
    return (f"{r['layout']:<28} temporaries {one['temp_gib']:7.2f} -> {many['temp_gib']:7.2f} GiB "
            f"({r['temp_ratio']:.2f}x; {r['temp_ratio_less_accumulator']:.2f}x less the "
            f"accumulator)  predicted {one['predicted_s'] * 1e3:8.1f} ms -> "
            f"{many['predicted_s'] * 1e3:8.1f} ms ({r['time_ratio']:.2f}x of {K} steps)  "
            f"loops {one['while_loops']} -> {many['while_loops']}, GEMMs run "
            f"{one['gemm_kernels']} -> {many['gemm_kernels']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a hidden-512 model")
    parser.add_argument("--only", nargs="*", default=None, help="layout names (default all)")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    from jphantom.costs import aot
    from jphantom.analysis.machine import output_folder, write_results
    from jphantom.errors import ConfigError
    from jphantom.predict import device as described

    try:
        target, devices = aot.deviceless_node("gpu:h100")
    except ConfigError as error:
        print(f"accumulation: {error}", file=sys.stderr)
        return 2
    base = QUICK if args.quick else LLAMA
    out = output_folder(args.out, OUT, quick=args.quick, name="accumulation")
    out.mkdir(parents=True, exist_ok=True)
    h100 = described.for_target("gpu:h100")
    rows = []
    for name, flags, batch in LAYOUTS:
        if args.only and name not in args.only:
            continue
        flags = {**base, **flags} if not args.quick else {**flags, **base}
        runs = []
        for k in (1, K):
            hlo = out / "step.hlo"
            try:
                report = aot.compile_report({**flags, "batch": batch * k, "accumulate": k},
                                            target, devices=devices, hlo_out=hlo,
                                            predict_on=h100)
            except ConfigError as error:
                print(f"{name}: {error}", file=sys.stderr)
                return 2
            runs.append(row_of(report, hlo.read_text()))
            hlo.unlink()
        rows.append(compare(name, *runs))
        print(line(rows[-1]), flush=True)
    result = {"model": base, "layouts": {n: f for n, f, _ in LAYOUTS}, "rows": rows,
              "device": "gpu:h100 (compiled without a GPU; times modelled)",
              "versions": aot.versions()}
    write_results(out, "accumulation", result, [line(r) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
