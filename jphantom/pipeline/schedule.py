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

:func:`simulate` executes a schedule's per-device order with real costs -- a forward costs ``1 / V``
per chunk (so one device's forwards of a micro-batch cost 1) and a backward ``backward_cost / V`` --
starting every task as soon as its device is free and its dependencies have finished;
:func:`lockstep` runs the same order in the lock-step slots of one SPMD program.

``zb-h1`` and ``zb-v`` (zero-bubble schedules; Qi, Wan, Huang & Lin, "Zero Bubble Pipeline
Parallelism", ICLR 2024) split each backward into **B**, the gradient of the stage's input (on
the critical path), and **W**, the gradient of its weights (deferrable), so that W fills what
would be bubbles. Their orders hold F, B and W tasks (:data:`SPLIT_SCHEDULES`); each is written
once and :func:`simulate` and :func:`lockstep` take it like any other, W costing a
``weight_share`` of the backward (the executor's B and W: :mod:`jphantom.pipeline.split`):

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


def _validate(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    if schedule not in ALL_SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; use one of "
                          f"{', '.join(ALL_SCHEDULES)}")
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


def _costs(schedule: str, chunks: int, backward_cost: float, weight_share: float | None
           ) -> tuple[float, float, float]:
    """(F, B, W) costs of one task on one of a device's ``chunks`` chunks, a forward of the
    device's whole share costing 1: B is the whole backward, or with a split backward its
    input's share (W the ``weight_share`` of the weights', default 0.5)."""
    if not backward_cost > 0 or not math.isfinite(backward_cost):
        raise ConfigError(f"backward_cost={backward_cost!r} must be a positive finite number; pass e.g. 2.0")
    if schedule not in SPLIT_SCHEDULES:
        if weight_share is not None:
            raise ConfigError(f"weight_share={weight_share!r} applies to the split-backward "
                              f"schedules ({', '.join(SPLIT_SCHEDULES)}), not {schedule!r}")
        return 1.0 / chunks, backward_cost / chunks, 0.0
    weight_share = 0.5 if weight_share is None else weight_share
    if not 0 < weight_share < 1:
        raise ConfigError(f"weight_share={weight_share!r}: the weight gradient's share of the "
                          "backward, strictly between 0 and 1 (e.g. 0.5)")
    return (1.0 / chunks, backward_cost * (1 - weight_share) / chunks,
            backward_cost * weight_share / chunks)


# An operation in a device's order: (kind, microbatch, chunk).
_Op = tuple[str, int, int]


def _orders(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1, *,
            lockstep: bool = False, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
            ) -> list[list[_Op]]:
    """Each device's operations, in the order it runs them: F, and B (the whole backward) or,
    with a split backward, B and W. ``lockstep``: 1F1B's warm-up is ``2 (P - s - 1)`` forwards
    instead of ``P - s - 1`` (see :func:`lockstep`). ``costs`` (F, B, W): what ``zb-v``'s list
    scheduling weighs."""
    P, M, V = stages, microbatches, virtual_stages
    if schedule == "zb-v":
        return _zb_v_orders(P, M, costs)
    orders: list[list[_Op]] = []
    for s in range(P):
        if schedule == "gpipe":
            order = [("F", m, 0) for m in range(M)] + [("B", m, 0) for m in reversed(range(M))]
        elif schedule in ("1f1b", "zb-h1"):
            warmup = min((P - s - 1) * (2 if lockstep and schedule == "1f1b" else 1), M)
            order = [("F", m, 0) for m in range(warmup)]
            for i in range(M - warmup):
                order += [("F", warmup + i, 0), ("B", i, 0)]
            order += [("B", m, 0) for m in range(M - warmup, M)]
            if schedule == "zb-h1":
                order = _defer_weights(order, cap=min(P, M))
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


def _defer_weights(order: list[_Op], cap: int) -> list[_Op]:
    """ZB-H1 from 1F1B's ``order``: each backward split into B and a W deferred while the
    stage holds fewer than ``cap`` micro-batches (activations live until W; 1F1B's peak), W's
    filling the cool-down between B's."""
    M = sum(kind == "F" for kind, _, _ in order)
    out: list[_Op] = []
    pending: list[_Op] = []
    forwards = backwards = weights = 0
    for kind, m, chunk in order:
        if kind == "F":
            while forwards - weights >= cap and pending:  # make room for the next forward
                out.append(pending.pop(0))
                weights += 1
            forwards += 1
            out.append((kind, m, chunk))
            continue
        out.append((kind, m, chunk))
        pending.append(("W", m, chunk))
        backwards += 1
        if forwards == M and backwards < M:  # cool-down: W between B's
            out.append(pending.pop(0))
            weights += 1
    return out + pending


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
    if schedule in SPLIT_SCHEDULES:
        raise ConfigError(f"build tables the schedules with a whole backward "
                          f"({', '.join(SCHEDULES)}); for {schedule!r} use simulate or lockstep")
    orders = _orders(schedule, stages, microbatches, virtual_stages)
    times = _execute(schedule, orders, stages, (1.0, 1.0, 0.0), virtual_stages)
    tasks = [Task(int(start), s, op[1], op[0], op[2]) for (s, op), (start, _) in times.items()]
    return sorted(tasks, key=lambda t: (t.tick, t.stage))


def simulate(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1,
             backward_cost: float = 1.0, weight_share: float | None = None) -> Simulation:
    """Discrete-event simulation of the schedule's per-device order with real costs: a forward
    of one device's whole share of the model costs 1 and its backward ``backward_cost`` (each of
    V chunks a ``1 / V`` share: ``virtual_stages``, or ``zb-v``'s two), of which a split
    backward's W is ``weight_share`` (default 0.5); each task starts when its device is free and
    its dependencies have ended. ``peak_in_flight`` counts (chunk) activations held from F to
    the backward (split: to W).

    GPipe and 1F1B give Narayanan et al.'s bubble ``(P - 1) / (M + P - 1)`` for any ``backward_cost``;
    interleaved 1F1B gives ``(P - 1) / (P - 1 + V * M)`` (see the module docstring).
    """
    _validate(schedule, stages, microbatches, virtual_stages)
    P = stages
    V = virtual_stages * chunks_of(schedule, P)
    costs = _costs(schedule, V, backward_cost, weight_share)
    orders = _orders(schedule, stages, microbatches, virtual_stages, costs=costs)
    times = _execute(schedule, orders, P, costs, V)
    makespan = max(end for _, end in times.values())
    busy = sum(end - start for start, end in times.values())
    release = "W" if schedule in SPLIT_SCHEDULES else "B"
    timed = sorted((TimedTask(Task(int(round(start * V)), s, op[1], op[0], op[2]), start, end)
                    for (s, op), (start, end) in times.items()), key=lambda t: (t.start, t.stage))
    return Simulation(schedule=schedule, stages=P, microbatches=microbatches, virtual_stages=V,
                      backward_cost=float(backward_cost), makespan=makespan,
                      bubble_fraction=(P * makespan - busy) / (P * makespan),
                      peak_in_flight=_peak_in_flight(orders, release), tasks=timed)


@dataclass(frozen=True)
class Lockstep:
    """A schedule as the SPMD executor runs it (:func:`lockstep`): ``slots``, each at most one
    task ``(kind, microbatch, chunk)`` per device (``None``: idle), ``phases`` slots a tick (a
    forward slot and then a backward slot; one slot of any task with a split backward), and
    ``peak_in_flight`` per stage (micro-batch chunks whose forward ran and whose backward, or W,
    has not: the residuals the stage holds)."""

    schedule: str
    stages: int
    microbatches: int
    virtual_stages: int
    phases: int
    slots: tuple[tuple[_Op | None, ...], ...]
    peak_in_flight: tuple[int, ...]

    @property
    def ticks(self) -> tuple[tuple[tuple[_Op | None, ...], ...], ...]:
        """The slots by tick, ``phases`` a tick."""
        return tuple(self.slots[t:t + self.phases] for t in range(0, len(self.slots), self.phases))

    def cost(self, backward_cost: float = 2.0, weight_share: float | None = None) -> float:
        """Step time in forwards of one device's whole share of the model, when every slot lasts
        as long as its longest task (:func:`simulate`'s costs)."""
        V = self.virtual_stages * chunks_of(self.schedule, self.stages)
        each = dict(zip("FBW", _costs(self.schedule, V, backward_cost, weight_share)))
        return sum(max((each[op[0]] for op in slot if op), default=0.0) for slot in self.slots)

    def bubble_fraction(self, backward_cost: float = 2.0, weight_share: float | None = None
                        ) -> float:
        """Idle device time / total device time of the lock-step execution."""
        busy = self.microbatches * (1.0 + backward_cost)
        return 1.0 - busy / self.cost(backward_cost, weight_share)

    def exchanges(self) -> int:
        """Slots after which an activation or a cotangent moves (a collective-permute each)."""
        return sum(any(op and op[0] == kind for op in slot)
                   for slot in self.slots for kind in ("F", "B"))


def lockstep(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1, *,
             forward_only: bool = False) -> Lockstep:
    """The schedule in lock-step slots, as one SPMD program runs it.

    In a single program every slot ends in the same point-to-point exchange on all devices, so a
    slot lasts as long as its slowest device. Every device walks its own order and takes, per
    slot, at most its next task whose inputs were produced in an earlier slot. With a whole
    backward a tick is a forward slot and then a backward slot (a micro-batch moves one stage
    per tick each way); with a split backward every slot takes a task of any kind: with equal
    F, B and W costs every slot costs one task, so ZB-H1's bubble survives lock-step where
    1F1B's tick of a forward and a whole backward does not shrink. ``forward_only``: the F tasks
    alone, in the same orders.

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
    P, split = stages, schedule in SPLIT_SCHEDULES
    orders = _orders(schedule, P, microbatches, virtual_stages, lockstep=True)
    if forward_only:
        orders = [[op for op in order if op[0] == "F"] for order in orders]
    kinds = (None,) if split else ("F", "B")  # what each slot of a tick may run
    last = virtual_stages * chunks_of(schedule, P) * P - 1
    done: dict[tuple[int, str, int], int] = {}  # -> the slot it ran in
    position = [0] * P
    total = sum(len(o) for o in orders)
    slots = []
    while sum(position) < total or len(slots) % len(kinds):
        index = len(slots)
        ran: list[_Op | None] = [None] * P
        for s in range(P):
            if position[s] >= len(orders[s]):
                continue
            op = orders[s][position[s]]
            kind, m, chunk = op
            c = model_chunk(schedule, P, s, chunk)
            if kinds[index % len(kinds)] in (None, kind) and all(
                    done.get(d, index) < index for d in _dependencies(c, kind, m, last)):
                ran[s] = op
                done[(c, kind, m)] = index
                position[s] += 1
        slots.append(tuple(ran))
        if len(slots) > 4 * total + 4:  # pragma: no cover - the orders never deadlock
            raise RuntimeError("lock-step schedule deadlocked")
    peaks = _peak_in_flight(orders, release="W" if split else "B")
    return Lockstep(schedule, P, microbatches, virtual_stages, len(kinds), tuple(slots),
                    tuple(peaks))


def chunks_of(schedule: str, stages: int) -> int:
    """Model chunks per device: 2 for ``zb-v`` (the V shape), else 1."""
    return 2 if schedule == "zb-v" else 1


def model_chunk(schedule: str, stages: int, device: int, chunk: int) -> int:
    """The model chunk (position along the forward) of ``device``'s ``chunk``: ``zb-v`` places
    chunk 0 of device s at s and chunk 1 at 2P - 1 - s."""
    if schedule == "zb-v":
        return device if chunk == 0 else 2 * stages - 1 - device
    return chunk * stages + device


def _dependencies(c: int, kind: str, m: int, last: int) -> list[tuple[int, str, int]]:
    """What task ``(c, kind, m)`` waits for: F on the previous chunk's F; B (whole or the
    input's gradient) on the chunk's F and the next chunk's B; W on its B."""
    if kind == "F":
        return [(c - 1, "F", m)] if c > 0 else []
    if kind == "B":
        return [(c, "F", m)] + ([(c + 1, "B", m)] if c < last else [])
    return [(c, "B", m)]  # W


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
                                 for d in _dependencies(c, "B", m, last)))
        choice = None
        if ready_b:
            m, c = ready_b[0][0], -ready_b[0][1]
            choice = ("B", m, c)
        elif live[s] < 2 * P:
            ready_f = sorted((-c, done_f[c]) for c in mine if done_f[c] < M
                             and all(d in finished and finished[d] <= now for d in
                                     _dependencies(c, "F", done_f[c], last)))
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




def _execute(schedule: str, orders: list[list[_Op]], stages: int,
             costs: tuple[float, float, float], chunks: int
             ) -> dict[tuple[int, _Op], tuple[float, float]]:
    """Each device's order (F, B and W tasks; placed by :func:`model_chunk`, ``chunks`` per
    device) as early as its dependencies allow: (start, end) per operation."""
    P = stages
    last = chunks * P - 1
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
                deps = _dependencies(c, kind, m, last)
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


