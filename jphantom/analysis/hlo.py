"""Parse the collectives (and the GEMMs) out of compiled HLO text.

``collectives(hlo_text)`` lists every collective instruction with its kind (the HLO op name:
"all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all"), result shapes,
per-device result bytes and replica groups. Asynchronous pairs (``all-gather-start`` /
``all-gather-done``) count once, with the bytes of the ``-done`` result. A collective inside a loop
body is listed once, not once per trip: jphantom's strategies unroll their layers, so this is exact
for them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import OrderedDict

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}

_OP = "|".join(re.escape(k) for k in KINDS)
_LINE = re.compile(
    rf"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+(?P<op>(?:{_OP})(?:-start|-done)?)\("
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
# Groups come as {{0,1},{2,3}}, as iota [2,4]<=[8], or as mesh['x'=2,'y'=4] {'y'}.
_GROUPS = re.compile(r"replica_groups=(.*?)(?:, [a-z_]+=|$)")


@dataclasses.dataclass(frozen=True)
class Collective:
    name: str
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result buffer
    bytes: int  # per-device size of the result buffers
    replica_groups: str

    @property
    def elements(self) -> int:
        total = 0
        for _, dims in self.shapes:
            count = 1
            for d in dims:
                count *= d
            total += count
        return total


def _parse_shapes(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    shapes = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in DTYPE_BYTES:
            continue  # token[], layouts and the like
        shapes.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return tuple(shapes)


def _nbytes(shapes) -> int:
    total = 0
    for dtype, dims in shapes:
        count = 1
        for d in dims:
            count *= d
        total += count * DTYPE_BYTES[dtype]
    return total


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in an HLO module's text, in program order."""
    found = []
    groups_of_start = {}
    for line in hlo_text.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        op = match["op"]
        groups = _GROUPS.search(line)
        groups_text = groups.group(1) if groups else ""
        if op.endswith("-start"):
            groups_of_start[match["name"]] = groups_text
            continue
        kind = op.removesuffix("-done")
        if op.endswith("-done"):
            operand = re.search(r"-done\(\s*(?:\S+\s+)?%?([\w.\-]+)", line)
            groups_text = groups_of_start.get(operand.group(1), "") if operand else ""
        shapes = _parse_shapes(match["type"])
        found.append(Collective(match["name"], kind, shapes, _nbytes(shapes), groups_text))
    return found


def summarize(found: list[Collective]) -> list[dict]:
    """``[{"kind", "count", "bytes"}]`` per collective kind present, bytes summed over the step."""
    table: OrderedDict[str, dict] = OrderedDict()
    for c in found:
        row = table.setdefault(c.kind, {"kind": c.kind, "count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += c.bytes
    return list(table.values())


_DEFINES = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[a-z0-9]+\[([0-9,]*)\]")
_DOT = re.compile(
    r"=\s*[a-z0-9]+\[([0-9,]*)\]\S*\s+dot\(\s*(?:[a-z0-9]+\[[0-9,]*\]\S*\s+)?%?([\w.\-]+)"
)
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def dot_flops(hlo_text: str) -> tuple[int, int]:
    """(FLOPs, count) of every ``dot`` in an optimized HLO module, 2 per multiply-add:
    2 x (elements of the result) x (product of the lhs contracting dimensions). Fusion bodies
    included; each instruction name is defined once per module, so operand shapes are looked up by
    name. Unlike ``cost_analysis()``, element-wise work is not counted: these are the GEMMs alone."""
    shapes = {}
    for line in hlo_text.splitlines():
        match = _DEFINES.match(line)
        if match:
            shapes[match[1]] = _dims(match[2])
    flops = count = 0
    for line in hlo_text.splitlines():
        dot = _DOT.search(line)
        if not dot:
            continue
        lhs = shapes[dot[2]]
        contracted = math.prod(lhs[d] for d in _dims(_LHS_CONTRACTING.search(line)[1]))
        flops += 2 * math.prod(_dims(dot[1])) * contracted
        count += 1
    return flops, count
