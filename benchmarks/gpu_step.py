"""One NVIDIA GPU: jphantom's training step against a plain-JAX step of the same model, in bf16 and
in FP8, and ``jphantom train``'s per-step metrics (the step's device check).

The model is a Llama of about 1.2B parameters (Llama-3.2-1B's shape: 16 layers, hidden 2048, 32
query and 8 key/value heads of 64, SwiGLU 8192, vocabulary 128256, tied embeddings) at S = 4096,
batch 4 (16,384 tokens a step), float32 master weights and AdamW state, bf16 compute. Variants,
each in its own process (so that each has its own peak memory and compile):

``gemm``            the bf16 and FP8 matrix rates the card reaches on an 8192^3 product (jax)
``jphantom-bf16``   ``jphantom.make_train_step`` of :class:`jphantom.models.llama.Llama` on a
                    one-device mesh, ``precision="bf16"``, ``attention="auto"`` (cuDNN flash
                    attention), the chunked fused cross-entropy
``jphantom-fp8``    the same, ``precision="fp8"`` (:mod:`jphantom.step.fp8`)
``reference-bf16``  the same model written here in plain JAX as a user would (``lax.scan`` over
                    the layers, ``jax.nn.dot_product_attention(implementation="cudnn")``, logits
                    [B, S, V] in bf16 and optax's cross-entropy in float32, ``optax.adamw``, one
                    ``jax.jit`` with the state donated)
``jphantom-bf16-unchunked``, ``jphantom-bf16-c26``: bf16 with the loss in one chunk (every
                    logit held, as the reference) or in chunks of 2^26 logits (32 here): what the
                    chunking costs
``jphantom-bf16-acc4``: bf16 accumulating 4 micro-batches of the shape's batch in one step
                    (``accumulate=4``, 4x the tokens): its step against 4 single steps and its
                    peak memory against one (the accumulation device check)
``flash-blocks``    ring attention's blocks on jax's Pallas Triton kernels (jphantom.nn.flash),
                    compiled, against the float32 einsum blocks (forward and backward)
``train``           ``python -m jphantom train`` on a small Llama for a few steps: its
                    ``metrics.jsonl`` must record ``energy_source: "nvml"``, an MFU and a peak
                    memory

Per variant: median step seconds over ``--steps`` timed steps after ``--warmup``, tokens/s, model
TFLOP/s and MFU (:func:`jphantom.costs.metrics.flops_per_token`: 6 x matmul weights per token plus
causal attention 6 L S H d, i.e. the attention's FLOPs halved for the causal mask) against the
datasheet's dense bf16 peak and against the measured bf16 GEMM rate, the device's peak memory
(``memory_stats()``), and NVML's energy counter over the timed steps (joules per token). The
ratio jphantom / reference of step times is the number that matters (goal <= 1.05).

``--shape slice8b``: a 4-layer slice of Llama-3-8B's width (hidden 4096, 32 / 8 heads, SwiGLU
14336, vocabulary 128256, untied) at S = 8192, batch 1, instead of the 1.2B model: the
FP8 and accumulation device check, with the ratios fp8 / bf16 and acc4 / (4 x bf16) of step
times and acc4 / bf16 of peak memory in the summary.

Usage (the device machine has jax, flax and optax; nothing to install)::

    PYTHONPATH=. python benchmarks/gpu_step.py --out DIR      # on one GPU, about 5 minutes
    python benchmarks/gpu_step.py --small --out /tmp/g        # tiny shapes, runs on CPU too
    PYTHONPATH=. python benchmarks/gpu_step.py --shape slice8b --out DIR \
        --skip reference-bf16 jphantom-bf16-unchunked jphantom-bf16-c26 flash-blocks train

Writes ``DIR/gpu_step.json``, ``DIR/gpu_step.png`` and the train check's ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL = dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256,
            seq_len=4096, batch=4)
SMALL = dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512,
             seq_len=128, batch=2)
SLICE_8B = dict(layers=4, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                seq_len=8192, batch=1, tied=False)
SHAPES = {"gpu_step": FULL, "slice8b": SLICE_8B}
ACCUMULATE = 4  # the accumulating variant's micro-batches, named in it
ACCUMULATING = f"jphantom-bf16-acc{ACCUMULATE}"
VARIANTS = ("jphantom-bf16", "reference-bf16", "jphantom-fp8", "jphantom-bf16-unchunked",
            "jphantom-bf16-c26", ACCUMULATING)
# the loss's chunk limit of the variants that change it (jphantom.nn.vocab)
CHUNK_LIMITS = {"unchunked": 2**62, "c26": 2**26}


# ------------------------------------------------------------------------------------------------
# The plain-JAX reference: the same Llama, written as a JAX user would
# ------------------------------------------------------------------------------------------------


def reference_init(shape: dict, key):
    import jax
    import jax.numpy as jnp

    h, f, v, L = shape["hidden"], shape["intermediate"], shape["vocab"], shape["layers"]
    d = h // shape["heads"]
    q, kv = shape["heads"] * d, shape["kv_heads"] * d
    sizes = {"wq": (L, h, q), "wk": (L, h, kv), "wv": (L, h, kv), "wo": (L, q, h),
             "w_gate": (L, h, f), "w_up": (L, h, f), "w_down": (L, f, h)}
    keys = jax.random.split(key, len(sizes) + 1)
    layers = {name: 0.02 * jax.random.normal(k, s, jnp.float32)
              for (name, s), k in zip(sizes.items(), keys[1:])}
    layers |= {"ln1": jnp.ones((L, h)), "ln2": jnp.ones((L, h))}
    return {"embed": 0.02 * jax.random.normal(keys[0], (v, h), jnp.float32), "layers": layers,
            "norm": jnp.ones((h,))}


def reference_loss(params, tokens, targets, shape: dict, implementation):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    heads, kv_heads = shape["heads"], shape["kv_heads"]
    d = shape["hidden"] // heads
    seq = tokens.shape[1]
    inv = 1.0 / (500000.0 ** (np.arange(0, d, 2) / d))
    angles = np.arange(seq)[:, None] * inv[None]
    cos = jnp.asarray(np.cos(np.concatenate([angles, angles], -1)), jnp.float32)[None, :, None]
    sin = jnp.asarray(np.sin(np.concatenate([angles, angles], -1)), jnp.float32)[None, :, None]

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)
                ).astype(x.dtype) * w

    def rope(x):
        half = x.shape[-1] // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
        return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)

    def block(x, w):
        b = x.shape[0]
        y = rms(x, w["ln1"])
        q = rope((y @ w["wq"]).reshape(b, seq, heads, d))
        k = rope((y @ w["wk"]).reshape(b, seq, kv_heads, d))
        v = (y @ w["wv"]).reshape(b, seq, kv_heads, d)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
        x = x + a.reshape(b, seq, -1) @ w["wo"]
        y = rms(x, w["ln2"])
        return x + (jax.nn.silu(y @ w["w_gate"]) * (y @ w["w_up"])) @ w["w_down"], None

    x = p["embed"][tokens]
    x, _ = jax.lax.scan(block, x, p["layers"])
    logits = rms(x, p["norm"]) @ p["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                           targets).mean()


# ------------------------------------------------------------------------------------------------
# One variant, in its own process
# ------------------------------------------------------------------------------------------------


def energy_counter():
    """``read() -> joules`` of GPU 0's NVML energy counter, or None where there is none."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3
    except Exception:  # noqa: BLE001 (no NVML, no GPU, no counter)
        return None


def _kernels(hlo_text: str) -> dict:
    try:
        from jphantom.analysis.hlo import kernels

        return kernels(hlo_text)
    except Exception:  # noqa: BLE001 (an older tree without the kernel counter)
        return {"cudnn_fmha": hlo_text.count("__cudnn$fmha"),
                "f8_mentions": hlo_text.count("f8e4m3fn")}


def gemm_rates(small: bool) -> dict:
    """bf16 and FP8 (E4M3 x E4M3 -> bf16) matrix products of n^3 on the device: TFLOP/s, and the
    kernels XLA chose. ``fp8`` is compiled as an FP8 run's GEMMs are (on NVIDIA GPUs
    ``gpu_defaults.fp8_gemm_options``: cuBLAS-LT's FP8 call, B stored [N, K] as that call takes
    it); ``fp8_bf16_flags`` is the same product under this process's bf16 flags (Triton GEMMs
    on: what this variant measured before it compiled FP8 as the runs do)."""
    import jax
    import jax.numpy as jnp

    from jphantom.runtime import gpu_defaults

    n = 1024 if small else 8192
    device = jax.devices()[0]
    out = {"n": n, "device": getattr(device, "device_kind", device.platform),
           "platform": device.platform, "jax": jax.__version__}
    nn = lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.bfloat16)
    tn = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                          preferred_element_type=jnp.bfloat16)
    fp8 = gpu_defaults.fp8_gemm_options(device)
    for name, dtype, product, options in (("bf16", jnp.bfloat16, nn, {}),
                                          ("fp8", jnp.float8_e4m3fn, tn, fp8),
                                          ("fp8_bf16_flags", jnp.float8_e4m3fn, nn, {})):
        a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(dtype)
        try:
            f = jax.jit(product).lower(a, b).compile(compiler_options=options or None)
            out[f"{name}_gemms"] = _kernels(f.as_text()).get("gemms", {}).get("by_kind")
            f(a, b).block_until_ready()
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                f(a, b).block_until_ready()
                times.append(time.perf_counter() - t0)
            times.sort()
            out[f"{name}_tflops"] = 2 * n ** 3 / times[len(times) // 2] / 1e12
        except Exception as error:  # noqa: BLE001 (no FP8 GEMM on this platform)
            out[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    out["fp8_compiler_options"] = fp8
    return out


def flash_blocks(small: bool) -> dict:
    """Ring attention's blocks on the Pallas Triton kernels (jphantom.nn.flash, compiled) against
    the einsum blocks in float32: forward (causal and not, unequal lengths) and the backward
    given the final statistics; max |error| / max |reference| per output."""
    import math

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jphantom.nn import attention, flash

    sq, d = (64, 64) if small else (2048, 128)
    rng = np.random.default_rng(0)
    interpret = jax.devices()[0].platform != "gpu"  # elsewhere through Pallas' interpreter
    out = {"sq": sq, "head_dim": d, "interpreted": interpret}
    for causal, sk in ((True, sq), (False, sq // 2)):
        q = jnp.asarray(rng.normal(size=(1, sq, 4, 2, d)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.normal(size=(1, sk, 4, d)), jnp.bfloat16) for _ in range(2))
        do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
        scale = 1 / math.sqrt(d)
        mask = jnp.tril(jnp.ones((sq, sk), bool)) if causal else None
        f32 = lambda a: a.astype(jnp.float32)
        want_o, want_lse = jax.jit(attention.block, static_argnums=4)(
            f32(q), f32(k), f32(v), mask, scale)
        o, lse = jax.jit(lambda q, k, v: flash.block(q, k, v, causal=causal, scale=scale,
                                                       interpret=interpret))(q, k, v)
        delta = jnp.sum(do * want_o, -1)
        want = jax.jit(attention.block_grads, static_argnums=7)(
            f32(q), f32(k), f32(v), do, want_lse, delta, mask, scale)
        got = jax.jit(lambda q, k, v, o, l, do: flash.block_grads(
            q, k, v, o, l, do, causal=causal, scale=scale, interpret=interpret))(
                q, k, v, want_o, want_lse, do)
        rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        out[f"{'causal' if causal else 'full'}_{sq}x{sk}"] = {
            "out": rel(o, want_o), "lse_abs": float(jnp.max(jnp.abs(lse - want_lse))),
            "dq": rel(got[0], want[0]), "dk": rel(got[1], want[1]), "dv": rel(got[2], want[2])}
    return out


def run_variant(name: str, shape: dict, steps: int, warmup: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jphantom.costs.metrics import flops_per_token, peak_tflops
    from jphantom.models.llama import LlamaConfig

    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    config = LlamaConfig(vocab_size=shape["vocab"], hidden=shape["hidden"],
                         intermediate=shape["intermediate"], layers=shape["layers"],
                         heads=shape["heads"], kv_heads=shape["kv_heads"],
                         max_positions=shape["seq_len"],
                         tie_word_embeddings=shape.get("tied", True), rope_theta=500000.0)
    rng = np.random.default_rng(0)
    accumulate = ACCUMULATE if name == ACCUMULATING else 1
    rows = (shape["batch"] * accumulate, shape["seq_len"])
    tokens = jnp.asarray(rng.integers(0, shape["vocab"], rows), jnp.int32)
    targets = jnp.asarray(rng.integers(0, shape["vocab"], rows), jnp.int32)
    optimizer = optax.adamw(3e-4, b2=0.95, weight_decay=0.1)
    t0 = time.perf_counter()
    if name.startswith("jphantom"):
        from flax import nnx

        from jphantom.nn import vocab

        limit = CHUNK_LIMITS.get(name.split("-")[-1])
        if limit is not None:
            vocab.LOGITS_CHUNK_ELEMENTS = limit

        import jphantom
        from jphantom.runtime.mesh import MeshConfig
        from jphantom.models.llama import Llama, lm_loss

        model = Llama(config, rngs=nnx.Rngs(0))
        mesh = MeshConfig.parse("model=1").build(jax.devices()[:1])
        step = jphantom.make_train_step(model, mesh, optimizer, lm_loss,
                                        precision=name.split("-")[1], attention="auto",
                                        accumulate=accumulate)
        state = step.init()
        del model
        batch = jax.device_put((tokens, targets), step.batch_shardings(2))
        compiled = step.lower(state, *batch).compile()
        run = lambda state: compiled(state, *batch)
    else:
        implementation = "cudnn" if on_gpu else None
        params = reference_init(shape, jax.random.PRNGKey(0))
        state = (params, optimizer.init(params))

        def train_step(state, tokens, targets):
            params, opt_state = state
            loss, grads = jax.value_and_grad(reference_loss)(params, tokens, targets, shape,
                                                             implementation)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        compiled = jax.jit(train_step, donate_argnums=0).lower(state, tokens, targets).compile()
        run = lambda state: compiled(state, tokens, targets)
    compile_seconds = time.perf_counter() - t0
    hlo = compiled.as_text()
    memory = compiled.memory_analysis()
    losses, times = [], []
    for _ in range(warmup):
        state, loss = run(state)
        losses.append(float(loss))
    energy = energy_counter() if on_gpu else None
    start_j = energy() if energy else None
    for _ in range(steps):
        t = time.perf_counter()
        state, loss = run(state)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - t)
        losses.append(loss)
    joules = energy() - start_j if energy else None
    step_s = sorted(times)[len(times) // 2]
    tokens_per_step = rows[0] * shape["seq_len"]
    flops = flops_per_token(config, "dense", shape["seq_len"]) * tokens_per_step
    peak = peak_tflops(device)
    stats = device.memory_stats() if on_gpu else None
    from jphantom.nn import vocab

    return {"variant": name, "accumulate": accumulate,
            "device": getattr(device, "device_kind", device.platform),
            "platform": device.platform, "jax": jax.__version__,
            "loss_chunks": vocab.token_chunks(tokens_per_step, shape["vocab"])
            if name.startswith("jphantom") else 1, "compile_seconds": compile_seconds,
            "step_seconds": step_s, "step_seconds_all": times,
            "tokens_per_second": tokens_per_step / step_s,
            "model_tflops": flops / step_s / 1e12, "model_flops_per_step": flops,
            "mfu_datasheet": None if peak is None else flops / step_s / 1e12 / peak,
            "datasheet_bf16_tflops": peak,
            "peak_memory_bytes": None if not stats else stats.get("peak_bytes_in_use"),
            "compiled_temp_bytes": getattr(memory, "temp_size_in_bytes", None),
            "joules": joules, "joules_per_token": None if joules is None
            else joules / (tokens_per_step * steps),
            "losses": losses, "kernels": _kernels(hlo)}


# ------------------------------------------------------------------------------------------------
# The train check
# ------------------------------------------------------------------------------------------------


def train_check(out: Path, small: bool, env: dict) -> dict:
    folder = out / "train"
    shape = (["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32", "--batch",
              "4"] if small else
             ["--layers", "4", "--hidden", "1024", "--heads", "8", "--seq-len", "1024",
              "--batch", "16"])
    command = [sys.executable, "-m", "jphantom", "train", "--model", "llama", *shape,
               "--steps", "6", "--warmup-steps", "0", "--precision", "bf16", "--eval-every", "6",
               "--eval-batches", "1", "--out", str(folder), "--no-progress"]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    result = {"command": " ".join(command[1:]), "returncode": done.returncode,
              "seconds": time.perf_counter() - t0, "stdout_tail": done.stdout[-1500:],
              "stderr_tail": done.stderr[-1500:]}
    metrics = folder / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps = [r for r in rows if "train_loss" in r]
        last = steps[-1] if steps else {}
        result["last_step"] = last
        result["checks"] = {
            "energy_source_nvml": last.get("energy_source") == "nvml",
            "mfu_not_null": last.get("mfu") is not None,
            "peak_memory_not_null": last.get("peak_memory_bytes") is not None}
        (out / "train_metrics.jsonl").write_text(metrics.read_text())
    return result


# ------------------------------------------------------------------------------------------------
# The orchestration
# ------------------------------------------------------------------------------------------------


def _child(variant: str, args, env: dict, timeout: float) -> dict:
    command = [sys.executable, __file__, "--variant", variant, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--shape", args.shape] + (
                   ["--small"] if args.small else [])
    t0 = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        return {"variant": variant, "error": f"exit {done.returncode}",
                "stderr_tail": done.stderr[-3000:], "seconds": time.perf_counter() - t0}
    return json.loads(lines[-1][len("RESULT "):])


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["variants"] if "step_seconds" in r]
    if not rows:
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    names = [r["variant"] for r in rows]
    axes[0].barh(names, [r["tokens_per_second"] / 1e3 for r in rows])
    axes[0].set_xlabel("thousand tokens / s")
    axes[1].barh(names, [100 * (r["mfu_datasheet"] or 0) for r in rows])
    axes[1].set_xlabel("MFU % (datasheet dense bf16 peak)")
    axes[2].barh(names, [(r["peak_memory_bytes"] or 0) / 2**30 for r in rows])
    axes[2].set_xlabel("peak memory GiB")
    for ax in axes[1:]:
        ax.set_yticks([])
    fig.suptitle(f"{results['device']}: Llama {results['params'] / 1e9:.2f}B, "
                 f"S={results['shape']['seq_len']}, batch {results['shape']['batch']} "
                 "(benchmarks/gpu_step.py)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_step"))
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU-debuggable)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpu_step",
                        help="the model: gpu_step's 1.2B Llama or a 4-layer Llama-3-8B slice")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds for everything; what does not fit is skipped, saying so")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--skip", nargs="*", default=[], help="variants to leave out")
    args = parser.parse_args(argv)
    shape = SMALL if args.small else SHAPES[args.shape]
    if args.variant:  # a child (PYTHONPATH: this tree): one variant, one JSON line
        if args.variant == "gemm":
            result = gemm_rates(args.small)
        elif args.variant == "flash-blocks":
            result = flash_blocks(args.small)
        else:
            result = run_variant(args.variant, shape, args.steps, args.warmup)
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    applied = []
    try:
        from jphantom.runtime import gpu_defaults

        applied = gpu_defaults.apply(env)  # every variant gets the same XLA flags
    except Exception as error:  # noqa: BLE001 (an older tree: run as the environment is)
        applied = [f"not applied: {type(error).__name__}: {error}"]
    # The parent never starts jax's backend: on a GPU it would take the memory the children need.
    from jphantom.models.llama import LlamaConfig

    results = {"device": None, "platform": None, "jax": None, "shape": shape,
               "params": LlamaConfig(vocab_size=shape["vocab"], hidden=shape["hidden"],
                                     intermediate=shape["intermediate"],
                                     layers=shape["layers"], heads=shape["heads"],
                                     kv_heads=shape["kv_heads"],
                                     tie_word_embeddings=shape.get("tied", True)
                                     ).param_count(), "shape_name": args.shape,
               "steps": args.steps, "warmup": args.warmup, "gpu_defaults": applied,
               "variants": [], "skipped": []}
    save = lambda: (out / "gpu_step.json").write_text(json.dumps(results, indent=2) + "\n")
    for variant in ("gemm", *VARIANTS, "flash-blocks"):
        left = args.budget - (time.perf_counter() - start)
        if variant in args.skip or left < 45:
            results["skipped"].append(variant)
            continue
        row = _child(variant, args, env, timeout=min(left - 30, 200))
        print(json.dumps({k: v for k, v in row.items()
                          if k not in ("step_seconds_all", "kernels", "losses")}), flush=True)
        if variant in ("gemm", "flash-blocks"):
            results[variant] = row
        else:
            results["variants"].append(row)
        for key in ("device", "platform", "jax"):
            results[key] = results[key] or row.get(key)
        save()
    left = args.budget - (time.perf_counter() - start)
    if "train" not in args.skip and left > 40:
        results["train"] = train_check(out, args.small, env)
    else:
        results["skipped"].append("train")
    by_name = {r["variant"]: r for r in results["variants"] if "step_seconds" in r}
    measured = results.get("gemm", {}).get("bf16_tflops")
    for row in by_name.values():
        row["mfu_measured_gemm"] = None if not measured else row["model_tflops"] / measured
    for precision in ("bf16", "fp8"):
        ours, ref = by_name.get(f"jphantom-{precision}"), by_name.get("reference-bf16")
        if ours and ref:
            results[f"ratio_jphantom_{precision}_over_reference_bf16"] = (
                ours["step_seconds"] / ref["step_seconds"])
    bf16, fp8, acc = (by_name.get(v) for v in ("jphantom-bf16", "jphantom-fp8", ACCUMULATING))
    if bf16 and fp8:
        results["ratio_jphantom_fp8_over_jphantom_bf16"] = (fp8["step_seconds"]
                                                            / bf16["step_seconds"])
    if bf16 and acc:
        results[f"ratio_jphantom_bf16_acc4_over_{ACCUMULATE}x_jphantom_bf16"] = (
            acc["step_seconds"] / (ACCUMULATE * bf16["step_seconds"]))
        if bf16["peak_memory_bytes"] and acc["peak_memory_bytes"]:
            results["ratio_peak_memory_acc4_over_bf16"] = (acc["peak_memory_bytes"]
                                                          / bf16["peak_memory_bytes"])
        results["ratio_compiled_temp_acc4_over_bf16"] = (acc["compiled_temp_bytes"]
                                                         / bf16["compiled_temp_bytes"])
    save()
    _plot(results, out / "gpu_step.png")
    print(f"\n{results['device']} (jax {results['jax']}), Llama {results['params'] / 1e9:.2f}B, "
          f"S={shape['seq_len']}, batch {shape['batch']}; gemm: {results.get('gemm')}")
    print(f"{'variant':<24} {'step s':>8} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'MFU/gemm':>8} "
          f"{'peak GiB':>9} {'J/token':>8} {'loss first->last':>18}")
    for row in results["variants"]:
        if "step_seconds" not in row:
            print(f"{row['variant']:<24} failed: {row.get('error')} "
                  f"{row.get('stderr_tail', '')[-600:]}")
            continue
        pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
        gib = "-" if row["peak_memory_bytes"] is None else f"{row['peak_memory_bytes'] / 2**30:.1f}"
        jpt = "-" if row["joules_per_token"] is None else f"{row['joules_per_token']:.4f}"
        print(f"{row['variant']:<24} {row['step_seconds']:>8.4f} {row['tokens_per_second']:>9.0f} "
              f"{row['model_tflops']:>8.1f} {pct(row['mfu_datasheet']):>6} "
              f"{pct(row['mfu_measured_gemm']):>8} {gib:>9} {jpt:>8} "
              f"{row['losses'][0]:>8.4f}->{row['losses'][-1]:.4f}")
    for key in sorted(k for k in results if k.startswith("ratio_")):
        print(f"{key}: {results[key]:.3f}")
    if "flash-blocks" in results:
        print(f"flash blocks (Pallas Triton, bf16) vs einsum float32: {results['flash-blocks']}")
    if "train" in results:
        t = results["train"]
        print(f"train check: exit {t['returncode']}, {t.get('checks')}")
    print(f"skipped: {results['skipped'] or 'none'}; total {time.perf_counter() - start:.0f} s; "
          f"wrote {out}/gpu_step.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
