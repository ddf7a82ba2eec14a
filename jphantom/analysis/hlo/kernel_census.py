"""The kernels that decide a step's speed, counted per step: fused attention custom calls
(cuDNN's), hand-written Pallas kernels, GEMMs by emitter and FP8 use, and the asynchronous
collectives with GEMMs scheduled under them (:func:`kernels`, :func:`format_kernels`)."""

from __future__ import annotations

from collections.abc import Mapping

from jphantom.analysis.hlo.accounting import collectives_in
from jphantom.analysis.hlo.callgraph import multipliers
from jphantom.analysis.hlo.gemms import GemmIndex, custom_call_target
from jphantom.analysis.hlo.text import Computation, called_computations, parse_module


# Hand-written kernels called as custom calls: Pallas on GPU through Triton, Pallas's Mosaic GPU
# and TPU backends.
_PALLAS_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2", "tpu_custom_call")
# Control flow whose called computations hold kernels (a fusion's body holds its kernel's ops)
_KERNEL_CALLERS = {"while": ("body", "condition"), "call": ("to_apply", "calls"),
                   "conditional": ("branch_computations", "true_computation",
                                   "false_computation"),
                   "async-start": ("calls",)}


def _kernel_computations(comps: Mapping[str, Computation]) -> list[str]:
    """The computations whose instructions are kernels or control flow: ENTRY and what loops,
    calls, conditionals and async wrappers run (not fusion bodies or reducers)."""
    roots = [c.name for c in comps.values() if c.entry]
    if not roots:
        called = {callee for comp in comps.values() for instr in comp.instructions
                  for _, callee in called_computations(instr)}
        roots = [name for name in comps if name not in called]
    seen, todo = set(roots), list(roots)
    while todo:
        for instr in comps[todo.pop()].instructions:
            keys = _KERNEL_CALLERS.get(instr.opcode, ())
            for key, callee in called_computations(instr):
                if key in keys and callee in comps and callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
    return [name for name in comps if name in seen]


def kernels(hlo_text: str) -> dict:
    """The kernels of an optimised HLO module that decide a step's speed, each counted as many
    times as it runs per step (loop trip counts multiplied in, as :func:`dot_flops`):

    - ``attention``: fused attention custom calls, ``forward`` and ``backward`` (cuDNN's
      ``__cudnn$fmha*``, e.g. ``__cudnn$fmhaSoftmax`` / ``__cudnn$fmhaSoftmaxBackward``, which
      ``jax.nn.dot_product_attention(..., implementation="cudnn")`` lowers to) and ``targets``
      (executions per custom-call target);
    - ``pallas``: executions per hand-written kernel's custom-call target (Pallas through Triton,
      ``__gpu$xla.gpu.triton``; Mosaic GPU; ``tpu_custom_call``);
    - ``gemms``: every GEMM kernel, ``total`` and ``by_kind`` (:meth:`GemmIndex.kind`: ``triton``,
      ``cublas``, ``cublas_lt``, ``cublas_lt_f8``, ``cudnn``, ``dot``, ``fusion``), ``fp8``
      (those whose matrix multiply takes FP8 operands) and ``fp8_upcast`` (those that read FP8
      arrays and widen them before the multiply);
    - ``collectives``: the asynchronous collectives that move data (``*-start``/``*-done``
      pairs, collective-permutes included; executions), how many of them have at least one GEMM
      kernel scheduled between start and done (``with_gemms``: the overlap that collective
      matmuls and the latency-hiding scheduler give), and the GEMM executions under them
      (``gemms_under``).

    Raises ``ValueError`` when a loop's trip count cannot be determined."""
    comps = parse_module(hlo_text)
    mult = multipliers(comps)
    index = GemmIndex(comps)
    attention = {"forward": 0, "backward": 0, "targets": {}}
    pallas: dict[str, int] = {}
    gemms = {"total": 0, "by_kind": {}, "fp8": 0, "fp8_upcast": 0}
    for name in _kernel_computations(comps):
        runs = mult.get(name, 0)
        if runs == 0:
            continue
        for instr in comps[name].instructions:
            target = custom_call_target(instr)
            if target.startswith("__cudnn$fmha"):
                attention["backward" if "Backward" in target else "forward"] += runs
                attention["targets"][target] = attention["targets"].get(target, 0) + runs
            elif target in _PALLAS_TARGETS:
                pallas[target] = pallas.get(target, 0) + runs
            kind = index.kind(instr)
            if kind is None:
                continue
            gemms["total"] += runs
            gemms["by_kind"][kind] = gemms["by_kind"].get(kind, 0) + runs
            fp8 = index.fp8(instr)
            if fp8 is not None:
                gemms[fp8] += runs
    moving = [c for c in collectives_in(comps, mult, index) if c.asynchronous and not c.trivial]
    collectives_ = {"asynchronous": sum(c.count for c in moving),
                    "with_gemms": sum(c.count for c in moving if c.overlapped_gemms),
                    "gemms_under": sum(c.count * c.overlapped_gemms for c in moving)}
    return {"attention": attention, "pallas": pallas, "gemms": gemms,
            "collectives": collectives_}


def format_kernels(found: dict) -> str:
    """One line of :func:`kernels`' result: ``cuDNN attention 4 fwd / 4 bwd, FP8 GEMMs 0, GEMMs
    38 (triton 30, cublas_lt 8), collectives with GEMMs under them: 12 of 40``."""
    a, g, c = found["attention"], found["gemms"], found["collectives"]
    kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(g["by_kind"].items(),
                                                          key=lambda item: -item[1]))
    parts = [f"cuDNN attention {a['forward']} fwd / {a['backward']} bwd",
             f"FP8 GEMMs {g['fp8']}" + (f" (+{g['fp8_upcast']} reading FP8, 16-bit math)"
                                        if g["fp8_upcast"] else ""),
             f"GEMMs {g['total']}" + (f" ({kinds})" if kinds else "")]
    if found["pallas"]:
        parts.append("Pallas/Triton calls " + ", ".join(f"{t} {n}"
                                                        for t, n in found["pallas"].items()))
    parts.append(f"collectives with GEMMs under them: {c['with_gemms']} of {c['asynchronous']}"
                 " asynchronous")
    return ", ".join(parts)
