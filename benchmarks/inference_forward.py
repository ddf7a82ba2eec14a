"""Seal et al.'s inference claim at its scale: phantom against tensor parallelism for the forward
pass only, on H100 and MI250X descriptions (:mod:`jphantom.perf.inference`; modelled).

Two tables, every figure per GPU:

- **the paper's FFN** (n = 16,384, L = 2, the (p, k) of Table I; n = 65,536, L = 6, k = 64 on
  p = 32..128 of Fig. 5a), float32 as the paper trained, batch ``--batch`` (1024; the paper gives
  none): bytes the forward's collectives move (result buffers, the compiled HLO's convention, and
  the ring's wire bytes), the predicted forward (HBM/compute roofline + collectives) and joules per
  sample (Seal et al.'s Eq. 1), for ``phantom``, Megatron's ``tensor`` and Seal et al.'s
  ``tensor-t1``. Each row's collectives are also taken from the compiled forward (abstract
  parameters, XLA:CPU on ``--devices`` simulated devices, 256 by default so that every p
  compiles) and checked against the formula: the row says ``compiled`` where they agree
  exactly, ``modelled`` where p exceeds the devices;
- **a transformer's decode step** at Llama-3-8B's widths (h 4096, 32 layers, 32 heads, 8 KV
  heads, SwiGLU 14,336, vocabulary 128,256) on one node (``--model`` 8 GPUs), bf16, batch 1 and
  32, context 2048 and 8192: weights + KV cache read per GPU (the HBM roofline), collectives,
  tokens/s and J/token, one GPU alone, Megatron ``tensor`` and ``phantom`` (k = h/32 = 128, the
  planner's default, and k = 32). The decode collectives are checked against the compiled forward
  of one token per sequence of a 2-layer model of the same widths (float32: jphantom's forward
  computes in its parameters' dtype); a KV cache adds no collective (heads stay on their rank).
  ``--gpu-check`` compiles the same forwards for one node of 8 H100s (XLA:GPU, no GPU needed),
  whose combiner joins phantom's q|k|v and gate|up ghost all-gathers: the decode prices that
  schedule (the same bytes in fewer collectives; assumed the same on MI250X).

    python benchmarks/inference_forward.py              # ~20 s of compiles on 2 cores
    python benchmarks/inference_forward.py --quick      # small sizes, 8 devices, for a check
    .venv-aot/bin/python benchmarks/inference_forward.py --gpu-check   # + compiled for gpu:h100

Writes ``benchmarks/results/inference_forward/inference_forward.json``, the tables
``inference_forward.txt`` and ``inference_forward.png`` (``--no-plot`` skips it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "inference_forward"
DEVICES = ("h100-sxm", "mi250x-gcd")
STRATEGIES = ("phantom", "tensor", "tensor-t1")
FFN = [(16384, 2, p, k) for p, k in ((8, 16), (16, 6), (32, 4), (64, 2), (128, 2), (256, 4))] + [
    (65536, 6, p, 64) for p in (32, 64, 128)]  # (n, L, p, k): Table I; Fig. 5a
QUICK_FFN = [(256, 2, 4, 4), (256, 2, 8, 4), (512, 3, 8, 8)]
LLAMA = dict(layers=32, hidden=4096, heads=32, seq_len=8192, vocab_size=128256,
             family="llama", intermediate=14336, kv_heads=8)
QUICK_LLAMA = dict(LLAMA, layers=2, hidden=256, heads=8, intermediate=512, vocab_size=1024)
DECODE = [(b, c) for b in (1, 32) for c in (2048, 8192)]
QUICK_DECODE = [(1, 64), (4, 64)]


def check(formula, compiled, nbytes: int) -> bool:
    """Whether the compiled collectives (kind, elements, count, bytes) are the formula's
    (kind, elements, count) at ``nbytes`` per element."""
    want = sorted((kind, int(e), int(c), int(e) * nbytes) for kind, e, c in formula)
    return want == sorted(tuple(int(x) if i else x for i, x in enumerate(r)) for r in compiled)


def ffn_rows(configs, batch: int, devices: int) -> list[dict]:
    """Every (n, L, p, k) x strategy x device, priced and checked against its compile."""
    from jphantom.registry import strategies
    from jphantom.models.ffn import FFNConfig
    from jphantom.perf import inference
    from jphantom.predict.device import load

    rows = []
    for n, L, p, k in configs:
        for strategy in STRATEGIES:
            ghost = k if strategies.get(strategy).needs_ghost_width else None
            forward = inference.ffn_forward(n, L, p, batch, strategy, ghost, "f32")
            source = "modelled"
            if p <= devices:
                config = FFNConfig(width=n, depth=L, ghost_width=ghost)
                compiled = inference.compiled_forward(config, strategy, f"model={p}", (batch, n),
                                                      ghost_width=ghost)
                if not check(forward.collectives, compiled, 4):
                    raise SystemExit(f"FFN n={n} L={L} p={p} {strategy}: compiled {compiled} "
                                     f"!= formula {forward.collectives}")
                source = "compiled"
            for device in DEVICES:
                priced = inference.price(forward, load(device), p, 1, "f32",
                                         f"FFN forward n={n} L={L} p={p} B={batch}")
                rows.append({"n": n, "L": L, "p": p, "k": k, "batch": batch,
                             "strategy": strategy, "device": device, "bytes_source": source,
                             **priced})
    return rows


def decode_rows(llama: dict, cases, model: int, ghosts) -> list[dict]:
    """Every (batch, context) x device x layout of the decode step, priced."""
    from jphantom.perf import inference
    from jphantom.perf.axonn_model import GPTShape

    shape = GPTShape(**llama)
    layouts = [("1 GPU", "tensor", 1, None), ("tensor", "tensor", model, None)] + [
        (f"phantom k={k}", "phantom", model, k) for k in ghosts]
    rows = []
    for batch, context in cases:
        for device in DEVICES:
            for name, strategy, p, k in layouts:
                r = inference.decode_roofline(shape, batch, context, device, {"model": p},
                                              strategy=strategy, ghost_width=k)
                rows.append({"layout": name, "strategy": strategy, "model": p, "k": k,
                             "batch": batch, "context": context, **r})
    return rows


def decode_check(llama: dict, model: int, ghosts, batch: int) -> list[dict]:
    """The decode step's collectives formula against the compiled forward of one token per
    sequence of a 2-layer model of the same widths (float32)."""
    from jphantom.models.llama import LlamaConfig
    from jphantom.perf import inference
    from jphantom.perf.axonn_model import GPTShape

    config = LlamaConfig(vocab_size=llama["vocab_size"], hidden=llama["hidden"],
                         intermediate=llama["intermediate"], layers=2, heads=llama["heads"],
                         kv_heads=llama["kv_heads"], max_positions=64)
    shape = GPTShape(**{**llama, "layers": 2})
    out = []
    for strategy, k in [("tensor", None)] + [("phantom", k) for k in ghosts]:
        formula = inference.llama_forward(shape, batch, 1, 1, model, strategy, k, "f32",
                                          combined=False)  # XLA:CPU: one per projection
        compiled = inference.compiled_forward(config, strategy, f"model={model}", (batch, 1),
                                              ghost_width=k)
        out.append({"strategy": strategy, "k": k, "batch": batch, "layers": 2,
                    "formula": [list(c) for c in formula.collectives],
                    "compiled": [list(c) for c in compiled],
                    "agree": check(formula.collectives, compiled, 4)})
        if not out[-1]["agree"]:
            raise SystemExit(f"decode {strategy} k={k}: compiled {compiled} != formula "
                             f"{formula.collectives}")
    return out


def gpu_check(configs, llama: dict, model: int, ghosts, batch: int, ffn_batch: int) -> dict:
    """The same formulas against the forward compiled for one node of 8 H100s (XLA:GPU, no GPU
    needed: ``jphantom[aot]``): the FFN rows of p <= 8 and the 2-layer decode forward, whose
    phantom all-gathers XLA:GPU combines (``combined=True``). Skipped, saying why, without the
    GPU compiler."""
    from jphantom.costs import aot
    from jphantom.registry import strategies
    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import device_pool
    from jphantom.models.ffn import FFNConfig
    from jphantom.models.llama import LlamaConfig
    from jphantom.perf import inference
    from jphantom.perf.axonn_model import GPTShape

    try:
        _, devices = aot.deviceless_node("gpu:h100")
    except ConfigError as error:
        return {"skipped": str(error)}
    rows = []
    config = LlamaConfig(vocab_size=llama["vocab_size"], hidden=llama["hidden"],
                         intermediate=llama["intermediate"], layers=2, heads=llama["heads"],
                         kv_heads=llama["kv_heads"], max_positions=64)
    cases = [("ffn", n, L, p, s, k if strategies.get(s).needs_ghost_width else None)
             for n, L, p, k in configs if p <= len(devices) for s in STRATEGIES] + [
        ("decode", None, 2, model, s, k) for s, k in [("tensor", None)] + [
            ("phantom", g) for g in ghosts]]
    with device_pool(devices):
        for what, n, L, p, strategy, k in cases:
            if what == "ffn":
                formula = inference.ffn_forward(n, L, p, ffn_batch, strategy, k).collectives
                compiled = inference.compiled_forward(FFNConfig(width=n, depth=L, ghost_width=k),
                                                      strategy, f"model={p}", (ffn_batch, n),
                                                      ghost_width=k)
            else:
                shape = GPTShape(**{**llama, "layers": 2})
                formula = inference.llama_forward(shape, batch, 1, 1, p, strategy, k,
                                                  "f32").collectives
                compiled = inference.compiled_forward(config, strategy, f"model={p}",
                                                      (batch, 1), ghost_width=k)
            rows.append({"what": what, "n": n, "L": L, "p": p, "strategy": strategy, "k": k,
                         "formula": [list(c) for c in formula],
                         "compiled": [list(c) for c in compiled],
                         "agree": check(formula, compiled, 4)})
    return {"target": "gpu:h100 (one node of 8, compiled without a GPU)", "rows": rows,
            "all_agree": all(r["agree"] for r in rows)}


def ffn_table(rows: list[dict]) -> list[str]:
    """One line per device and (n, L, p, k): phantom, tensor and tensor-t1 side by side."""
    by = {(r["device"], r["n"], r["L"], r["p"], r["strategy"]): r for r in rows}
    head = (f"{'device':<11}{'n':>7}{'L':>3}{'p':>5}{'k':>4}  {'collective MB/GPU (result)':^29}"
            f"  {'predicted forward ms':^29}  {'J/sample':^29}  {'J ph/TP':>7}  bytes")
    sub = (" " * 30 + "  ".join(f"{'phantom':>9}{'tensor':>10}{'t1':>10}" for _ in range(3)))
    lines = [head, sub]
    seen = []
    for r in rows:
        key = (r["device"], r["n"], r["L"], r["p"])
        if key in seen:
            continue
        seen.append(key)
        ph, tp, t1 = (by[key + (s,)] for s in STRATEGIES)
        cells = "  ".join(f"{a:>9.3g}{b:>10.3g}{c:>10.3g}" for a, b, c in (
            [x["collective_result_bytes"] / 1e6 for x in (ph, tp, t1)],
            [x["step_seconds"] * 1e3 for x in (ph, tp, t1)],
            [x["joules_per_token"] for x in (ph, tp, t1)]))
        lines.append(f"{r['device']:<11}{r['n']:>7}{r['L']:>3}{r['p']:>5}{r['k']:>4}  {cells}  "
                     f"{ph['joules_per_token'] / tp['joules_per_token']:>7.3f}  "
                     f"{ph['bytes_source']}")
    return lines


def decode_table(rows: list[dict]) -> list[str]:
    """One line per decode case, device and layout: the HBM roofline, then the prediction."""
    lines = [f"{'device':<11}{'B':>3}{'context':>8}  {'layout':<14}{'weights GB':>11}"
             f"{'KV GB':>7}{'roofline ms':>12}{'tok/s':>8}  {'comm ms':>8}{'colls':>6}"
             f"{'comm KB':>9}{'pred. ms':>9}{'tok/s':>8}{'J/token':>9}"]
    for r in rows:
        count = sum(c[2] for c in r["collectives"])
        lines.append(f"{r['device']:<11}{r['batch']:>3}{r['context']:>8}  {r['layout']:<14}"
                     f"{r['weight_bytes'] / 1e9:>11.3f}{r['cache_bytes'] / 1e9:>7.3f}"
                     f"{r['seconds'] * 1e3:>12.3f}{r['roofline_tokens_per_s']:>8.0f}  "
                     f"{r['comm_seconds'] * 1e3:>8.3f}{count:>6}"
                     f"{r['collective_result_bytes'] / 1e3:>9.1f}{r['step_seconds'] * 1e3:>9.3f}"
                     f"{r['tokens_per_s']:>8.0f}{r['joules_per_token']:>9.3f}")
    return lines


def plot(result: dict, path: Path) -> bool:
    """J/sample of the FFN forward and J/token of the decode step, phantom over tensor."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for device, color in zip(DEVICES, ("C0", "C3")):
        for n, marker in zip(sorted({r["n"] for r in result["ffn"]}), "osD^v"):
            pick = lambda s: [r for r in result["ffn"] if r["device"] == device
                              and r["n"] == n and r["strategy"] == s]
            ph, tp = pick("phantom"), pick("tensor")
            if ph:
                left.plot([r["p"] for r in ph], [a["joules_per_token"] / b["joules_per_token"]
                                                 for a, b in zip(ph, tp)],
                          marker=marker, color=color, label=f"{device} n={n}")
        rows = [r for r in result["decode"] if r["device"] == device]
        cases = sorted({(r["batch"], r["context"]) for r in rows})
        for layout, style in (("tensor", "-"), (rows[-1]["layout"], "--")):
            right.plot(range(len(cases)), [next(r["joules_per_token"] for r in rows if
                                                (r["batch"], r["context"]) == c and
                                                r["layout"] == layout) for c in cases],
                       style, marker="o", color=color, label=f"{device} {layout}")
        right.set_xticks(range(len(cases)), [f"B={b}\nS={c}" for b, c in cases])
    left.set(xscale="log", yscale="log", xlabel="GPUs p", ylabel="J/sample, phantom / tensor",
             title="FFN forward (modelled)")
    right.set(yscale="log", ylabel="J/token", title="decode step, one node (modelled)")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a check")
    parser.add_argument("--batch", type=int, default=1024, help="FFN samples (default 1024)")
    parser.add_argument("--model", type=int, default=8, help="decode: GPUs per model (8)")
    parser.add_argument("--out", default=None, help=f"results folder (default {OUT})")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--gpu-check", action="store_true",
                        help="also compile for gpu:h100 (needs jphantom[aot]: .venv-aot)")
    args = parser.parse_args(argv)
    import jax

    from jphantom.analysis.machine import (machine_info, output_folder, source_revision,
                                           write_results)

    out = output_folder(args.out, OUT, quick=args.quick, name="inference_forward")
    out.mkdir(parents=True, exist_ok=True)
    llama, ghosts = (QUICK_LLAMA, (4,)) if args.quick else (LLAMA, (128, 32))
    batch = 16 if args.quick else args.batch
    devices = jax.device_count()
    result = {
        "config": {"quick": args.quick, "ffn_batch": batch, "ffn": QUICK_FFN if args.quick
                   else FFN, "llama": llama, "decode": QUICK_DECODE if args.quick else DECODE,
                   "model": args.model, "ghost_widths": list(ghosts),
                   "compile_devices": devices},
        "ffn": ffn_rows(QUICK_FFN if args.quick else FFN, batch, devices),
        "decode": decode_rows(llama, QUICK_DECODE if args.quick else DECODE, args.model, ghosts),
        "decode_check": decode_check(llama, args.model, ghosts, 4 if args.quick else 32),
        "gpu_check": (gpu_check(QUICK_FFN if args.quick else FFN, llama, args.model, ghosts,
                                4 if args.quick else 32, batch) if args.gpu_check
                      else {"skipped": "not asked (--gpu-check)"}),
        "machine": machine_info(), "revision": source_revision(ROOT),
        "label": "modelled: times and joules from jphantom.perf.inference on the shipped device "
                 "descriptions; FFN collective bytes also from the compiled forward (XLA:CPU)",
    }
    table = (["FFN forward, float32, batch %d (Seal et al. Table I / Fig. 5a shapes)" % batch]
             + ffn_table(result["ffn"]) + ["", "Decode step, bf16, one node of %d GPUs, "
                                               "Llama-3-8B widths" % args.model]
             + decode_table(result["decode"]))
    check = result["gpu_check"]
    table += ["", "Compiled for gpu:h100: " + (check["skipped"] if "skipped" in check else (
        f"{sum(r['agree'] for r in check['rows'])} of {len(check['rows'])} forwards have the "
        "formulas' collectives (FFN rows of p <= 8; the decode step's 2-layer forward)"))]
    write_results(out, "inference_forward", result, table)
    print("\n".join(table))
    if not args.no_plot and plot(result, out / "inference_forward.png"):
        print(f"wrote {out}/inference_forward.png")
    return result


if __name__ == "__main__":
    from jphantom.runtime.mesh import simulate_cpu_devices

    simulate_cpu_devices(8 if "--quick" in sys.argv else 256)
    main()
