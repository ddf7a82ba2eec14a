"""What a scheduled HLO program runs under each asynchronous collective: for every ``*-start`` /
``*-done`` pair of one kind (by default ``collective-permute``, ring attention's K/V transfers),
the kernels between the two in the schedule (the text order of a scheduled computation), looking
inside the ``conditional``s, ``call``s and loops scheduled there, and whether one of them is an
attention kernel (:func:`async_windows`, :func:`ring_overlap`).

Ring attention (Liu, Zaharia & Abbeel 2023; Megatron-LM's context parallelism) hides its ring
when each step's K/V transfer is in flight while the previous step's block of attention runs:
in the compiled program, an attention kernel (cuDNN's fused attention, or a Pallas flash block
such as :mod:`jphantom.nn.flash`'s) scheduled between the transfer's start and its done."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jphantom.analysis.hlo.callgraph import multipliers
from jphantom.analysis.hlo.gemms import GemmIndex, custom_call_target
from jphantom.analysis.hlo.groups import pair_axes
from jphantom.analysis.hlo.text import Computation, Instruction, called_computations, \
    parse_module

_PALLAS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2", "tpu_custom_call")
# a Pallas kernel's name (its op_name metadata) that says it is attention
_ATTENTION_NAMES = ("ring_block", "flash", "attention", "mha")
# control flow whose callees run where it is scheduled
_RUNS_INSIDE = {"while": ("body",), "call": ("to_apply", "calls"),
                "conditional": ("branch_computations", "true_computation", "false_computation")}
_KERNEL_OPCODES = frozenset({"fusion", "custom-call", "dot", "convolution"})


def attention_kernel(instr: Instruction) -> bool:
    """Whether ``instr`` is an attention kernel: cuDNN's fused attention (``__cudnn$fmha*``) or
    a Pallas kernel whose name says attention (``ring_block_forward``, ``ring_block_backward``,
    a flash kernel)."""
    target = custom_call_target(instr)
    if target.startswith("__cudnn$fmha"):
        return True
    if target not in _PALLAS:
        return False
    metadata = instr.attrs[instr.attrs.find("metadata="):] if "metadata=" in instr.attrs else ""
    return any(name in metadata for name in _ATTENTION_NAMES)


@dataclasses.dataclass(frozen=True)
class AsyncWindow:
    """One asynchronous collective (its ``-start``) and what runs until its ``-done``:
    ``attention`` and ``gemms`` (kernels, those inside control flow scheduled in between
    included: a conditional's branches each counted), ``kernels`` (all of them), ``under``
    (the names of the instructions scheduled in between that hold them), ``count`` (executions
    per step), ``axes`` (the mesh axes a permute's pairs cross; () without ``axes``) and
    ``backward`` (its op_name says it is in a transpose: the backward pass)."""

    name: str
    done: str
    kind: str
    computation: str
    count: int
    nbytes: int
    axes: tuple[str, ...]
    backward: bool
    attention: int
    gemms: int
    kernels: int
    under: tuple[str, ...]

    @property
    def overlaps_attention(self) -> bool:
        return self.attention > 0


def _kernels_in(instr: Instruction, comps: Mapping[str, Computation], index: GemmIndex,
                seen: frozenset = frozenset()) -> tuple[int, int, int]:
    """(attention kernels, GEMMs, kernels) that ``instr`` runs, looking through control flow."""
    keys = _RUNS_INSIDE.get(instr.opcode)
    if keys is None:
        if instr.opcode not in _KERNEL_OPCODES:
            return 0, 0, 0
        return int(attention_kernel(instr)), int(index.kind(instr) is not None), 1
    totals = [0, 0, 0]
    for key, callee in called_computations(instr):
        if key not in keys or callee not in comps or callee in seen:
            continue
        for inner in comps[callee].instructions:
            found = _kernels_in(inner, comps, index, seen | {callee})
            totals = [a + b for a, b in zip(totals, found)]
    return totals[0], totals[1], totals[2]


def _backward(instr: Instruction) -> bool:
    return "transpose(" in instr.attrs[instr.attrs.find("op_name="):] if (
        "op_name=" in instr.attrs) else False


def async_windows(hlo_text: str, kind: str = "collective-permute",
                  axes: Mapping[str, int] | None = None) -> list[AsyncWindow]:
    """Every asynchronous ``kind`` collective of the optimised, scheduled HLO module
    ``hlo_text`` with what runs between its start and done (:class:`AsyncWindow`), in
    computation and schedule order; computations that never run (multiplier 0) left out.
    ``axes``: the mesh's axis sizes (``{"data": 2, "context": 4}``), to name the axes a
    collective-permute crosses."""
    comps = parse_module(hlo_text)
    mult = multipliers(comps)
    index = GemmIndex(comps)
    found = []
    for comp in comps.values():
        if not mult.get(comp.name):
            continue
        starts: dict[str, int] = {}
        for position, instr in enumerate(comp.instructions):
            if instr.opcode == f"{kind}-start":
                starts[instr.name] = position
            elif instr.opcode == f"{kind}-done" and instr.operands and (
                    instr.operands[0] in starts):
                begun = starts.pop(instr.operands[0])
                found.append(_window(comp, begun, position, instr, mult[comp.name], comps,
                                     index, axes))
    return found


def _window(comp, begun, position, done, count, comps, index, axes) -> AsyncWindow:
    start = comp.instructions[begun]
    totals, under = [0, 0, 0], []
    for other in comp.instructions[begun + 1:position]:
        found = _kernels_in(other, comps, index)
        if found[2]:
            under.append(other.name)
        totals = [a + b for a, b in zip(totals, found)]
    pairs = start.attr("source_target_pairs")
    crossed = pair_axes(pairs, axes) if axes and pairs else ()
    return AsyncWindow(start.name, done.name, start.opcode[:-len("-start")], comp.name, count,
                       done.nbytes, crossed, _backward(start), totals[0], totals[1], totals[2],
                       tuple(under))


def ring_overlap(hlo_text: str, axes: Mapping[str, int], axis: str = "context") -> dict:
    """The collective-permutes over ``axis`` (ring attention's K/V and dK/dV transfers) of the
    scheduled module ``hlo_text`` and how many run under an attention kernel, counted per step
    (loop trip counts multiplied in): ``permutes``, ``overlapped_with_attention``, the same
    split ``forward`` / ``backward``, ``synchronous`` (permutes over ``axis`` issued without a
    start/done pair: nothing overlaps them) and ``windows`` (one row per permute in the text:
    :class:`AsyncWindow`'s fields)."""
    windows = [w for w in async_windows(hlo_text, "collective-permute", axes)
               if w.axes == (axis,)]
    comps = parse_module(hlo_text)
    mult = multipliers(comps)
    synchronous = sum(mult.get(c.name, 0) for c in comps.values() for i in c.instructions
                      if i.opcode == "collective-permute" and axes
                      and pair_axes(i.attr("source_target_pairs"), axes) == (axis,))
    out = {"permutes": sum(w.count for w in windows) + synchronous,
           "overlapped_with_attention": sum(w.count for w in windows if w.overlaps_attention),
           "synchronous": synchronous}
    for side, backward in (("forward", False), ("backward", True)):
        mine = [w for w in windows if w.backward == backward]
        out[side] = {"permutes": sum(w.count for w in mine),
                     "overlapped_with_attention": sum(w.count for w in mine
                                                      if w.overlaps_attention)}
    out["windows"] = [dataclasses.asdict(w) | {"overlaps_attention": w.overlaps_attention}
                      for w in windows]
    return out
