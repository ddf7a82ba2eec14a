"""The compiled program played on a modelled device: one compute stream and one collective
stream, following the schedule XLA chose.

The text order of a scheduled HLO computation is its schedule. The simulator walks ENTRY in that
order with two clocks:

* **compute**: every kernel (:class:`jphantom.predict.costs.KernelPricer`) runs on one stream, one
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
slowest branch (in the pipeline executor's SPMD switch every device waits for the slowest), or,
where its op_name ends in ``taken_in_<n>_of_<t>_ticks/cond``, its true branch in n of its loop's
t trips and its false branch in the rest (the pipeline executor's entry branch, which some
device takes in only M ticks of a schedule of about V M:
:meth:`jphantom.pipeline.runner._Step.taken`), and a ``while`` of zero or one trips under such
a scope (its head and embedding gradients: :func:`jphantom.pipeline.runner.at_most_once`) runs
its body n / t times; a ``call`` runs its callee in place. Each collective's group is placed on
nodes by ``node_of`` (the device id's node), so a group that spans nodes is priced on the NICs, and
on a device with packages (``gpus_per_package``: consecutive ids) a group inside one package on its
link.

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
from jphantom.analysis.hlo.accounting import HloCollective
from jphantom.analysis.hlo.callgraph import taken_share, trip_count
from jphantom.analysis.hlo.text import Computation, Instruction, parse_module, type_bytes
from jphantom.predict.costs import KernelPricer, callees, op_name
from jphantom.predict.device import DeviceModel
from jphantom.predict.network import Network, placement


@dataclasses.dataclass
class Timeline:
    """Seconds of one run of a computation: ``step`` (wall), ``compute`` (the compute stream
    busy), ``exposed`` (compute stream waiting on collectives) and ``hidden`` (collective time
    under compute); ``comm`` = exposed + hidden; FLOPs and HBM bytes; per-op totals ``ops``
    (name -> [kind, seconds, count, flops, source]); ``waits``: the exposed seconds of each
    collective (its ``-start``'s or its own name; loop counts multiplied in)."""

    step: float = 0.0
    compute: float = 0.0
    exposed: float = 0.0
    comm: float = 0.0
    flops: float = 0.0
    nbytes: float = 0.0
    collective_bytes: float = 0.0
    kernels: float = 0.0
    ops: dict = dataclasses.field(default_factory=dict)
    waits: dict = dataclasses.field(default_factory=dict)  # a collective's name -> its exposed s

    @property
    def hidden(self) -> float:
        return max(0.0, self.comm - self.exposed)

    def add_op(self, name: str, kind: str, seconds: float, count: float, flops: float,
               source: str) -> None:
        row = self.ops.setdefault(name, [kind, 0.0, 0.0, 0.0, source])
        row[1] += seconds * count
        row[2] += count
        row[3] += flops * count

    def absorb(self, other: Timeline, times: float, *, step: bool = True) -> None:
        """Add ``times`` runs of ``other`` (a loop body, a called computation) in sequence;
        ``step=False`` leaves ``step`` to the caller's clocks."""
        for field in ("step", "compute", "exposed", "comm", "flops", "nbytes",
                      "collective_bytes", "kernels")[0 if step else 1:]:
            setattr(self, field, getattr(self, field) + times * getattr(other, field))
        for name, seconds in other.waits.items():
            self.waits[name] = self.waits.get(name, 0.0) + times * seconds
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


class _Streams:
    """The two clocks of one run of a computation (module docstring) and what it adds up."""

    def __init__(self):
        self.out = Timeline()
        self.clock = 0.0  # the compute stream
        self.comm_free = 0.0  # the collective stream
        self.pending: dict[str, float] = {}  # a -start's name -> when it ends

    def kernel(self, name: str, cost) -> None:
        self.clock += cost.seconds
        out = self.out
        out.compute += cost.seconds
        out.flops += cost.flops
        out.nbytes += cost.nbytes
        out.kernels += 1
        out.add_op(name, cost.kind, cost.seconds, 1, cost.flops, cost.source)

    def collective(self, name: str, kind: str, seconds: float, nbytes: float, source: str, *,
                   asynchronous: bool) -> None:
        """Start one on the collective stream when both it and the compute stream reach it; a
        synchronous one blocks the compute stream until it ends."""
        self.out.comm += seconds
        self.out.collective_bytes += nbytes
        self.out.add_op(name, f"collective:{kind}", seconds, 1, 0.0, source)
        start = max(self.clock, self.comm_free)
        self.comm_free = start + seconds
        if asynchronous:
            self.pending[name] = self.comm_free
        else:
            self._expose(name, self.comm_free - self.clock)
            self.clock = self.comm_free

    def _expose(self, name: str, seconds: float) -> None:
        """The compute stream waits ``seconds`` on collective ``name``."""
        self.out.exposed += seconds
        self.out.waits[name] = self.out.waits.get(name, 0.0) + seconds

    def wait_for(self, start_name: str) -> None:
        """A ``-done``: the compute stream waits for what is left of its collective."""
        end = self.pending.pop(start_name, None)
        if end is not None and end > self.clock:
            self._expose(start_name, end - self.clock)
            self.clock = end

    def sequence(self, inner: Timeline) -> None:
        """Run ``inner`` (a loop, a branch, a call) on the compute stream; the collectives
        still in flight keep running under it."""
        self.out.absorb(inner, 1, step=False)
        self.clock += inner.step
        self.comm_free = max(self.comm_free, self.clock)

    def finish(self) -> Timeline:
        """The run's timeline: a start never awaited still holds the step."""
        for name in list(self.pending):
            self.wait_for(name)
        self.out.step = max(self.clock, self.comm_free)
        return self.out


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
        self.pricer = KernelPricer(comps, device)
        self.devices = devices
        per_node = self.network.gpus_per_node
        self.node_of = node_of or (lambda i: i // per_node)
        per_package = self.network.gpus_per_package  # ids run through a node's packages in order
        self.package_of = (lambda i: i // per_package) if per_package > 1 else None
        self._cache: dict[str, Timeline] = {}

    # -- collectives -----------------------------------------------------------------------------
    def collective_seconds(self, kind: str, result: Instruction, source: Instruction) -> tuple[
            float, float]:
        """(seconds, bytes per device) of one collective: ``result`` gives its bytes (the
        ``-done``'s type), ``source`` its groups (the ``-start``)."""
        nbytes = type_bytes(result.type_text)
        c = HloCollective(source.name, kind, (), nbytes, source.attr("replica_groups"),
                          source_target_pairs=source.attr("source_target_pairs"))
        if kind == "collective-permute" and not c.source_target_pairs:
            groups = [[0, 1]]  # send/recv: one peer
        else:
            groups = c.device_groups(self.devices)
        where = placement(groups, self.node_of, self.package_of)
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
        streams = _Streams()
        for instr in comp.instructions:
            parsed = _collective_kind(instr.opcode)
            wrapped = self._wrapped_collective(instr) if instr.opcode == "async-start" else None
            if wrapped is not None:
                parsed = (wrapped.opcode, "-start")
            elif instr.opcode == "async-done" and instr.operands and (
                    instr.operands[0] in streams.pending):
                parsed = ("", "-done")
            if parsed is not None and parsed[1] == "-done":
                streams.wait_for(instr.operands[0] if instr.operands else "")
            elif parsed is not None:
                source = wrapped or instr
                seconds, nbytes = self.collective_seconds(
                    parsed[0], self._result_of(comp, instr, wrapped), source)
                streams.collective(instr.name, parsed[0], seconds, nbytes, op_name(source),
                                   asynchronous=parsed[1] == "-start")
            elif instr.opcode in ("while", "conditional") or (
                    self._called_program(instr) is not None):
                streams.sequence(self._control_flow(instr))
            else:
                if instr.opcode == "async-start":  # one op on another stream: priced in line
                    target = callees(instr, "calls")
                    instr = self.comps[target[0]].root if target else instr
                cost = self.pricer.price(instr)
                if cost is not None:
                    streams.kernel(instr.name, cost)
        out = streams.finish()
        self._cache[name] = out
        return out

    def _called_program(self, instr: Instruction) -> str | None:
        """The computation a ``call`` or ``async-start`` runs in place, when it is a sequence of
        kernels (a command buffer, a call) rather than one kernel's body."""
        if instr.opcode not in ("call", "async-start"):
            return None
        target = (callees(instr, "to_apply") or callees(instr, "calls") or [None])[0]
        return target if target in self.comps and self._is_program(target) else None

    def _control_flow(self, instr: Instruction) -> Timeline:
        """The timeline of a ``while`` (body x trips, condition x (trips + 1)), a
        ``conditional`` (its slowest branch) or a called program."""
        if instr.opcode == "while":
            share = taken_share(instr)  # a loop of zero or one trips: its share of them
            trips = trip_count(instr, self.comps) if share is None else share
            inner = Timeline()
            inner.absorb(self.run(callees(instr, "body")[0]), trips)
            inner.absorb(self.run(callees(instr, "condition")[0]), trips + 1)
            return inner
        if instr.opcode == "conditional":
            indexed = callees(instr, "branch_computations")  # lax.cond's: [false, true]
            true = callees(instr, "true_computation") or indexed[1:2]
            false = callees(instr, "false_computation") or indexed[:1]
            share = taken_share(instr)
            if share is not None and len(indexed) <= 2 and true and false:
                inner = Timeline()
                inner.absorb(self.run(true[0]), share)
                inner.absorb(self.run(false[0]), 1.0 - share)
                return inner
            branches = [self.run(c) for c in indexed + true + false]
            return max(branches, key=lambda t: t.step) if branches else Timeline()
        return self.run(self._called_program(instr))

    def _is_program(self, name: str) -> bool:
        """Whether a called computation is a sequence of kernels (a command buffer, a call)
        rather than one kernel's body."""
        comp = self.comps[name]
        return any(i.opcode in ("fusion", "custom-call", "while", "conditional", "call")
                   or _collective_kind(i.opcode) is not None for i in comp.instructions)

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
