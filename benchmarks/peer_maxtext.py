"""jphantom against MaxText, side by side in one run: the same small Llama-style decoder trained
under each parallel layout by both libraries, in two worker processes that alternate step by step.

MaxText (Google's JAX LLM library, ``maxtext`` on the package registry) is never a dependency of
jphantom: on first use this script creates its own environment outside the repository
(``~/.cache/jphantom/peer-maxtext/venv``, or ``$JPHANTOM_PEER_HOME/venv``) with Python >= 3.12
(MaxText requires it), installs MaxText there without its several hundred optional dependencies
(its wheel puts every dependency behind the ``tpu``/``cuda12`` extras, which pull libtpu or CUDA)
and adds the few packages its training step imports, pinned (:data:`MAXTEXT_PACKAGES`). Later
runs reuse it; ``--setup`` only builds it, ``--reinstall`` builds it again.

The model (``--layers 4 --hidden 256 --heads 8 --seq-len 128 --batch 16``, vocabulary 256,
float32, AdamW, 8 simulated CPU devices): jphantom's :class:`jphantom.models.llama.Llama` built by
``RunConfig`` (what ``jphantom train --model llama`` runs); MaxText's default ``llama2`` decoder
block with ``base_emb_dim``, ``base_num_query_heads`` = ``base_num_kv_heads``, ``head_dim``,
``base_mlp_dim`` and ``base_num_decoder_layers`` set to the same shape, synthetic data, its own
``train_step`` (``maxtext.trainers.pre_train.train``) jitted by its own ``train_utils``. Both are
pre-RMSNorm blocks of causal multi-head attention with rotary positions and a SwiGLU MLP (width
``--intermediate``, default jphantom's 8h/3 rounded up to 32: 704), no biases, untied head,
scanned layers. What still differs is listed in :data:`MODEL_DIFFERENCES` and in
``results.json``. Activation checkpointing is matched (``--remat``): ``dots`` (default) keeps
the matmul outputs on both sides (jphantom ``dots_saveable``, MaxText ``minimal_with_context``),
``dots_collectives`` keeps the collectives' outputs too on jphantom's side
(``dots_collectives_saveable``; ``dots_saveable`` recomputes a row-parallel all-reduce), ``full``
recomputes each layer (``nothing_saveable`` / ``full``), ``none`` is jphantom without
remat (its default) against MaxText's closest (``minimal_with_context``: MaxText always
checkpoints a layer); the pipelines too.

Layouts (:data:`LAYOUTS`): data parallel (``data=8`` / ``ici_data_parallelism=8``), ZeRO-3 against
FSDP (``--zero 3`` on ``data=8`` / ``ici_fsdp_parallelism=8``), Megatron tensor parallelism
(``model=8`` / ``ici_tensor_parallelism=8``), tensor + sequence parallelism (``model=8
--sequence-parallel`` / ``ici_tensor_sequence_parallelism=8``), a 2-stage pipeline (1F1B on
``stage=2,data=4`` with 2 micro-batches per data rank / ``ici_pipeline_parallelism=2,
ici_data_parallelism=4``, 2 pipeline micro-batches and ``num_layers_per_pipeline_stage=2``: both
bubbles (P-1)/(M+P-1) = 1/3) and the same mesh interleaved (jphantom's ``interleaved-1f1b`` with 2
virtual stages / MaxText's default circular pipeline, one layer per stage and 2 repeats: both
bubbles 1/5). MaxText's pipeline is a loop over iterations whose backward is the loop's autodiff.

Each worker builds and compiles every layout once; then the driver asks them in turn for one timed
step (``--steps`` rounds after ``--warmup``, the order alternating each round), so load from
anything else on the machine hits both alike. Reported per layout and system: the median step
time, the model's FLOPs per second per device (6 x matmul parameters x tokens + the attention's
12 L S h per token, the same analytic count for both), the compiled step's GEMM FLOPs per device
(every ``dot`` with loop trip counts), ``memory_analysis()`` per device, the collectives per
device from the optimized HLO (``jphantom.analysis.hlo``, for both programs) and an op census of
the compiled program (:func:`analyse_hlo`: the instructions the CPU runtime executes per step by
opcode, the bytes its copies write and the bytes its dynamic-update-slices write, which is where a
layer scan stacks its residuals). ``--profile LAYOUTS`` adds a ``jax.profiler`` trace of both
programs, summed per op category (:func:`aggregate_profile`). The ratio is jphantom's median
step time over MaxText's (target: no layout above 1.05); ``paired_ratio`` is the median of the
per-round ratios (:func:`paired_ratio`), steadier when the machine's load drifts.

Usage::

    python benchmarks/peer_maxtext.py                      # every layout, 10 rounds
    python benchmarks/peer_maxtext.py --quick              # tiny shapes, 2 rounds, scratch output
    python benchmarks/peer_maxtext.py --only tp --dump-hlo /tmp/hlo   # keep both compiled HLOs
    python benchmarks/peer_maxtext.py --only tp --profile tp --remat none   # jphantom's default
    python benchmarks/peer_maxtext.py --setup              # only create MaxText's environment
    python benchmarks/peer_maxtext.py --jphantom-python ~/.cache/jphantom/peer-maxtext/venv/bin/python
        # jphantom on MaxText's interpreter (jax 0.12): one jax and XLA for both

Results: ``<out>/results.json`` and ``<out>/peer_maxtext.png`` (default
``benchmarks/results/peer_maxtext/``; ``--quick`` writes to a scratch folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "peer_maxtext"
TARGET = 1.05
MAXTEXT_VERSION = "0.2.5"
# What MaxText's pre-training step imports, pinned to what was tested (MaxText 0.2.5's wheel has
# no unconditional dependency; its extras add libtpu / CUDA and ~250 packages for the rest).
MAXTEXT_PACKAGES = (
    "jax==0.12.0.1", "jaxlib==0.12.0.1", "flax==0.12.12", "optax==0.2.8",
    "orbax-checkpoint==0.12.8", "grain==0.2.18", "qwix==0.1.8", "tokamax==0.0.17", "drjax==0.2.1",
    "jaxtyping==0.3.11", "aqtp==0.9.0", "omegaconf==2.4.0", "PyYAML==6.0.4", "absl-py==2.5.1",
    "ml-collections", "pydantic==2.14.4", "tensorboardX==2.6.5", "sentencepiece==0.2.3",
    "tiktoken==0.14.0", "pathwaysutils==0.1.13", "Jinja2==3.1.6", "huggingface_hub==2.4.0",
    "transformers==5.24.0", "sympy==1.14.0", "pillow==13.0.0",
)
HOME = Path(os.environ.get("JPHANTOM_PEER_HOME", "~/.cache/jphantom/peer-maxtext")).expanduser()

# layout -> (label, jphantom RunConfig flags, MaxText config overrides)
LAYOUTS = {
    "dp": ("data parallel, data=8",
           {"strategy": "tensor", "mesh": "data=8,model=1"},
           {"ici_data_parallelism": 8}),
    "zero3": ("ZeRO-3 vs FSDP, data=8",
              {"strategy": "tensor", "mesh": "data=8,model=1", "zero": 3},
              {"ici_fsdp_parallelism": 8}),
    "tp": ("Megatron TP, model=8",
           {"strategy": "tensor", "mesh": "model=8"},
           {"ici_tensor_parallelism": 8}),
    "tp_sp": ("TP + SP, model=8",
              {"strategy": "tensor", "mesh": "model=8", "sequence_parallel": True},
              {"ici_tensor_sequence_parallelism": 8}),
    "pp": ("2-stage pipeline, stage=2,data=4",
           {"strategy": "tensor", "mesh": "stage=2,data=4,model=1", "schedule": "1f1b",
            "microbatches": 2},
           {"ici_pipeline_parallelism": 2, "ici_data_parallelism": 4,
            "num_pipeline_microbatches": 2, "num_layers_per_pipeline_stage": 2}),
    "pp_circular": ("2-stage interleaved, 2 virtual",
                    {"strategy": "tensor", "mesh": "stage=2,data=4,model=1",
                     "schedule": "interleaved-1f1b", "virtual_stages": 2, "microbatches": 2},
                    {"ici_pipeline_parallelism": 2, "ici_data_parallelism": 4,
                     "num_pipeline_microbatches": 2, "num_layers_per_pipeline_stage": 1}),
}
REMAT = {  # --remat -> (jphantom's policy, MaxText's remat_policy)
    "dots": ("dots_saveable", "minimal_with_context"),
    "dots_collectives": ("dots_collectives_saveable", "minimal_with_context"),
    "full": ("nothing_saveable", "full"),
    "none": ("none", "minimal_with_context"),
}
MODEL_DIFFERENCES = (
    "RoPE: jphantom rotates halves (Hugging Face's convention) at positions 0..S-1 built from "
    "numpy constants; MaxText's llama2 block takes the positions as an input array "
    "(decoder_positions) and computes its sin/cos in the step.",
    "Masking and loss weights: MaxText's batch carries segment ids (packing), so its attention "
    "mask is causal AND same-segment and its loss is weighted by targets_segmentation; jphantom's "
    "mask is causal only and its loss a plain mean.",
    "Loss: jphantom's cross-entropy is vocabulary-parallel when the head is split (each rank its "
    "vocabulary slice, per-token statistics all-reduced); MaxText takes one_hot(targets) against "
    "logits sharded by its logical rules.",
    "Residual stream under TP: MaxText's rules shard activation_embed over 'tensor', so its "
    "residual stream, norms and their weights are split over the hidden dimension between "
    "layers; jphantom's Megatron keeps the residual stream and the norms whole on every rank.",
    "Step extras: MaxText's step also computes three global norms (raw gradient, gradient, "
    "parameters) as metrics and a warm-up + cosine learning-rate schedule; gradient clipping is "
    "off on both sides (jphantom has none by default).",
    "AdamW: the same b2=0.95 and eps=1e-8; weight decay 0.1 (MaxText's default) and 1e-4 "
    "(jphantom's default): an element-wise term either way.",
    "Pipeline: jphantom runs 1F1B (or interleaved 1F1B) over 2 micro-batches per data rank, "
    "MaxText its circular pipeline over 2 micro-batches (a forward loop over iterations, the "
    "backward by autodiff: all forwards, then all backwards); the bubbles are the same.",
    "Remat: MaxText wraps every layer in jax.checkpoint; 'minimal_with_context' saves the "
    "projections, MLP matmuls and attention context (close to jphantom's dots_saveable).",
    "jax: jphantom runs on the interpreter given by --jphantom-python (the repository's .venv: "
    "jax 0.10.2 on Python 3.11), MaxText on jax 0.12.0.1 (Python 3.12); pass MaxText's "
    "interpreter as --jphantom-python for one XLA.",
)


def model_shape(args) -> dict:
    intermediate = args.intermediate or -(-8 * args.hidden // 3 // 32) * 32
    return {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "seq_len": args.seq_len, "batch": args.batch, "vocab": args.vocab,
            "intermediate": intermediate}


def model_flops(shape: dict) -> int:
    """Training FLOPs of one step, the same analytic count for both systems: 6 per matmul
    parameter per token (q, k, v, o, gate, up, down, LM head; the embedding lookup is free) plus
    the attention's scores and context, 12 L S h per token (causal masking not discounted)."""
    h, f, L, v = shape["hidden"], shape["intermediate"], shape["layers"], shape["vocab"]
    tokens = shape["batch"] * shape["seq_len"]
    matmul_params = L * (4 * h * h + 3 * h * f) + h * v
    return 6 * matmul_params * tokens + 12 * L * shape["seq_len"] * h * tokens


# --------------------------------------------------------------------------------------------------
# MaxText's environment
# --------------------------------------------------------------------------------------------------


def venv_python() -> Path:
    return HOME / "venv" / "bin" / "python"


def _find_python312() -> str:
    for name in ("python3.12", "python3.13"):
        found = shutil.which(name)
        if found and subprocess.run([found, "-c", "import venv"],
                                    capture_output=True).returncode == 0:
            return found
    for pattern in ("3.12*", "3.13*"):  # pyenv keeps interpreters off the PATH
        for path in sorted(Path("~/.pyenv/versions").expanduser().glob(pattern), reverse=True):
            if (path / "bin" / "python").exists():
                return str(path / "bin" / "python")
    raise SystemExit("MaxText 0.2.5 needs Python >= 3.12 and none was found (python3.12, "
                     "python3.13, ~/.pyenv/versions): install one, or pass --python PATH")


def setup_maxtext(python: str | None, reinstall: bool) -> Path:
    """MaxText's own environment, created on first use (or again with ``reinstall``)."""
    target = venv_python()
    stamp = HOME / "venv" / f".maxtext-{MAXTEXT_VERSION}-ready"
    if stamp.exists() and target.exists() and not reinstall:
        return target
    python = python or _find_python312()
    print(f"Setting up MaxText {MAXTEXT_VERSION} in {HOME / 'venv'} (first use; once, about two "
          f"minutes and 1.4 GB; nothing of it enters jphantom's environment) with {python}",
          flush=True)
    if (HOME / "venv").exists():  # half-built, or --reinstall: start again
        shutil.rmtree(HOME / "venv")
    HOME.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    subprocess.run([python, "-m", "venv", str(HOME / "venv")], check=True)
    pip = [str(target), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "--no-deps", f"maxtext=={MAXTEXT_VERSION}"], check=True)
    subprocess.run([*pip, *MAXTEXT_PACKAGES], check=True)
    check = subprocess.run([str(target), "-c", "from maxtext.trainers.pre_train import train"],
                           capture_output=True, text=True, env=_worker_env(8))
    if check.returncode:
        raise SystemExit("MaxText was installed but its training step does not import:\n"
                         + check.stderr[-3000:])
    stamp.write_text(json.dumps({"seconds": time.perf_counter() - start, "python": python}))
    print(f"MaxText ready in {time.perf_counter() - start:.0f} s", flush=True)
    return target


# --------------------------------------------------------------------------------------------------
# Workers: one library each, commands on stdin, one JSON answer per line on stdout
# --------------------------------------------------------------------------------------------------


def _compiled_memory(compiled) -> dict:
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    return {f"{k}_bytes": int(getattr(stats, f"{k}_size_in_bytes", 0))
            for k in ("argument", "output", "temp", "alias", "generated_code")}


def _build_jphantom(case: dict, shape: dict, remat: str, scratch: Path):
    import jax
    import numpy as np

    from jphantom.config import RunConfig

    flags = {"remat": REMAT[remat][0], **case["jphantom"]}  # a layout's own remat wins
    config = RunConfig.from_flags(
        model="llama", layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"],
        seq_len=shape["seq_len"], vocab=shape["vocab"], intermediate=shape["intermediate"],
        batch=shape["batch"], optimizer="adamw", learning_rate=1e-4, warmup_steps=0,
        out=None, progress=False, **flags)
    built = config.build()
    state = built.program.init(built.step)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, shape["vocab"], (shape["batch"], shape["seq_len"] + 1), np.int32)
    batch = tuple(jax.device_put(a, s) for a, s in zip((tokens[:, :-1], tokens[:, 1:]),
                                                        built.shardings))
    compiled = built.step.lower(state, *batch).compile()

    def run(state):
        return compiled(state, *batch)

    return compiled, state, run


def _build_maxtext(case: dict, shape: dict, remat: str, scratch: Path):
    import jax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules
    from maxtext.trainers.pre_train import train
    from maxtext.utils import maxtext_utils, sharding, train_utils

    devices = jax.device_count()
    overrides = {
        "run_name": f"peer-{case['name']}", "base_output_directory": str(scratch / "maxtext"),
        "dataset_type": "synthetic", "enable_checkpointing": False, "steps": 1_000_000,
        "base_emb_dim": shape["hidden"], "base_num_query_heads": shape["heads"],
        "base_num_kv_heads": shape["heads"], "head_dim": shape["hidden"] // shape["heads"],
        "base_mlp_dim": shape["intermediate"], "base_num_decoder_layers": shape["layers"],
        "vocab_size": shape["vocab"], "max_target_length": shape["seq_len"],
        "per_device_batch_size": shape["batch"] / devices, "dtype": "float32",
        "weight_dtype": "float32", "attention": "dot_product", "enable_dropout": False,
        "remat_policy": REMAT[remat][1], "gradient_clipping_threshold": 0.0,
        "learning_rate": 1e-4, "skip_jax_distributed_system": True, "log_config": False,
        "ici_fsdp_parallelism": 1, **case["maxtext"],
    }
    argv = ["peer_maxtext"] + [f"{k}={v}" for k, v in overrides.items()]
    config, recorder = train.initialize(argv)
    (_, _, state_mesh_shardings, _, mesh, _, _, _, _, _, state) = train_utils.setup_train_loop(
        config, recorder)
    jit_model, state = nnx.split(state)
    params_shardings, state_mesh_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_mesh_shardings)
    p_train_step, _ = train_utils.jit_train_and_eval_step(
        config, jit_model, mesh, state, state_mesh_shardings, train.train_step,
        params_shardings=params_shardings)
    rules = logical_axis_rules(config.logical_axis_rules)
    with jax.set_mesh(mesh), rules:
        shaped = maxtext_utils.get_shaped_batch(
            config, batch_sharding=sharding.get_input_data_sharding(config, mesh))
        compiled = p_train_step.lower(state, shaped).compile()
        batch = train.make_synthetic_batch(config, shaped)

    def run(state):
        with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
            return compiled(state, batch)

    return compiled, state, run


def _loss_of(loss):
    if isinstance(loss, dict):  # MaxText's metrics
        loss = loss["scalar"]["learning/loss"]
    return float(loss)


def worker(system: str) -> int:
    import jax

    scratch = Path(os.environ["PEER_SCRATCH"])
    build = _build_jphantom if system == "jphantom" else _build_maxtext
    built = {}
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "exit":
            return 0
        try:
            if command["do"] == "build":
                case, name = command["case"], command["case"]["name"]
                start = time.perf_counter()
                compiled, state, run = build(case, command["shape"], command["remat"], scratch)
                seconds = time.perf_counter() - start
                hlo = scratch / f"{system}-{name}.hlo.txt"
                hlo.write_text(compiled.as_text())
                state, out = run(state)  # one untimed step
                built[name] = (state, run)
                answer = {"build_seconds": seconds, "hlo": str(hlo), "first_loss": _loss_of(out),
                          "memory": _compiled_memory(compiled), "jax": jax.__version__,
                          "python": platform.python_version()}
            elif command["do"] == "time":
                state, run = built[command["case"]]
                start = time.perf_counter()
                for _ in range(command.get("chunk", 1)):
                    state, out = run(state)
                jax.block_until_ready((state, out))
                answer = {"seconds": (time.perf_counter() - start) / command.get("chunk", 1)}
                built[command["case"]] = (state, run)
            elif command["do"] == "profile":
                name = command["case"]
                state, run = built[name]
                folder = scratch / f"profile-{system}-{name}"
                jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
                for _ in range(command["steps"]):
                    state, out = run(state)
                jax.block_until_ready((state, out))
                jax.profiler.stop_trace()
                built[name] = (state, run)
                traces = sorted(folder.glob("plugins/profile/*/perfetto_trace.json.gz"))
                answer = {"trace": str(traces[-1])}
            elif command["do"] == "analyse":
                answer = analyse_hlo(Path(command["path"]).read_text())
            elif command["do"] == "aggregate":
                answer = aggregate_profile(Path(command["trace"]), Path(command["hlo"]).read_text(),
                                           command["steps"])
            else:
                answer = {"error": f"unknown command {command['do']!r}"}
        except Exception as error:  # reported; the driver decides
            import traceback
            traceback.print_exc(file=sys.stderr)
            first = str(error).splitlines()[0][:400] if str(error) else ""
            answer = {"error": f"{type(error).__name__}: {first}"}
        print(json.dumps(answer), flush=True)
    return 0


# What the op census counts as not dispatching work on the CPU runtime.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "copy-done", "all-gather-done",
         "all-reduce-done", "collective-permute-done", "async-done", "add-dependency"}


def _categories(comps) -> dict[str, str]:
    """HLO instruction name -> what its time counts as in a profile: ``collective``, ``gemm`` (a
    dot, or a fusion holding one), ``stack`` (a fusion writing a dynamic-update-slice: a scan
    stacking residuals or gradients), ``copy`` (a copy, or a fusion of copies and transposes only),
    ``elementwise`` (any other fusion), ``loop`` (while, call, conditional: their bodies' ops are
    counted themselves) or ``other``."""
    from jphantom.analysis import hlo

    out = {}
    for comp in comps.values():
        for instr in comp.instructions:
            op = instr.opcode.removesuffix("-start").removesuffix("-done")
            if op in hlo.KINDS:
                kind = "collective"
            elif op == "dot":
                kind = "gemm"
            elif op == "copy" or op == "transpose":
                kind = "copy"
            elif op in ("while", "call", "conditional"):
                kind = "loop"
            elif op == "fusion":
                body = comps.get(instr.attr("calls").lstrip("%"))
                inside = {i.opcode for i in body.instructions} if body else set()
                inside -= {"parameter", "bitcast", "constant", "get-tuple-element", "tuple"}
                kind = ("gemm" if "dot" in inside or "convolution" in inside
                        else "stack" if "dynamic-update-slice" in inside
                        else "copy" if inside <= {"copy", "transpose"}
                        else "elementwise")
            else:
                kind = "other"
            out[instr.name] = kind
    return out


def aggregate_profile(trace: Path, hlo_text: str, steps: int) -> dict:
    """Per step, the time the CPU runtime spent in each category of op (:func:`_categories`) of a
    perfetto trace of ``steps`` steps, summed over the device threads (8 simulated devices share
    the machine's cores, so a collective's time includes its wait for the slowest device), and
    the ten most expensive instructions."""
    import gzip

    from jphantom.analysis import hlo

    comps = hlo.parse_module(hlo_text)
    kinds = _categories(comps)
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    by_kind, by_op = {}, {}
    for e in events:
        if e.get("ph") != "X" or e.get("name") not in kinds or kinds[e["name"]] == "loop":
            continue
        ms = e.get("dur", 0) / 1e3 / steps
        by_kind[kinds[e["name"]]] = by_kind.get(kinds[e["name"]], 0.0) + ms
        by_op[e["name"]] = by_op.get(e["name"], 0.0) + ms
    types = {i.name: i.type_text for c in comps.values() for i in c.instructions}
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:10]
    return {"thread_ms_per_step": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "total_thread_ms_per_step": sum(by_kind.values()),
            "top_ops": [{"name": n, "kind": kinds[n], "type": types[n][:80], "thread_ms": ms}
                        for n, ms in top]}


def analyse_hlo(text: str) -> dict:
    """Collectives per device (kind, count, bytes; non-trivial groups only), GEMM FLOPs, and an op
    census of a compiled module: the instructions the runtime executes per step (those outside
    fusion bodies and reducers, loop trip counts applied) by opcode, with the fusions split by
    kind (loop, input, output, custom), the bytes the copies and transposes write, and the bytes
    written by dynamic-update-slices (a layer scan stacking its residuals, or its gradients)."""
    from jphantom.analysis import hlo

    found = [c for c in hlo.collectives(text) if not c.trivial]
    rows = hlo.summarize(found)
    flops, dots = hlo.dot_flops(text)
    comps = hlo.parse_module(text)
    mult = hlo.multipliers(comps)
    inner = set()  # fusion bodies, reducers, comparators: not executed as thunks of their own
    for comp in comps.values():
        for instr in comp.instructions:
            for key, callee in instr.callees():
                if key in ("calls", "to_apply", "select", "scatter", "comparator") and (
                        instr.opcode == "fusion" or key != "calls"):
                    inner.add(callee)
    types = {i.name: i.type_text for c in comps.values() for i in c.instructions}

    def stacked(instr) -> int:  # bytes a dynamic-update-slice (fused or not) writes
        body = comps.get(instr.attr("calls").lstrip("%")) \
            if instr.opcode == "fusion" else None
        updates = [i for i in (body.instructions if body else [instr])
                   if i.opcode == "dynamic-update-slice"]
        return sum(hlo.type_bytes(types.get(i.operands[1], "")) for i in updates)

    census, moved = {}, {"copy": 0, "transpose": 0, "stacked": 0}
    for comp in comps.values():
        runs = mult.get(comp.name, 0)
        if comp.name in inner or runs == 0:
            continue
        for instr in comp.instructions:
            if instr.opcode in _FREE:
                continue
            op = instr.opcode
            if op == "fusion":
                kind = instr.attr("kind") or "?"
                op = f"fusion:{kind.replace('k', '', 1).lower()}"
            census[op] = census.get(op, 0) + runs
            if op in moved:
                moved[op] += runs * instr.nbytes
            if instr.opcode in ("fusion", "dynamic-update-slice"):
                moved["stacked"] += runs * stacked(instr)
    return {"collectives": rows, "collective_bytes": sum(r["bytes"] for r in rows),
            "collective_count": sum(r["count"] for r in rows), "gemm_flops": flops,
            "dots": dots, "thunks": sum(census.values()),
            "census": dict(sorted(census.items(), key=lambda kv: -kv[1])),
            "copy_bytes": moved["copy"], "transpose_bytes": moved["transpose"],
            "dynamic_update_bytes": moved["stacked"]}


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def _worker_env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               TF_CPP_MIN_LOG_LEVEL="2", **extra)
    return env


class Worker:
    def __init__(self, system: str, python: str, devices: int, scratch: Path, log: Path):
        extra = {"PEER_SCRATCH": str(scratch)}
        if system == "jphantom":
            extra["PYTHONPATH"] = str(ROOT)  # this tree, whatever the interpreter has installed
        self.system = system
        self.log = open(log, "w")
        self.process = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", system], cwd=str(scratch),
            env=_worker_env(devices, **extra), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True)

    def ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.system} worker exited (log: {self.log.name})")
            if line.startswith("{"):
                return json.loads(line)  # anything else is a library printing to stdout

    def close(self):
        try:
            self.ask(do="exit")
        except (RuntimeError, BrokenPipeError, OSError):
            pass
        self.process.wait(timeout=120)
        self.log.close()


def _default_jphantom_python() -> str:
    local = ROOT / ".venv" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--only", default=None,
                        help=f"comma-separated layouts, of {', '.join(LAYOUTS)} (default all)")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    parser.add_argument("--chunk", type=int, default=1,
                        help="steps per timed sample (default 1: alternate step by step)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=None,
                        help="SwiGLU width (default jphantom's 8h/3 rounded up to 32)")
    parser.add_argument("--remat", choices=tuple(REMAT), default="dots",
                        help="activation checkpointing, matched (default dots: jphantom "
                             "dots_saveable, MaxText minimal_with_context)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (8)")
    parser.add_argument("--jphantom-python", default=_default_jphantom_python(),
                        help="interpreter of the jphantom worker (default the repository's .venv); "
                             "this tree is put first on its path")
    parser.add_argument("--python", default=None,
                        help="Python >= 3.12 to create MaxText's environment with (default: found)")
    parser.add_argument("--setup", action="store_true",
                        help="only create MaxText's environment (if missing) and exit")
    parser.add_argument("--reinstall", action="store_true",
                        help="create MaxText's environment again")
    parser.add_argument("--dump-hlo", type=Path, default=None,
                        help="keep both compiled HLO modules of every layout in this folder")
    parser.add_argument("--profile", default="",
                        help="comma-separated layouts to profile after timing (jax.profiler on "
                             "both workers: time per op category and the costliest ops)")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps profiled (3)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT.relative_to(ROOT)}; "
                             "--quick: a scratch folder)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, 2 rounds; results go to a scratch folder")
    parser.add_argument("--worker", choices=("jphantom", "maxtext"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.jphantom_python = str(Path(args.jphantom_python).expanduser().absolute())
    if args.quick:
        args.steps, args.warmup = 2, 1
        args.hidden, args.seq_len, args.intermediate = 64, 32, 176
    if args.worker is None:
        from jphantom.analysis.machine import output_folder

        args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="peer-maxtext")
    names = list(LAYOUTS) if args.only is None else args.only.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}: use {', '.join(LAYOUTS)}")
    args.layouts = names
    args.profile = [n for n in args.profile.split(",") if n]
    if any(n not in LAYOUTS for n in args.profile):
        parser.error(f"--profile takes layouts of {', '.join(LAYOUTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker(args.worker)
    maxtext_python = setup_maxtext(args.python, args.reinstall)
    if args.setup:
        print(f"MaxText's interpreter: {maxtext_python}")
        return 0
    shape = model_shape(args)
    flops = model_flops(shape)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jphantom-peer-") as scratch_text:
        scratch = Path(scratch_text)
        hlo_dir = args.dump_hlo or scratch
        hlo_dir.mkdir(parents=True, exist_ok=True)
        workers = [Worker("jphantom", args.jphantom_python, args.devices, hlo_dir,
                          scratch / "jphantom.log"),
                   Worker("maxtext", str(maxtext_python), args.devices, hlo_dir,
                          scratch / "maxtext.log")]
        jphantom = workers[0]
        rows = []
        try:
            for name in args.layouts:
                label, jflags, mflags = LAYOUTS[name]
                case = {"name": name, "jphantom": jflags, "maxtext": mflags}
                row = {"layout": name, "label": label, "jphantom_flags": jflags,
                       "maxtext_overrides": mflags}
                for w in workers:
                    answer = w.ask(do="build", case=case, shape=shape, remat=args.remat)
                    row[f"{w.system}_build"] = answer
                    if "error" in answer:
                        continue
                    analysis = jphantom.ask(do="analyse", path=answer["hlo"])
                    row[f"{w.system}_hlo"] = analysis
                failed = {w.system: row[f"{w.system}_build"]["error"] for w in workers
                          if "error" in row[f"{w.system}_build"]}
                if failed:
                    print(f"{label:<34} skipped: {failed}", flush=True)
                    rows.append(row)
                    continue
                times = {w.system: [] for w in workers}
                for round_index in range(args.warmup + args.steps):
                    order = workers if round_index % 2 == 0 else workers[::-1]
                    for w in order:
                        answer = w.ask(do="time", case=name, chunk=args.chunk)
                        if "error" in answer:
                            raise RuntimeError(f"{w.system} {name}: {answer['error']}")
                        if round_index >= args.warmup:
                            times[w.system].append(answer["seconds"])
                for system, samples in times.items():
                    median = statistics.median(samples)
                    row[f"{system}_seconds"] = median
                    row[f"{system}_model_tflops_per_device"] = flops / median / args.devices / 1e12
                row["ratio"] = row["jphantom_seconds"] / row["maxtext_seconds"]
                row["paired_ratio"] = paired_ratio(times)
                row["times"] = times
                rows.append(row)
                _print_row(row)
                if name in args.profile:
                    for w in workers:
                        trace = w.ask(do="profile", case=name, steps=args.profile_steps)
                        row[f"{w.system}_profile"] = jphantom.ask(
                            do="aggregate", trace=trace["trace"], steps=args.profile_steps,
                            hlo=row[f"{w.system}_build"]["hlo"]) if "trace" in trace else trace
                    _print_profile(row)
        except BaseException:
            for w in workers:  # what the workers said before it went wrong
                print(f"--- {w.system} worker log (tail) ---\n"
                      + (scratch / f"{w.system}.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            for w in workers:
                w.close()
    measured = [r["ratio"] for r in rows if "ratio" in r]
    from jphantom.analysis.machine import source_revision  # ROOT is on the path (main)

    result = {
        "jphantom": source_revision(ROOT) + " + working tree", "maxtext": MAXTEXT_VERSION,
        "jphantom_python": args.jphantom_python, "maxtext_python": str(maxtext_python),
        "devices": args.devices, "steps": args.steps, "warmup": args.warmup, "chunk": args.chunk,
        "remat": {"name": args.remat, "jphantom": REMAT[args.remat][0],
                  "maxtext": REMAT[args.remat][1]},
        "model": shape, "model_flops_per_step": flops, "target_ratio": TARGET,
        "worst_ratio": max(measured) if measured else None,
        "geometric_mean_ratio": statistics.geometric_mean(measured) if measured else None,
        "worst_paired_ratio": max((r["paired_ratio"] for r in rows if "ratio" in r), default=None),
        "model_differences": list(MODEL_DIFFERENCES), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "rows": rows,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    _plot(rows, args.out / "peer_maxtext.png")
    if measured:
        print(f"worst ratio {max(measured):.3f}, geometric mean "
              f"{result['geometric_mean_ratio']:.3f} (target <= {TARGET}: "
              f"{'met' if max(measured) <= TARGET else 'missed'}); wrote {args.out}")
    return 0


def paired_ratio(times: dict) -> float:
    """The median over rounds of jphantom's time over MaxText's in the same round: each round
    times both back to back, so this cancels load that drifts between rounds."""
    return statistics.median(j / m for j, m in zip(times["jphantom"], times["maxtext"]))


def _print_row(row) -> None:
    j, m = row["jphantom_hlo"], row["maxtext_hlo"]
    jm, mm = row["jphantom_build"]["memory"], row["maxtext_build"]["memory"]
    print(f"{row['label']:<34} jphantom {row['jphantom_seconds'] * 1e3:8.1f} ms  maxtext "
          f"{row['maxtext_seconds'] * 1e3:8.1f} ms  ratio {row['ratio']:.3f} (per round "
          f"{row['paired_ratio']:.3f})  | collectives "
          f"{j['collective_bytes'] / 1e6:7.2f} / {m['collective_bytes'] / 1e6:7.2f} MB "
          f"({j['collective_count']} / {m['collective_count']})  GEMM "
          f"{j['gemm_flops'] / 1e9:6.2f} / {m['gemm_flops'] / 1e9:6.2f} GFLOP  temp "
          f"{jm.get('temp_bytes', 0) / 1e6:6.1f} / {mm.get('temp_bytes', 0) / 1e6:6.1f} MB  "
          f"thunks {j['thunks']} / {m['thunks']}", flush=True)


def _print_profile(row) -> None:
    kinds = ("gemm", "elementwise", "collective", "copy", "stack", "other")
    print("  profile (ms per step summed over device threads): "
          + "  ".join(f"{k} {row['jphantom_profile']['thread_ms_per_step'].get(k, 0):.0f}/"
                      f"{row['maxtext_profile']['thread_ms_per_step'].get(k, 0):.0f}"
                      for k in kinds) + "  (jphantom/MaxText)", flush=True)


def _plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "ratio" in r]
    if not measured:
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(measured) + 1.8))
    labels = [r["label"] for r in measured]
    y = range(len(measured))
    left.barh([i - 0.2 for i in y], [r["jphantom_seconds"] * 1e3 for r in measured], 0.4,
              label="jphantom", color="tab:blue")
    left.barh([i + 0.2 for i in y], [r["maxtext_seconds"] * 1e3 for r in measured], 0.4,
              label=f"MaxText {MAXTEXT_VERSION}", color="tab:orange")
    left.set_yticks(list(y), labels)
    left.set_xlabel("median step time (ms)")
    left.invert_yaxis()
    left.legend()
    right.barh(labels, [r["ratio"] for r in measured], color="tab:blue")
    right.axvline(1.0, color="grey", lw=1)
    right.axvline(TARGET, color="tab:red", ls="--", lw=1, label=f"target {TARGET}")
    right.set_xlabel("step time: jphantom / MaxText")
    right.set_yticks(list(y), [""] * len(measured))
    right.invert_yaxis()
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
