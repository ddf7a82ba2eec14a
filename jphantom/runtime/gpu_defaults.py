"""The XLA flags and allocator setting a GPU run should have, in one place.

XLA reads ``XLA_FLAGS`` once, when jax starts its first backend, so these go into the environment
before that (:func:`apply`), and never over what the user set: a flag already in ``XLA_FLAGS`` keeps
the user's value, flag by flag, and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is set only when absent.
``jphantom train`` applies them when an NVIDIA GPU is visible and prints what it set;
``jphantom compile --target gpu:*`` applies the flags (not the allocator setting: nothing is
allocated) and records them in its report; ``--no-gpu-defaults`` turns both off.

The flags (:data:`XLA_FLAGS`), each accepted by the XLA of jax 0.10.2 and of jax 0.12 in
``XLA_FLAGS`` (an unknown flag aborts the process; checked by starting jax with each flag alone in
``XLA_FLAGS``). jaxlib 0.12's XLA (CUDA and ROCm plugins alike) no longer has the three pipeliner
flags as compile options (``compile(compiler_options=...)`` answers ``No such compile option``),
so :func:`current` leaves them out there (:data:`RETIRED`); the others are accepted by the ROCm
compiler too (checked by compiling for MI250X and MI300X with each alone):

- ``--xla_gpu_enable_latency_hiding_scheduler=true``: schedule the asynchronous collectives'
  ``*-start`` early and their ``*-done`` late, with independent compute between them, from a
  latency estimate of each op. This is what lets a Megatron all-reduce or a ZeRO all-gather run
  under the GEMMs of the step (jax's "GPU performance tips" page, NVIDIA's JAX-Toolbox images and
  MaxText's GPU flags all turn it on);
- ``--xla_gpu_enable_pipelined_all_gather=true``,
  ``--xla_gpu_enable_pipelined_reduce_scatter=true``,
  ``--xla_gpu_enable_pipelined_all_reduce=true``: XLA's collective pipeliner moves a collective of
  a scanned layer (jphantom's layers run under ``lax.scan``) into the previous iteration (the
  all-gather of layer i+1's ZeRO-3 shards while layer i computes) or the next (the reduce-scatter of
  layer i's gradients while layer i-1 computes), so the scheduler has compute to hide it under
  across the loop's iterations, not only inside one (jax's GPU performance tips, "FSDP"; MaxText's
  GPU flags);
- ``--xla_gpu_enable_while_loop_double_buffering=true``: unrolls a ``while`` loop by two so that
  one iteration's collectives can overlap the other's compute, which the pipeliner's moves need
  (jax's GPU performance tips; MaxText's GPU flags);
- ``--xla_gpu_enable_highest_priority_async_stream=true``: runs the asynchronous collectives on
  the highest-priority CUDA stream, so that a compute kernel launched first does not hold up a
  collective the next layer waits for (MaxText's GPU flags; NVIDIA's JAX-Toolbox GPU performance
  page);
- ``--xla_gpu_enable_dus_accumulator_zero_init_elimination=true``: a ``lax.scan``'s stacked
  outputs (the residuals each layer saves for the backward) start as a zero ``broadcast`` that
  the loop then overwrites slot by slot; where the loop's ``dynamic-update-slice`` covers every
  slot, XLA replaces the zeros with an uninitialised buffer (an ``AllocateBuffer`` custom call,
  no kernel). Without it a step that accumulates k micro-batches writes zeros into every residual
  stack k times, and where two stacks share a shape XLA merges their zeros and copies them once
  per further stack: NeMo's Llama3.1-8B layout (CP 2, 32 micro-batches, ZeRO-2) spends 0.37 of
  its 15.10 predicted seconds so, and 0.01 s with the flag, at the same 50.5 GiB peak
  (docs/predict.md). Where the collective pipeliner moved a collective into the layer loop by
  peeling its first iteration (ZeRO-3's pipelined parameter all-gathers) the loop's update no
  longer covers every slot and the zeros stay (measured on a 2-layer ZeRO-3 compile: none
  replaced, 9 with ``--xla_gpu_enable_pipelined_all_gather=false``).

Under ``--precision fp8`` (:data:`FP8_XLA_FLAGS`), on NVIDIA GPUs only:

- ``--xla_gpu_enable_triton_gemm=false``: XLA's Triton GEMM rewriter runs before its cuBLAS FP8
  rewriter (jaxlib 0.10's pipeline: ``triton-gemm-rewriter`` in ``hlo_normalization``, the GEMM
  rewriter later) and takes every dot it can, FP8 ones included, so an FP8 GEMM reaches
  cuBLAS-LT's FP8 kernel only where the autotuner swaps a Triton fusion back, and in an
  ahead-of-time compile (no autotuning) never. Without Triton GEMMs each FP8 dot becomes
  ``__cublas$lt$matmul$f8`` with its operands' scales fused (docs/gpu.md, "FP8"). MaxText's H100
  runs set it at every precision (its A3 configs' ``XLA_FLAGS``); jphantom sets it for FP8 alone,
  leaving bf16's GEMMs to the autotuner as before.

In a pipelined run (a ``stage`` axis over 1; :data:`PIPELINE_XLA_FLAGS`):

- ``--xla_gpu_enable_while_loop_double_buffering=false``: the pipeline's tick loop, unrolled by
  two, holds two ticks' buffers at once, and XLA's rematerialisation then clones GEMMs and
  gradient adds to fit them. Compiled for NeMo's Llama3.1-70B layout on 64 H100 (TP 4, PP 4,
  VP 5, CP 2; docs/predict.md): 2,513 rematerialised instructions with it, 602 without, the same
  71.8 GiB peak, and a predicted step of 29.6 s against 27.0 s (modelled). The schedule's
  collective-permutes are small, and the layers' own collectives overlap inside a tick.

Left out on purpose: the combine thresholds (``--xla_gpu_all_reduce_combine_threshold_bytes`` and
the like), which MaxText sizes by the number of GPUs and the model, so no one value suits every
run; ``--xla_gpu_threshold_for_windowed_einsum_mib`` (collective matmul for GSPMD-partitioned
einsums: jphantom's layers write their collectives themselves, only the ``gspmd`` baseline has
such einsums); and ``--xla_gpu_multi_streamed_windowed_einsum``, which fails XLA's verifier on
jax 0.10.2. Put any of them in ``XLA_FLAGS`` yourself: yours are kept.

The allocator (:data:`ENVIRONMENT`): ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.9`` lets jax's allocator
take 90% of each GPU's memory instead of its default 75%, leaving the rest to CUDA's and NCCL's own
buffers (NVIDIA's JAX-Toolbox recommends 0.8-0.9; jax's "GPU memory allocation" page). It is
also the memory a step must fit, and jax passes it to XLA as the budget its scheduler and
rematerialisation aim at; ``jphantom compile`` judges and compiles a layout to the same
(:mod:`jphantom.costs.budget`).

References: https://docs.jax.dev/en/latest/gpu_performance_tips.html,
MaxText's GPU documentation and scripts (``XLA_FLAGS`` for its GPU runs),
https://docs.nvidia.com/jax-toolbox/performance-profiling/gpu-performance.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

XLA_FLAGS: dict[str, str] = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_enable_dus_accumulator_zero_init_elimination": "true",
}
"""XLA flag (without ``--``) -> value: what a GPU run gets unless the user set the flag (those of
:data:`RETIRED` only on the jaxlib versions that still have them: :func:`current`)."""

FP8_XLA_FLAGS: dict[str, str] = {"xla_gpu_enable_triton_gemm": "false"}
"""XLA flag -> value: what an NVIDIA run under ``--precision fp8`` gets besides :data:`XLA_FLAGS`
(module docstring): its FP8 GEMMs become cuBLAS-LT FP8 calls, not Triton fusions."""

PIPELINE_XLA_FLAGS: dict[str, str] = {"xla_gpu_enable_while_loop_double_buffering": "false"}
"""XLA flag -> value: what a pipelined run (a ``stage`` axis over 1) gets over :data:`XLA_FLAGS`
(module docstring): its schedule's tick loop is not unrolled by two."""

RETIRED: dict[str, tuple[int, int]] = {
    "xla_gpu_enable_pipelined_all_gather": (0, 12),
    "xla_gpu_enable_pipelined_reduce_scatter": (0, 12),
    "xla_gpu_enable_pipelined_all_reduce": (0, 12),
}
"""XLA flag -> the first jaxlib (major, minor) whose XLA has no such compile option."""


def current(jaxlib_version: str | None = None, precision: str | None = None,
            pipelined: bool = False) -> dict[str, str]:
    """:data:`XLA_FLAGS` less the flags :data:`RETIRED` from ``jaxlib_version`` (default: the
    installed jaxlib's, read without importing jax), with :data:`FP8_XLA_FLAGS` for
    ``precision`` ``fp8`` and :data:`PIPELINE_XLA_FLAGS` over them where ``pipelined``."""
    if jaxlib_version is None:
        import importlib.metadata

        jaxlib_version = importlib.metadata.version("jaxlib")
    release = tuple(int(part) for part in re.findall(r"\d+", jaxlib_version)[:2])
    flags = {**XLA_FLAGS, **(FP8_XLA_FLAGS if str(precision).lower() == "fp8" else {}),
             **(PIPELINE_XLA_FLAGS if pipelined else {})}
    return {name: value for name, value in flags.items()
            if release < RETIRED.get(name, (10**6, 0))}

ENVIRONMENT: dict[str, str] = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}
"""Environment variable -> value: the allocator's settings, set only when absent."""

_FLAG_NAME = re.compile(r"(?:^|\s)--?([A-Za-z0-9_]+)")
_FLAG_VALUE = re.compile(r"(?:^|\s)--?([A-Za-z0-9_]+)(=\S*)?")


def flag_names(xla_flags: str) -> set[str]:
    """The names of the flags an ``XLA_FLAGS`` string sets (``--name=value`` or ``--name``)."""
    return set(_FLAG_NAME.findall(xla_flags or ""))


def merge_flags(xla_flags: str, defaults: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """``xla_flags`` (the user's ``XLA_FLAGS``) with every flag of ``defaults`` (default
    :func:`current`) it does not name appended. Returns the merged string and the ``--name=value``
    items added, in ``defaults``' order; the user's flags come first and are kept as written."""
    defaults = current() if defaults is None else defaults
    given = flag_names(xla_flags)
    added = [f"--{name}={value}" for name, value in defaults.items() if name not in given]
    merged = " ".join(part for part in ((xla_flags or "").strip(), *added) if part)
    return merged, added


def apply(environ: MutableMapping[str, str] | None = None, *, allocator: bool = True,
          precision: str | None = None, pipelined: bool = False) -> list[str]:
    """Put the GPU defaults into ``environ`` (default ``os.environ``) without overriding the
    user's: the flags of :func:`current` that ``XLA_FLAGS`` does not name, and (``allocator``)
    the variables of :data:`ENVIRONMENT` that are unset; ``precision``: the run's (``fp8`` adds
    :data:`FP8_XLA_FLAGS`); ``pipelined``: whether it runs a pipeline (:func:`is_pipelined`;
    :data:`PIPELINE_XLA_FLAGS`). Returns what it set, as ``--name=value`` for flags and
    ``NAME=value`` for variables (empty when the user had set everything). Call it before jax
    starts a backend: XLA reads ``XLA_FLAGS`` once."""
    environ = os.environ if environ is None else environ
    merged, added = merge_flags(environ.get("XLA_FLAGS", ""),
                                current(precision=precision, pipelined=pipelined))
    if added:
        environ["XLA_FLAGS"] = merged
    set_ = list(added)
    if allocator:
        for name, value in ENVIRONMENT.items():
            if name not in environ:
                environ[name] = value
                set_.append(f"{name}={value}")
    return set_


def is_pipelined(mesh: str | None) -> bool:
    """Whether a run on ``mesh`` (``--mesh``'s text, e.g. ``data=2,stage=4``; None: the default
    mesh, which has no ``stage`` axis) runs a pipeline: a ``stage`` axis over 1. A mesh that
    does not parse is not (the run's validation names its mistake)."""
    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import MeshConfig

    try:
        return bool(mesh) and dict(MeshConfig.parse(mesh).axes).get("stage", 1) > 1
    except ConfigError:
        return False


def compiler_options(xla_flags: str, names=None) -> dict[str, bool | int | float | str]:
    """The values ``xla_flags`` (an ``XLA_FLAGS`` string, e.g. :func:`merge_flags`' result) gives
    the flags ``names`` (default: those of :func:`current`), as ``compile(compiler_options=...)``
    takes them (booleans and numbers typed: XLA refuses the string ``'true'`` there). Passed to
    one compilation they hold for it even when jax started its backends before ``XLA_FLAGS`` was
    set (a test process, a notebook), where the environment no longer counts."""
    names = current() if names is None else names
    out: dict[str, bool | int | float | str] = {}
    for name, value in _FLAG_VALUE.findall(xla_flags or ""):
        if name in names:
            out[name] = _typed(value[1:] if value else "true")  # a bare --flag is true
    return out


def _typed(value: str) -> bool | int | float | str:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def nvidia_gpu_visible(env=None) -> bool:
    """Whether jax will start on NVIDIA GPUs, decided without starting it: ``JAX_PLATFORMS`` names
    ``cuda`` (or ``gpu``), or it is unset and ``nvidia-smi`` is on the PATH with jax's CUDA plugin
    installed (as :func:`jphantom.runtime.distributed.accelerator_visible` decides for any accelerator)."""
    import shutil

    from jphantom.runtime.distributed import GPU_PLUGINS, has_module

    env = os.environ if env is None else env
    platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return any(p in ("cuda", "gpu") for p in platforms)
    return bool(shutil.which("nvidia-smi")) and any(has_module(m)
                                                     for m in GPU_PLUGINS["nvidia-smi"])


def fp8_gemm_options(device, environ: MutableMapping[str, str] | None = None
                     ) -> dict[str, bool | int | float | str]:
    """``compile(compiler_options=...)`` for an FP8 GEMM measured by itself on ``device`` (a jax
    device) with the kernel an FP8 run's GEMMs get: on an NVIDIA GPU :data:`FP8_XLA_FLAGS`, as
    ``environ``'s ``XLA_FLAGS`` (default ``os.environ``) leaves them (a value the user set wins);
    elsewhere none. A benchmark's process started with the bf16 flags (Triton GEMMs on), so an
    FP8 GEMM compiled without these would time Triton's fusion, not the cuBLAS-LT call that
    ``--precision fp8`` runs."""
    if getattr(device, "platform", "") not in ("gpu", "cuda") or "nvidia" not in str(
            getattr(device, "device_kind", "")).lower():
        return {}
    environ = os.environ if environ is None else environ
    merged, _ = merge_flags(environ.get("XLA_FLAGS", ""), FP8_XLA_FLAGS)
    return compiler_options(merged, FP8_XLA_FLAGS)


__all__ = ["ENVIRONMENT", "FP8_XLA_FLAGS", "PIPELINE_XLA_FLAGS", "XLA_FLAGS", "apply",
           "compiler_options", "flag_names", "fp8_gemm_options", "is_pipelined", "merge_flags",
           "nvidia_gpu_visible"]
