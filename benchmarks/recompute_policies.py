"""Recompute policies side by side: every ``--remat`` policy (:mod:`jphantom.step.remat`, the peers'
among them: MaxText's ``minimal_flash`` and ``save_qkv_proj``, Megatron-LM's selective recompute)
compiled for one node of 8 H100 from a CPU-only machine (``jphantom compile --target gpu:h100
--predict``), under TP + SP and under FSDP (ZeRO-3).

Per layout and policy: XLA's temporaries per device (``memory_analysis()`` of the compiled step:
what the activations kept for the backward, and the rest of the step's scratch, need), the
predicted step (the compiled program played on the H100 description, :mod:`jphantom.predict`:
modelled, not measured), and the per-layer slope of the temporaries (the step compiled with 2 and
with 4 layers, the difference / 2: what one more layer costs) against Korthikanti et al.'s
activation bytes per layer under TP + SP, 34 s b h / t with selective recompute or a fused
attention kernel (s the sequence, b the micro-batch per data rank, h the hidden width, t the
tensor ranks; their Table 2, a GPT layer with a 4h MLP, LayerNorm and dropout, 16-bit
activations), plus 5 a s^2 b / t for the attention scores without either (a the heads).

Rows: the default kernel on the H100 (``--attention auto``: cuDNN's flash attention, which keeps
no S x S array), and TP + SP on XLA's attention path (``--attention xla``, the S x S scores and
probabilities kept unless a policy recomputes them: where Megatron's selective recompute earns its
keep).

Model: Llama-3-8B's layer shapes (hidden 4096, 32 heads, 8 key/value heads, SwiGLU 14336,
vocabulary 128256), 4 layers, S = 8192, float32 master weights, bf16 compute, AdamW.

    python benchmarks/recompute_policies.py           # 48 compiles, about 15 minutes on 2 cores
    python benchmarks/recompute_policies.py --quick   # hidden 512, S 512, for a check

Needs XLA's GPU compiler: ``pip install 'jphantom[aot]'`` (``make test-aot`` builds .venv-aot).
Writes ``benchmarks/results/recompute_policies/recompute_policies.json`` and a table
``recompute_policies.txt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

OUT = Path(__file__).resolve().parent / "results" / "recompute_policies"
LAYERS = (2, 4)  # the slope: (temp(4) - temp(2)) / 2
LLAMA = dict(model="llama", hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
             seq_len=8192, dtype="float32", precision="bf16", optimizer="adamw")
QUICK = dict(LLAMA, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=4096, seq_len=512)
LAYOUTS = [  # (name, flags, sequences per step, data ranks, tensor ranks)
    ("tp+sp", dict(strategy="tensor", mesh="data=2,model=4", sequence_parallel=True), 4, 2, 4),
    ("fsdp", dict(strategy="tensor", mesh="data=8", zero=3), 8, 8, 1),
    ("tp+sp xla-attention", dict(strategy="tensor", mesh="data=2,model=4",
                                 sequence_parallel=True, attention="xla"), 4, 2, 4),
]


def korthikanti(model: dict, batch: int, data: int, tensor: int) -> dict:
    """Activation bytes per layer and device (Korthikanti et al. 2022, Table 2, TP + SP):
    ``selective`` 34 s b h / t (selective recompute, or a fused attention kernel), ``full``
    that plus 5 a s^2 b / t (the attention scores, softmax output and dropout mask kept)."""
    s, b, h, a = model["seq_len"], batch // data, model["hidden"], model["heads"]
    selective = 34 * s * b * h / tensor
    return {"selective_gib": selective / 2**30,
            "full_gib": (selective + 5 * a * s * s * b / tensor) / 2**30}


def run(flags: dict, target, devices, h100) -> dict:
    from jphantom.costs import aot

    report = aot.compile_report(flags, target, devices=devices, predict_on=h100)
    memory, prediction = report["memory"], report["prediction"]
    return {"temp_gib": memory["temp_bytes"] / 2**30, "peak_gib": memory["peak_bytes"] / 2**30,
            "fits": memory["fits"], "predicted_s": prediction["step_s"],
            "compile_seconds": report["compile_seconds"]}


def line(r: dict) -> str:
    deep, shallow = r["runs"][str(LAYERS[-1])], r["runs"][str(LAYERS[0])]
    return (f"{r['layout']:<20} {r['policy']:<32} temporaries {deep['temp_gib']:7.2f} GiB "
            f"(peak {deep['peak_gib']:6.2f})  predicted {deep['predicted_s'] * 1e3:8.1f} ms  "
            f"per layer {r['slope_gib']:6.2f} GiB (34sbh/t {r['formula']['selective_gib']:.2f}, "
            f"+5as^2b/t {r['formula']['full_gib']:.2f})  [{LAYERS[0]} layers: "
            f"{shallow['temp_gib']:.2f} GiB, {shallow['predicted_s'] * 1e3:.1f} ms]")


def main(argv=None) -> int:
    from jphantom.step.remat import NAMES, PEERS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a hidden-512 model")
    parser.add_argument("--only", nargs="*", default=None, help="layout names (default all)")
    parser.add_argument("--policies", nargs="*", default=None, choices=NAMES,
                        help="policies (default all)")
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
        print(f"recompute_policies: {error}", file=sys.stderr)
        return 2
    base = QUICK if args.quick else LLAMA
    out = output_folder(args.out, OUT, quick=args.quick, name="recompute_policies")
    out.mkdir(parents=True, exist_ok=True)
    h100 = described.for_target("gpu:h100")
    rows = []
    for name, flags, batch, data, tensor in LAYOUTS:
        if args.only and name not in args.only:
            continue
        for policy in args.policies or NAMES:
            runs = {}
            for layers in LAYERS:
                try:
                    runs[str(layers)] = run({**base, **flags, "layers": layers, "batch": batch,
                                             "remat": policy}, target, devices, h100)
                except ConfigError as error:
                    print(f"{name} {policy}: {error}", file=sys.stderr)
                    return 2
            deep, shallow = runs[str(LAYERS[-1])], runs[str(LAYERS[0])]
            rows.append({"layout": name, "policy": policy, "peer": PEERS.get(policy, ""),
                         "runs": runs,
                         "slope_gib": (deep["temp_gib"] - shallow["temp_gib"])
                         / (LAYERS[-1] - LAYERS[0]),
                         "formula": korthikanti(base, batch, data, tensor)})
            print(line(rows[-1]), flush=True)
    result = {"model": base, "layers": LAYERS,
              "layouts": {n: dict(f, batch=b) for n, f, b, _, _ in LAYOUTS}, "rows": rows,
              "device": "gpu:h100 (compiled without a GPU; times modelled)",
              "versions": aot.versions()}
    write_results(out, "recompute_policies", result, [line(r) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
