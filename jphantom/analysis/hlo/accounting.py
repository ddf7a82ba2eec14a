"""Collective accounting: every collective instruction of a module with its kind, per-device
result bytes, replica groups, executions per step (its computation's multiplier) and the compute
scheduled under an asynchronous pair (:func:`collectives`), and the tally per kind and mesh axes
(:func:`summarize`)."""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from collections.abc import Mapping

from jphantom.analysis.hlo.callgraph import multipliers
from jphantom.analysis.hlo.gemms import GemmIndex
from jphantom.analysis.hlo.groups import group_axes, pair_axes, replica_group_lists
from jphantom.analysis.hlo.text import Computation, Instruction, attr_value, nbytes, parse_module, parse_shapes


KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all",
         "ragged-all-to-all")


@dataclasses.dataclass(frozen=True)
class HloCollective:
    name: str
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result buffer
    bytes: int  # per-device size of the result buffers, per execution
    replica_groups: str
    count: int = 1  # executions per step: the multiplier of its computation (loop trip counts)
    computation: str = ""  # name of the computation holding it
    source_target_pairs: str = ""  # collective-permute only, e.g. "{{0,1},{1,2}}"
    asynchronous: bool = False  # issued as a *-start / *-done pair (XLA:GPU, XLA:TPU)
    overlapped: int = 0  # compute ops (fusions, GEMM calls, dots) scheduled between its start/done
    overlapped_gemms: int = 0  # of those, GEMM kernels (gemm_kind): collective-matmul evidence

    @property
    def elements(self) -> int:
        """Elements of the result buffers, per execution."""
        total = 0
        for _, dims in self.shapes:
            count = 1
            for d in dims:
                count *= d
            total += count
        return total

    @property
    def trivial(self) -> bool:
        """Every replica group holds one device: nothing moves (a psum over an axis of size 1,
        which XLA keeps as a copy). Collective-permutes and ungrouped ops are never trivial."""
        if self.kind == "collective-permute" or not self.replica_groups.strip():
            return False
        try:
            groups = replica_group_lists(self.replica_groups, 1 << 30)
        except ValueError:
            return False
        return all(len(g) <= 1 for g in groups)

    @property
    def total_bytes(self) -> int:
        """Per-device result bytes over the step: ``bytes * count``."""
        return self.bytes * self.count

    def device_groups(self, num_devices: int) -> list[list[int]]:
        """The groups of devices (ids as in ``group_axes``) that exchange data: a
        collective-permute's (source, target) pairs, else its replica groups (all
        ``num_devices`` when it names none or cannot be read)."""
        if self.kind == "collective-permute":
            return [[int(a), int(b)] for a, b in
                    re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", self.source_target_pairs)]
        try:
            groups = replica_group_lists(self.replica_groups, num_devices)
        except ValueError:
            groups = []
        return groups or [list(range(num_devices))]

    def mesh_axes(self, axes: Mapping[str, int]) -> tuple[str, ...]:
        """The mesh axes this collective communicates over (``group_axes``; for a
        collective-permute, the axes on which its sources and targets differ, ``pair_axes``)."""
        if self.kind == "collective-permute":
            return pair_axes(self.source_target_pairs, axes)
        return group_axes(self.replica_groups, axes)


def _kind_of(opcode: str) -> tuple[str, str] | None:
    """(kind, "" | "-start" | "-done") for a collective opcode, else None."""
    for suffix in ("-start", "-done", ""):
        if opcode.endswith(suffix):
            kind = opcode[: len(opcode) - len(suffix)] if suffix else opcode
            if kind in KINDS:
                return kind, suffix
    return None


def collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective in an HLO module's text, in text order, with ``count`` = how many times it
    runs per step (the multiplier of its computation: loop trip counts multiplied in). Collectives
    in computations that never run (unreachable from ENTRY, or in a loop of trip count 0) are left
    out. A ``*-start``/``*-done`` pair (the GPU and TPU backends' asynchronous collectives, also
    inside loops) is one collective, ``asynchronous``, read at its ``-done`` with the groups of its
    ``-start``; ``overlapped`` counts the compute ops (fusions, custom calls, dots, convolutions)
    the schedule places between the two (the text order of a scheduled module is its schedule),
    0 where nothing overlaps it, and ``overlapped_gemms`` how many of those are GEMM kernels
    (:func:`gemm_kind`: cuBLAS calls, bare dots, fusions holding a dot). Raises ``ValueError``
    when a loop's trip count cannot be determined."""
    comps = parse_module(hlo_text)
    return collectives_in(comps, multipliers(comps), GemmIndex(comps))


def collectives_in(comps: Mapping[str, Computation], mult: Mapping[str, int],
                 index: GemmIndex) -> list[HloCollective]:
    found = []
    for comp in comps.values():
        starts: dict[str, tuple[int, Instruction]] = {}
        for position, instr in enumerate(comp.instructions):
            parsed = _kind_of(instr.opcode)
            if parsed is None:
                continue
            kind, suffix = parsed
            if suffix == "-start":
                starts[instr.name] = (position, instr)
                continue
            source, overlapped, gemms = instr, 0, 0
            if suffix == "-done":  # the groups are on the matching -start
                begun = starts.get(instr.operands[0]) if instr.operands else None
                source = begun[1] if begun else None
                if begun:
                    under = [other for other in comp.instructions[begun[0] + 1:position]
                             if other.opcode in _COMPUTE_OPCODES]
                    overlapped = len(under)
                    gemms = sum(index.kind(other) is not None for other in under)
            attrs = source.attrs if source is not None else ""
            count = mult.get(comp.name, 0)
            if count == 0:
                continue
            shapes = parse_shapes(instr.type_text)
            found.append(HloCollective(
                instr.name, kind, shapes, nbytes(shapes), attr_value(attrs, "replica_groups"),
                count=count, computation=comp.name,
                source_target_pairs=attr_value(attrs, "source_target_pairs"),
                asynchronous=suffix == "-done", overlapped=overlapped, overlapped_gemms=gemms,
            ))
    return found


_COMPUTE_OPCODES = frozenset({"fusion", "custom-call", "dot", "convolution"})


def summarize(found: list[HloCollective], axes: Mapping[str, int] | None = None) -> list[dict]:
    """Totals over the step, one row per collective kind present (in order of appearance):
    ``{"kind", "count", "bytes"}`` with ``count`` the executions (``HloCollective.count``
    summed) and ``bytes`` the per-device result bytes of all of them
    (``HloCollective.total_bytes`` summed).

    With ``axes`` (mesh axis name -> size, in mesh order, e.g. ``{"data": 2, "model": 4}``), one row
    per (kind, mesh axes) instead, with an ``"axes"`` key: the tuple of axis names the collective
    spans (``HloCollective.mesh_axes``), e.g. ``("model",)``."""
    table: OrderedDict[tuple, dict] = OrderedDict()
    for c in found:
        if axes is None:
            row = table.setdefault((c.kind,), {"kind": c.kind, "count": 0, "bytes": 0})
        else:
            spanned = c.mesh_axes(axes)
            row = table.setdefault((c.kind, spanned),
                                   {"kind": c.kind, "axes": spanned, "count": 0, "bytes": 0})
        row["count"] += c.count
        row["bytes"] += c.total_bytes
    return list(table.values())
