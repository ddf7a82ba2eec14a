"""Which kernel runs the unsplit attention core: cuDNN's flash attention
(``jax.nn.dot_product_attention(implementation="cudnn")``, Dao et al.'s flash attention) where it
can run these inputs on this platform, else XLA's path, and why (:func:`choose`)."""

from __future__ import annotations

import os

import jax.numpy as jnp

from jphantom.registry.attention_choices import IMPLEMENTATIONS
from jphantom.errors import ConfigError

FUSED_DTYPES = ("bfloat16", "float16")


def platform_of(device) -> str:
    """``nvidia``, ``rocm``, ``cpu`` or ``tpu``: the platform of ``device`` (a device of the
    step's mesh: also the target devices of an ahead-of-time compile, which the process's default
    backend is not)."""
    platform = str(getattr(device, "platform", "cpu")).lower()
    kind = str(getattr(device, "device_kind", "")).lower()
    if platform in ("gpu", "cuda", "rocm"):
        # an ahead-of-time ROCm target's devices say platform "gpu", kind "MI300X" / "MI250"
        if platform == "rocm" or "amd" in kind or "instinct" in kind or kind.startswith("mi"):
            return "rocm"
        return "nvidia"
    return platform


# XLA flags under which XLA's cuDNN flash attention fails at run time: on an H200 with jax 0.11.2
# the step's first call raises ``IndexError: absl::container_internal::raw_hash_map<>::at``
# (benchmarks/results/gpu_resilience/deterministic_ops.json); XLA's attention path trains.
DETERMINISTIC_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_deterministic_ops",
                       "--xla_gpu_exclude_nondeterministic_ops=true")


def fused_problem(platform: str, dtype, head_dim: int) -> str | None:
    """Why cuDNN's flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``)
    cannot run these inputs, or ``None``: it runs on NVIDIA GPUs, in bfloat16 or float16, with a
    head dimension that is a multiple of 8 and at most 128, and not under XLA's deterministic-ops
    flags (:data:`DETERMINISTIC_FLAGS`: XLA's cuDNN attention fails at run time under them)."""
    if platform == "rocm":
        return ("on ROCm jax offers no fused attention: jax.nn.dot_product_attention's "
                "implementation='cudnn' answers 'cuDNN is not detected' (compiled for MI250X "
                "and MI300X, jax 0.12.0)")
    if platform != "nvidia":
        return f"the {platform} platform has no cuDNN (it is NVIDIA's)"
    asked = set(os.environ.get("XLA_FLAGS", "").split()) & set(DETERMINISTIC_FLAGS)
    if asked:
        return (f"XLA_FLAGS has {sorted(asked)[0]}, under which XLA's cuDNN flash attention "
                "fails at run time (jax 0.11.2 on an H200)")
    name = jnp.dtype(dtype).name
    if name not in FUSED_DTYPES:
        return (f"{name} compute: cuDNN's flash attention takes bfloat16 or float16 "
                "(--precision bf16)")
    if head_dim % 8 or head_dim > 128:
        return (f"head dimension {head_dim}: cuDNN's flash attention needs a multiple of 8, "
                "at most 128")
    return None


def choose(implementation: str, platform: str, dtype, head_dim: int, *, packed: bool = False,
           window: int | None = None) -> tuple[str, str]:
    """The kernel (``xla`` or ``cudnn``; ``pallas`` for packed batches) that runs attention for
    ``implementation`` (``auto``, ``xla``, ``cudnn``) and why. ``auto`` takes cuDNN wherever
    :func:`fused_problem` finds none, else XLA's path, and says why; ``cudnn`` where cuDNN cannot
    run is a :class:`ConfigError`. ``packed`` (segment ids, :mod:`~jphantom.nn.attention.packing`):
    ``jax.nn.dot_product_attention`` takes no segment ids or offsets (cuDNN's own take sequence
    offsets, but jax's public API does not pass them), so where cuDNN would run, jax's Pallas
    Triton flash kernel runs instead (it takes segment ids), unless the layer has a sliding
    ``window`` (that kernel has none): then XLA's path under the mask."""
    check_implementation(implementation)
    if implementation == "xla":
        return "xla", "asked for (--attention xla)"
    problem = fused_problem(platform, dtype, head_dim)
    if packed:
        return _packed_choice(implementation, problem, dtype, window)
    if implementation == "cudnn":
        if problem:
            raise ConfigError(f"attention='cudnn' cannot run here: {problem}; use --attention "
                              "auto (XLA's path where cuDNN cannot run) or xla")
        return "cudnn", "asked for (--attention cudnn)"
    if problem:
        return "xla", f"auto: {problem}"
    return "cudnn", f"auto: {jnp.dtype(dtype).name} on an NVIDIA GPU"


def _packed_choice(implementation, problem, dtype, window) -> tuple[str, str]:
    asked = "asked for (--attention cudnn)" if implementation == "cudnn" else "auto"
    if problem:
        if implementation == "cudnn":
            raise ConfigError(f"attention='cudnn' cannot run here: {problem}; use --attention "
                              "auto (XLA's path where cuDNN cannot run) or xla")
        return "xla", f"auto: {problem}; packed batch: XLA's path under the segment mask"
    if window is not None:
        if implementation == "cudnn":
            raise ConfigError(f"attention='cudnn' with a packed batch and a sliding window "
                              f"({window} tokens): jax.nn.dot_product_attention takes no "
                              "segment ids and jax's Pallas flash kernel no window; use "
                              "--attention auto (XLA's path) or xla")
        return "xla", (f"auto: packed batch with a sliding window ({window} tokens): "
                       "jax.nn.dot_product_attention's cuDNN path takes no segment ids and "
                       "jax's Pallas Triton flash kernel no window: XLA's path under the mask")
    return "pallas", (f"{asked}: packed batch, {jnp.dtype(dtype).name} on an NVIDIA GPU: jax's "
                      "Pallas Triton flash attention with segment ids "
                      "(jax.nn.dot_product_attention's cuDNN path takes none)")


def check_implementation(name: str) -> str:
    if name not in IMPLEMENTATIONS:
        raise ConfigError(f"attention={name!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    return name
