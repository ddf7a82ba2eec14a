"""What one kernel of a compiled GPU program costs on a device: each scheduled instruction
classified (GEMM, fused attention, memory-bound kernel, collective, free) with its FLOPs, its
bytes through HBM and its seconds (:class:`jphantom.predict.device.DeviceModel`'s roofline).

Bytes of a kernel are what it reads and writes, as XLA's GPU performance model counts them:

* an operand read only through ``dynamic-slice``, ``slice`` or ``gather`` inside the fusion (a
  layer's weights taken from the stacked ``[L, ...]`` array of a scanned model), possibly through
  ``bitcast`` re-views, costs the slices' bytes, not the whole array's;
* a fusion whose root is a ``dynamic-update-slice`` (a layer's residuals written into the stacked
  buffer; bitcasts seen through) updates in place: it writes the update's bytes, and the buffer it
  updates is not read;
* free instructions (``parameter``, ``get-tuple-element``, ``tuple``, ``bitcast``, constants,
  ``partition-id`` ...) launch nothing and cost nothing, nor does an ``AllocateBuffer`` custom
  call (:data:`FREE_TARGETS`: a buffer left uninitialised, ``lax.empty``'s lowering and what
  XLA's ``--xla_gpu_enable_dus_accumulator_zero_init_elimination`` puts where a scan's stacked
  outputs started from zeros; XLA's GPU thunk sequence holds no thunk for it).

GEMM FLOPs are 2 x (result elements) x (contracted elements) of each ``dot`` in the kernel;
a cuBLAS call's from its backend config. A fused attention call (``__cudnn$fmha*``) does
4 B H Sq Sk D FLOPs forward (the two GEMMs of Q K^T and P V), half that under a causal mask, and
2.5 times that backward (the recomputed scores and the four gradients' GEMMs, Dao's FlashAttention-2
count). A Pallas flash block of :mod:`jphantom.nn.flash` (a Triton custom call whose op_name names
the kernel: ``ring_block_forward``, ``ring_block_backward_causal``, ``packed_attention_*``; q
and k its first two operands, [B, S, H, D]) is counted the same way and priced at the device's
attention efficiency, which is cuDNN's: jax's Pallas Triton kernel is assumed as fast (no
measurement of it on a GPU yet), so a ring's attention is, if anything, priced optimistically.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from jphantom.analysis.hlo.gemms import FUSIONS, GemmIndex, custom_call_target
from jphantom.analysis.hlo.text import (Computation, Instruction, backend_config,
                                        called_computations, op_name, parse_shapes, type_bytes)
from jphantom.predict.device import DeviceModel

FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
    "replica-id", "after-all", "add-dependency", "opt-barrier", "optimization-barrier",
    "domain", "get-dimension-size", "copy-done", "async-done", "recv", "recv-done",
    "fusion-done",  # an asynchronous fusion's end: its start (gemms.FUSIONS) is the kernel
})
FREE_TARGETS = frozenset({"AllocateBuffer"})
"""Custom-call targets that launch nothing (module docstring)."""
_SLICERS = frozenset({"dynamic-slice", "slice", "gather"})
# jphantom.nn.flash's block kernels, by the name they keep in the compiled program's op_name
_FLASH = re.compile(r"(ring_block|packed_attention)_(forward|backward)(_causal)?\)*/pallas_call")


@dataclasses.dataclass(frozen=True)
class Cost:
    """One kernel: ``kind`` (``gemm``, ``attention``, ``memory``), FLOPs, bytes, seconds, the
    jax operation it came from (``source``) and the FP8 flag of a GEMM."""

    kind: str
    flops: float
    nbytes: float
    seconds: float
    source: str = ""
    dtype: str = ""


def _dims(type_text: str) -> tuple[str, tuple[int, ...]]:
    shapes = parse_shapes(type_text)
    return shapes[0] if shapes else ("", ())


class KernelPricer:
    """Prices the kernels of one parsed module on one device."""

    def __init__(self, comps: Mapping[str, Computation], device: DeviceModel):
        self.comps = comps
        self.device = device
        self.gemms = GemmIndex(comps)
        self.types = self.gemms.types
        self._fusion_bytes: dict[str, tuple[list[float | None], float]] = {}

    # -- bytes -----------------------------------------------------------------------------------
    def _body_io(self, body: str) -> tuple[list[float | None], float]:
        """Per parameter of a fusion body: the bytes it reads (None: all of the operand), and
        the bytes the body writes."""
        if body in self._fusion_bytes:
            return self._fusion_bytes[body]
        comp = self.comps[body]
        params: dict[str, int] = {}
        users: dict[str, list[Instruction]] = {}
        for instr in comp.instructions:
            if instr.opcode == "parameter" and instr.operands[0].isdigit():
                params[instr.name] = int(instr.operands[0])
            for op in instr.operands:
                users.setdefault(op, []).append(instr)
        reads: list[float | None] = [None] * (max(params.values(), default=-1) + 1)

        def seen(instr: Instruction | None) -> Instruction | None:
            """``instr`` seen through free re-views (bitcast) to what produced it."""
            while instr is not None and instr.opcode == "bitcast" and instr.operands:
                instr = comp.find(instr.operands[0])
            return instr

        root = comp.root
        roots = [seen(comp.find(n)) for n in root.operands] if root is not None and (
            root.opcode == "tuple") else [seen(root)]
        updated = {seen(comp.find(r.operands[0])).name for r in roots if r is not None
                   and r.opcode == "dynamic-update-slice" and seen(comp.find(r.operands[0]))}
        def readers(name: str) -> list[tuple[str, Instruction]]:
            """(operand name, user) of ``name``'s uses, seen through free re-views (bitcast)."""
            found = []
            for u in users.get(name, []):
                found += readers(u.name) if u.opcode == "bitcast" else [(name, u)]
            return found

        for name, index in params.items():
            used = readers(name)
            if name in updated:
                reads[index] = 0.0
            elif used and all(u.opcode in _SLICERS and u.operands[0] == via for via, u in used):
                reads[index] = float(sum(type_bytes(u.type_text) for _, u in used))
        written = 0.0
        for r in roots:
            if r is None:
                continue
            if r.opcode == "dynamic-update-slice":
                update = comp.find(r.operands[1])
                written += type_bytes(update.type_text) if update is not None else 0
            else:
                written += type_bytes(r.type_text)
        self._fusion_bytes[body] = (reads, written)
        return reads, written

    def kernel_bytes(self, instr: Instruction) -> float:
        """Bytes a kernel reads and writes (module docstring)."""
        body = self.gemms.body(instr) if instr.opcode in FUSIONS else None
        if body is None or body not in self.comps:
            read = sum(type_bytes(self.types.get(op, "")) for op in instr.operands)
            return float(read + type_bytes(instr.type_text))
        reads, written = self._body_io(body)
        total = written
        for i, op in enumerate(instr.operands):
            part = reads[i] if i < len(reads) else None
            total += type_bytes(self.types.get(op, "")) if part is None else part
        return float(total)

    # -- GEMMs -----------------------------------------------------------------------------------
    def _gemm_shape(self, instr: Instruction) -> tuple[float, float, float, str]:
        """(FLOPs, output elements, contracted elements, dtype) of a GEMM kernel."""
        if instr.opcode == "custom-call":
            config = backend_config(instr).get("gemm_backend_config", {})
            numbers = config.get("dot_dimension_numbers", {})
            _, lhs = _dims(self.types.get(instr.operands[0], ""))
            contracted = math.prod(lhs[int(d)] for d in numbers.get(
                "lhs_contracting_dimensions", []) if int(d) < len(lhs))
            _, out = _dims(instr.type_text)
            dtype = _dims(self.types.get(instr.operands[0], ""))[0]
            return 2.0 * math.prod(out) * contracted, math.prod(out), contracted, dtype
        dots = ([(instr, None)] if instr.opcode == "dot"
                else self.gemms.dots(self.gemms.body(instr)))
        flops = out_total = 0.0
        contracted_max, dtype = 1.0, ""
        for dot, comp in dots:
            lookup = (lambda n: self.types.get(n, "")) if comp is None else (
                lambda n, c=comp: (c.find(n).type_text if c.find(n) else self.types.get(n, "")))
            dtype, lhs = _dims(lookup(dot.operands[0]))
            found = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", dot.attrs)
            dims = [int(d) for d in found[1].split(",") if d] if found else []
            contracted = math.prod(lhs[d] for d in dims if d < len(lhs))
            _, out = _dims(dot.type_text)
            flops += 2.0 * math.prod(out) * contracted
            out_total += math.prod(out)
            contracted_max = max(contracted_max, contracted)
        return flops, out_total, contracted_max, dtype

    def _gemm_dtype(self, instr: Instruction, operand_dtype: str) -> str:
        if self.gemms.fp8(instr) == "fp8":
            return "fp8"
        return "f32" if operand_dtype in ("f32", "f64") else "bf16"

    # -- attention -------------------------------------------------------------------------------
    def _attention(self, instr: Instruction, target: str) -> Cost:
        config = backend_config(instr).get("cudnn_fmha_backend_config", {})
        numbers = config.get("bmm1_dot_dimension_numbers", {})
        _, q = _dims(self.types.get(instr.operands[0], ""))
        _, k = _dims(self.types.get(instr.operands[1], ""))
        batch = [int(d) for d in numbers.get("lhs_batch_dimensions", [])]
        contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
        k_batch = [int(d) for d in numbers.get("rhs_batch_dimensions", [])]
        k_contracting = [int(d) for d in numbers.get("rhs_contracting_dimensions", [])]
        if q and k and contracting:
            bh = math.prod(q[d] for d in batch)
            head = math.prod(q[d] for d in contracting)
            sq = math.prod(d for i, d in enumerate(q) if i not in batch + contracting)
            sk = math.prod(d for i, d in enumerate(k) if i not in k_batch + k_contracting)
        else:  # no dimension numbers: [B, S, H, D] for both
            bh, head = (q[0] * q[2], q[3]) if len(q) == 4 else (1, 1)
            sq, sk = (q[1], k[1]) if len(q) == 4 and len(k) == 4 else (1, 1)
        causal = config.get("mask_type", "") in ("CAUSAL", "PADDING_CAUSAL")
        return self._attention_cost(instr, bh, sq, sk, head, causal, "Backward" in target)

    def _flash(self, instr: Instruction, found: re.Match) -> Cost | None:
        """A Pallas flash block (:mod:`jphantom.nn.flash`): q [B, Sq, H, D] over k [B, Sk, H, D],
        counted as a cuDNN call of those shapes (the module docstring); None when its first two
        operands are not such arrays."""
        shapes = [_dims(self.types.get(name, ""))[1] for name in instr.operands[:2]]
        if len(shapes) < 2 or any(len(shape) != 4 for shape in shapes):
            return None
        (batch, sq, heads, head), sk = shapes[0], shapes[1][1]
        return self._attention_cost(instr, batch * heads, sq, sk, head, bool(found[3]),
                                    found[2] == "backward")

    def _attention_cost(self, instr: Instruction, bh, sq, sk, head, causal: bool,
                        backward: bool) -> Cost:
        """4 B H Sq Sk D FLOPs, half under a causal mask, 2.5x backward, at the device's
        attention efficiency for ``head``."""
        flops = 4.0 * bh * sq * sk * head * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
        nbytes = self.kernel_bytes(instr)
        seconds = self.device.attention_seconds(flops, nbytes, int(head), backward)
        return Cost("attention", flops, nbytes, seconds, op_name(instr), "bf16")

    # -- any kernel ------------------------------------------------------------------------------
    def price(self, instr: Instruction) -> Cost | None:
        """The kernel ``instr`` launches, priced; None for a free instruction."""
        if instr.opcode in FREE:
            return None
        target = custom_call_target(instr)
        if target in FREE_TARGETS:
            return None
        if target.startswith("__cudnn$fmha"):
            return self._attention(instr, target)
        flash = _FLASH.search(op_name(instr)) if target == "__gpu$xla.gpu.triton" else None
        priced = self._flash(instr, flash) if flash else None
        if priced is not None:
            return priced
        if self.gemms.kind(instr) is not None:
            flops, out, contracted, operand = self._gemm_shape(instr)
            dtype = self._gemm_dtype(instr, operand)
            nbytes = self.kernel_bytes(instr)
            seconds = self.device.gemm_seconds(flops, nbytes, dtype, out, contracted)
            return Cost("gemm", flops, nbytes, seconds, op_name(instr), dtype)
        nbytes = self.kernel_bytes(instr)
        seconds = self.device.memory_seconds(nbytes) + self.device.launch_seconds
        return Cost("memory", 0.0, nbytes, seconds, op_name(instr))


def callees(instr: Instruction, key: str) -> list[str]:
    return [name for k, name in called_computations(instr) if k == key]
