"""Pipeline schedules as data: who runs which micro-batch's forward or backward, and when.

:func:`build` returns the table of every device's tasks for three schedules, in unit ticks (one
operation per tick per device, every operation one tick long):

``gpipe``
    All forwards, then all backwards (reverse micro-batch order per stage). Stage ``s`` runs the
    forward of micro-batch ``m`` at tick ``s + m``; the backwards start once the last stage has
    finished its last forward. Every stage holds all ``M`` micro-batches' activations.
``1f1b``
    PipeDream-Flush: stage ``s`` runs a warm-up of ``P - s - 1`` forwards, then alternates one
    forward and one backward, then drains the remaining backwards. At most ``P - s`` micro-batches
    are in flight on stage ``s``.
``interleaved-1f1b``
    Megatron-LM's interleaved schedule (Narayanan et al. 2021, Sec. 2.2): each device holds
    ``V`` model chunks (virtual stages); model chunk ``chunk * P + stage`` lives on ``stage``, so a
    micro-batch passes through all ``V * P`` chunks, visiting every device ``V`` times. Like
    Megatron, it requires ``microbatches % stages == 0``.

:func:`simulate` executes a table's per-device order with real costs -- a forward costs ``1 / V``
per chunk (so one device's forwards of a micro-batch cost 1) and a backward ``backward_cost / V`` --
starting every task as soon as its device is free and its dependencies have finished.

``zb-h1`` and ``zb-v`` (zero-bubble schedules; Qi, Wan, Huang & Lin, "Zero Bubble Pipeline
Parallelism", ICLR 2024) split each backward into **B**, the gradient of the stage's input (on
the critical path), and **W**, the gradient of its weights (deferrable), so that W fills what
would be bubbles. Their tables hold F, B and W tasks (:data:`SPLIT_SCHEDULES`; simulated,
drawn, and run in lock-step by :mod:`jphantom.pipeline.split`):

``zb-h1``
    1F1B's order with every W deferred as long as the stage holds no more micro-batches than
    1F1B does (``P - s``; a micro-batch's activations live until its W), and W's filling the
    cool-down between B's. The paper's bubble is ``(P - 1)(T_F + T_B - T_W)`` against 1F1B's
    ``(P - 1)(T_F + T_B + T_W)``: a third of it when the three costs are equal.
``zb-v``
    The V-shaped placement (ZB-V, and DeepSeek-V3's DualPipeV): 2P model chunks, device ``s``
    holding chunks ``s`` and ``2P - 1 - s``, so a micro-batch goes down the devices and back up
    and its loss is computed on device 0. Each device runs, when free, a ready B, else a forward
    while it holds fewer than ``2P`` chunk activations (1F1B's memory: ``P`` micro-batches of
    whole stages), else a W: with equal costs the bubble is the paper's near-zero.

Bubble fractions (idle time / total device time over the makespan), as this simulator measures them
(see ``tests/pipeline/test_pipeline_schedule.py``):

* GPipe and 1F1B: ``(P - 1) / (M + P - 1)`` exactly, for *any* ``backward_cost`` -- Narayanan et al.'s
  formula: the bubble is ``(P - 1) * (t_f + t_b)`` against an ideal ``M * (t_f + t_b)``, so the
  backward/forward cost ratio cancels. (P, M) = (4, 4), (4, 16), (4, 64), (16, 16), (16, 64),
  (16, 256) give 42.9, 15.8, 4.5, 48.4, 19.0, 5.5 %.
* Interleaved 1F1B: Narayanan et al. give a bubble of ``(1 / V) * (P - 1) / M`` *relative to the ideal
  time*; as a fraction of total device time that is ``(P - 1) / (P - 1 + V * M)``, which the
  simulator reproduces (to float rounding) for the (P, V, M) tested, with ``backward_cost`` 1
  and 2 alike -- again the cost ratio cancels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jphantom.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
SPLIT_SCHEDULES = ("zb-h1", "zb-v")
"""Schedules whose backward is split into B (input gradient) and W (weight gradient)."""
ALL_SCHEDULES = SCHEDULES + SPLIT_SCHEDULES


@dataclass(frozen=True)
class Task:
    """One operation in a schedule table.

    ``tick``: when it runs, in unit ticks. ``stage``: the device (pipeline stage). ``microbatch``:
    which micro-batch. ``kind``: ``"F"`` (forward) or ``"B"`` (backward). ``chunk``: the virtual
    stage index on that device (0 unless interleaved); the model chunk is ``chunk * stages + stage``.
    """

    tick: int
    stage: int
    microbatch: int
    kind: str
    chunk: int = 0


@dataclass(frozen=True)
class TimedTask:
    """A :class:`Task` as the simulator ran it, from ``start`` to ``end`` (forward of one whole
    micro-batch on one device = 1 time unit)."""

    task: Task
    start: float
    end: float

    @property
    def stage(self) -> int:
        return self.task.stage

    @property
    def microbatch(self) -> int:
        return self.task.microbatch

    @property
    def kind(self) -> str:
        return self.task.kind

    @property
    def chunk(self) -> int:
        return self.task.chunk


@dataclass(frozen=True)
class Simulation:
    """Result of :func:`simulate`.

    ``bubble_fraction``: idle time / (stages * makespan). ``makespan``: end of the last task.
    ``peak_in_flight``: per stage, the most micro-batches (per chunk, when interleaved) whose
    forward had run on that device but whose backward had not. ``tasks``: every task with its
    start and end times, ordered by (start, stage).
    """

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int
    backward_cost: float
    makespan: float
    bubble_fraction: float
    peak_in_flight: list[int]
    tasks: list[TimedTask] = field(repr=False)

    def timeline(self, width: int | None = None) -> str:
        """An ASCII chart, one row per stage: each task spans its share of the row, labelled with
        its kind and micro-batch (``F3``, ``B3``), ``.`` where the device is idle. ``width`` is the
        number of chart columns (default: enough for every label to show)."""
        labels = {t: f"{t.kind}{t.microbatch}" for t in self.tasks}
        shortest = min(t.end - t.start for t in self.tasks)
        per_unit = (max(len(s) for s in labels.values()) + 1) / shortest
        fits = max(1, math.ceil(self.makespan * per_unit - 1e-9))
        width = fits if width is None else width
        narrowest = math.ceil(self.makespan / shortest - 1e-9)  # one column for the shortest task
        if isinstance(width, bool) or not isinstance(width, int) or width < narrowest:
            raise ConfigError(f"timeline width={width!r} is too narrow to show each task apart: "
                              f"pass width >= {narrowest} ({fits} shows every label)")
        scale = width / self.makespan
        rows = [["."] * width for _ in range(self.stages)]
        for timed in self.tasks:
            lo = min(width - 1, int(round(timed.start * scale)))
            hi = max(lo + 1, int(round(timed.end * scale)))
            text = labels[timed].ljust(hi - lo)[: hi - lo]
            rows[timed.stage][lo:hi] = list(text)
        pad = len(str(self.stages - 1))
        return "\n".join(f"stage {s:>{pad}} |{''.join(r)}|" for s, r in enumerate(rows))


def _validate(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> None:
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer; pass {name} >= 1")
    if schedule != "interleaved-1f1b" and virtual_stages != 1:
        raise ConfigError(
            f"virtual_stages={virtual_stages} only applies to 'interleaved-1f1b', not {schedule!r}; "
            "pass virtual_stages=1 or schedule='interleaved-1f1b'"
        )
    if schedule == "interleaved-1f1b" and microbatches % stages != 0:
        raise ConfigError(
            f"interleaved-1f1b needs microbatches divisible by stages (as Megatron does), got "
            f"microbatches={microbatches}, stages={stages}; use a multiple of {stages} micro-batches"
        )


# An operation in a device's order: (kind, microbatch, chunk).
_Op = tuple[str, int, int]


def _orders(schedule: str, stages: int, microbatches: int, virtual_stages: int,
            lockstep: bool = False) -> list[list[_Op]]:
    """Each device's operations, in the order it runs them. ``lockstep``: 1F1B's warm-up is
    ``2 (P - s - 1)`` forwards instead of ``P - s - 1`` (see :func:`lockstep`)."""
    P, M, V = stages, microbatches, virtual_stages
    orders: list[list[_Op]] = []
    for s in range(P):
        if schedule == "gpipe":
            order = [("F", m, 0) for m in range(M)] + [("B", m, 0) for m in reversed(range(M))]
        elif schedule == "1f1b":
            warmup = min((P - s - 1) * (2 if lockstep else 1), M)
            order = [("F", m, 0) for m in range(warmup)]
            for i in range(M - warmup):
                order += [("F", warmup + i, 0), ("B", i, 0)]
            order += [("B", m, 0) for m in range(M - warmup, M)]
        else:  # interleaved-1f1b, following Megatron-LM's forward_backward_pipelining_with_interleaving
            total = M * V

            def forward(k: int) -> _Op:
                return ("F", (k // (P * V)) * P + k % P, (k // P) % V)

            def backward(k: int) -> _Op:
                return ("B", (k // (P * V)) * P + k % P, V - 1 - (k // P) % V)

            warmup = min((P - s - 1) * 2 + (V - 1) * P, total)
            order = [forward(k) for k in range(warmup)]
            for k in range(total - warmup):
                order += [forward(warmup + k), backward(k)]
            order += [backward(k) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def _peak_in_flight(orders: list[list[_Op]], release: str = "B") -> list[int]:
    """Per device, the most operations whose forward ran and whose ``release`` (the backward;
    split schedules: W, which still needs the activations) has not."""
    peaks = []
    for order in orders:
        live = peak = 0
        for kind, _, _ in order:
            live += {"F": 1, release: -1}.get(kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _execute(
    orders: list[list[_Op]], stages: int, virtual_stages: int, forward_cost: float, backward_cost: float
) -> dict[tuple[int, _Op], tuple[float, float]]:
    """Run each device's order as early as dependencies allow; returns (start, end) per op."""
    return _execute_split("round-robin", orders, stages, (forward_cost, backward_cost, 0.0),
                          chunks=virtual_stages)


def build(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> list[Task]:
    """The table of every device's tasks, in unit ticks, ordered by (tick, stage).

    Each device runs one operation per tick; a task starts at the first tick after its device's
    previous task and after its dependencies: F(m) on model chunk ``c`` after F(m) on ``c - 1``;
    B(m) on ``c`` after B(m) on ``c + 1`` and F(m) on ``c``. The table holds exactly one F and one
    B per (stage, chunk, micro-batch): ``2 * microbatches * virtual_stages`` tasks per device.
    Raises :class:`~jphantom.errors.ConfigError` for an unknown schedule, a count below 1,
    ``virtual_stages > 1`` outside ``interleaved-1f1b``, or interleaving with ``microbatches`` not a
    multiple of ``stages``.
    """
    _validate(schedule, stages, microbatches, virtual_stages)
    orders = _orders(schedule, stages, microbatches, virtual_stages)
    times = _execute(orders, stages, virtual_stages, 1.0, 1.0)
    tasks = [Task(int(start), s, op[1], op[0], op[2]) for (s, op), (start, _) in times.items()]
    return sorted(tasks, key=lambda t: (t.tick, t.stage))


def simulate(
    schedule: str, stages: int, microbatches: int, virtual_stages: int = 1, backward_cost: float = 1.0
) -> Simulation:
    """Discrete-event simulation of :func:`build`'s per-device order with real costs.

    A forward costs ``1 / virtual_stages`` per chunk and a backward ``backward_cost /
    virtual_stages``; each task starts when its device is free and its dependencies have ended.
    GPipe and 1F1B give Narayanan et al.'s bubble ``(P - 1) / (M + P - 1)`` for any ``backward_cost``;
    interleaved 1F1B gives ``(P - 1) / (P - 1 + V * M)`` (see the module docstring).
    """
    _validate(schedule, stages, microbatches, virtual_stages)
    if not backward_cost > 0 or not math.isfinite(backward_cost):
        raise ConfigError(f"backward_cost={backward_cost!r} must be a positive finite number; pass e.g. 2.0")
    P, V = stages, virtual_stages
    orders = _orders(schedule, stages, microbatches, virtual_stages)
    times = _execute(orders, P, V, 1.0 / V, backward_cost / V)
    makespan = max(end for _, end in times.values())
    busy = sum(end - start for start, end in times.values())
    peaks = _peak_in_flight(orders)
    timed = sorted(
        (TimedTask(Task(int(round(start * V)), s, op[1], op[0], op[2]), start, end) for (s, op), (start, end) in times.items()),
        key=lambda t: (t.start, t.stage),
    )
    return Simulation(
        schedule=schedule,
        stages=P,
        microbatches=microbatches,
        virtual_stages=V,
        backward_cost=float(backward_cost),
        makespan=makespan,
        bubble_fraction=(P * makespan - busy) / (P * makespan),
        peak_in_flight=peaks,
        tasks=timed,
    )


@dataclass(frozen=True)
class Tick:
    """One lock-step tick: per stage, the forward it runs and then the backward it runs, each a
    ``(microbatch, chunk)`` or ``None``."""

    forward: tuple[tuple[int, int] | None, ...]
    backward: tuple[tuple[int, int] | None, ...]


@dataclass(frozen=True)
class Lockstep:
    """A schedule as the SPMD executor runs it (:func:`lockstep`): ``ticks``, each a forward slot
    then a backward slot on every stage, and ``peak_in_flight`` per stage (micro-batch chunks whose
    forward ran and backward has not: the residuals the stage holds)."""

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int
    ticks: tuple[Tick, ...]
    peak_in_flight: tuple[int, ...]

    def cost(self, backward_cost: float = 2.0) -> float:
        """Step time in units of one device's forward of one micro-batch, when every tick lasts as
        long as its slowest stage: ``1/V`` if any stage runs a forward, plus ``backward_cost/V`` if
        any runs a backward."""
        V = self.virtual_stages
        return sum((1.0 / V if any(t.forward) else 0.0)
                   + (backward_cost / V if any(t.backward) else 0.0) for t in self.ticks)

    def bubble_fraction(self, backward_cost: float = 2.0) -> float:
        """Idle device time / total device time of the lock-step execution."""
        busy = self.microbatches * (1.0 + backward_cost)
        return 1.0 - busy / self.cost(backward_cost)


def lockstep(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Lockstep:
    """The schedule in lock-step ticks, as one SPMD program runs it.

    In a single program every tick ends in the same point-to-point exchange on all devices, so a
    tick lasts as long as its slowest device. Each tick has a forward slot, then the activation
    exchange, then a backward slot, then the cotangent exchange; every device walks its own order
    (:func:`build`'s) and takes, per tick, at most its next forward and then at most its next
    backward whose inputs have arrived. A micro-batch thus moves one stage per tick each way.

    For GPipe and interleaved 1F1B (Megatron's warm-up of ``2 (P - s - 1) + (V - 1) P``) this costs
    exactly their ideal time: ``(M + P - 1)(t_f + t_b)`` and ``(M + (P - 1)/V)(t_f + t_b)``. Plain
    1F1B's warm-up of ``P - s - 1`` forwards, though, stalls in lock-step: a micro-batch's round trip
    from stage ``s`` to the last stage and back takes ``2 (P - 1 - s)`` ticks, so keeping every tick
    busy needs ``2 (P - 1 - s) + 1`` micro-batches in flight, not ``P - s``. With ``P - s`` the step
    costs 1.3-1.8x GPipe's (P = 4-8, M = 2P-8P); the lock-step 1F1B here therefore warms up with
    ``2 (P - s - 1)`` forwards: GPipe's time, at most ``min(M, 2 (P - s) - 1)`` micro-batches in
    flight -- bounded in M, unlike GPipe's M, but up to twice PipeDream-Flush's ``P - s``.
    """
    _validate(schedule, stages, microbatches, virtual_stages)
    P, V = stages, virtual_stages
    orders = _orders(schedule, stages, microbatches, virtual_stages, lockstep=True)
    last = V * P - 1
    done: dict[tuple[int, str, int], int] = {}
    position = [0] * P
    total = sum(len(o) for o in orders)
    ticks: list[Tick] = []
    t = 0
    while sum(position) < total:
        forward: list[tuple[int, int] | None] = [None] * P
        backward: list[tuple[int, int] | None] = [None] * P
        for s in range(P):
            if position[s] < len(orders[s]):
                kind, m, chunk = orders[s][position[s]]
                c = chunk * P + s
                if kind == "F" and (c == 0 or done.get((c - 1, "F", m), t) < t):
                    forward[s] = (m, chunk)
                    done[(c, "F", m)] = t
                    position[s] += 1
        for s in range(P):
            if position[s] < len(orders[s]):
                kind, m, chunk = orders[s][position[s]]
                c = chunk * P + s
                if (kind == "B" and done.get((c, "F", m), t + 1) <= t
                        and (c == last or done.get((c + 1, "B", m), t) < t)):
                    backward[s] = (m, chunk)
                    done[(c, "B", m)] = t
                    position[s] += 1
        ticks.append(Tick(tuple(forward), tuple(backward)))
        t += 1
        if t > 4 * total + 4:  # pragma: no cover - the orders never deadlock
            raise RuntimeError("lock-step schedule deadlocked")
    peaks = _peak_in_flight(orders)
    return Lockstep(schedule, P, microbatches, V, tuple(ticks), tuple(peaks))


# -------------------------------------------------------------------------------------------------
# Split backward: zero-bubble schedules (F, B = input gradient, W = weight gradient)
# -------------------------------------------------------------------------------------------------


def chunks_of(schedule: str, stages: int) -> int:
    """Model chunks per device: 2 for ``zb-v`` (the V shape), else 1."""
    return 2 if schedule == "zb-v" else 1


def model_chunk(schedule: str, stages: int, device: int, chunk: int) -> int:
    """The model chunk (position along the forward) of ``device``'s ``chunk``: ``zb-v`` places
    chunk 0 of device s at s and chunk 1 at 2P - 1 - s."""
    if schedule == "zb-v":
        return device if chunk == 0 else 2 * stages - 1 - device
    return chunk * stages + device


def _split_dependencies(c: int, kind: str, m: int, last: int) -> list[tuple[int, str, int]]:
    if kind == "F":
        return [(c - 1, "F", m)] if c > 0 else []
    if kind == "B":
        return [(c, "F", m)] + ([(c + 1, "B", m)] if c < last else [])
    return [(c, "B", m)]  # W


def _zb_h1_orders(stages: int, microbatches: int) -> list[list[_Op]]:
    """1F1B with B and W split, each W deferred while the stage holds at most 1F1B's ``P - s``
    micro-batches (activations live until W), W's filling the cool-down between B's."""
    P, M = stages, microbatches
    orders = []
    for s in range(P):
        cap = min(P, M)  # 1F1B's peak (its first stage's), on every stage
        warmup = min(P - s - 1, M)
        order: list[_Op] = [("F", m, 0) for m in range(warmup)]
        pending: list[int] = []
        forwards, backwards = warmup, 0
        while backwards < M:
            if forwards < M:
                while forwards - (backwards - len(pending)) >= cap and pending:
                    order.append(("W", pending.pop(0), 0))  # make room for the next forward
                order.append(("F", forwards, 0))
                forwards += 1
            order.append(("B", backwards, 0))
            pending.append(backwards)
            backwards += 1
            if forwards == M and pending and backwards < M:  # cool-down: W between B's
                order.append(("W", pending.pop(0), 0))
        order += [("W", m, 0) for m in pending]
        orders.append(order)
    return orders


def _zb_v_orders(stages: int, microbatches: int, costs: tuple[float, float, float]
                 ) -> list[list[_Op]]:
    """ZB-V by list scheduling with unit-free ``costs`` (F, B, W per chunk): each free device
    runs a ready B (the oldest micro-batch first), else a ready forward while it holds fewer
    than 2P chunk activations (the deepest chunk first), else its oldest pending W."""
    P, M = stages, microbatches
    last = 2 * P - 1
    place = {c: (c if c < P else 2 * P - 1 - c, 0 if c < P else 1) for c in range(2 * P)}
    finished: dict[tuple[int, str, int], float] = {}
    free = [0.0] * P
    live = [0] * P
    pending: list[list[tuple[int, int]]] = [[] for _ in range(P)]  # (m, c) awaiting W
    done_f = {c: 0 for c in range(2 * P)}  # next micro-batch each chunk forwards
    orders: list[list[_Op]] = [[] for _ in range(P)]
    remaining = 3 * 2 * P * M
    cost = dict(zip("FBW", costs))
    while remaining:
        # the device that becomes free first takes its best ready task
        s = min(range(P), key=lambda d: (free[d], d))
        now = free[s]
        mine = [c for c in range(2 * P) if place[c][0] == s]
        ready_b = sorted((m, -c) for c in mine for m in range(M)
                         if (c, "B", m) not in finished
                         and all(d in finished and finished[d] <= now
                                 for d in _split_dependencies(c, "B", m, last)))
        choice = None
        if ready_b:
            m, c = ready_b[0][0], -ready_b[0][1]
            choice = ("B", m, c)
        elif live[s] < 2 * P:
            ready_f = sorted((-c, done_f[c]) for c in mine if done_f[c] < M
                             and all(d in finished and finished[d] <= now for d in
                                     _split_dependencies(c, "F", done_f[c], last)))
            if ready_f:
                choice = ("F", ready_f[0][1], -ready_f[0][0])
        if choice is None and pending[s]:
            m, c = pending[s].pop(0)
            choice = ("W", m, c)
        if choice is None:  # wait for the next finish anywhere
            later = [t for t in finished.values() if t > now]
            free[s] = min(later) if later else now + min(costs)
            continue
        kind, m, c = choice
        end = now + cost[kind]
        finished[(c, kind, m)] = end
        free[s] = end
        orders[s].append((kind, m, place[c][1]))
        if kind == "F":
            done_f[c] += 1
            live[s] += 1
        elif kind == "B":
            pending[s].append((m, c))
        else:
            live[s] -= 1
        remaining -= 1
    return orders


def split_orders(schedule: str, stages: int, microbatches: int,
                 costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> list[list[_Op]]:
    """Each device's F / B / W operations in order, ``(kind, microbatch, chunk)``."""
    if schedule == "zb-h1":
        return _zb_h1_orders(stages, microbatches)
    if schedule == "zb-v":
        return _zb_v_orders(stages, microbatches, costs)
    raise ConfigError(f"{schedule!r} is not a split-backward schedule: use one of "
                      f"{', '.join(SPLIT_SCHEDULES)}")


def _execute_split(schedule: str, orders: list[list[_Op]], stages: int,
                   costs: tuple[float, float, float], chunks: int | None = None
                   ) -> dict[tuple[int, _Op], tuple[float, float]]:
    """Each device's order (F, B and W tasks; placed by :func:`model_chunk`, ``chunks`` per
    device, default the schedule's) as early as its dependencies allow: (start, end) per
    operation."""
    P = stages
    last = (chunks or chunks_of(schedule, P)) * P - 1
    cost = dict(zip("FBW", costs))
    done: dict[tuple[int, _Op], tuple[float, float]] = {}
    finished: dict[tuple[int, str, int], float] = {}
    position, free = [0] * P, [0.0] * P
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(P):
            while position[s] < len(orders[s]):
                op = orders[s][position[s]]
                kind, m, chunk = op
                c = model_chunk(schedule, P, s, chunk)
                deps = _split_dependencies(c, kind, m, last)
                if any(d not in finished for d in deps):
                    break
                start = max([free[s]] + [finished[d] for d in deps])
                done[(s, op)] = (start, start + cost[kind])
                finished[(c, kind, m)] = free[s] = start + cost[kind]
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the built orders never deadlock
            raise RuntimeError("pipeline schedule deadlocked: per-device orders violate dependencies")
    return done


def zero_bubble_formula(schedule: str, stages: int, microbatches: int,
                        costs: tuple[float, float, float]) -> float:
    """The paper's bubble fraction (Qi et al. 2024): ZB-H1 idles ``(P - 1)(T_F + T_B - T_W)``
    per device against ``M (T_F + T_B + T_W)`` of work (Sec. 3); for ZB-V the paper claims no
    bubble when T_F = T_B = T_W (Sec. 6): 0 is returned, whatever the costs (a claim, not a
    formula)."""
    f, b, w = costs
    if schedule != "zb-h1":
        return 0.0
    idle = (stages - 1) * (f + b - w)
    return idle / (microbatches * (f + b + w) + idle)


def simulate_split(schedule: str, stages: int, microbatches: int,
                   backward_cost: float = 2.0, weight_share: float = 0.5) -> Simulation:
    """:func:`simulate` for :data:`SPLIT_SCHEDULES`: a forward of one whole stage costs 1, its
    backward ``backward_cost``, of which ``weight_share`` is W (ZB-V: each of its two chunks
    costs half). ``peak_in_flight`` counts chunk activations (held from F to W)."""
    _validate_split(schedule, stages, microbatches, backward_cost, weight_share)
    P, V = stages, chunks_of(schedule, stages)
    costs = (1.0 / V, backward_cost * (1 - weight_share) / V, backward_cost * weight_share / V)
    orders = split_orders(schedule, P, microbatches, costs)
    times = _execute_split(schedule, orders, P, costs)
    makespan = max(end for _, end in times.values())
    busy = sum(end - start for start, end in times.values())
    timed = sorted((TimedTask(Task(int(round(start * V)), s, op[1], op[0], op[2]), start, end)
                    for (s, op), (start, end) in times.items()), key=lambda t: (t.start, t.stage))
    return Simulation(schedule=schedule, stages=P, microbatches=microbatches, virtual_stages=V,
                      backward_cost=float(backward_cost), makespan=makespan,
                      bubble_fraction=(P * makespan - busy) / (P * makespan),
                      peak_in_flight=_peak_in_flight(orders, release="W"), tasks=timed)


def _validate_split(schedule, stages, microbatches, backward_cost, weight_share) -> None:
    if schedule not in SPLIT_SCHEDULES:
        raise ConfigError(f"unknown split-backward schedule {schedule!r}; use one of "
                          f"{', '.join(SPLIT_SCHEDULES)}")
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer; pass {name} >= 1")
    if not backward_cost > 0 or not math.isfinite(backward_cost):
        raise ConfigError(f"backward_cost={backward_cost!r} must be a positive finite number")
    if not 0 < weight_share < 1:
        raise ConfigError(f"weight_share={weight_share!r}: the weight gradient's share of the "
                          "backward, strictly between 0 and 1 (e.g. 0.5)")


@dataclass(frozen=True)
class SplitLockstep:
    """A split-backward schedule in lock-step slots: in each slot every device runs at most its
    next task (F, B or W) whose inputs were produced in an earlier slot, then the slot's
    activations move one device down and its cotangents one device up; a slot lasts as long as
    its longest task. ``cost`` in forwards of one whole stage."""

    schedule: str
    stages: int
    microbatches: int
    slots: tuple[tuple[_Op | None, ...], ...]
    peak_in_flight: tuple[int, ...]

    def cost(self, backward_cost: float = 2.0, weight_share: float = 0.5) -> float:
        V = chunks_of(self.schedule, self.stages)
        each = {"F": 1.0 / V, "B": backward_cost * (1 - weight_share) / V,
                "W": backward_cost * weight_share / V}
        return sum(max((each[op[0]] for op in slot if op), default=0.0) for slot in self.slots)

    def bubble_fraction(self, backward_cost: float = 2.0, weight_share: float = 0.5) -> float:
        busy = self.microbatches * (1.0 + backward_cost)
        return 1.0 - busy / self.cost(backward_cost, weight_share)

    def exchanges(self) -> int:
        """Slots after which an activation or a cotangent moves (a collective-permute each)."""
        return sum(any(op and op[0] == kind for op in slot)
                   for slot in self.slots for kind in ("F", "B"))


def lockstep_split(schedule: str, stages: int, microbatches: int, *,
                   forward_only: bool = False) -> SplitLockstep:
    """The split schedule as one SPMD program would run it: slot by slot, each device its next
    task of any kind whose inputs arrived in an earlier slot (every slot ends in the exchange).
    With equal F, B and W costs every slot costs one task, so the lock-step time is the unit-time
    schedule's makespan: ZB-H1's bubble survives lock-step, where 1F1B's tick of a forward and a
    whole backward does not shrink (:func:`lockstep`). ``forward_only``: the F tasks alone, in
    the same orders (an evaluation's slots)."""
    P = stages
    orders = split_orders(schedule, P, microbatches)
    if forward_only:
        orders = [[op for op in order if op[0] == "F"] for order in orders]
    last = chunks_of(schedule, P) * P - 1
    done: dict[tuple[int, str, int], int] = {}  # -> the slot it ran in
    position = [0] * P
    total = sum(len(o) for o in orders)
    slots = []
    while sum(position) < total:
        index = len(slots)
        ran: list[_Op | None] = [None] * P
        for s in range(P):
            if position[s] >= len(orders[s]):
                continue
            op = orders[s][position[s]]
            kind, m, chunk = op
            c = model_chunk(schedule, P, s, chunk)
            if all(done.get(d, index) < index for d in _split_dependencies(c, kind, m, last)):
                ran[s] = op
                done[(c, kind, m)] = index
                position[s] += 1
        slots.append(tuple(ran))
        if len(slots) > 4 * total + 4:  # pragma: no cover - the orders never deadlock
            raise RuntimeError("lock-step schedule deadlocked")
    return SplitLockstep(schedule, P, microbatches, tuple(slots), tuple(_peak_in_flight(orders, release="W")))
