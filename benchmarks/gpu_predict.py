"""One NVIDIA GPU: the step-time and energy simulator (:mod:`jphantom.predict`) against measured
jphantom training steps, on a device description measured on the same card, and jphantom's step
against a PyTorch peer (the simulator issue's device check).

Three parts, in this order, each child in its own process with its own timeout (so that each has
its own peak memory and compile), inside ``--budget`` seconds:

``calibrate``   ``benchmarks/calibrate.py`` measures the card's GEMM, attention, stream, launch
                and power numbers and writes ``OUT/calibration/<name>-measured.toml``
                (``--device PATH`` skips it and uses that description)
``cases``       at least 12 single-GPU jphantom training steps (:data:`CASES`): Llama widths
                0.1B (h 768, 12 layers), 0.5B (h 1024, 24 layers), 1.2B (``gpu_step.py``'s
                shape), the 8B width with 4 layers, and a Mixtral-style MoE (8 experts, top 2);
                S from 1024 to 32768, batch 1-8, ``remat`` none / ``nothing_saveable`` /
                ``dots_saveable``, bf16 and FP8, cuDNN (``attention="auto"``) and XLA attention.
                Each is built with ``jphantom.make_train_step`` on a one-device mesh
                (``optax.adamw``, float32 master weights), compiled, its optimised HLO saved
                (``OUT/hlo/<case>.hlo.txt.gz``) and PREDICTED (``jphantom.predict.predict``: the
                calibrated description, and the shipped one it was built over), then MEASURED:
                median of ``--steps`` timed steps after ``--warmup``, NVML energy over the
                timed steps (:class:`jphantom.energy.NvmlEnergyMeter`). The prediction runs in
                this (parent) process while the next case runs on the GPU. The first case (the
                gpu_step shape) also takes a profiler trace of 2 steps
                (``OUT/trace/``): its per-op device time against the predicted top 10 ops.
``peer``        PyTorch at the gpu_step shape: ``transformers``' ``LlamaForCausalLM`` (same
                sizes, tied embeddings, ``attn_implementation="sdpa"``), float32 weights under
                bf16 autocast, ``torch.optim.AdamW(fused=True)``, ``torch.compile``; median step
                against jphantom's bf16 step of the first case (ratio jphantom / peer; both MFUs
                from :func:`jphantom.costs.metrics.flops_per_token`). No torch: skipped, saying why.

Per case: predicted and measured step seconds, error (predicted - measured) / measured, predicted
and NVML joules per token, predicted and measured MFU (the description's datasheet dense bf16
peak). Summary: median and worst |error|, Spearman's rank correlation of the step times, the
median |error| of joules per token, for the calibrated description and for the shipped one.

Usage (the device machine has jax, flax, optax, torch, transformers and nvidia-ml-py)::

    PYTHONPATH=. python benchmarks/gpu_predict.py --out DIR         # one GPU, about 9 minutes
    PYTHONPATH=. python benchmarks/gpu_predict.py --small --out /tmp/p   # tiny shapes, CPU too
    ... --cases 4 (the first 4 cases) --only NAME ... --skip calibrate peer trace
    ... --device PATH (a description to use instead of calibrating) --budget SECONDS

``--small`` runs 2 tiny cases (``--cases 3``: 3) with 1 timed step, predicts with the shipped ``h100-sxm``
description, and tests the plumbing only.
Writes ``DIR/gpu_predict.json``, ``DIR/gpu_predict.png`` (predicted against measured step
seconds, log axes, y = x), ``DIR/calibration/``, ``DIR/hlo/`` and ``DIR/trace/``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import gzip
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Llama shapes: layers, hidden, heads, kv_heads, intermediate, vocab (tied embeddings)
SHAPES = {
    "0.1b": dict(layers=12, hidden=768, heads=12, kv_heads=4, intermediate=2048, vocab=32000),
    "0.5b": dict(layers=24, hidden=1024, heads=16, kv_heads=8, intermediate=4096, vocab=128256),
    "1.2b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256),
    "8bw": dict(layers=4, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "moe": dict(layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2048, vocab=32000,
                experts=8, top_k=2),
    # --small
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512),
    "tiny-moe": dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=256,
                     experts=4, top_k=2),
}


def _case(shape, seq, batch, precision="bf16", attention="auto", remat="none", trace=False):
    tag = "" if attention == "auto" else f"-{attention}"
    tag += "" if remat == "none" else f"-remat-{remat.split('_')[0]}"
    return dict(name=f"{shape}-s{seq}-b{batch}-{precision}{tag}", shape=shape, seq=seq,
                batch=batch, precision=precision, attention=attention, remat=remat, trace=trace)


# In priority order: what the budget cuts is the tail. The first is gpu_step.py's shape (the
# trace and the peer's comparison).
CASES = [
    _case("1.2b", 4096, 4, trace=True),
    _case("0.1b", 1024, 8),
    _case("0.1b", 1024, 8, attention="xla"),
    _case("0.5b", 8192, 2),
    _case("0.5b", 8192, 2, precision="fp8"),
    _case("moe", 2048, 4),
    _case("0.1b", 32768, 1),
    _case("1.2b", 4096, 4, remat="nothing_saveable"),
    _case("8bw", 4096, 2),
    _case("0.5b", 32768, 1, remat="nothing_saveable"),
    _case("1.2b", 4096, 4, precision="fp8"),
    _case("1.2b", 1024, 1),
    _case("1.2b", 16384, 1, remat="dots_saveable"),
]
SMALL_CASES = [
    _case("tiny", 64, 2, trace=True),
    _case("tiny-moe", 128, 1, precision="fp8", attention="xla", remat="nothing_saveable"),
    _case("tiny", 64, 2, attention="xla"),  # --cases 3
]
PEER_SHAPE = dict(SHAPES["1.2b"], seq=4096, batch=4)  # gpu_step.py's
SMALL_PEER_SHAPE = dict(SHAPES["tiny"], seq=64, batch=2)
MEMORY_LIMIT_GIB = 70.0  # an H100's 79.6 GiB at XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 is 71.7 GiB
FALLBACK_DEVICES = ("h100-sxm",)


def log(message: str) -> None:
    print(f"[gpu_predict {time.strftime('%H:%M:%S')}] {message}", flush=True)


def llama_config(shape: dict, seq: int):
    from jphantom.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=shape["vocab"], hidden=shape["hidden"],
                       intermediate=shape["intermediate"], layers=shape["layers"],
                       heads=shape["heads"], kv_heads=shape["kv_heads"], max_positions=seq,
                       tie_word_embeddings=True, rope_theta=500000.0,
                       experts=shape.get("experts", 0), top_k=shape.get("top_k", 2))


def memory_estimate_gib(case: dict) -> float:
    """A rough peak in GiB: 18 bytes a parameter (float32 weights, gradients and two Adam
    moments, a bf16 copy) plus the residuals the backward keeps, per token and layer
    2 x (24 h + 5 f_eff) bytes (f_eff: the MLP's width, times the experts: jphantom's
    single-device MoE runs every expert on every token); with ``nothing_saveable`` only each
    layer's input (2 h) plus two layers' working sets, with ``dots_saveable`` half; XLA
    attention adds its B H S^2 scores (~10 bytes each) per layer; the loss's logits chunk.
    The factor 2 fits gpu_step.py's 1.2B step (67.3 GiB peak on an H200)."""
    shape = SHAPES[case["shape"]]
    config = llama_config(shape, case["seq"])
    h, L = shape["hidden"], shape["layers"]
    f_eff = shape["intermediate"] * max(1, shape.get("experts", 0))
    tokens = case["seq"] * case["batch"]
    per_token_layer = 2.0 * (24 * h + 5 * f_eff)
    scores = (10 * case["batch"] * shape["heads"] * case["seq"] ** 2
              if case["attention"] == "xla" else 0)
    layer = tokens * per_token_layer + scores
    if case["remat"] == "nothing_saveable":
        acts = L * tokens * 2 * h + 2 * layer
    elif case["remat"] == "dots_saveable":
        acts = L * layer / 2 + layer
    else:
        acts = L * layer
    logits = min(tokens * shape["vocab"], 2**28) * 10  # the chunked loss's chunk
    return (18 * config.param_count() + acts + logits) / 2**30


# ------------------------------------------------------------------------------------------------
# Children (each in its own process)
# ------------------------------------------------------------------------------------------------


def run_case(case: dict, steps: int, warmup: int, out: Path) -> dict:
    """Build, compile, save the HLO, time ``steps`` steps after ``warmup``, meter NVML energy,
    and (``case["trace"]``) trace 2 steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jphantom
    from jphantom.runtime.mesh import MeshConfig
    from jphantom.costs.metrics import flops_per_token
    from jphantom.models.llama import Llama, lm_loss

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    shape = SHAPES[case["shape"]]
    config = llama_config(shape, case["seq"])
    rng = np.random.default_rng(0)
    rows = (case["batch"], case["seq"])
    tokens = jnp.asarray(rng.integers(0, shape["vocab"], rows), jnp.int32)
    targets = jnp.asarray(rng.integers(0, shape["vocab"], rows), jnp.int32)
    t0 = time.perf_counter()
    model = Llama(config, rngs=nnx.Rngs(0))
    mesh = MeshConfig.parse("model=1").build(jax.devices()[:1])
    options = dict(precision=case["precision"], attention=case["attention"])
    if case["remat"] != "none":
        options["remat"] = case["remat"]
    step = jphantom.make_train_step(model, mesh, optax.adamw(3e-4, b2=0.95, weight_decay=0.1),
                                    lm_loss, **options)
    state = step.init()
    del model
    batch = jax.device_put((tokens, targets), step.batch_shardings(2))
    compiled = step.lower(state, *batch).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    hlo_dir = out / "hlo"
    hlo_dir.mkdir(parents=True, exist_ok=True)
    hlo_path = hlo_dir / f"{case['name']}.hlo.txt.gz"
    with gzip.open(hlo_path, "wt") as f:
        f.write(hlo)
    memory = compiled.memory_analysis()
    compiled_peak = None
    if memory is not None:
        compiled_peak = sum(getattr(memory, k, 0) or 0 for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")) - (
            getattr(memory, "alias_size_in_bytes", 0) or 0)
    losses, times = [], []
    for _ in range(warmup):
        state, loss = compiled(state, *batch)
        losses.append(float(loss))
    meter, energy_error = None, None
    try:
        from jphantom.energy import NvmlEnergyMeter

        meter = NvmlEnergyMeter(devices=[device])
        jax.block_until_ready(state)
        meter.start()
    except Exception as error:  # noqa: BLE001 (CPU, no NVML: no measured energy)
        meter, energy_error = None, f"{type(error).__name__}: {str(error)[:300]}"
    for _ in range(steps):
        t = time.perf_counter()
        state, loss = compiled(state, *batch)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - t)
        losses.append(loss)
    measurement = meter.stop() if meter is not None else None
    step_s = statistics.median(times)
    tokens_per_step = case["batch"] * case["seq"]
    flops = flops_per_token(config, "dense", case["seq"]) * tokens_per_step
    result = {"case": case["name"], "device": getattr(device, "device_kind", device.platform),
              "platform": device.platform, "jax": jax.__version__,
              "params": config.param_count(), "tokens_per_step": tokens_per_step,
              "model_flops_per_step": flops, "compile_seconds": compile_s,
              "hlo_path": str(hlo_path), "hlo_bytes": len(hlo),
              "compiled_peak_bytes": compiled_peak,
              "compiled_temp_bytes": getattr(memory, "temp_size_in_bytes", None),
              "step_seconds": step_s, "step_seconds_all": times,
              "tokens_per_second": tokens_per_step / step_s, "losses": losses,
              "peak_memory_bytes": (device.memory_stats() or {}).get("peak_bytes_in_use")
              if on_gpu else None}
    if measurement is not None:
        result.update(joules=measurement.joules, energy_method=measurement.method,
                      joules_per_token=measurement.joules / (tokens_per_step * steps),
                      mean_watts=measurement.mean_watts)
    else:
        result["energy_skipped"] = energy_error
    if case.get("trace"):
        result["trace"] = _trace(step, compiled, state, batch, out / "trace", on_gpu)
    return result


def _trace(step, compiled, state, batch, trace_dir: Path, on_gpu: bool) -> dict:
    """2 steps under jax's profiler. On a GPU the traced program is the step compiled again with
    XLA's command buffers off: inside a CUDA graph the trace names a command buffer, not the HLO
    instructions the prediction names (the first validation run on an H200 traced only
    ``command_buffer_*``); the timed steps above kept them on."""
    import jax

    traced, note = compiled, "the timed program"
    if on_gpu:
        try:
            traced = step.lower(state, *batch).compile(
                compiler_options={"xla_gpu_enable_command_buffer": ""})
            note = "recompiled with xla_gpu_enable_command_buffer='' (no CUDA graphs)"
        except Exception as error:  # noqa: BLE001 (the option refused: trace the timed program)
            note = f"command buffers kept ({type(error).__name__}: {str(error)[:200]})"
    try:
        jax.block_until_ready(state)
        t = time.perf_counter()
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            for _ in range(2):
                state, loss = traced(state, *batch)
                float(loss)
        return {"dir": str(trace_dir), "steps": 2, "seconds": time.perf_counter() - t,
                "program": note}
    except Exception as error:  # noqa: BLE001 (no profiler: the rest stands)
        return {"error": f"{type(error).__name__}: {str(error)[:300]}", "program": note}


def run_peer(shape: dict, steps: int, warmup: int) -> dict:
    """transformers' LlamaForCausalLM at ``shape`` (module docstring); ``{"skipped": why}``
    without torch, transformers or CUDA. Halves the batch once on an out-of-memory error."""
    try:
        import torch
        import transformers
    except ImportError as error:
        return {"skipped": f"PyTorch peer needs torch and transformers: {error}"}
    if not torch.cuda.is_available():
        return {"skipped": f"torch {torch.__version__} sees no CUDA device"}
    from transformers import LlamaConfig, LlamaForCausalLM

    result = {"torch": torch.__version__, "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name(0), "attempts": []}
    batch = shape["batch"]
    while batch >= 1:
        try:
            result.update(_peer_attempt(torch, LlamaConfig, LlamaForCausalLM, shape, batch,
                                        steps, warmup))
            return result
        except torch.cuda.OutOfMemoryError as error:
            result["attempts"].append({"batch": batch,
                                       "error": f"out of memory: {str(error)[:300]}"})
            del error
            import gc

            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
            batch //= 2
    return result


def _peer_attempt(torch, LlamaConfig, LlamaForCausalLM, shape, batch, steps, warmup) -> dict:
    import gc
    import inspect

    seq, vocab = shape["seq"], shape["vocab"]
    fields = dict(vocab_size=vocab, hidden_size=shape["hidden"],
                  intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                  num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                  max_position_embeddings=seq, tie_word_embeddings=True)
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:  # transformers 5
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    else:
        fields["rope_theta"] = 500000.0
    config = LlamaConfig(**fields)
    try:
        config._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 (a read-only property: set on the model below)
        pass
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda()  # float32 weights, bf16 autocast compute
    if getattr(model.config, "_attn_implementation", None) != "sdpa" and hasattr(
            model, "set_attn_implementation"):
        model.set_attn_implementation("sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
    compiled = torch.compile(model)
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    try:
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        losses = [float(step().item())]  # the first step compiles
        compile_s = time.perf_counter() - t0
        for _ in range(max(0, warmup - 1)):
            losses.append(float(step().item()))
        from gpu_step import energy_counter  # this script's sibling: GPU 0's NVML counter

        energy = energy_counter()
        start_j = energy() if energy else None
        times = []
        torch.cuda.synchronize()
        for _ in range(steps):
            t = time.perf_counter()
            losses.append(float(step().item()))
            times.append(time.perf_counter() - t)
        joules = energy() - start_j if energy else None
        step_s = statistics.median(times)
        return {"batch": batch, "seq": seq, "tokens_per_step": batch * seq,
                "attn_implementation": getattr(model.config, "_attn_implementation", None),
                "compile_and_first_step_seconds": compile_s, "step_seconds": step_s,
                "step_seconds_all": times, "tokens_per_second": batch * seq / step_s,
                "losses": losses, "peak_memory_bytes": torch.cuda.max_memory_allocated(),
                "joules_per_token": None if joules is None else joules / (batch * seq * steps)}
    finally:
        del model, optimizer, compiled
        gc.collect()


# ------------------------------------------------------------------------------------------------
# The parent: predictions, the trace, the summary
# ------------------------------------------------------------------------------------------------


def predict_case(hlo_path: str, descriptions: dict, tokens: int, model_flops: float,
                 peak_memory: float | None, top: int) -> dict:
    """The prediction of one compiled step on each description (label -> path); in a worker
    process of the parent."""
    from jphantom.predict import load, predict

    with gzip.open(hlo_path, "rt") as f:
        text = f.read()
    out = {}
    for label, path in descriptions.items():
        t0 = time.perf_counter()
        try:
            p = predict(text, load(path), devices=1, tokens_per_step=tokens,
                        model_flops_per_step=model_flops, peak_memory_bytes=peak_memory,
                        top=top)
            row = p.as_dict()
            row["seconds_to_predict"] = time.perf_counter() - t0
        except Exception as error:  # noqa: BLE001 (a simulator bug: recorded, the rest goes on)
            import traceback

            row = {"error": f"{type(error).__name__}: {error}",
                   "traceback": traceback.format_exc()[-2000:]}
        out[label] = row
    return out


def parse_trace(trace_dir: Path, steps: int) -> dict:
    """Per-op device seconds a step from the profiler's perfetto trace: the ``XLA Ops`` line of
    the GPU's process (event names are HLO instruction names), else the kernels' ``hlo_op``
    argument, else the kernel names."""
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz")) or sorted(
        trace_dir.rglob("*.trace.json.gz"))
    if not files:
        return {"error": f"no trace file under {trace_dir}"}
    path = files[-1]
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = str(e.get("args", {}).get("name", ""))
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    gpu = {pid for pid, name in processes.items() if "GPU" in name or "gpu" in name}
    ops, kernels, by_hlo_op = {}, {}, {}
    busy = 0.0
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu:
            continue
        thread = threads.get((e["pid"], e.get("tid")), "")
        seconds = float(e.get("dur", 0.0)) * 1e-6
        name = str(e.get("name", ""))
        if thread == "XLA Ops":
            ops[name] = ops.get(name, 0.0) + seconds
        elif "stream" in thread.lower():
            kernels[name] = kernels.get(name, 0.0) + seconds
            busy += seconds
            hlo_op = (e.get("args") or {}).get("hlo_op")
            if hlo_op:
                by_hlo_op[hlo_op] = by_hlo_op.get(hlo_op, 0.0) + seconds
    source = "XLA Ops" if ops else ("kernel hlo_op" if by_hlo_op else "kernel names")
    per_op = ops or by_hlo_op or kernels
    per_step = {k: v / steps for k, v in per_op.items()}
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:20]
    return {"file": str(path), "bytes": path.stat().st_size, "steps": steps,
            "processes": sorted(processes.values()), "device_processes": len(gpu),
            "source": source, "per_step": per_step,
            "kernel_busy_seconds_per_step": busy / steps,
            "top": [{"op": k, "seconds": v} for k, v in top]}


def _op_key(name: str) -> str:
    """An HLO instruction's name as a trace may spell it: ``%fusion.3 = ...``, ``fusion.3`` and
    the kernel ``fusion_3`` are one key."""
    name = name.strip().lstrip("%").split(" ")[0].split("=")[0]
    return name.replace(".", "_").replace("-", "_")


def trace_comparison(trace: dict, predicted: dict) -> dict:
    """The predicted top-10 ops beside the trace's time for the same instruction, and the trace's
    top 10 beside the prediction's."""
    measured: dict = {}
    for name, seconds in trace.get("per_step", {}).items():
        measured[_op_key(name)] = measured.get(_op_key(name), 0.0) + seconds
    predicted_ops = {_op_key(row["op"]): row for row in predicted.get("top_ops", [])}
    rows = []
    for row in predicted.get("top_ops", [])[:10]:
        rows.append({"op": row["op"], "kind": row["kind"], "source": row["source"],
                     "predicted_s": row["seconds"], "count": row["count"],
                     "traced_s": measured.get(_op_key(row["op"]))})
    traced = []
    for row in trace.get("top", [])[:10]:
        match = predicted_ops.get(_op_key(row["op"]))
        traced.append({"op": row["op"], "traced_s": row["seconds"],
                       "predicted_s": match["seconds"] if match else None})
    matched = sum(r["traced_s"] is not None for r in rows)
    return {"predicted_top10": rows, "traced_top10": traced,
            "predicted_ops_found_in_trace": matched}


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties)."""
    if len(xs) < 2:
        return None

    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        r = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    sy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (sx * sy) if sx and sy else None


def summarise(cases: list[dict], label: str) -> dict:
    rows = [c for c in cases if "step_seconds" in c.get("measured", {})
            and "step_s" in c.get("predicted", {}).get(label, {})]
    if not rows:
        return {"cases": 0}
    errors = [(c["predicted"][label]["step_s"] - c["measured"]["step_seconds"])
              / c["measured"]["step_seconds"] for c in rows]
    worst = max(range(len(rows)), key=lambda i: abs(errors[i]))
    energy = [(c["predicted"][label]["joules_per_token"] - c["measured"]["joules_per_token"])
              / c["measured"]["joules_per_token"] for c in rows
              if c["measured"].get("joules_per_token") and
              c["predicted"][label].get("joules_per_token")]
    return {"cases": len(rows), "median_abs_error": statistics.median(abs(e) for e in errors),
            "mean_error": statistics.fmean(errors),
            "worst_abs_error": abs(errors[worst]), "worst_case": rows[worst]["name"],
            "spearman_step_seconds": spearman(
                [c["predicted"][label]["step_s"] for c in rows],
                [c["measured"]["step_seconds"] for c in rows]),
            "energy_cases": len(energy),
            "joules_per_token_median_abs_error": statistics.median(abs(e) for e in energy)
            if energy else None,
            "joules_per_token_mean_error": statistics.fmean(energy) if energy else None}


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label = results["primary"]
    rows = [c for c in results["cases"] if "step_seconds" in c.get("measured", {})
            and "step_s" in c.get("predicted", {}).get(label, {})]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    panels = [("step seconds", lambda c: c["measured"]["step_seconds"],
               lambda c, lab: c["predicted"][lab]["step_s"]),
              ("joules per token", lambda c: c["measured"].get("joules_per_token"),
               lambda c, lab: c["predicted"][lab].get("joules_per_token"))]
    for ax, (title, meas, pred) in zip(axes, panels):
        points = []
        for lab, marker in ((label, "o"), (results["secondary"], "x")):
            xs, ys = [], []
            for c in rows:
                m = meas(c)
                p = pred(c, lab) if lab in c["predicted"] and "step_s" in c["predicted"][lab] \
                    else None
                if m and p:
                    xs.append(m)
                    ys.append(p)
                    if lab == label:
                        ax.annotate(c["name"], (m, p), fontsize=6, alpha=0.7)
            if xs:
                ax.scatter(xs, ys, marker=marker, label=f"{lab} description")
                points += xs + ys
        if not points:
            ax.set_title(f"{title}: not measured here")
            continue
        low, high = min(points) / 1.5, max(points) * 1.5
        ax.plot([low, high], [low, high], "k--", lw=1, label="y = x")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.set_xlabel(f"measured {title}")
        ax.set_ylabel(f"predicted {title}")
        ax.legend(fontsize=7)
        s = results["summary"].get(label, {})
        if title == "step seconds" and s.get("cases"):
            ax.set_title(f"median |err| {s['median_abs_error']:.1%}, worst "
                         f"{s['worst_abs_error']:.1%}, Spearman {s['spearman_step_seconds'] or 0:.2f}",
                         fontsize=9)
    fig.suptitle(f"{results['device']} (jax {results['jax']}): jphantom.predict against measured "
                 "steps (benchmarks/gpu_predict.py)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _child(kind: str, payload: dict, args, env: dict, timeout: float, out: Path) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--payload", json.dumps(payload),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "seconds": timeout}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}", "stderr_tail": done.stderr[-3000:],
                "stdout_tail": done.stdout[-1000:], "seconds": time.perf_counter() - t0}
    result = json.loads(lines[-1][len("RESULT "):])
    result["child_seconds"] = time.perf_counter() - t0
    return result


def _calibrate(args, env: dict, out: Path, timeout: float) -> dict:
    """benchmarks/calibrate.py in a child; what it wrote is read even when it timed out (it
    rewrites its description after every stage)."""
    folder = out / "calibration"
    shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, str(ROOT / "benchmarks" / "calibrate.py"), "--out", str(folder),
               "--budget", f"{max(20.0, timeout - 70):.0f}"]  # its last stages take ~60 s
    command += ["--small"] if args.small else []
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=timeout)
        result = {"returncode": done.returncode, "stdout_tail": done.stdout[-4000:],
                  "stderr_tail": done.stderr[-2000:]}
        log_text = done.stdout + "\n" + done.stderr
    except subprocess.TimeoutExpired as error:
        result = {"error": f"timed out after {timeout:.0f} s"}
        log_text = "\n".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                             for x in (error.stdout, error.stderr))
    result["seconds"] = time.perf_counter() - t0
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "log.txt").write_text(log_text)
    report = folder / "calibrate.json"
    if report.is_file():
        data = json.loads(report.read_text())
        result.update(description_path=data.get("description_path"), base=data["base"],
                      base_path=data["base_path"], measured=data["measured"],
                      skipped=data["skipped"], complete=data.get("complete"),
                      device=data["device"], jax=data["jax"])
    return result


def _shipped_description(kind: str | None) -> str:
    """The shipped description for ``kind`` (jax's device_kind), else the fallbacks' first."""
    from jphantom.predict import device as device_module

    if kind:
        try:
            found = device_module.for_kind(kind)
            if found is not None:
                return found.name
        except Exception:  # noqa: BLE001 (no devices/ folder)
            pass
    for name in FALLBACK_DEVICES:
        try:
            device_module.load(name)
            return name
        except Exception:  # noqa: BLE001
            continue
    raise SystemExit(f"no device description: none of {FALLBACK_DEVICES} loads")


def _resolve(name_or_path: str) -> str:
    """A shipped name as is, a path made absolute (the worker processes load either)."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        return str(Path(name_or_path).resolve())
    return name_or_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_predict"))
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU-debuggable)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (5; --small 1)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for everything; what does not fit is skipped, saying so")
    parser.add_argument("--peer-reserve", type=float, default=150.0,
                        help="seconds kept for the PyTorch peer while the cases run")
    parser.add_argument("--cases", type=int, default=None, help="run only the first N cases")
    parser.add_argument("--only", nargs="*", default=None, help="case names to run")
    parser.add_argument("--skip", nargs="*", default=[], choices=["calibrate", "peer", "trace"])
    parser.add_argument("--device", help="a description (name or path) to predict with instead "
                                         "of calibrating")
    parser.add_argument("--repredict", metavar="DIR",
                        help="price a finished run's saved HLO again with this tree's simulator "
                             "(no GPU); rewrites DIR/gpu_predict.json and .png")
    parser.add_argument("--merge", nargs="*", default=[], metavar="DIR",
                        help="with --repredict: runs on the same card whose cases fill this "
                             "run's skipped ones, and whose trace replaces its trace")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--payload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.small else 5
    out = Path(args.out)
    if args.repredict:
        repredict(Path(args.repredict), [Path(m) for m in args.merge])
        return 0
    if args.child:  # a child (PYTHONPATH: this tree): one JSON line
        payload = json.loads(args.payload)
        if args.child == "case":
            result = run_case(payload, args.steps, args.warmup, out)
        else:
            result = run_peer(payload, args.steps, args.warmup)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    start = time.perf_counter()
    left = lambda: args.budget - (time.perf_counter() - start)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("hlo", "trace"):
        shutil.rmtree(out / stale, ignore_errors=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        from jphantom.runtime import gpu_defaults

        applied = gpu_defaults.apply(env)  # every jax child gets the same XLA flags
    except Exception as error:  # noqa: BLE001
        applied = [f"not applied: {type(error).__name__}: {error}"]
    # The parent never starts jax's backend: on a GPU it would take the memory the children need.
    cases = [dict(c) for c in (SMALL_CASES if args.small else CASES)]
    if args.only:
        cases = [c for c in cases if c["name"] in args.only]
    if args.cases is not None:
        cases = cases[:args.cases]
    elif args.small:
        cases = cases[:2]
    if "trace" in args.skip:
        for c in cases:
            c["trace"] = False
    try:
        import importlib.util

        has_torch = importlib.util.find_spec("torch") is not None
    except Exception:  # noqa: BLE001
        has_torch = False
    peer_reserve = args.peer_reserve if has_torch and "peer" not in args.skip else 0.0
    results = {"device": None, "platform": None, "jax": None, "small": args.small,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
               "steps": args.steps, "warmup": args.warmup, "budget": args.budget,
               "gpu_defaults": applied, "calibration": None, "descriptions": {},
               "primary": None, "secondary": None, "cases": [], "summary": {}, "trace": None,
               "peer": None, "skipped": []}
    save = lambda: (out / "gpu_predict.json").write_text(json.dumps(results, indent=2) + "\n")

    # (a) calibrate
    if args.device:
        calibrated = _resolve(args.device)
        results["calibration"] = {"skipped": f"--device {args.device}"}
    elif "calibrate" in args.skip:
        calibrated = None
        results["calibration"] = {"skipped": "--skip calibrate"}
    else:
        log("calibrating (benchmarks/calibrate.py)")
        results["calibration"] = _calibrate(args, env, out, timeout=min(max(left() - 60, 30),
                                                                          220))
        calibrated = results["calibration"].get("description_path")
        log(f"calibration: {results['calibration'].get('description_path') or results['calibration']}")
        for key in ("device", "jax"):
            results[key] = results["calibration"].get(key)
    shipped = _resolve(_shipped_description(results["device"]))
    descriptions = {"shipped": shipped}
    if calibrated:
        descriptions["calibrated"] = calibrated
    # --small predicts with the shipped description (the CPU's numbers test only the plumbing)
    results["primary"] = "shipped" if args.small or not calibrated else "calibrated"
    results["secondary"] = "calibrated" if results["primary"] == "shipped" else "shipped"
    results["descriptions"] = descriptions
    save()

    # (b) the validation set
    from jphantom.models.llama import LlamaConfig  # noqa: F401 (parent: no jax backend started)

    import multiprocessing

    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    futures = {}
    queue = list(cases)
    while queue:
        case = queue.pop(0)
        row = {"name": case["name"], "case": case,
               "memory_estimate_gib": memory_estimate_gib(case)}
        row["params"] = llama_config(SHAPES[case["shape"]], case["seq"]).param_count()
        if row["memory_estimate_gib"] > MEMORY_LIMIT_GIB and not args.small:
            row["skipped"] = (f"estimated {row['memory_estimate_gib']:.0f} GiB > "
                              f"{MEMORY_LIMIT_GIB:.0f} GiB")
            results["cases"].append(row)
            results["skipped"].append(case["name"])
            continue
        if left() - peer_reserve < 45:
            row["skipped"] = "budget"
            results["cases"].append(row)
            results["skipped"].append(case["name"])
            continue
        log(f"case {case['name']} (~{row['memory_estimate_gib']:.0f} GiB estimated)")
        measured = _child("case", case, args, env, min(left() - peer_reserve - 15, 180), out)
        row["measured"] = measured
        results["cases"].append(row)
        for key in ("device", "platform", "jax"):
            results[key] = results[key] or measured.get(key)
        if "step_seconds" in measured:
            top = 500 if case.get("trace") else 10
            futures[case["name"]] = pool.submit(
                predict_case, measured["hlo_path"], descriptions, measured["tokens_per_step"],
                measured["model_flops_per_step"], measured.get("compiled_peak_bytes"), top)
            log(f"  measured {measured['step_seconds'] * 1e3:.1f} ms a step "
                f"(compile {measured['compile_seconds']:.0f} s)")
        else:
            log(f"  failed: {measured.get('error')} {measured.get('stderr_tail', '')[-400:]}")
            tail = measured.get("stderr_tail", "")
            if case["batch"] > 1 and ("RESOURCE_EXHAUSTED" in tail or "out of memory" in
                                      tail.lower()):  # once more at half the batch
                retry = _case(case["shape"], case["seq"], case["batch"] // 2, case["precision"],
                              case["attention"], case["remat"], case.get("trace", False))
                retry["retry_of"] = case["name"]
                row["retried_as"] = retry["name"]
                queue.insert(0, retry)
        save()

    # (c) the peer, while the predictions finish
    peer_shape = SMALL_PEER_SHAPE if args.small else PEER_SHAPE
    if "peer" in args.skip:
        results["peer"] = {"skipped": "--skip peer"}
    elif not has_torch:
        results["peer"] = {"skipped": "torch is not installed here"}
    elif left() < 60:
        results["peer"] = {"skipped": "budget"}
    else:
        log("PyTorch peer (transformers LlamaForCausalLM, sdpa, torch.compile, fused AdamW)")
        results["peer"] = _child("peer", peer_shape, args, env, max(left() - 10, 30), out)
    save()

    for name, future in futures.items():
        row = next(r for r in results["cases"] if r["name"] == name)
        try:
            row["predicted"] = future.result(timeout=max(60.0, left() + 120))
        except Exception as error:  # noqa: BLE001
            row["predicted"] = {"error": f"{type(error).__name__}: {error}"}
    pool.shutdown(cancel_futures=True)
    _finish(results, out, peer_shape)
    save()
    _plot(results, out / "gpu_predict.png")
    _print(results)
    log(f"total {time.perf_counter() - start:.0f} s; wrote {out}/gpu_predict.json")
    return 0


def repredict(folder: Path, merge: list[Path]) -> dict:
    """A finished run in ``folder`` priced again from its saved HLO with this tree's simulator
    (the measurements are kept as they are). Each run in ``merge`` (the same card) fills this
    run's skipped or failed cases with the ones it measured (HLO copied in) and, where it traced
    a case measured here, gives that case its trace (the same case compiled again). Paths in the
    JSON become relative to ``folder``; ``repredicted`` records when and from what."""
    folder = folder.resolve()
    results = json.loads((folder / "gpu_predict.json").read_text())
    where = {str(Path(r["measured"]["hlo_path"]).parent.parent) for r in results["cases"]
             if "hlo_path" in r.get("measured", {})}  # the folder it was written to
    merged = []
    for other_dir in (m.resolve() for m in merge):
        other = json.loads((other_dir / "gpu_predict.json").read_text())
        if other["device"] != results["device"]:
            raise SystemExit(f"--merge {other_dir}: {other['device']}, not {results['device']}")
        merged.append(_merge(results, folder, other, other_dir))
    calibrated = sorted((folder / "calibration").glob("*-measured.toml"))
    results["descriptions"] = {"shipped": results["descriptions"]["shipped"],
                               **({"calibrated": str(calibrated[0])} if calibrated else {})}
    for row in results["cases"]:
        m = row.get("measured", {})
        if "step_seconds" not in m:
            continue
        m["hlo_path"] = str(folder / "hlo" / f"{row['name']}.hlo.txt.gz")
        log(f"pricing {row['name']}")
        row["predicted"] = predict_case(m["hlo_path"], results["descriptions"],
                                        m["tokens_per_step"], m["model_flops_per_step"],
                                        m.get("compiled_peak_bytes"),
                                        500 if "trace" in m else 10)
    results["summary"], results["trace"] = {}, None
    results["repredicted"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": "benchmarks/gpu_predict.py --repredict " + " --merge ".join(
            _shown(p) for p in [folder, *merge]), "merged": merged}
    _finish(results, folder, SMALL_PEER_SHAPE if results["small"] else PEER_SHAPE)
    text = json.dumps(results, indent=2)
    for prefix in sorted(where | {str(folder)}, key=len, reverse=True):
        text = text.replace(prefix + "/", "")
    (folder / "gpu_predict.json").write_text(text + "\n")
    _plot(results, folder / "gpu_predict.png")
    _print(results)
    return results


def _shown(path: Path) -> str:
    """``path`` relative to the checkout where it lies in it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _merge(results: dict, folder: Path, other: dict, other_dir: Path) -> dict:
    """``other``'s measured cases into ``results`` (:func:`repredict`); what it took."""
    took = {"from": other_dir.name, "date": other["date"], "cases": [], "trace": None}
    rows = {r["name"]: r for r in results["cases"]}
    for row in other["cases"]:
        m = row.get("measured", {})
        if "step_seconds" not in m:
            continue
        mine = rows.get(row["name"])
        if mine is None or "step_seconds" not in mine.get("measured", {}):
            (folder / "hlo").mkdir(exist_ok=True)
            shutil.copy(other_dir / "hlo" / f"{row['name']}.hlo.txt.gz", folder / "hlo")
            m["run"] = other_dir.name
            if mine is None:
                results["cases"].append(row)
            else:
                mine.clear()
                mine.update(row)
            results["skipped"] = [s for s in results["skipped"] if s != row["name"]]
        if rows.get(row["name"], row).get("measured", {}).get("run") == other_dir.name:
            took["cases"].append(row["name"])  # taken now or by an earlier --repredict
        if "dir" in m.get("trace", {}):
            shutil.rmtree(folder / "trace", ignore_errors=True)
            shutil.copytree(other_dir / "trace", folder / "trace")
            for r in results["cases"]:
                r.get("measured", {}).pop("trace", None)
                r["case"]["trace"] = False
            target = rows.get(row["name"], row)
            target["case"]["trace"] = True
            target["measured"]["trace"] = dict(m["trace"], dir=str(folder / "trace"),
                                               run=other_dir.name)
            took["trace"] = row["name"]
    return took


def _finish(results: dict, out: Path, peer_shape: dict) -> None:
    """Errors, MFUs, the summary, the trace comparison and the peer's ratio."""
    from jphantom.costs.metrics import flops_per_token
    from jphantom.predict import load

    descriptions = {k: load(v) for k, v in results["descriptions"].items()}
    for row in results["cases"]:
        m = row.get("measured", {})
        for label, p in (row.get("predicted") or {}).items():
            if "step_s" not in p or "step_seconds" not in m:
                continue
            peak = descriptions[label].peak_flops("bf16")
            p["error"] = (p["step_s"] - m["step_seconds"]) / m["step_seconds"]
            p["measured_mfu"] = m["model_flops_per_step"] / m["step_seconds"] / peak
            if m.get("joules_per_token") and p.get("joules_per_token"):
                p["joules_per_token_error"] = (p["joules_per_token"] - m["joules_per_token"]) \
                    / m["joules_per_token"]
            p["top_ops"] = p.get("top_ops", [])[:10] if not row["case"].get("trace") else \
                p.get("top_ops", [])
    for label in results["descriptions"]:
        results["summary"][label] = summarise(results["cases"], label)

    # the trace
    traced = next((r for r in results["cases"] if r["case"].get("trace")
                   and "trace" in r.get("measured", {})), None)
    if traced is not None and "dir" in traced["measured"]["trace"]:
        trace_dir = Path(traced["measured"]["trace"]["dir"])
        try:
            trace = parse_trace(trace_dir, traced["measured"]["trace"]["steps"])
        except Exception as error:  # noqa: BLE001
            trace = {"error": f"{type(error).__name__}: {error}"}
        predicted = (traced.get("predicted") or {}).get(results["primary"], {})
        comparison = trace_comparison(trace, predicted) if "per_step" in trace else {}
        trace.pop("per_step", None)
        _slim_trace(trace_dir, trace)
        results["trace"] = {"case": traced["name"], **trace, **comparison}
        for p in (traced.get("predicted") or {}).values():
            if "top_ops" in p:
                p["top_ops"] = p["top_ops"][:10]
    else:
        results["trace"] = {"skipped": "no traced case ran"}

    # the peer
    peer = results.get("peer") or {}
    same = [r for r in results["cases"] if r["case"]["shape"] in ("1.2b", "tiny")
            and r["case"]["seq"] == peer_shape["seq"] and r["case"]["precision"] == "bf16"
            and r["case"]["attention"] == "auto" and r["case"]["remat"] == "none"
            and "step_seconds" in r.get("measured", {})]  # the batch may have been halved
    same.sort(key=lambda r: r["case"]["batch"] != peer_shape["batch"])
    ours = same[0] if same else None
    if "step_seconds" in peer:
        shape = peer_shape
        config = llama_config(shape, shape["seq"])
        fpt = flops_per_token(config, "dense", shape["seq"])
        peak = descriptions[results["primary"]].peak_flops("bf16")
        peer["model_flops_per_token"] = fpt
        peer["mfu"] = fpt * peer["tokens_per_second"] / peak
        if ours is not None:
            m = ours["measured"]
            peer["jphantom_case"] = ours["name"]
            peer["jphantom_step_seconds"] = m["step_seconds"]
            peer["jphantom_tokens_per_second"] = m["tokens_per_second"]
            peer["jphantom_mfu"] = fpt * m["tokens_per_second"] / peak
            peer["ratio_jphantom_over_peer_step"] = (
                m["step_seconds"] / peer["step_seconds"]
                if peer["batch"] == ours["case"]["batch"] else None)
            peer["ratio_peer_over_jphantom_tokens_per_second"] = (
                peer["tokens_per_second"] / m["tokens_per_second"])
            peer["mfu_peak"] = f"{descriptions[results['primary']].name} bf16 " \
                               f"{peak / 1e12:g} TFLOP/s"


def _slim_trace(trace_dir: Path, trace: dict) -> None:
    """Keep the trace small: the perfetto JSON only where the xplane is large, and the duplicate
    ``*.trace.json.gz`` removed when the perfetto file exists."""
    removed = []
    for path in trace_dir.rglob("*"):
        if not path.is_file():
            continue
        if path.name.endswith(".trace.json.gz") and any(trace_dir.rglob("perfetto_trace.json.gz")):
            removed.append(path.name)
            path.unlink()
        elif path.name.endswith(".xplane.pb") and path.stat().st_size > 20 * 2**20:
            removed.append(f"{path.name} ({path.stat().st_size / 2**20:.0f} MiB)")
            path.unlink()
    trace["removed"] = removed
    trace["kept"] = [str(p) for p in trace_dir.rglob("*") if p.is_file()]


def _print(results: dict) -> None:
    label = results["primary"]
    print(f"\n{results['device']} (jax {results['jax']}); predictions on the {label} "
          f"description ({results['descriptions'].get(label)})")
    print(f"{'case':<36} {'meas ms':>9} {'pred ms':>9} {'err':>7} {'MFU m/p':>11} "
          f"{'J/tok m/p':>15} {'GiB est/peak':>13}")
    for row in results["cases"]:
        m = row.get("measured", {})
        if "step_seconds" not in m:
            why = row.get("skipped") or m.get("error")
            print(f"{row['name']:<36} skipped/failed: {why}")
            continue
        p = (row.get("predicted") or {}).get(label, {})
        if "step_s" not in p:
            print(f"{row['name']:<36} {m['step_seconds'] * 1e3:>9.1f} prediction failed: "
                  f"{p.get('error') or row.get('predicted')}")
            continue
        jm = m.get("joules_per_token")
        energy = f"{jm:.4f}/{p['joules_per_token']:.4f}" if jm else \
            f"-/{p['joules_per_token']:.4f}"
        peak = m.get("peak_memory_bytes")
        print(f"{row['name']:<36} {m['step_seconds'] * 1e3:>9.1f} {p['step_s'] * 1e3:>9.1f} "
              f"{p['error']:>+7.1%} {p['measured_mfu']:>5.1%}/{p['mfu'] or 0:<5.1%} "
              f"{energy:>15} {row['memory_estimate_gib']:>6.1f}/"
              f"{'-' if peak is None else f'{peak / 2**30:.1f}'}")
    for lab, s in results["summary"].items():
        if s.get("cases"):
            print(f"summary ({lab}): {s['cases']} cases, median |error| "
                  f"{s['median_abs_error']:.1%}, worst {s['worst_abs_error']:.1%} "
                  f"({s['worst_case']}), Spearman {s['spearman_step_seconds']}, J/token median "
                  f"|error| {s['joules_per_token_median_abs_error']}")
    trace = results.get("trace") or {}
    if trace.get("predicted_top10"):
        print(f"trace ({trace.get('source')}, {trace.get('file')}): predicted top ops found in "
              f"it: {trace['predicted_ops_found_in_trace']}/10")
        for r in trace["predicted_top10"]:
            traced = "-" if r["traced_s"] is None else f"{r['traced_s'] * 1e3:.2f}"
            print(f"  {r['predicted_s'] * 1e3:8.2f} ms predicted, {traced:>8} ms traced  "
                  f"{r['kind']:<14} {r['op'][:40]}")
    else:
        print(f"trace: {trace}")
    peer = results.get("peer") or {}
    if "step_seconds" in peer:
        print(f"peer: torch {peer['torch']} {peer['step_seconds'] * 1e3:.1f} ms a step (batch "
              f"{peer['batch']}), MFU {peer['mfu']:.1%}; jphantom "
              f"{(peer.get('jphantom_step_seconds') or 0) * 1e3:.1f} ms, MFU "
              f"{peer.get('jphantom_mfu') or 0:.1%}; jphantom/peer step "
              f"{peer.get('ratio_jphantom_over_peer_step')}")
    else:
        print(f"peer: {peer.get('skipped') or peer.get('error') or peer}")
    print(f"skipped: {results['skipped'] or 'none'}")


if __name__ == "__main__":
    sys.exit(main())
