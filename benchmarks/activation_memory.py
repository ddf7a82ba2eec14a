"""Activation memory per layer against Korthikanti et al.'s count: a Llama-3-8B-width step
compiled for one node of 8 H100 from a CPU-only machine (``jphantom compile --target gpu:h100``)
with 2 and with 4 layers, per layout (TP + SP, FSDP, context parallelism, a pipeline stage).

Per layout: XLA's temporaries per device (``memory_analysis()``) at 2 and 4 layers and their
per-layer slope (the difference / the layers one device gained: 2, or 1 on a stage of a 2-stage
pipeline), against :func:`jphantom.perf.axonn_model.memory.llama_layer_activations`
(Korthikanti et al. 2022's way, 34 s b h / t at Llama-3-8B widths under TP + SP) for the
sequences a device holds at once (a pipeline's first stage: min(micro-batches, stages)
micro-batches in flight), plus the layer's bf16 copy of its weights (``--precision bf16`` casts
the float32 master weights before the layer scan, [L, ...] as they are split: 2 bytes a
parameter over the ranks that split them; the parameters per layer from the compiled step's own
parameter count, (P(4) - P(2)) / 2), plus, on a pipeline stage, the layer's float32 gradient
accumulator (4 bytes a parameter: the stage sums its micro-batches' gradients across the
schedule's ticks, as Megatron's ``main_grad`` does). ``ratio``: (slope - copy - accumulator) /
formula.

Model: Llama-3-8B's layer shapes (hidden 4096, 32 heads, 8 key/value heads, SwiGLU 14336,
vocabulary 128256), S = 4096, float32 master weights, bf16 compute, AdamW, ``--remat none``,
cuDNN's fused attention (``--attention auto``).

    python benchmarks/activation_memory.py           # 8 compiles, about 3 minutes on 2 cores
    python benchmarks/activation_memory.py --quick   # hidden 512, S 512, for a check
    git worktree add /tmp/act_before ef8e043^        # the same compiles of an earlier jphantom
    python benchmarks/activation_memory.py --source /tmp/act_before \\
        --out benchmarks/results/activation_memory/before

Needs XLA's GPU compiler: ``pip install 'jphantom[aot]'`` (``make test-aot`` builds .venv-aot).
Writes ``benchmarks/results/activation_memory/activation_memory.json`` and a table
``activation_memory.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

OUT = Path(__file__).resolve().parent / "results" / "activation_memory"
LAYERS = (2, 4)
LLAMA = dict(model="llama", hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
             seq_len=4096, dtype="float32", precision="bf16", optimizer="adamw", remat="none")
QUICK = dict(LLAMA, hidden=512, heads=8, kv_heads=4, intermediate=1024, vocab=4096, seq_len=512)
# (name, flags, the formula's shape: sequences b a device holds at once, tensor t, context c,
#  sequence parallelism; the ranks splitting the layer's weights; layers a device gains 2 -> 4)
LAYOUTS = [
    ("tp+sp", dict(strategy="tensor", mesh="data=2,model=4", sequence_parallel=True, batch=4),
     dict(batch=2, tensor=4, sequence_parallel=True), 4, 2),
    ("fsdp", dict(strategy="tensor", mesh="data=8", zero=3, batch=32),
     dict(batch=4), 8, 2),
    ("cp", dict(strategy="tensor", mesh="data=2,context=4", batch=4),
     dict(batch=2, context=4), 1, 2),
    ("pipeline stage", dict(strategy="tensor", mesh="data=4,stage=2", schedule="1f1b",
                            microbatches=2, batch=8),
     dict(batch=2), 1, 1),
]


def line(r: dict) -> str:
    t = r["temp_gib"]
    accumulator = r.get("accumulator_gib", 0.0)
    rest = r["slope_gib"] - r["formula_gib"] - r["weight_copy_gib"] - accumulator
    grads = f" + f32 gradients {accumulator:.3f}" if accumulator else ""
    stored = ""
    if "stored_ratio" in r:
        stored = (f"; stored for the backward {r['stored_gib']:.3f} GiB a layer, "
                  f"{r['stored_ratio']:.2f}x the count")
        if r["stored_sets"] > 1:
            stored += (f", held in {r['stored_sets']} slots: {r['allocated_ratio']:.2f}x")
        if r.get("stored_scanned"):
            stored += " (read from the program with the chunk's layers scanned)"
    return (f"{r['layout']:<16} temporaries {t[str(LAYERS[0])]:6.2f} -> "
            f"{t[str(LAYERS[-1])]:6.2f} GiB  per layer {r['slope_gib']:6.3f} GiB = formula "
            f"{r['formula_gib']:.3f} + bf16 weights {r['weight_copy_gib']:.3f}{grads} "
            f"{rest:+.3f}  (slope - weights{' - gradients' if grads else ''}) / formula "
            f"{r['ratio']:.2f}x{stored}")


def formula(model: dict, shape: dict) -> float:
    """Korthikanti's count for Llama's layer in bytes (this checkout's, also with --source)."""
    from jphantom.perf.axonn_model.memory import llama_layer_activations

    return llama_layer_activations(seq=model["seq_len"], hidden=model["hidden"],
                                   heads=model["heads"], kv_heads=model["kv_heads"],
                                   intermediate=model["intermediate"], **shape)["total"]


def compiled_sizes(model: dict, layout: tuple, target, devices) -> dict:
    """Temporary bytes and parameters of the layout's step at each of :data:`LAYERS`, as the
    jphantom that imports compiles it."""
    from jphantom.costs import aot

    import tempfile

    sizes = {"temp": {}, "params": {}}
    for layers in LAYERS:
        with tempfile.TemporaryDirectory() as folder:
            hlo = Path(folder) / "step.hlo"
            report = aot.compile_report({**model, **layout[1], "layers": layers}, target,
                                        devices=devices, hlo_out=hlo)
            if layers == LAYERS[-1]:
                sizes["residuals"] = residuals(hlo.read_text(), model, layout, layers)
                if (sizes["residuals"] is not None and not sizes["residuals"]["bytes"]
                        and "stage" in layout[1]["mesh"]):
                    sizes["residuals"] = scanned_residuals(model, layout, layers, target,
                                                           devices)
        sizes["temp"][str(layers)] = report["memory"]["temp_bytes"]
        sizes["params"][str(layers)] = report["params"]
    return sizes


def scanned_residuals(model: dict, layout: tuple, layers: int, target, devices) -> dict:
    """A pipeline stage's stored residuals read from its program with the chunk's layers
    scanned (``unroll_layers=0``): where they run unrolled and XLA unrolled the schedule's
    short tick loop too (this layout's 2 micro-batches), the program has no loop whose results
    show them. The same residuals either way (the same ``jax.vjp``); marked ``scanned``."""
    from jphantom.costs import aot

    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        hlo = Path(folder) / "step.hlo"
        aot.compile_report({**model, **layout[1], "layers": layers, "unroll_layers": 0}, target,
                           devices=devices, hlo_out=hlo)
        return {**residuals(hlo.read_text(), model, layout, layers), "scanned": True}


def residuals(hlo_text: str, model: dict, layout: tuple, layers: int) -> dict | None:
    """What the step's layer loop stores for the backward
    (:func:`jphantom.analysis.hlo.residuals.saved_residuals`): the layers one device runs, the
    rows of one pass (a pipeline's micro-batch), a sequence's tokens whole or split by the
    layout's ``model`` or ``context``. None from a jphantom without that analysis (--source)."""
    try:
        from jphantom.analysis.hlo.residuals import saved_residuals
    except ImportError:
        return None
    flags = layout[1]
    axes = dict(part.split("=") for part in flags["mesh"].split(","))
    stages, data = int(axes.get("stage", 1)), int(axes.get("data", 1))
    rows = flags["batch"] // data // flags.get("microbatches", 1)
    seq = model["seq_len"]
    found = saved_residuals(hlo_text, layers=layers // stages, rows=rows,
                            tokens={seq, seq // int(axes.get("model", 1)),
                                    seq // int(axes.get("context", 1))})
    return {**found, "layers": layers // stages, "rows": rows}


def measure(model: dict, layout: tuple, sizes: dict) -> dict:
    """The layout's per-layer slope of the temporaries against the count (module docstring)."""
    name, flags, shape, weight_split, gained = layout
    temp, params = sizes["temp"], sizes["params"]
    deep, shallow = str(LAYERS[-1]), str(LAYERS[0])
    layer_params = (params[deep] - params[shallow]) / (LAYERS[-1] - LAYERS[0])
    slope = (temp[deep] - temp[shallow]) / gained
    copy = 2 * layer_params / weight_split
    accumulator = 4 * layer_params / weight_split if "stage" in flags["mesh"] else 0.0
    count = formula(model, shape)
    row = {"layout": name, "flags": flags, "shape": shape,
           "temp_gib": {k: v / 2**30 for k, v in temp.items()},
           "slope_gib": slope / 2**30, "weight_copy_gib": copy / 2**30,
           "accumulator_gib": accumulator / 2**30, "formula_gib": count / 2**30,
           "ratio": (slope - copy - accumulator) / count}
    stored = sizes.get("residuals")
    if stored:  # per layer and per sequence the layer loop stores, against the count's
        per_row = stored["bytes"] / stored["layers"] / stored["rows"]
        row.update(stored_gib=per_row * shape["batch"] / 2**30, stored_sets=stored["copies"],
                   stored_ratio=per_row * shape["batch"] / count,
                   allocated_ratio=per_row * stored["rows"] * stored["copies"] / count,
                   stored_shapes=stored["shapes"], stored_scanned=stored.get("scanned", False))
    return row


def sizes_from(source: str, model: dict, names: list[str]) -> dict:
    """:func:`compiled_sizes` of each layout in ``names`` by the jphantom of the checkout
    ``source``: this script run again in a process whose ``PYTHONPATH`` starts there (two
    versions of one package cannot share an interpreter)."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(source).resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, __file__, "--sizes", json.dumps(model), *names],
                          env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a hidden-512 model")
    parser.add_argument("--only", nargs="*", default=None, help="layout names (default all)")
    parser.add_argument("--source", default=None,
                        help="compile with the jphantom of this checkout (an earlier revision, "
                             "for a before column); the formula stays this checkout's")
    parser.add_argument("--sizes", default=None, metavar="MODEL_JSON",
                        help=argparse.SUPPRESS)  # sizes_from's child: print the sizes as JSON
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {OUT}; --quick: a scratch folder)")
    parser.add_argument("names", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from jphantom.costs import aot

    layouts = [layout for layout in LAYOUTS
               if not (args.only or args.names) or layout[0] in (args.only or args.names)]
    if args.sizes is not None:  # an earlier jphantom's child: only what every version has
        target = aot.Target.parse("gpu:h100", nodes=1)
        model, devices = json.loads(args.sizes), target.devices()
        print(json.dumps({l[0]: compiled_sizes(model, l, target, devices) for l in layouts}))
        return 0
    from jphantom.analysis.machine import output_folder, source_revision, write_results
    from jphantom.errors import ConfigError

    try:
        target, devices = aot.deviceless_node("gpu:h100")
    except ConfigError as error:
        print(f"activation_memory: {error}", file=sys.stderr)
        return 2
    model = QUICK if args.quick else LLAMA
    out = output_folder(args.out, OUT, quick=args.quick, name="activation_memory")
    out.mkdir(parents=True, exist_ok=True)
    before = sizes_from(args.source, model, [l[0] for l in layouts]) if args.source else {}
    rows = []
    for layout in layouts:
        sizes = before.get(layout[0]) or compiled_sizes(model, layout, target, devices)
        rows.append(measure(model, layout, sizes))
        print(line(rows[-1]), flush=True)
    root = Path(args.source or Path(__file__).resolve().parents[1])
    result = {"model": model, "layers": LAYERS, "rows": rows,
              "jphantom": {"path": str(root), "revision": source_revision(root)},
              "device": "gpu:h100 (compiled without a GPU)", "versions": aot.versions()}
    write_results(out, "activation_memory", result, [line(r) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
