"""The compiled program played on a modelled device: one compute stream and one collective
stream, following the schedule XLA chose.

The text order of a scheduled HLO computation is its schedule. The simulator walks ENTRY in that
order with two clocks:

* **compute**: every kernel (:class:`jphantom.predict.costs.Pricer`) runs on one stream, one
  after another;
* **collectives**: a synchronous collective waits for both streams and blocks compute while it
  runs. An asynchronous one (``*-start`` ... ``*-done``, or an ``async-start`` wrapping a
  collective) starts when the compute stream reaches its start and the collective stream is free
  (NCCL runs one collective at a time on it), runs for its network time
  (:class:`jphantom.predict.network.Network`), and the compute stream waits at its ``-done``
  only for what is left. Compute scheduled between start and done hides it.

Control flow: a ``while`` runs its body (and its condition) as a program of its own, times its
trip count (XLA's ``known_trip_count``, else its condition's constant:
:func:`jphantom.analysis.hlo.trip_count`), nested loops multiplying; a ``conditional`` takes its
slowest branch (in the pipeline executor's SPMD switch every device waits for the slowest); a
``call`` runs its callee in place. Each collective's group is placed on nodes by ``node_of``
(the device id's node), so a group that spans nodes is priced on the NICs.

The result (:class:`Timeline`) splits the step into compute seconds, communication hidden under
compute, and communication exposed (the compute stream waiting on a collective): ``step = compute
+ exposed``. Every op's seconds, multiplied by the loops around it, feed the top-ops table.
Modelled, not measured: no contention between overlapped streams, no host overhead.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping

from jphantom.analysis.hlo.accounting import KINDS as COLLECTIVE_KINDS
from jphantom.analysis.hlo.accounting import Collective
from jphantom.analysis.hlo.callgraph import trip_count
from jphantom.analysis.hlo.text import Computation, Instruction, parse_module, type_bytes
from jphantom.predict.costs import Pricer, callees, op_name
from jphantom.predict.device import DeviceModel
from jphantom.predict.network import Network, placement


@dataclasses.dataclass
class Timeline:
    """Seconds of one run of a computation: ``step`` (wall), ``compute`` (the compute stream
    busy), ``exposed`` (compute stream waiting on collectives) and ``hidden`` (collective time
    under compute); ``comm`` = exposed + hidden; FLOPs and HBM bytes; per-op totals ``ops``
    (name -> [kind, seconds, count, flops, source])."""

    step: float = 0.0
    compute: float = 0.0
    exposed: float = 0.0
    comm: float = 0.0
    flops: float = 0.0
    nbytes: float = 0.0
    collective_bytes: float = 0.0
    kernels: float = 0.0
    ops: dict = dataclasses.field(default_factory=dict)

    @property
    def hidden(self) -> float:
        return max(0.0, self.comm - self.exposed)

    def add_op(self, name: str, kind: str, seconds: float, count: float, flops: float,
               source: str) -> None:
        row = self.ops.setdefault(name, [kind, 0.0, 0.0, 0.0, source])
        row[1] += seconds * count
        row[2] += count
        row[3] += flops * count

    def absorb(self, other: Timeline, times: float) -> None:
        """Add ``times`` runs of ``other`` (a loop body, a called computation) in sequence."""
        for field in ("step", "compute", "exposed", "comm", "flops", "nbytes",
                      "collective_bytes", "kernels"):
            setattr(self, field, getattr(self, field) + times * getattr(other, field))
        for name, (kind, seconds, count, flops, source) in other.ops.items():
            row = self.ops.setdefault(name, [kind, 0.0, 0.0, 0.0, source])
            row[1] += times * seconds
            row[2] += times * count
            row[3] += times * flops

    def top(self, n: int = 10) -> list[dict]:
        rows = sorted(self.ops.items(), key=lambda kv: -kv[1][1])[:n]
        return [{"op": name, "kind": kind, "seconds": seconds, "count": count,
                 "flops": flops, "source": source}
                for name, (kind, seconds, count, flops, source) in rows]

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for kind, seconds, *_ in self.ops.values():
            out[kind] += seconds
        return dict(out)


def _collective_kind(opcode: str) -> tuple[str, str] | None:
    """(kind, "" | "-start" | "-done") of a collective opcode; a ``send`` is a
    collective-permute's start and ``send-done`` its done (its ``recv`` is the same transfer)."""
    for suffix in ("-start", "-done"):
        if opcode.endswith(suffix) and opcode[: -len(suffix)] in COLLECTIVE_KINDS:
            return opcode[: -len(suffix)], suffix
    if opcode in COLLECTIVE_KINDS:
        return opcode, ""
    return {"send": ("collective-permute", "-start"),
            "send-done": ("collective-permute", "-done")}.get(opcode)


class Simulator:
    """Plays a parsed module on ``device`` with ``network`` (module docstring). ``node_of``: the
    node of a device id (default: ``id // gpus_per_node``); ``devices``: the program's device
    count (to read replica groups written as iota)."""

    def __init__(self, comps: Mapping[str, Computation], device: DeviceModel,
                 network: Network | None = None, *, devices: int = 1,
                 node_of: Callable[[int], int] | None = None):
        self.comps = comps
        self.device = device
        self.network = network or Network.of(device)
        self.pricer = Pricer(comps, device)
        self.devices = devices
        per_node = self.network.gpus_per_node
        self.node_of = node_of or (lambda i: i // per_node)
        self._cache: dict[str, Timeline] = {}

    # -- collectives -----------------------------------------------------------------------------
    def collective_seconds(self, kind: str, result: Instruction, source: Instruction) -> tuple[
            float, float]:
        """(seconds, bytes per device) of one collective: ``result`` gives its bytes (the
        ``-done``'s type), ``source`` its groups (the ``-start``)."""
        nbytes = type_bytes(result.type_text)
        c = Collective(source.name, kind, (), nbytes, source.attr("replica_groups"),
                       source_target_pairs=source.attr("source_target_pairs"))
        if kind == "collective-permute" and not c.source_target_pairs:
            groups = [[0, 1]]  # send/recv: one peer
        else:
            groups = c.device_groups(self.devices)
        where = placement(groups, self.node_of)
        return self.network.seconds(kind, nbytes, where), float(nbytes)

    def _wrapped_collective(self, instr: Instruction) -> Instruction | None:
        """The collective an ``async-start`` wraps, if any."""
        for name in callees(instr, "calls"):
            comp = self.comps.get(name)
            for inner in comp.instructions if comp else ():
                if inner.opcode in COLLECTIVE_KINDS:
                    return inner
        return None

    # -- the walk --------------------------------------------------------------------------------
    def run(self, name: str) -> Timeline:
        """One run of computation ``name`` (module docstring); cached."""
        if name in self._cache:
            return self._cache[name]
        self._cache[name] = Timeline()  # a cycle (never in valid HLO) costs nothing
        comp = self.comps[name]
        out = Timeline()
        clock = 0.0  # the compute stream
        comm_free = 0.0  # the collective stream
        pending: dict[str, float] = {}  # -start name -> its end time
        for instr in comp.instructions:
            parsed = _collective_kind(instr.opcode)
            wrapped = self._wrapped_collective(instr) if instr.opcode == "async-start" else None
            if wrapped is not None:
                parsed = (wrapped.opcode, "-start")
            elif instr.opcode == "async-done" and instr.operands and instr.operands[0] in pending:
                parsed = ("", "-done")
            if parsed is not None:
                kind, suffix = parsed
                if suffix == "-done":
                    end = pending.pop(instr.operands[0], None) if instr.operands else None
                    if end is not None and end > clock:
                        out.exposed += end - clock
                        clock = end
                    continue
                source = wrapped or instr
                result = self._result_of(comp, instr, wrapped)
                seconds, nbytes = self.collective_seconds(kind, result, source)
                out.comm += seconds
                out.collective_bytes += nbytes
                out.add_op(instr.name, f"collective:{kind}", seconds, 1, 0.0, op_name(source))
                if suffix == "-start":
                    start = max(clock, comm_free)
                    comm_free = start + seconds
                    pending[instr.name] = comm_free
                else:  # synchronous: waits for the collective stream, blocks compute
                    start = max(clock, comm_free)
                    out.exposed += start + seconds - clock
                    clock = comm_free = start + seconds
                continue
            if instr.opcode == "while":
                body = self.run(callees(instr, "body")[0])
                cond = self.run(callees(instr, "condition")[0])
                trips = trip_count(instr, self.comps)
                inner = Timeline()
                inner.absorb(body, trips)
                inner.absorb(cond, trips + 1)
                clock = self._sequence(out, inner, clock, comm_free, pending)
                comm_free = max(comm_free, clock)
                continue
            if instr.opcode == "conditional":
                branches = [self.run(c) for c in (callees(instr, "branch_computations")
                                                  + callees(instr, "true_computation")
                                                  + callees(instr, "false_computation"))]
                if branches:
                    slowest = max(branches, key=lambda t: t.step)
                    clock = self._sequence(out, slowest, clock, comm_free, pending)
                    comm_free = max(comm_free, clock)
                continue
            target = (callees(instr, "to_apply") or callees(instr, "calls") or [None])[0]
            if instr.opcode in ("call", "async-start") and target in self.comps:
                if self._is_program(target):  # a command buffer, a call: its kernels in place
                    clock = self._sequence(out, self.run(target), clock, comm_free, pending)
                    comm_free = max(comm_free, clock)
                    continue
                if instr.opcode == "async-start":  # one op on another stream: priced in line
                    instr = self.comps[target].root or instr
            cost = self.pricer.price(instr)
            if cost is None:
                continue
            clock += cost.seconds
            out.compute += cost.seconds
            out.flops += cost.flops
            out.nbytes += cost.nbytes
            out.kernels += 1
            out.add_op(instr.name, cost.kind, cost.seconds, 1, cost.flops, cost.source)
        for end in pending.values():  # a start never awaited: the step still waits for it
            if end > clock:
                out.exposed += end - clock
                clock = end
        out.step = max(clock, comm_free)
        self._cache[name] = out
        return out

    def _is_program(self, name: str) -> bool:
        """Whether a called computation is a sequence of kernels (a command buffer, a call)
        rather than one kernel's body."""
        comp = self.comps[name]
        return any(i.opcode in ("fusion", "custom-call", "while", "conditional", "call")
                   or _collective_kind(i.opcode) is not None for i in comp.instructions)

    @staticmethod
    def _sequence(out: Timeline, inner: Timeline, clock: float, comm_free: float,
                  pending: dict) -> float:
        """Run ``inner`` (a loop, a branch, a call) after the compute stream's ``clock``: the
        collectives still in flight keep running under it."""
        out.absorb(inner, 1)
        out.step -= inner.step  # the caller sets its own step from the clocks
        return clock + inner.step

    def _result_of(self, comp: Computation, instr: Instruction,
                   wrapped: Instruction | None) -> Instruction:
        """The instruction whose type is the collective's result: the wrapped op, the matching
        ``-done``, a ``send``'s data operand, or the op itself."""
        if wrapped is not None:
            return wrapped
        if instr.opcode == "send":
            return dataclasses.replace(instr, type_text=self.pricer.types.get(
                instr.operands[0], "") if instr.operands else "")
        if instr.opcode.endswith("-start"):
            for other in comp.instructions:
                if other.operands and other.operands[0] == instr.name and (
                        other.opcode.endswith("-done")):
                    return other
        return instr


def simulate(hlo_text: str, device: DeviceModel, network: Network | None = None, *,
             devices: int = 1, node_of: Callable[[int], int] | None = None) -> Timeline:
    """The ENTRY computation of ``hlo_text`` played on ``device`` (module docstring)."""
    comps = parse_module(hlo_text)
    entry = next((c.name for c in comps.values() if c.entry), None)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Simulator(comps, device, network, devices=devices, node_of=node_of).run(entry)
