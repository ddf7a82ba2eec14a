"""The planner against the compiler at scale: `jphantom plan`'s top layouts compiled for H100 nodes.

For Llama-3-shaped GPTs at 8B (L = 32, h = 4096, 32 heads) and 70B (L = 80, h = 8192, 64 heads),
V = 128256, S = 2048, 512 sequences per step, on 64 and 256 H100 SXM GPUs (8 per node; NVLink
450 GB/s per direction inside a node, 8 x 400 Gb/s InfiniBand = 400 GB/s per node across nodes):
`jphantom.plan` ranks every layout; the top K that train the model are compiled ahead of time
for the GPUs (`jphantom.aot.compile_plan`: XLA's GPU compiler, no GPU) and each row puts the
planner's modelled memory per GPU beside XLA's compiled peak, term by term:

- ``state``: modelled 16 bytes per parameter shard (bf16 compute, float32 master weights, Adam)
  against the parameters', gradients' and optimizer state's bytes from the compiled step's
  shardings (exact);
- the rest: modelled checkpointed activations + logits (+ ZeRO-3's transient gathers) against
  the compiled peak minus that state (XLA's temporaries: activations, recompute buffers,
  gathered weights, collective buffers, the update's temporaries).

The blocks are GPT-2's (what the planner prices: 4h MLP, full multi-head attention, learned
positions), at Llama-3's widths, depths and vocabulary: Llama's SwiGLU and grouped-query attention
have 12.75 h^2 parameters per block to the GPT's 12 h^2. Times are not measured: nothing runs.

    python experiments/compile_at_scale.py            # 8B and 70B on 64 and 256 H100s, top 5
    python experiments/compile_at_scale.py --quick    # a 2-layer GPT on 16 H100s, top 2

Needs XLA's GPU compiler: pip install 'jphantom[aot]'.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = {  # Llama 3 widths, depths, heads and vocabulary (Meta's model cards)
    "8B": dict(layers=32, hidden=4096, heads=32, seq_len=2048, vocab_size=128256),
    "70B": dict(layers=80, hidden=8192, heads=64, seq_len=2048, vocab_size=128256),
}
QUICK = {"tiny": dict(layers=2, hidden=256, heads=8, seq_len=128, vocab_size=1024)}
GIB = 2**30


def run(models: dict, device_counts: list[int], top: int, batch: int, out: Path) -> dict:
    from tqdm import tqdm

    from jphantom import aot
    from jphantom.perf.axonn_model import GPTShape, Topology
    from jphantom.plan import plan

    topology = Topology(gpus_per_node=8, inter_node_gbps=400.0, intra_node_gbps=450.0,
                        latency_us=5.0, name="H100 SXM nodes (assumed)")
    rows = []
    cases = [(name, shape, n) for name, shape in models.items() for n in device_counts]
    bar = tqdm(total=len(cases) * top, desc="compiling", unit="layout")
    for name, shape, devices in cases:
        target = aot.Target.parse("gpu:h100", nodes=devices // 8)
        result = plan(GPTShape(**shape), devices, topology, batch=batch,
                      memory_gib=target.memory_bytes / GIB, device_tflops=700.0)
        start = time.perf_counter()
        entries = aot.compile_plan(result, top, target, progress=lambda _: bar.update())
        rows_by_rank = {row.rank: row for row in result.rows}
        for entry in entries:
            memory = dict(rows_by_rank[entry["plan_rank"]].memory)
            entry |= {"model": name, "devices": devices, "modelled_memory": memory}
            if "error" not in entry:
                state = sum(entry["compiled_memory"][k]
                            for k in ("params_bytes", "gradient_bytes", "optimizer_bytes"))
                entry["terms"] = {
                    "state_modelled": memory["state"], "state_compiled": state,
                    "rest_modelled": memory["total"] - memory["state"],
                    "rest_compiled": entry["compiled_peak_bytes"] - state}
            rows.append(entry)
        print(f"\n{name} on {devices} H100s ({time.perf_counter() - start:.0f} s):\n"
              f"{aot.format_compiled_plan(entries)}", flush=True)
    bar.close()
    results = {"models": models, "device_counts": device_counts, "top": top,
               "batch_sequences": batch, "topology": topology.as_dict(),
               "versions": aot.versions(), "rows": rows,
               "modelled": "planner memory and communication (jphantom.plan)",
               "compiled": "XLA's GPU compiler's memory_analysis() and HLO; nothing ran"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, out / "compile_at_scale.png")
    _table(results)
    return results


def _table(results: dict) -> None:
    print("\nmodel devices layout          mesh                      modelled  compiled  ratio   "
          "state m/c GiB   rest m/c GiB   compile s")
    for r in results["rows"]:
        if "error" in r:
            print(f"{r['model']:>5} {r['devices']:>7} {r['layout']:<15} {r['mesh']:<25} "
                  f"refused: {r['error']}")
            continue
        t = r["terms"]
        print(f"{r['model']:>5} {r['devices']:>7} {r['layout']:<15} {r['mesh']:<25} "
              f"{r['modelled_memory_bytes'] / GIB:>8.1f} {r['compiled_peak_bytes'] / GIB:>9.1f} "
              f"{r['memory_ratio']:>6.2f}   {t['state_modelled'] / GIB:>5.1f} / "
              f"{t['state_compiled'] / GIB:<5.1f}   {t['rest_modelled'] / GIB:>5.1f} / "
              f"{t['rest_compiled'] / GIB:<6.1f} {r['compile_seconds']:>8.1f}")


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
    ax.set_title("jphantom plan's top layouts compiled for H100 (no GPU used)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true",
                        help="a 2-layer GPT on 16 H100s, the top 2 layouts (seconds)")
    parser.add_argument("--top", type=int, default=5, help="layouts compiled per case (default 5)")
    parser.add_argument("--out", default=None,
                        help="output folder (default experiments/results/compile_at_scale; "
                             "--quick: a scratch folder)")
    args = parser.parse_args(argv)
    from jphantom import aot

    problem = aot.plugin_problem("gpu")
    if problem:
        print(f"compile_at_scale: {problem}", file=sys.stderr)
        return 2
    if args.quick:
        out = Path(args.out or tempfile.mkdtemp(prefix="compile_at_scale_"))
        run(QUICK, [16], 2, 32, out)
    else:
        out = Path(args.out or Path(__file__).parent / "results" / "compile_at_scale")
        run(MODELS, [64, 256], args.top, 512, out)
    print(f"\nwrote {out}/results.json and {out}/compile_at_scale.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
