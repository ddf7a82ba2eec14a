"""How many times each computation of an HLO module runs per step (its *multiplier*): the call
graph from ENTRY, a ``while`` body run its trip count times (from XLA's ``known_trip_count`` or its
condition's compare against a constant), its condition once more. A ``conditional``'s branches
count once each, and so does the body of a loop of zero or one trips under the pipeline
executor's scope ``taken_in_<n>_of_<t>_ticks`` (:func:`taken_share`;
:func:`jphantom.pipeline.runner.at_most_once`): at most once per trip of the loop around it.
The executor's switch says how often each branch runs (:func:`branch_ticks`): its branches
count that many times per t trips of its loop."""

from __future__ import annotations

import re
from collections.abc import Mapping

from jphantom.analysis.hlo.text import (Computation, Instruction, backend_config,
                                       called_computations, op_name)


_TRIP = re.compile(r'\\?"known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(-?\d+)')
_DIRECTION = re.compile(r"direction=(\w+)")
_TAKEN = re.compile(r"taken_in_(\d+)_of_(\d+)_ticks/(cond|while)$")
_BRANCH_TICKS = re.compile(r"branch_ticks_((?:\d+_)+)of_(\d+)_ticks/cond$")


def taken_share(instr: Instruction) -> float | None:
    """The share of its loop's trips in which a ``conditional`` takes its true branch, or a
    ``while`` of zero or one trips runs its body, from the name scope
    ``taken_in_<n>_of_<t>_ticks`` that directly holds it (None without one:
    :meth:`jphantom.pipeline.runner._Step.taken`)."""
    found = _TAKEN.search(op_name(instr))
    return None if found is None else int(found[1]) / max(1, int(found[2]))


def branch_ticks(instr: Instruction) -> tuple[tuple[int, ...], int] | None:
    """How many of its loop's ``t`` trips each branch of a ``conditional`` runs on the device
    that runs it most, and ``t``, from the name scope ``branch_ticks_<n0>_<n1>_..._of_<t>_ticks``
    that directly holds it (None without one: the pipeline executor's switch,
    :meth:`jphantom.pipeline.runner._Step.slot`)."""
    found = _BRANCH_TICKS.search(op_name(instr))
    if found is None:
        return None
    return tuple(int(n) for n in found[1].rstrip("_").split("_")), int(found[2])


def _int_value(comp: Computation, name: str, params: Mapping[int, int | None],
               carried: Mapping[int, int] = {}) -> int | None:
    """The integer ``name`` holds in ``comp`` if it is a compile-time constant, else None.

    Follows ``copy``/``convert``/``bitcast``/``reshape``, a tuple element of a ``tuple`` or an
    ``opt-barrier``; inside a fusion maps ``parameter(i)`` to the value of the fusion's i-th
    operand (``params``); in a loop's condition maps element i of its parameter to the constant
    the loop carries there unchanged (``carried``, :func:`_carried_constants`)."""
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
        return _int_value(comp, instr.operands[0], params, carried)
    if instr.opcode == "get-tuple-element" and instr.operands:
        index = re.search(r"index=(\d+)", instr.attrs)
        source = comp.find(instr.operands[0])
        if index is None or source is None:
            return None
        index = int(index[1])
        if source.opcode == "parameter":
            return carried.get(index)
        while source is not None and source.opcode == "opt-barrier" and source.operands:
            source = comp.find(source.operands[0])
        if source is not None and source.opcode == "tuple" and index < len(source.operands):
            return _int_value(comp, source.operands[index], params, carried)
    return None


def _carried_constants(loop: Instruction, comps: Mapping[str, Computation]) -> dict[int, int]:
    """Tuple index -> value of each element of the loop's state that starts as a constant and
    that the body passes on unchanged. A bound the program hid from XLA behind an
    ``optimization_barrier`` (so that XLA's loop passes leave the loop alone, as the step's
    accumulation loop does: :func:`jphantom.step.grads.accumulate`) ends up there."""
    caller = next((c for c in comps.values() if any(i is loop for i in c.instructions)), None)
    body = [name for key, name in called_computations(loop) if key == "body"]
    if caller is None or not loop.operands or not body or body[0] not in comps:
        return {}
    init, root = caller.find(loop.operands[0]), comps[body[0]].root
    if init is None or init.opcode != "tuple" or root is None or root.opcode != "tuple":
        return {}
    found = {}
    for index, out in enumerate(root.operands):
        passed = comps[body[0]].find(out)
        if (passed is not None and passed.opcode == "get-tuple-element"
                and re.search(rf"index={index}\b", passed.attrs)
                and index < len(init.operands)):
            value = _int_value(caller, init.operands[index], {})
            if value is not None:
                found[index] = value
    return found


def _trip_count_from_condition(cond: Computation, comps: Mapping[str, Computation],
                               init: int, step: int, carried: Mapping[int, int] = {}
                               ) -> int | None:
    """Trip count of a loop whose condition compares the loop variable with a constant."""
    root = cond.root
    if root is None:
        return None
    scope, params = cond, {}
    if root.opcode == "fusion":  # CPU/GPU wrap the compare in a fusion: look inside it
        callee = [name for key, name in called_computations(root) if key == "calls"]
        if len(callee) != 1 or callee[0] not in comps:
            return None
        params = {i: _int_value(cond, op, {}, carried) for i, op in enumerate(root.operands)}
        scope = comps[callee[0]]
        root = scope.root
    if root is None or root.opcode != "compare" or len(root.operands) != 2:
        return None
    direction = _DIRECTION.search(root.attrs)
    lhs, rhs = (_int_value(scope, op, params, carried if scope is cond else {})
                for op in root.operands)
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
    ``constant(N)``, also ``LE``/``GT``/``GE`` and inside a fusion; N may also be a constant the
    loop carries unchanged in its state), with the loop variable starting
    at ``"known_init_step"`` of backend_config if given, else at 0 with step 1 (how ``lax.scan``
    and ``lax.fori_loop`` lower). Raises ``ValueError`` when neither works.
    """
    config = backend_config(loop)
    known = config.get("known_trip_count", {}).get("n") if isinstance(config, dict) else None
    if known is None:
        match = _TRIP.search(loop.attrs)
        known = match[1] if match else None
    if known is not None:
        return int(known)
    init_step = config.get("known_init_step", {}) if isinstance(config, dict) else {}
    init, step = int(init_step.get("init", 0)), int(init_step.get("step", 1))
    condition = [name for key, name in called_computations(loop) if key == "condition"]
    if condition and condition[0] in comps and step != 0:
        count = _trip_count_from_condition(comps[condition[0]], comps, init, step,
                                           _carried_constants(loop, comps))
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
            for key, callee in called_computations(instr):
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
        branch = {}  # id(conditional) -> its next branch's index
        for callee, instr, key in edges[name]:
            factor = 1
            if instr.opcode == "conditional" and key == "branch_computations":
                index = branch[id(instr)] = branch.get(id(instr), -1) + 1
                ticks = branch_ticks(instr)
                if ticks is not None and index < len(ticks[0]):
                    mult[callee] += round(mult[name] * ticks[0][index] / max(1, ticks[1]))
                    continue
            if instr.opcode == "while" and key in ("body", "condition"):
                if id(instr) not in trips:  # a loop of at most one trip counts once
                    trips[id(instr)] = (1 if taken_share(instr) is not None
                                        else trip_count(instr, comps))
                # The condition is evaluated once more than the body: the last test exits.
                factor = trips[id(instr)] + (key == "condition")
            mult[callee] += mult[name] * factor
    return mult
