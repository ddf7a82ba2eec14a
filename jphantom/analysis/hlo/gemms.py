"""The GEMMs of an optimised HLO module: the FLOPs of every ``dot`` and cuBLAS call executed per
step (:func:`dot_flops`), and which kernels are GEMMs, by emitter, and whether they read FP8
(:class:`GemmIndex`, :func:`gemm_kind`)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from jphantom.analysis.hlo.callgraph import multipliers
from jphantom.analysis.hlo.text import (ARRAY, Computation, Instruction, backend_config,
                                     called_computations, parse_module)


_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_SINGLE_ARRAY = re.compile(r"^[a-z][a-z0-9]*\[([0-9,]*)\]")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


_GEMM_CALL = re.compile(r'custom_call_target="__cublas\$(lt\$matmul(\$f8)?|gemm)"')
_ARRAY_TYPE = re.compile(r"\w+\[([\d,]*)\]")


def dot_flops(hlo_text: str) -> tuple[int, int]:
    """(FLOPs, count) of every ``dot`` executed by an optimized HLO module, 2 per multiply-add:
    2 x (elements of the result) x (product of the lhs contracting dimensions), times the number of
    times the dot runs per step (its computation's multiplier: loop trip counts multiplied in);
    ``count`` is likewise the number of dot executions. XLA:GPU's cuBLAS calls (``__cublas$gemm``,
    ``__cublas$lt$matmul`` and its FP8 ``__cublas$lt$matmul$f8`` custom calls, the dots it did not
    fuse) are dots. Fusion bodies included; each instruction name is defined once per module, so
    operand shapes are looked up by name. Unlike
    ``cost_analysis()``, element-wise work is not counted: these are the GEMMs alone. Raises
    ``ValueError`` when a loop's trip count cannot be determined."""
    comps = parse_module(hlo_text)
    mult = multipliers(comps)
    shapes = {}
    for comp in comps.values():
        for instr in comp.instructions:
            array = _SINGLE_ARRAY.match(instr.type_text)
            if array:
                shapes[instr.name] = _dims(array[1])
    flops = count = 0
    for comp in comps.values():
        runs = mult.get(comp.name, 0)
        for instr in comp.instructions:
            gemm = instr.opcode == "custom-call" and _GEMM_CALL.search(instr.attrs)
            if not (instr.opcode == "dot" or gemm) or runs == 0:
                continue
            lhs = shapes[instr.operands[0]]
            if gemm:  # XLA:GPU's cuBLAS call: dimension numbers in its backend config (JSON)
                numbers = backend_config(instr)["gemm_backend_config"]["dot_dimension_numbers"]
                dims = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
            else:
                dims = _dims(_LHS_CONTRACTING.search(instr.attrs)[1])
            contracted = math.prod(lhs[d] for d in dims)
            result = _ARRAY_TYPE.search(instr.type_text)  # a cuBLAS call's first result
            flops += runs * 2 * math.prod(_dims(result[1])) * contracted
            count += runs
    return flops, count


_TARGET = re.compile(r'custom_call_target="([^"]*)"')
FUSIONS = frozenset({"fusion", "fusion-start"})
"""The opcodes of a kernel with a fused body: a ``fusion``, or a ``fusion-start`` (XLA:GPU runs
a dynamic-slice or dynamic-update-slice fusion asynchronously as ``fusion-start`` ...
``fusion-done``: the start is the kernel, its body the fusion's)."""
_FUSION_KIND = re.compile(r'"kind"\s*:\s*"([^"]*)"')
_CUBLAS_KINDS = {"__cublas$gemm": "cublas", "__cublas$lt$matmul": "cublas_lt",
                 "__cublas$lt$matmul$f8": "cublas_lt_f8",
                 # also the targets of XLA:ROCm's hipBLASLt calls (in the ROCm plugin's strings)
                 "__cublas$lt$matmul$mx": "cublas_lt_mx",
                 "__cublas$lt$groupedMatmul": "cublas_lt_grouped"}


def custom_call_target(instr: Instruction) -> str:
    """The ``custom_call_target`` of a custom call ("" for anything else)."""
    if instr.opcode != "custom-call":
        return ""
    found = _TARGET.search(instr.attrs)
    return found[1] if found else ""


def _dtype(type_text: str) -> str:
    """The element type of an array type (the first array of a tuple), "" when none."""
    found = ARRAY.search(type_text)
    return found[1] if found else ""


def _is_f8(type_text: str) -> bool:
    return _dtype(type_text).startswith("f8")


class GemmIndex:
    """Which kernels of a parsed module are GEMMs (:meth:`kind`) and whether they read FP8
    (:meth:`fp8`), with the dots of every fusion body (nested fusions included) found once."""

    def __init__(self, comps: Mapping[str, Computation]):
        self.comps = comps
        self._dots: dict[str, list[tuple[Instruction, Computation]]] = {}
        self.types = {instr.name: instr.type_text
                      for comp in comps.values() for instr in comp.instructions}

    def dots(self, name: str) -> list[tuple[Instruction, Computation]]:
        """The ``dot`` instructions of computation ``name`` and of the fusions it calls."""
        if name not in self._dots:
            self._dots[name] = []  # no recursion through a cycle
            comp = self.comps.get(name)
            found = []
            for instr in comp.instructions if comp is not None else ():
                if instr.opcode == "dot":
                    found.append((instr, comp))
                elif instr.opcode == "fusion":
                    for key, callee in called_computations(instr):
                        if key == "calls":
                            found += self.dots(callee)
            self._dots[name] = found
        return self._dots[name]

    def body(self, fusion: Instruction) -> str | None:
        return next((callee for key, callee in called_computations(fusion) if key == "calls"), None)

    def kind(self, instr: Instruction) -> str | None:
        """The GEMM kernel ``instr`` is, or None: ``cublas``, ``cublas_lt``, ``cublas_lt_f8``
        (XLA:GPU's cuBLAS custom calls), ``dot`` (a dot XLA left unfused: XLA:CPU), or for a
        fusion holding a dot its emitter from the backend config: ``triton`` (XLA's Triton GEMM
        fusions), ``cudnn`` (cuDNN GEMM fusions), ``cublas``, else ``fusion``."""
        if instr.opcode == "custom-call":
            return _CUBLAS_KINDS.get(custom_call_target(instr))
        if instr.opcode == "dot":
            return "dot"
        if instr.opcode not in FUSIONS:
            return None
        body = self.body(instr)
        if body is None or not self.dots(body):
            return None
        emitter = _FUSION_KIND.search(instr.attrs)  # the backend config's fusion kind
        emitter = (emitter[1] if emitter else "").lower()
        for name in ("triton", "cudnn", "cublas"):
            if name in emitter:
                return name
        return "fusion"

    def fp8(self, instr: Instruction) -> str | None:
        """How a GEMM kernel uses FP8: ``"fp8"`` when its matrix multiply takes FP8 operands
        (cuBLAS-LT's FP8 call, a cuBLAS call or dot on f8 arrays, a fusion whose dot reads f8),
        ``"fp8_upcast"`` when a fusion reads f8 arrays but widens them before its dot (FP8 in
        memory, 16-bit tensor-core math), else None."""
        if instr.opcode == "custom-call":
            if custom_call_target(instr) == "__cublas$lt$matmul$f8":
                return "fp8"
            return "fp8" if any(_is_f8(self.types.get(op, "")) for op in instr.operands[:2]) \
                else None
        if instr.opcode == "dot":
            return "fp8" if any(_is_f8(self.types.get(op, "")) for op in instr.operands) else None
        body = self.body(instr)
        if body is None:
            return None
        for dot, comp in self.dots(body):
            for op in dot.operands:
                source = comp.find(op)
                if source is not None and _is_f8(source.type_text):
                    return "fp8"
        params = [i for i in self.comps[body].instructions if i.opcode == "parameter"]
        return "fp8_upcast" if any(_is_f8(p.type_text) for p in params) else None


def gemm_kind(instr: Instruction, comps: Mapping[str, Computation]) -> str | None:
    """The GEMM kernel an instruction of a scheduled computation is (``cublas``, ``cublas_lt``,
    ``cublas_lt_f8``, ``dot``, ``triton``, ``cudnn``, ``fusion``), or None when it holds no
    matrix multiply (``GemmIndex.kind``)."""
    return GemmIndex(comps).kind(instr)
