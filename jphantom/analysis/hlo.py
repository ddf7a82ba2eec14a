"""Parse the collectives (and the GEMMs) out of compiled HLO text.

``collectives(hlo_text)`` lists every collective instruction with its kind (the HLO op name:
"all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all"), result shapes,
per-device result bytes, replica groups, the computation it sits in and ``count``: how many times it
executes per step. Asynchronous pairs (``all-gather-start`` / ``all-gather-done``) count once, with
the bytes of the ``-done`` result.

Loops are counted by their trip count. The module is split into its computations and each
computation reachable from ENTRY gets a *multiplier*, the number of times it runs per execution of
the module (``multipliers``):

* ENTRY runs once;
* a ``while`` body runs (caller's multiplier) x (trip count) times, its condition one time more,
  since the condition is evaluated once more than the body to exit; nested loops multiply;
* computations reached through ``calls=`` (fusions, ``call``, async wrappers such as
  ``async-start``), ``to_apply=`` (reductions, sort comparators, ...) and the like run as often as
  their caller;
* conditional branches (``branch_computations={...}``, ``true_computation=``,
  ``false_computation=``) are each counted as often as their caller, as if every branch ran: the
  branch taken is only known at run time, so this is an upper bound for the branches;
* a computation called from several places adds up the counts of all its call sites.

The trip count of a ``while`` comes from XLA's ``backend_config`` (``"known_trip_count":{"n":"N"}``)
when present, otherwise from its condition computation (the loop variable compared with a constant,
e.g. ``compare(i, constant(N)), direction=LT``; possibly inside a fusion); when neither works,
``ValueError`` is raised rather than guessing.

``dot_flops(hlo_text)`` counts the FLOPs of the ``dot`` instructions with the same multipliers.
``kernels(hlo_text)`` counts, with them too, the kernels that decide a step's speed: fused
attention custom calls (cuDNN's), hand-written Pallas kernels, GEMMs by emitter and whether they
read FP8, and the asynchronous collectives with GEMMs scheduled under them.
``summarize`` tallies collectives per kind and, given the mesh axes, per kind and mesh axes
(``group_axes`` maps replica groups onto mesh axes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all",
         "ragged-all-to-all")

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}

_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
# Groups come as {{0,1},{2,3}}, as iota [2,4]<=[8] (optionally with T(...)), or as
# mesh['x'=2,'y'=4] {'y'}; this fallback pattern cuts the value at the next attribute.
_GROUPS = re.compile(r"replica_groups=(.*?)(?:, [a-z_]+=|$)")
_IOTA = re.compile(r"\[([0-9,]*)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?")


# ---------------------------------------------------------------------------------------------
# Module structure: computations and instructions.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction line: ``[ROOT] %name = type opcode(operands), attrs``."""

    name: str
    type_text: str  # the result type, e.g. "f32[4,4]{1,0}" or "(s32[], f32[4,4]{1,0})"
    opcode: str
    operands: tuple[str, ...]  # operand names without '%' (for a constant: its literal)
    attrs: str  # everything after the operand list, e.g. ", channel_id=1, replica_groups=..."
    root: bool

    def attr(self, key: str) -> str:
        """The text of attribute ``key`` (braced, iota or plain), or "" when absent."""
        return _attr_value(self.attrs, key)

    def callees(self) -> list[tuple[str, str]]:
        """(attribute, computation name) for every computation this instruction calls."""
        return _callees(self)

    @property
    def nbytes(self) -> int:
        """Bytes of the result (every array of a tuple)."""
        return type_bytes(self.type_text)


@dataclasses.dataclass
class Computation:
    """A named HLO computation (``%name (params) -> type { ... }``); ``entry`` marks ENTRY."""

    name: str
    entry: bool
    instructions: list[Instruction] = dataclasses.field(default_factory=list)

    @property
    def root(self) -> Instruction | None:
        """The ROOT instruction (the last one when none is marked)."""
        for instr in self.instructions:
            if instr.root:
                return instr
        return self.instructions[-1] if self.instructions else None

    def find(self, name: str) -> Instruction | None:
        for instr in self.instructions:
            if instr.name == name:
                return instr
        return None


_HEADER = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR_HEAD = re.compile(r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*(?P<opcode>[a-z][\w\-]*)\(")
_OPEN, _CLOSE = "([{", ")]}"


def _balanced_end(text: str, start: int) -> int:
    """Index just past the bracket that closes the one opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO line: {text!r}")


def _split_top_level(text: str) -> list[str]:
    """Split at the commas that are not nested inside brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current))
    return [p.strip() for p in parts]


def parse_instruction(line: str) -> Instruction | None:
    """Parse one instruction line; None for anything else (headers, braces, metadata tables)."""
    head = _INSTR_HEAD.match(line)
    if not head:
        return None
    pos = head.end()
    if pos >= len(line):
        return None
    if line[pos] == "(":  # tuple type
        end = _balanced_end(line, pos)
    else:
        end = pos
        while end < len(line) and not line[end].isspace():
            end += 1
    type_text = line[pos:end]
    opcode = _OPCODE.match(line, end)
    if not opcode:
        return None
    open_paren = opcode.end() - 1
    close = _balanced_end(line, open_paren)
    operands_text = line[open_paren + 1:close - 1]
    if opcode["opcode"] == "constant":
        operands = (operands_text.strip(),)
    else:
        # Operands print as "%name" or, in older dumps, "f32[4]{0} %name": keep the last token.
        operands = tuple(p.split()[-1].lstrip("%") for p in _split_top_level(operands_text) if p)
    return Instruction(head["name"], type_text, opcode["opcode"], operands, line[close:],
                       bool(head["root"]))


def parse_module(hlo_text: str) -> OrderedDict[str, Computation]:
    """The computations of an HLO module's text, in text order, keyed by name.

    Lines outside any computation (the ``HloModule`` line, stack-frame tables) are skipped. Text
    without computation headers (a bare list of instructions) becomes one ENTRY computation named
    ``""``, so fragments parse as straight-line code.
    """
    comps: OrderedDict[str, Computation] = OrderedDict()
    current: Computation | None = None
    loose = Computation("", entry=True)
    for line in hlo_text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header:
                current = Computation(header["name"], entry=bool(header["entry"]))
                comps[current.name] = current
                continue
            instr = parse_instruction(line)
            if instr:
                loose.instructions.append(instr)
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = parse_instruction(line)
        if instr:
            current.instructions.append(instr)
    if not comps and loose.instructions:
        comps[""] = loose
    return comps


# ---------------------------------------------------------------------------------------------
# Call graph, trip counts and multipliers.
# ---------------------------------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# Attributes that name called computations: value is %comp or {%a, %b}.
_CALL_ATTRS = ("calls", "to_apply", "branch_computations", "true_computation",
               "false_computation", "called_computations", "select", "scatter", "comparator")
_CALLEE = re.compile(
    r"\b(?P<key>body|condition|" + "|".join(_CALL_ATTRS) + r")=(?P<value>\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'\\?"known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(-?\d+)')
_DIRECTION = re.compile(r"direction=(\w+)")


def _callees(instr: Instruction) -> list[tuple[str, str]]:
    """(attribute, computation name) for every computation ``instr`` calls."""
    attrs = _STRING.sub('""', instr.attrs)  # no matches inside metadata strings
    found = []
    for match in _CALLEE.finditer(attrs):
        for name in re.findall(r"%?([\w.\-]+)", match["value"]):
            found.append((match["key"], name))
    return found


def _backend_config(instr: Instruction) -> dict:
    """The while's ``backend_config`` JSON, or {} when absent or unreadable."""
    start = instr.attrs.find("backend_config=")
    if start < 0:
        return {}
    start += len("backend_config=")
    if start >= len(instr.attrs) or instr.attrs[start] != "{":
        return {}
    try:
        return json.loads(instr.attrs[start:_balanced_end(instr.attrs, start)])
    except (ValueError, json.JSONDecodeError):
        return {}


def _int_value(comp: Computation, name: str, params: Mapping[int, int | None]) -> int | None:
    """The integer ``name`` holds in ``comp`` if it is a compile-time constant, else None.

    Follows ``copy``/``convert``/``bitcast``/``reshape`` and, inside a fusion, maps
    ``parameter(i)`` to the value of the fusion's i-th operand (``params``)."""
    instr = comp.find(name)
    if instr is None:
        return None
    if instr.opcode == "constant":
        literal = instr.operands[0]
        return int(literal) if re.fullmatch(r"-?\d+", literal) else None
    if instr.opcode == "parameter":
        index = instr.operands[0]
        return params.get(int(index)) if index.isdigit() else None
    if instr.opcode in ("copy", "convert", "bitcast", "reshape") and instr.operands:
        return _int_value(comp, instr.operands[0], params)
    return None


def _trip_count_from_condition(cond: Computation, comps: Mapping[str, Computation],
                               init: int, step: int) -> int | None:
    """Trip count of a loop whose condition compares the loop variable with a constant."""
    root = cond.root
    if root is None:
        return None
    scope, params = cond, {}
    if root.opcode == "fusion":  # CPU/GPU wrap the compare in a fusion: look inside it
        callee = [name for key, name in _callees(root) if key == "calls"]
        if len(callee) != 1 or callee[0] not in comps:
            return None
        params = {i: _int_value(cond, op, {}) for i, op in enumerate(root.operands)}
        scope = comps[callee[0]]
        root = scope.root
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = _DIRECTION.search(root.attrs)
    lhs, rhs = (_int_value(scope, op, params) for op in root.operands)
    if direction is None or (lhs is None) == (rhs is None):
        return None  # need exactly one constant side: the bound
    direction = direction[1]
    if lhs is not None:  # "N > i" is "i < N"
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    bound = rhs if rhs is not None else lhs
    if step > 0 and direction in ("LT", "LE"):
        stop = bound if direction == "LT" else bound + 1
        return max(0, -(-(stop - init) // step))
    if step < 0 and direction in ("GT", "GE"):
        stop = bound if direction == "GT" else bound - 1
        return max(0, -(-(init - stop) // -step))
    return None


def trip_count(loop: Instruction, comps: Mapping[str, Computation]) -> int:
    """How many times the body of the ``while`` instruction ``loop`` runs.

    XLA's ``"known_trip_count"`` (backend_config) when present; otherwise derived from the condition
    computation, ``i < N`` (``compare(..., direction=LT)`` of the loop variable against
    ``constant(N)``, also ``LE``/``GT``/``GE`` and inside a fusion), with the loop variable starting
    at ``"known_init_step"`` of backend_config if given, else at 0 with step 1 (how ``lax.scan``
    and ``lax.fori_loop`` lower). Raises ``ValueError`` when neither works.
    """
    config = _backend_config(loop)
    known = config.get("known_trip_count", {}).get("n") if isinstance(config, dict) else None
    if known is None:
        match = _TRIP.search(loop.attrs)
        known = match[1] if match else None
    if known is not None:
        return int(known)
    init_step = config.get("known_init_step", {}) if isinstance(config, dict) else {}
    init, step = int(init_step.get("init", 0)), int(init_step.get("step", 1))
    condition = [name for key, name in _callees(loop) if key == "condition"]
    if condition and condition[0] in comps and step != 0:
        count = _trip_count_from_condition(comps[condition[0]], comps, init, step)
        if count is not None:
            return count
    raise ValueError(
        f"cannot determine the trip count of while loop %{loop.name} (condition="
        f"{'%' + condition[0] if condition else '?'}): no known_trip_count in its backend_config "
        "and its condition is not a compare of the loop variable against a constant"
    )


def multipliers(comps: Mapping[str, Computation]) -> dict[str, int]:
    """How many times each computation runs per execution of the module (see the module doc).

    Computations not reachable from ENTRY are absent (their loops are never inspected). Without an
    ENTRY (a fragment), every computation that nothing calls is a root run once."""
    edges: dict[str, list[tuple[str, Instruction, str]]] = {name: [] for name in comps}
    called = set()
    for comp in comps.values():
        for instr in comp.instructions:
            for key, callee in _callees(instr):
                if callee in comps:
                    edges[comp.name].append((callee, instr, key))
                    called.add(callee)
    roots = [c.name for c in comps.values() if c.entry]
    if not roots:
        roots = [name for name in comps if name not in called]

    # Reachable computations in topological order (callers before callees; HLO has no recursion).
    order, state = [], {}
    for root in roots:
        if root in state:
            continue
        state[root] = "open"
        stack = [(root, iter(edges[root]))]
        while stack:
            node, children = stack[-1]
            for child, _, _ in children:
                if child not in state:
                    state[child] = "open"
                    stack.append((child, iter(edges[child])))
                    break
                if state[child] == "open":
                    raise ValueError(f"recursive HLO call graph through %{child}")
            else:
                stack.pop()
                state[node] = "done"
                order.append(node)
    order.reverse()

    mult = {name: 0 for name in order}
    for root in roots:
        mult[root] = 1
    trips: dict[int, int] = {}  # id(while instruction) -> trip count
    for name in order:
        for callee, instr, key in edges[name]:
            factor = 1
            if instr.opcode == "while" and key in ("body", "condition"):
                if id(instr) not in trips:
                    trips[id(instr)] = trip_count(instr, comps)
                # The condition is evaluated once more than the body: the last test exits.
                factor = trips[id(instr)] + (key == "condition")
            mult[callee] += mult[name] * factor
    return mult


# ---------------------------------------------------------------------------------------------
# Collectives.
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Collective:
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


def _parse_shapes(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    shapes = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in DTYPE_BYTES:
            continue  # token[], layouts and the like
        shapes.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return tuple(shapes)


def type_bytes(type_text: str) -> int:
    """Bytes of the arrays an HLO type names (``f32[4,4]{1,0}``, or a tuple of them)."""
    return _nbytes(_parse_shapes(type_text))


def _nbytes(shapes) -> int:
    total = 0
    for dtype, dims in shapes:
        count = 1
        for d in dims:
            count *= d
        total += count * DTYPE_BYTES[dtype]
    return total


def _attr_value(attrs: str, key: str) -> str:
    """The text of attribute ``key`` (braced, iota or plain), or "" when absent."""
    match = re.search(rf"\b{re.escape(key)}=", attrs)
    if not match:
        return ""
    start = match.end()
    if attrs.startswith("{", start):
        return attrs[start:_balanced_end(attrs, start)]
    iota = _IOTA.match(attrs, start)
    if iota:
        return iota[0]
    mesh = _MESH_GROUPS.match(attrs, start) if key == "replica_groups" else None
    if mesh:
        return mesh[0]
    fallback = _GROUPS.search(attrs) if key == "replica_groups" else None
    if fallback:
        return fallback[1]
    return re.match(r"[^,\s]*", attrs[start:])[0]


def _kind_of(opcode: str) -> tuple[str, str] | None:
    """(kind, "" | "-start" | "-done") for a collective opcode, else None."""
    for suffix in ("-start", "-done", ""):
        if opcode.endswith(suffix):
            kind = opcode[: len(opcode) - len(suffix)] if suffix else opcode
            if kind in KINDS:
                return kind, suffix
    return None


def collectives(hlo_text: str) -> list[Collective]:
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
    return _collectives(comps, multipliers(comps), _GemmIndex(comps))


def _collectives(comps: Mapping[str, Computation], mult: Mapping[str, int],
                 index: _GemmIndex) -> list[Collective]:
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
            shapes = _parse_shapes(instr.type_text)
            found.append(Collective(
                instr.name, kind, shapes, _nbytes(shapes), _attr_value(attrs, "replica_groups"),
                count=count, computation=comp.name,
                source_target_pairs=_attr_value(attrs, "source_target_pairs"),
                asynchronous=suffix == "-done", overlapped=overlapped, overlapped_gemms=gemms,
            ))
    return found


_COMPUTE_OPCODES = frozenset({"fusion", "custom-call", "dot", "convolution"})


def summarize(found: list[Collective], axes: Mapping[str, int] | None = None) -> list[dict]:
    """Totals over the step, one row per collective kind present (in order of appearance):
    ``{"kind", "count", "bytes"}`` with ``count`` the executions (``Collective.count`` summed) and
    ``bytes`` the per-device result bytes of all of them (``Collective.total_bytes`` summed).

    With ``axes`` (mesh axis name -> size, in mesh order, e.g. ``{"data": 2, "model": 4}``), one row
    per (kind, mesh axes) instead, with an ``"axes"`` key: the tuple of axis names the collective
    spans (``Collective.mesh_axes``), e.g. ``("model",)``."""
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


# ---------------------------------------------------------------------------------------------
# Replica groups -> mesh axes.
# ---------------------------------------------------------------------------------------------

def _mesh_shape(axes: Mapping[str, int]) -> tuple[list[str], tuple[int, ...]]:
    names = list(axes)
    shape = tuple(int(axes[name]) for name in names)
    if not names or any(size < 1 for size in shape):
        raise ValueError(f"mesh axes {dict(axes)!r} must be a non-empty name -> size (>= 1) map")
    return names, shape


_MESH_GROUPS = re.compile(r"mesh\[(?P<axes>[^\]]*)\]"
                          r"(?:,\s*device_ids=\(\[(?P<ids>[0-9,]*)\](?:T\((?P<perm>[0-9,]*)\))?\))?"
                          r"\s*\{(?P<over>[^}]*)\}")


def normalise_replica_groups(text: str) -> str:
    """GSPMD writes replica groups as ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (devices in iota
    order over that shape, or in the order ``device_ids=([2,4]T(1,0))`` gives between the two,
    one group per combination of the axes *not* listed); rewrite that as the
    equivalent iota list ``[2,4]<=[2,4]`` (here; transposed with ``T(...)`` so that the listed axes
    come last) that :func:`jphantom.analysis.hlo.replica_group_lists` reads. Other syntaxes are
    returned unchanged."""
    match = _MESH_GROUPS.fullmatch(text.strip())
    if not match:
        return text
    axes = re.findall(r"'([^']*)'\s*=\s*(\d+)", match["axes"])
    over = set(re.findall(r"'([^']*)'", match["over"]))
    names = [name for name, _ in axes]
    sizes = [int(size) for _, size in axes]
    if not axes or not over <= set(names):
        return text
    kept = [i for i, name in enumerate(names) if name not in over]
    grouped = [i for i, name in enumerate(names) if name in over]
    group_size = math.prod(sizes[i] for i in grouped)
    if match["ids"] is not None:  # the mesh's devices: an iota reshaped and transposed
        dims = [int(d) for d in match["ids"].split(",") if d]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match["perm"]:
            ids = ids.transpose([int(d) for d in match["perm"].split(",") if d])
        groups = ids.reshape(sizes).transpose(kept + grouped).reshape(-1, group_size)
        return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups.tolist()) + "}"
    perm = ",".join(str(i) for i in kept + grouped)
    return (f"[{math.prod(sizes) // group_size},{group_size}]<=[{','.join(map(str, sizes))}]"
            f"T({perm})")


def replica_group_lists(replica_groups_text: str, num_devices: int) -> list[list[int]]:
    """The device-id groups of a ``replica_groups`` attribute: explicit ``{{0,1},{2,3}}``, iota
    ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)`` (iota of the product reshaped to the dims after ``<=``,
    transposed by ``T(...)``, reshaped to the dims before ``<=``; one group per row), or empty
    ``{}`` / "" (all ``num_devices`` devices in one group), or GSPMD's
    ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (:func:`normalise_replica_groups`)."""
    text = normalise_replica_groups(replica_groups_text).strip()
    if text in ("", "{}"):
        return [list(range(num_devices))]
    iota = _IOTA.fullmatch(text)
    if iota:
        group_shape = [int(d) for d in iota[1].split(",") if d]
        source_shape = [int(d) for d in iota[2].split(",") if d]
        ids = np.arange(math.prod(source_shape)).reshape(source_shape)
        if iota[3] is not None:
            ids = ids.transpose([int(d) for d in iota[3].split(",") if d])
        ids = ids.reshape(group_shape[0], -1) if group_shape else ids.reshape(1, -1)
        return ids.tolist()
    if re.fullmatch(r"\{\s*(\{[0-9,\s]*\}\s*,?\s*)*\}", text):
        return [[int(d) for d in group.split(",") if d.strip()]
                for group in re.findall(r"\{([0-9,\s]*)\}", text[1:-1])]
    raise ValueError(f"unrecognised replica_groups syntax: {replica_groups_text!r}")


def _axes_differing(members: list[int], names: list[str], shape: tuple[int, ...]) -> set[str]:
    """Names of the axes on which the mesh coordinates of ``members`` are not all equal."""
    size = math.prod(shape)
    if any(d < 0 or d >= size for d in members):
        raise ValueError(f"device ids {members} outside a mesh of {size} devices {shape}")
    if len(members) < 2:
        return set()
    coords = np.array(np.unravel_index(members, shape))  # (rank, members), C order
    return {names[a] for a in range(len(shape)) if np.unique(coords[a]).size > 1}


def group_axes(replica_groups_text: str, axes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes, in mesh order, that the replica groups span.

    ``axes`` maps axis name -> size in mesh order (``{"data": 2, "model": 4}``); device id ``d`` has
    coordinates ``numpy.unravel_index(d, sizes)`` (C order, as ``jax.make_mesh`` lays devices out).
    A group spans axis ``a`` iff its members differ in coordinate ``a``; the result is the union over
    the groups. Groups as in ``replica_group_lists``: ``"{{0,1},{2,3}}"``, ``"[2,4]<=[8]"``,
    ``"[4,2]<=[2,4]T(1,0)"``, ``"{}"`` (all devices: every axis of size > 1)."""
    names, shape = _mesh_shape(axes)
    spanned: set[str] = set()
    for group in replica_group_lists(replica_groups_text, math.prod(shape)):
        spanned |= _axes_differing(group, names, shape)
    return tuple(name for name in names if name in spanned)


def pair_axes(source_target_pairs_text: str, axes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes, in mesh order, on which the source and target of some pair differ, for a
    collective-permute's ``source_target_pairs={{0,1},{1,2}}`` (device ids as in ``group_axes``)."""
    names, shape = _mesh_shape(axes)
    text = source_target_pairs_text.strip()
    if not re.fullmatch(r"\{\s*(\{\s*\d+\s*,\s*\d+\s*\}\s*,?\s*)*\}", text):
        raise ValueError(f"unrecognised source_target_pairs syntax: {source_target_pairs_text!r}")
    spanned: set[str] = set()
    for source, target in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", text):
        spanned |= _axes_differing([int(source), int(target)], names, shape)
    return tuple(name for name in names if name in spanned)


# ---------------------------------------------------------------------------------------------
# GEMM FLOPs.
# ---------------------------------------------------------------------------------------------

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
                numbers = _backend_config(instr)["gemm_backend_config"]["dot_dimension_numbers"]
                dims = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
            else:
                dims = _dims(_LHS_CONTRACTING.search(instr.attrs)[1])
            contracted = math.prod(lhs[d] for d in dims)
            result = _ARRAY_TYPE.search(instr.type_text)  # a cuBLAS call's first result
            flops += runs * 2 * math.prod(_dims(result[1])) * contracted
            count += runs
    return flops, count


# ---------------------------------------------------------------------------------------------
# Kernels: fused attention, FP8 and other GEMMs, GEMMs under asynchronous collectives.
# ---------------------------------------------------------------------------------------------

_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FUSION_KIND = re.compile(r'"kind"\s*:\s*"([^"]*)"')
_CUBLAS_KINDS = {"__cublas$gemm": "cublas", "__cublas$lt$matmul": "cublas_lt",
                 "__cublas$lt$matmul$f8": "cublas_lt_f8"}
# Hand-written kernels called as custom calls: Pallas on GPU through Triton, Pallas's Mosaic GPU
# and TPU backends.
_PALLAS_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "mosaic_gpu_v2", "tpu_custom_call")
# Control flow whose called computations hold kernels (a fusion's body holds its kernel's ops)
_KERNEL_CALLERS = {"while": ("body", "condition"), "call": ("to_apply", "calls"),
                   "conditional": ("branch_computations", "true_computation",
                                   "false_computation"),
                   "async-start": ("calls",)}


def custom_call_target(instr: Instruction) -> str:
    """The ``custom_call_target`` of a custom call ("" for anything else)."""
    if instr.opcode != "custom-call":
        return ""
    found = _TARGET.search(instr.attrs)
    return found[1] if found else ""


def _dtype(type_text: str) -> str:
    """The element type of an array type (the first array of a tuple), "" when none."""
    found = _ARRAY.search(type_text)
    return found[1] if found else ""


def _is_f8(type_text: str) -> bool:
    return _dtype(type_text).startswith("f8")


class _GemmIndex:
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
                    for key, callee in _callees(instr):
                        if key == "calls":
                            found += self.dots(callee)
            self._dots[name] = found
        return self._dots[name]

    def body(self, fusion: Instruction) -> str | None:
        return next((callee for key, callee in _callees(fusion) if key == "calls"), None)

    def kind(self, instr: Instruction) -> str | None:
        """The GEMM kernel ``instr`` is, or None: ``cublas``, ``cublas_lt``, ``cublas_lt_f8``
        (XLA:GPU's cuBLAS custom calls), ``dot`` (a dot XLA left unfused: XLA:CPU), or for a
        fusion holding a dot its emitter from the backend config: ``triton`` (XLA's Triton GEMM
        fusions), ``cudnn`` (cuDNN GEMM fusions), ``cublas``, else ``fusion``."""
        if instr.opcode == "custom-call":
            return _CUBLAS_KINDS.get(custom_call_target(instr))
        if instr.opcode == "dot":
            return "dot"
        if instr.opcode != "fusion":
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
    matrix multiply (``_GemmIndex.kind``)."""
    return _GemmIndex(comps).kind(instr)


def _kernel_computations(comps: Mapping[str, Computation]) -> list[str]:
    """The computations whose instructions are kernels or control flow: ENTRY and what loops,
    calls, conditionals and async wrappers run (not fusion bodies or reducers)."""
    roots = [c.name for c in comps.values() if c.entry]
    if not roots:
        called = {callee for comp in comps.values() for instr in comp.instructions
                  for _, callee in _callees(instr)}
        roots = [name for name in comps if name not in called]
    seen, todo = set(roots), list(roots)
    while todo:
        for instr in comps[todo.pop()].instructions:
            keys = _KERNEL_CALLERS.get(instr.opcode, ())
            for key, callee in _callees(instr):
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
    - ``gemms``: every GEMM kernel, ``total`` and ``by_kind`` (:meth:`_GemmIndex.kind`: ``triton``,
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
    index = _GemmIndex(comps)
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
    moving = [c for c in _collectives(comps, mult, index) if c.asynchronous and not c.trivial]
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
