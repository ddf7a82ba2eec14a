"""Does context parallelism hide its ring? A Llama-3-8B-width slice compiled for one node of 8
H100 from a CPU-only machine (``jphantom compile --target gpu:h100``) with ``--mesh
data=2,context=4`` and ring attention (Liu, Zaharia & Abbeel 2023; Megatron-LM's context
parallelism), its blocks on jax's Pallas Triton flash kernels; in the scheduled optimised HLO,
every collective-permute over ``context`` (the ring's K/V transfers, and the backward's dK/dV
accumulators) and whether an attention kernel runs between its start and its done
(:func:`jphantom.analysis.context_ring.ring_report`), and what :mod:`jphantom.predict`'s timeline
makes of them on the H100 description: the seconds the compute stream waits on the ring
(exposed), the ring's transfer time, the whole step.

Model: Llama-3-8B's layer shapes (hidden 4096, 32 heads, 8 key/value heads, SwiGLU 14336,
vocabulary 128256), 4 layers, S = 8192 and 16384, batch 2 (one sequence per data rank), float32
master weights, bf16 compute, AdamW, ``--remat none``, the load-balanced layout.

    python benchmarks/context_ring_overlap.py                       # 2 compiles, about 1 minute
    git worktree add /tmp/ring_before 64177c3                       # the ring before double buffering
    python benchmarks/context_ring_overlap.py --source /tmp/ring_before   # + a before column
    python benchmarks/context_ring_overlap.py --quick               # hidden 512, S 4096

``--source``: the same compiles by the jphantom of that checkout (a child process whose
``PYTHONPATH`` starts there); both programs are read and played by this checkout's analysis and
predictor. Needs XLA's GPU compiler: ``pip install 'jphantom[aot]'`` (``make test-aot`` builds
.venv-aot). Writes ``benchmarks/results/context_ring_overlap/context_ring_overlap.json`` and a
table ``context_ring_overlap.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

OUT = Path(__file__).resolve().parent / "results" / "context_ring_overlap"
SEQS = (8192, 16384)
MESH = "data=2,context=4"
LLAMA = dict(model="llama", hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
             layers=4, dtype="float32", precision="bf16", optimizer="adamw", remat="none",
             strategy="tensor", mesh=MESH, batch=2)
QUICK = dict(LLAMA, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=4096, layers=2)
QUICK_SEQS = (4096,)


def compile_hlo(flags: dict, hlo_path: str) -> dict:
    """Compile ``flags`` for one H100 node with the jphantom that imports, write its optimised HLO
    to ``hlo_path``; the compile seconds and the kernel census."""
    from jphantom.costs import aot

    target, devices = aot.deviceless_node("gpu:h100")
    report = aot.compile_report(flags, target, devices=devices, hlo_out=hlo_path)
    return {"compile_seconds": report["compile_seconds"], "kernels": report["kernels"],
            "peak_gib": report["memory"]["peak_bytes"] / 2**30}


def compiled_by(source: str | None, flags: dict, hlo_path: str) -> dict:
    """:func:`compile_hlo` by this checkout (``source`` None) or by the checkout ``source``, in a
    child process (two versions of one package cannot share an interpreter)."""
    if source is None:
        return compile_hlo(flags, hlo_path)
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(source).resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(flags), hlo_path],
                          env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def measure(flags: dict, source: str | None, label: str, scratch: Path) -> dict:
    """One compile (this checkout's or ``source``'s) read by this checkout's analysis."""
    from jphantom.analysis.context_ring import ring_report
    from jphantom.predict.device import for_target

    hlo_path = scratch / f"{label}-{flags['seq_len']}.hlo"
    compiled = compiled_by(source, flags, str(hlo_path))
    report = ring_report(hlo_path.read_text(), {"data": 2, "context": 4},
                         for_target("gpu:h100"), gpus_per_node=8)
    predicted = report["predicted"]
    return {"version": label, "seq_len": flags["seq_len"], "layers": flags["layers"],
            "permutes": report["permutes"],
            "overlapped_with_attention": report["overlapped_with_attention"],
            "forward": report["forward"], "backward": report["backward"],
            "synchronous": report["synchronous"],
            "ring_exposed_ms": 1e3 * predicted["ring_exposed_s"],
            "ring_comm_ms": 1e3 * predicted["ring_comm_s"],
            "exposed_comm_ms": 1e3 * predicted["exposed_comm_s"],
            "step_ms": 1e3 * predicted["step_s"], **compiled,
            "windows": [{k: w[k] for k in ("name", "backward", "nbytes", "attention", "gemms",
                                           "kernels", "exposed_s")} for w in report["windows"]]}


def line(r: dict) -> str:
    f, b = r["forward"], r["backward"]
    return (f"{r['version']:<7} S {r['seq_len']:>5}  permutes over context {r['permutes']:>3}, "
            f"under attention {r['overlapped_with_attention']:>3} (forward {f['overlapped_with_attention']}"
            f"/{f['permutes']}, backward {b['overlapped_with_attention']}/{b['permutes']})  "
            f"ring exposed {r['ring_exposed_ms']:6.3f} ms of {r['ring_comm_ms']:6.3f} ms  "
            f"step {r['step_ms']:7.2f} ms")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a hidden-512 model, S 4096")
    parser.add_argument("--source", default=None,
                        help="also compile with the jphantom of this checkout (the before row)")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {OUT}; --quick: a scratch folder)")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:  # compiled_by's child, in an earlier jphantom
        print(json.dumps(compile_hlo(json.loads(args.child[0]), args.child[1])))
        return 0
    from jphantom.costs import aot
    from jphantom.analysis.machine import output_folder, source_revision, write_results
    from jphantom.errors import ConfigError

    try:
        aot.deviceless_node("gpu:h100")
    except ConfigError as error:
        print(f"context_ring_overlap: {error}", file=sys.stderr)
        return 2
    model, seqs = (QUICK, QUICK_SEQS) if args.quick else (LLAMA, SEQS)
    out = output_folder(args.out, OUT, quick=args.quick, name="context_ring_overlap")
    out.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).resolve().parents[1]
    versions = ([("before", args.source)] if args.source else []) + [("after", None)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="jphantom-ring-") as scratch:
        for seq in seqs:
            for label, source in versions:
                rows.append(measure({**model, "seq_len": seq}, source, label, Path(scratch)))
                print(line(rows[-1]), flush=True)
    result = {"model": model, "rows": rows,
              "jphantom": {"after": source_revision(here),
                           "before": source_revision(args.source) if args.source else None},
              "device": "gpu:h100 (compiled without a GPU; times modelled by jphantom.predict)",
              "versions": aot.versions()}
    write_results(out, "context_ring_overlap", result, [line(r) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
