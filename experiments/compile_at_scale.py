"""The planner against the compiler at scale: `jphantom plan`'s top layouts compiled for H100 nodes.

For Llama 3 8B (L = 32, h = 4096, 32 heads, 8 key/value heads, SwiGLU width 14336) and 70B
(L = 80, h = 8192, 64 heads, 8 key/value heads, 28672), V = 128256, S = 2048, 512 sequences per
step, on 64 and 256 H100 SXM GPUs (8 per node; NVLink 450 GB/s per direction inside a node,
8 x 400 Gb/s InfiniBand = 400 GB/s per node across nodes): `jphantom.planner` ranks every layout of
the Llama; the top K are compiled ahead of time for the GPUs (`jphantom.planner.compiled.compile_plan`: XLA's
GPU compiler, no GPU; float32 master weights, bf16 compute, Adam, per-layer activation
checkpointing, as the planner assumes) and each row puts the planner's figures beside XLA's,
term by term:

- ``state``: modelled 16 bytes per parameter shard against the parameters', gradients' and
  optimizer state's bytes from the compiled step's shardings (exact);
- ``per-token``: modelled checkpointed activations + working layer + logits against the compiled
  peak's part that scales with the batch, 2 x (peak(B) - peak(B/2)) (a second compile at half
  the batch);
- ``fixed``: the rest (modelled: transient gathered weights; compiled: peak - state - per-token:
  the update's temporaries, gathered or cast weights, collective buffers);
- collective bytes per device per mesh axis: modelled (the planner's formulas with
  ``as_compiled=True``: result buffers at 2 bytes per element, gradient reductions in float32,
  pmm3d's backward re-gather and the recompute forward's collectives) against the compiled HLO's
  (loops counted by trip count).

Times are not measured: nothing runs.

    python experiments/compile_at_scale.py            # 8B and 70B on 64 and 256 H100s, top 5
    python experiments/compile_at_scale.py --quick    # a 2-layer Llama on 16 H100s, top 2

Needs XLA's GPU compiler: pip install 'jphantom[aot]'.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

LLAMA = dict(family="llama", seq_len=2048, vocab_size=128256, kv_heads=8)
MODELS = {  # Llama 3's shapes (Meta's model cards); S = 2048 (the planner's default) of its 8192
    "8B": dict(LLAMA, layers=32, hidden=4096, heads=32, intermediate=14336),
    "70B": dict(LLAMA, layers=80, hidden=8192, heads=64, intermediate=28672),
}
QUICK = {"tiny": dict(family="llama", layers=2, hidden=256, heads=8, kv_heads=4,
                      intermediate=512, seq_len=128, vocab_size=1024)}
GIB = 2**30


def run(models: dict, device_counts: list[int], top: int, batch: int, out: Path) -> dict:
    from tqdm import tqdm

    from jphantom.costs import aot
    from jphantom.planner.compiled import compile_plan, format_compiled_plan
    from jphantom.analysis.machine import source_revision
    from jphantom.perf.axonn_model import GPTShape, Topology
    from jphantom.planner import plan

    topology = Topology(gpus_per_node=8, inter_node_gbps=400.0, intra_node_gbps=450.0,
                        latency_us=5.0, name="H100 SXM nodes (assumed)")
    rows = []
    cases = [(name, shape, n) for name, shape in models.items() for n in device_counts]
    bar = tqdm(total=2 * len(cases) * top, desc="compiling", unit="compile")
    for name, shape, devices in cases:
        target = aot.Target.parse("gpu:h100", nodes=devices // 8)
        result = plan(GPTShape(**shape), devices, topology, batch=batch,
                      memory_gib=target.memory_bytes / GIB, device_tflops=700.0,
                      as_compiled=True)
        start = time.perf_counter()
        devs = target.devices()
        entries = compile_plan(result, top, target, devices=devs,
                                   progress=lambda _: bar.update())
        rows_by_rank = {row.rank: row for row in result.rows}
        for entry in entries:
            row = rows_by_rank[entry["plan_rank"]]
            memory = dict(row.memory)
            entry |= {"model": name, "devices": devices, "modelled_memory": memory,
                      "modelled_bytes_by_axis": dict(row.bytes_by_axis)}
            if "error" not in entry:
                half = dict(entry["flags"], batch=batch // 2)
                if "microbatches" in half:
                    half["microbatches"] //= 2
                try:
                    peak_half = aot.compile_report(half, target, devices=devs)["memory"][
                        "peak_bytes"]
                except Exception as error:  # noqa: BLE001 -- reported, not fatal
                    peak_half, entry["half_batch_error"] = None, str(error).split("\n")[0]
                entry["terms"] = _terms(entry, memory, peak_half)
                entry["compiled_bytes_by_axis"] = _bytes_by_axis(entry["collectives"])
            rows.append(entry)
            bar.update()
        print(f"\n{name} on {devices} H100s ({time.perf_counter() - start:.0f} s):\n"
              f"{format_compiled_plan(entries)}", flush=True)
    bar.close()
    results = {"models": models, "device_counts": device_counts, "top": top,
               "batch_sequences": batch, "topology": topology.as_dict(),
               "versions": aot.versions(), "source_revision": source_revision(Path(__file__).parents[1]), "rows": rows,
               "modelled": "planner memory and communication (jphantom.planner)",
               "compiled": "XLA's GPU compiler's memory_analysis() and HLO; nothing ran"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, out / "compile_at_scale.png")
    _table(results)
    return results


def _terms(entry: dict, memory: dict, peak_half: int | None) -> dict:
    """Modelled and compiled memory per device, split into state, per-token and fixed parts."""
    state = sum(entry["compiled_memory"][k]
                for k in ("params_bytes", "gradient_bytes", "optimizer_bytes"))
    per_token = ("checkpoints", "working", "logits", "ghosts")
    modelled_tokens = sum(memory.get(k, 0.0) for k in per_token)
    terms = {"state_modelled": memory["state"], "state_compiled": state,
             "per_token_modelled": modelled_tokens,
             "fixed_modelled": memory["total"] - memory["state"] - modelled_tokens}
    if peak_half is not None:
        compiled_tokens = 2 * (entry["compiled_peak_bytes"] - peak_half)
        terms |= {"per_token_compiled": compiled_tokens,
                  "fixed_compiled": entry["compiled_peak_bytes"] - state - compiled_tokens}
    return terms


def _bytes_by_axis(collectives: list[dict]) -> dict[str, float]:
    """Compiled collective bytes per device per step by mesh axes (``data+model`` for a group
    spanning two axes)."""
    out: dict[str, float] = {}
    for row in collectives:
        key = "+".join(row["axes"]) or "-"
        out[key] = out.get(key, 0.0) + row["bytes"]
    return out


def _table(results: dict) -> None:
    print("\nGiB per GPU, modelled / compiled: state, per-token (activations + logits), fixed; "
          "collective GB per GPU per step by axis, modelled / compiled")
    print(f"{'model':>5} {'GPUs':>4} {'layout':<14} {'mesh':<24} {'total m/c':>13} {'ratio':>5}  "
          f"{'state':>11}  {'per-token':>11}  {'fixed':>11}  {'compile s':>9}  collectives")
    for r in results["rows"]:
        head = f"{r['model']:>5} {r['devices']:>4} {r['layout']:<14} {r['mesh']:<24}"
        if "error" in r:
            print(f"{head} refused: {r['error']}")
            continue
        t = r["terms"]

        def pair(key):
            c = t.get(f"{key}_compiled")
            return (f"{t[f'{key}_modelled'] / GIB:>5.1f}/" +
                    (f"{c / GIB:<5.1f}" if c is not None else "  -  "))

        axes = dict.fromkeys([*r["modelled_bytes_by_axis"], *r["compiled_bytes_by_axis"]])
        comm = ", ".join(f"{a} {r['modelled_bytes_by_axis'].get(a, 0) / 1e9:.1f}/"
                         f"{r['compiled_bytes_by_axis'].get(a, 0) / 1e9:.1f}" for a in axes)
        print(f"{head} {r['modelled_memory_bytes'] / GIB:>6.1f}/{r['compiled_peak_bytes'] / GIB:<6.1f}"
              f" {r['memory_ratio']:>5.2f}  {pair('state')}  {pair('per_token')}  "
              f"{pair('fixed')}  {r['compile_seconds']:>9.1f}  {comm}")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 6))
    for model, marker in zip(results["models"], "os^v"):
        for devices, color in zip(results["device_counts"], ("C0", "C1", "C2")):
            pick = [r for r in rows if r["model"] == model and r["devices"] == devices]
            ax.scatter([r["modelled_memory_bytes"] / GIB for r in pick],
                       [r["compiled_peak_bytes"] / GIB for r in pick], marker=marker,
                       color=color, label=f"{model}, {devices} H100s")
    top = max([r["compiled_peak_bytes"] / GIB for r in rows] + [1.0]) * 1.1
    ax.plot([0, top], [0, top], "k:", label="compiled = modelled")
    ax.plot([0, top], [0, top * 1.15], "k--", lw=0.7, label="±15%")
    ax.plot([0, top], [0, top / 1.15], "k--", lw=0.7)
    ax.axhline(79.1, color="r", lw=0.8, label="H100 80 GB")
    ax.set_xlabel("planner's modelled memory per GPU (GiB)")
    ax.set_ylabel("XLA's compiled peak per GPU (GiB)")
    ax.set_title("jphantom plan's top Llama layouts compiled for H100 (no GPU used)",
                 fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true",
                        help="a 2-layer Llama on 16 H100s, the top 2 layouts (seconds)")
    parser.add_argument("--top", type=int, default=5, help="layouts compiled per case (default 5)")
    parser.add_argument("--out", default=None,
                        help="output folder (default experiments/results/compile_at_scale; "
                             "--quick: a scratch folder)")
    args = parser.parse_args(argv)
    from jphantom.costs import aot

    problem = aot.plugin_problem("gpu")
    if problem:
        print(f"compile_at_scale: {problem}", file=sys.stderr)
        return 2
    from jphantom.analysis.machine import output_folder

    out = output_folder(args.out, Path(__file__).parent / "results" / "compile_at_scale",
                        quick=args.quick, name="compile_at_scale")
    if args.quick:
        run(QUICK, [16], 2, 32, out)
    else:
        run(MODELS, [64, 256], args.top, 512, out)
    print(f"\nwrote {out}/results.json and {out}/compile_at_scale.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
