"""HLO text read into its computations and instructions: an instruction line's name, result type,
opcode, operands and attributes; the arrays a type names and their bytes; an attribute's value
(braced, iota or GSPMD's mesh form); the computations an instruction calls; a ``backend_config``."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import OrderedDict


DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}

ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
# Groups come as {{0,1},{2,3}}, as iota [2,4]<=[8] (optionally with T(...)), or as
# mesh['x'=2,'y'=4] {'y'}; this fallback pattern cuts the value at the next attribute.
_GROUPS = re.compile(r"replica_groups=(.*?)(?:, [a-z_]+=|$)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
IOTA = re.compile(r"\[([0-9,]*)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?")


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
        return attr_value(self.attrs, key)

    def callees(self) -> list[tuple[str, str]]:
        """(attribute, computation name) for every computation this instruction calls."""
        return called_computations(self)

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
_COMMENT = re.compile(r"^/\*.*?\*/")


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
        # a long operand list marks every fifth operand "/*index=5*/%name": the name is the rest
        operands = tuple(_COMMENT.sub("", p.split()[-1]).lstrip("%")
                         for p in _split_top_level(operands_text) if p)
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


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# Attributes that name called computations: value is %comp or {%a, %b}.
_CALL_ATTRS = ("calls", "to_apply", "branch_computations", "true_computation",
               "false_computation", "called_computations", "select", "scatter", "comparator")
_CALLEE = re.compile(
    r"\b(?P<key>body|condition|" + "|".join(_CALL_ATTRS) + r")=(?P<value>\{[^}]*\}|%?[\w.\-]+)"
)


def called_computations(instr: Instruction) -> list[tuple[str, str]]:
    """(attribute, computation name) for every computation ``instr`` calls."""
    attrs = _STRING.sub('""', instr.attrs)  # no matches inside metadata strings
    found = []
    for match in _CALLEE.finditer(attrs):
        for name in re.findall(r"%?([\w.\-]+)", match["value"]):
            found.append((match["key"], name))
    return found


def op_name(instr: Instruction) -> str:
    """The op_name of ``instr``'s metadata (its jax name scope), or ""."""
    found = _OP_NAME.search(instr.attrs)
    return found[1] if found else ""


def backend_config(instr: Instruction) -> dict:
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


def parse_shapes(type_text: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    shapes = []
    for dtype, dims in ARRAY.findall(type_text):
        if dtype not in DTYPE_BYTES:
            continue  # token[], layouts and the like
        shapes.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return tuple(shapes)


def type_bytes(type_text: str) -> int:
    """Bytes of the arrays an HLO type names (``f32[4,4]{1,0}``, or a tuple of them)."""
    return nbytes(parse_shapes(type_text))


def nbytes(shapes) -> int:
    total = 0
    for dtype, dims in shapes:
        count = 1
        for d in dims:
            count *= d
        total += count * DTYPE_BYTES[dtype]
    return total


def attr_value(attrs: str, key: str) -> str:
    """The text of attribute ``key`` (braced, iota or plain), or "" when absent."""
    match = re.search(rf"\b{re.escape(key)}=", attrs)
    if not match:
        return ""
    start = match.end()
    if attrs.startswith("{", start):
        return attrs[start:_balanced_end(attrs, start)]
    iota = IOTA.match(attrs, start)
    if iota:
        return iota[0]
    mesh = MESH_GROUPS.match(attrs, start) if key == "replica_groups" else None
    if mesh:
        return mesh[0]
    fallback = _GROUPS.search(attrs) if key == "replica_groups" else None
    if fallback:
        return fallback[1]
    return re.match(r"[^,\s]*", attrs[start:])[0]


MESH_GROUPS = re.compile(r"mesh\[(?P<axes>[^\]]*)\]"
                          r"(?:,\s*device_ids=\(\[(?P<ids>[0-9,]*)\](?:T\((?P<perm>[0-9,]*)\))?\))?"
                          r"\s*\{(?P<over>[^}]*)\}")
