"""A Llama step compiled for AMD Instinct GPUs from a CPU-only machine (``jphantom compile
--target rocm:...``, :mod:`jphantom.rocm`): 2 Frontier nodes of 8 MI250X GCDs and one node of 8
MI300X, under tensor + sequence parallelism, ZeRO-3 and phantom parallelism, and FP8 on the MI300X.

Per run: memory per device (XLA's ``memory_analysis()``: arguments, outputs, temporaries, peak)
against the device's, every collective with its mesh axes, bytes, how many XLA made asynchronous
and overlapped, and how many cross nodes, the kernels (GEMMs by emitter, FP8 GEMMs and their
operand formats, fused attention calls) and the compile seconds. Nothing runs and nothing is
timed: no GEMM autotuning without a GPU, and the ROCm runtime is stood in for.

Model: Llama-3-8B's layer shapes (hidden 4096, 32 heads, 8 key/value heads, SwiGLU 14336),
2 layers, vocabulary 32000, S = 2048, global batch 32 sequences (16 per data rank group on the
MI250X runs), float32 master weights, bf16 compute (FP8 on the MI300X row), AdamW.

    python benchmarks/rocm_compile.py           # the 7 compiles (about 4 minutes on 2 cores)
    python benchmarks/rocm_compile.py --quick   # hidden 256, for a check

Needs the ROCm compiler: ``pip install 'jphantom[rocm]'`` (Python >= 3.12; ``make test-rocm``
builds .venv-rocm). Writes ``benchmarks/results/rocm_compile/rocm_compile.json`` and a table
``rocm_compile.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

OUT = Path(__file__).resolve().parent / "results" / "rocm_compile"
LLAMA = dict(model="llama", layers=2, hidden=4096, heads=32, kv_heads=8, intermediate=14336,
             vocab=32000, seq_len=2048, batch=32, dtype="float32", precision="bf16",
             optimizer="adamw")
QUICK = dict(LLAMA, hidden=256, heads=8, kv_heads=8, intermediate=512, seq_len=128)
RUNS = [  # (target, nodes, name, flags)
    ("rocm:mi250x", 2, "tensor+sp", dict(strategy="tensor", mesh="data=2,model=8",
                                         sequence_parallel=True)),
    ("rocm:mi250x", 2, "zero3", dict(strategy="tensor", mesh="data=16", zero=3)),
    ("rocm:mi250x", 2, "phantom", dict(strategy="phantom", mesh="data=2,model=8", ghost_width=64)),
    ("rocm:mi300x", 1, "tensor+sp", dict(strategy="tensor", mesh="model=8",
                                         sequence_parallel=True)),
    ("rocm:mi300x", 1, "zero3", dict(strategy="tensor", mesh="data=8", zero=3)),
    ("rocm:mi300x", 1, "phantom", dict(strategy="phantom", mesh="model=8", ghost_width=64)),
    ("rocm:mi300x", 1, "tensor+sp fp8", dict(strategy="tensor", mesh="model=8",
                                             sequence_parallel=True, precision="fp8")),
]


def fp8_formats(hlo: str) -> dict[str, int]:
    """How often each 8-bit float type appears in the optimised HLO's shapes."""
    found: dict[str, int] = {}
    for name in re.findall(r"\b(f8e[0-9a-z]+)\[", hlo):
        found[name] = found.get(name, 0) + 1
    return found


def row_of(report: dict, name: str, hlo: str) -> dict:
    memory, kernels = report["memory"], report["kernels"]
    return {"run": name, "target": report["target"]["name"], "mesh": report["mesh"],
            "strategy": report["strategy"], "compile_seconds": report["compile_seconds"],
            "memory_gib": {k: memory.get(k, 0) / 2**30 for k in
                           ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes",
                            "device_bytes")},
            "fits": memory["fits"],
            "collectives": [{k: r[k] for k in ("kind", "axes", "count", "bytes", "asynchronous",
                                                 "overlapped", "crosses_nodes")}
                            for r in report["collectives"]],
            "gemms": kernels["gemms"], "attention_calls": kernels["attention"],
            "fp8_formats": fp8_formats(hlo),
            "runtime_stand_ins": len(report["target"].get("runtime_stand_ins", [])),
            "xla_flags": report["xla_flags"]}


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        m = r["memory_gib"]
        lines.append(f"{r['run']} on {r['target']}, mesh {r['mesh']}: compiled in "
                     f"{r['compile_seconds']:.1f} s; peak {m['peak_bytes']:.2f} GiB of "
                     f"{m['device_bytes']:.1f} (arguments {m['argument_bytes']:.2f}, temporaries "
                     f"{m['temp_bytes']:.2f}); GEMMs {r['gemms']['total']} "
                     f"{r['gemms']['by_kind']}, FP8 GEMMs {r['gemms']['fp8']} "
                     f"{r['fp8_formats'] or ''}; fused attention calls "
                     f"{r['attention_calls']['forward']}")
        for c in r["collectives"]:
            lines.append(f"    {c['kind']:<15} {','.join(c['axes']):<12} x{c['count']:<3} "
                         f"{c['bytes'] / 1e6:9.2f} MB  async {c['asynchronous']:<3} overlapped "
                         f"{c['overlapped']:<3} across nodes {c['crosses_nodes']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a hidden-256 model")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    from jphantom import rocm
    from jphantom.costs import aot
    from jphantom.analysis.machine import output_folder
    from jphantom.errors import ConfigError

    if (problem := rocm.problem()) is not None:
        print(f"rocm_compile: {problem}", file=sys.stderr)
        return 2
    base = QUICK if args.quick else LLAMA
    out = output_folder(args.out, OUT, quick=args.quick, name="rocm_compile")
    out.mkdir(parents=True, exist_ok=True)
    rows, devices = [], {}
    for target_name, nodes, name, flags in RUNS:
        target = aot.Target.parse(target_name, nodes=nodes)
        key = (target_name, nodes)
        devices[key] = devices.get(key) or target.devices()
        hlo = out / "step.hlo"
        try:
            report = aot.compile_report({**base, **flags}, target, devices=devices[key],
                                        hlo_out=hlo)
        except ConfigError as error:
            print(f"{name} on {target_name}: {error}", file=sys.stderr)
            return 2
        rows.append(row_of(report, name, hlo.read_text()))
        hlo.unlink()
        print(table(rows[-1:]), end="", flush=True)
    try:  # the MI250X has no FP8 GEMMs: refused by name, before anything compiles
        aot.compile_report({**base, **RUNS[0][3], "precision": "fp8"},
                           aot.Target.parse("rocm:mi250x", nodes=2),
                           devices=devices[("rocm:mi250x", 2)])
        refusal = None
    except ConfigError as error:
        refusal = str(error)
    print(f"fp8 on rocm:mi250x: {refusal}")
    result = {"model": base, "rows": rows, "mi250x_fp8": refusal,
              "versions": aot.versions()}
    (out / "rocm_compile.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "rocm_compile.txt").write_text(table(rows) + f"fp8 on rocm:mi250x: {refusal}\n")
    print(f"wrote {out}/rocm_compile.json and rocm_compile.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
