"""A pipeline schedule compiled, on the host, to the table the executor walks
(:mod:`jphantom.pipeline.runner`): every schedule as slots of tasks.

One **slot** holds at most one task per device, then the slot's exchange:

    F    the forward of one model chunk on one micro-batch (stashes the pullback's residuals;
         on the last chunk also the loss and the seed of the backward)
    BW   its whole backward: the input's and the weights' gradients (GPipe, 1F1B, interleaved)
    B    the input's gradient alone, and W the weights' (ZB-H1, ZB-V: Qi et al., "Zero Bubble
         Pipeline Parallelism", Sec. 2; :mod:`jphantom.pipeline.split`)

A **tick** is one iteration of the executor's loop: one slot for the split schedules
(:func:`jphantom.pipeline.schedule.lockstep`), two for the others, whose lock-step tick is a
forward slot and then a backward slot.
``table[slot, device, field]`` (``FIELDS``) says what each device runs and which buffer slots
it reads and writes; every buffer slot is assigned here, from the intervals between a value's
write and its last read (:func:`allocate_slots`), so a 1F1B step holds at most
``min(M, 2 (P - s) - 1)`` residual sets whatever ``M`` is and GPipe ``M``.

The exchange: what a task produced (an activation for the next model chunk, an input gradient
for the previous one) moves to the device that holds that chunk: one ``[b, ...]``
collective-permute towards the next device and one towards the previous, each only where some
device sends that way (a ring with ``interleaved-1f1b``'s round-robin chunks; ``zb-v``'s turn,
chunk P - 1 to P on device P - 1, stays on its device: ``keep``). The ticks are cut into
**segments** of ticks whose slots run the same kinds of task and exchange the same ways, so the
compiled step holds exactly :attr:`ScheduleTable.permutes` collective-permutes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jphantom.pipeline.config import PipelineConfig
from jphantom.pipeline.schedule import chunks_of, lockstep, model_chunk

KINDS = ("idle", "F", "B", "W", "BW")
FIELDS = ("kind", "chunk", "mb", "first", "last", "inbox", "stash_b", "stash_w", "wstash", "seed",
          "keep", "from_prev", "from_next")
_F = {name: i for i, name in enumerate(FIELDS)}
MAX_SEGMENTS = 12  # more loops than this and short runs join their neighbour (``schedule_table``)
MIN_RUN = 3  # ticks: the runs that then join

# A slot's kinds (indices into KINDS) and whether it sends to the next and the previous device.
Phase = tuple[tuple[int, ...], bool, bool]


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    """A schedule as the executor runs it: ``table[slot, device, field]`` (``FIELDS``; slot
    ``t * phases + p`` is phase p of tick t), the buffers' slot counts, and the segments
    ``(start, stop, phases)`` of ticks ``[start, stop)``, one :data:`Phase` per slot of a tick.

    ``inbox``: messages received or kept (a forward's input, a backward's cotangent);
    ``stash_b``: the pullback's residuals the backward (B or BW) needs, from F; ``stash_w``: the
    weight-only residuals, from F to W; ``wstash``: B's linear function's residuals, from B to W.
    """

    table: np.ndarray
    phases: int
    ring: bool
    keeps: bool
    inbox_slots: int
    stash_b_slots: int
    stash_w_slots: int
    wstash_slots: int
    segments: tuple[tuple[int, int, tuple[Phase, ...]], ...]

    @property
    def splits(self) -> bool:
        """Whether the backward is split into B and W tasks."""
        return bool((self.table[:, :, 0] == KINDS.index("W")).any())

    @property
    def stash_slots(self) -> int:
        """Residual sets a device holds at once (F to its backward, or to W)."""
        return max(self.stash_b_slots, self.stash_w_slots)

    def _sends(self, way: int) -> int:
        return sum((stop - start) * sum(phase[way] for phase in phases)
                   for start, stop, phases in self.segments)

    @property
    def permutes_next(self) -> int:
        """Collective-permutes towards the next device (the classic schedules' activations)."""
        return self._sends(1)

    @property
    def permutes_prev(self) -> int:
        """Collective-permutes towards the previous device (their cotangents)."""
        return self._sends(2)

    @property
    def permutes(self) -> int:
        """Collective-permutes the compiled step holds: one per slot and direction that sends."""
        return self.permutes_next + self.permutes_prev


def allocate_slots(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for (write time, read time, key) intervals: a slot is reused once read before the
    next write. Returns key -> slot and the number of slots."""
    slot_of, free_after = {}, []
    for write, read, key in sorted(intervals, key=lambda i: (i[0], i[1])):
        for slot, busy_until in enumerate(free_after):
            if busy_until < write:
                break
        else:
            slot = len(free_after)
            free_after.append(0)
        free_after[slot] = read
        slot_of[key] = slot
    return slot_of, len(free_after)


def _slots(config: PipelineConfig, stages: int, train: bool):
    """The schedule's slots (per device ``(kind, microbatch, local chunk)`` or ``None``; a
    whole backward is ``BW``) and slots per tick. Evaluation: the forward slots that run
    something (a split schedule's F tasks alone in lock-step), one a tick."""
    steps = lockstep(config.schedule, stages, config.microbatches, config.virtual_stages,
                     forward_only=config.split and not train)
    whole = {"F": "F", "B": "B" if config.split else "BW", "W": "W"}
    slots = [tuple(None if op is None else (whole[op[0]], *op[1:]) for op in slot)
             for slot in steps.slots]
    if train:
        return slots, steps.phases
    return [slot for slot in slots if any(op is not None and op[0] == "F" for op in slot)], 1


def schedule_table(config: PipelineConfig, stages: int, *, train: bool = True) -> ScheduleTable:
    """Compile ``config``'s schedule on ``stages`` devices to the executor's table
    (``train=False``: its forward tasks only, for evaluation)."""
    P = stages
    slots, phases = _slots(config, P, train)
    V = config.local_chunks
    device = {model_chunk(config.schedule, P, s, v): s for s in range(P) for v in range(V)}
    slot_of, counts = _buffer_slots(config, P, slots, device, train)
    I, SB, SW, WS = (max(1, n) for n in counts)  # index n of each buffer: the garbage slot
    table, sends, kinds = _fill(config, P, slots, device, slot_of, (I, SB, SW, WS), train)
    ring = config.virtual_stages > 1  # as _fill sends
    keeps = bool((table[:, :, _F["keep"]] != I).any())
    return ScheduleTable(table, phases, ring, keeps, I, SB, SW, WS, _segments(kinds, sends, phases))


def _buffer_slots(config: PipelineConfig, P: int, slots, device, train: bool):
    """Every value's slot in its buffer, per device (inbox, stash_b, stash_w, wstash: ``{(device,
    key): slot}``), and each buffer's slot count, from the intervals between a value's write and
    its last read."""
    schedule, last = config.schedule, config.local_chunks * P - 1
    when: dict[tuple[str, int, int], int] = {}
    for t, slot in enumerate(slots):
        for s, op in enumerate(slot):
            if op is not None:
                kind, m, v = op
                when[(kind, model_chunk(schedule, P, s, v), m)] = t
    backward = "B" if config.split else "BW"
    inbox, stash_b, stash_w, wstash = ([[] for _ in range(P)] for _ in range(4))
    # Times: 2t = slot t's task, 2t + 1 = its exchange (what arrives is stored then).
    for (kind, c, m), t in when.items():
        if kind != "F":
            continue
        s = device[c]
        if c > 0:
            inbox[s].append((2 * when[("F", c - 1, m)] + 1, 2 * t, ("x", c, m)))
        if train:
            tb = when[(backward, c, m)]
            written = 2 * t if c == last else 2 * when[(backward, c + 1, m)] + 1
            inbox[s].append((written, 2 * tb, ("g", c, m)))
            stash_b[s].append((2 * t, 2 * tb, (c, m)))
            if config.split:
                tw = when[("W", c, m)]
                stash_w[s].append((2 * t, 2 * tw, (c, m)))
                wstash[s].append((2 * tb, 2 * tw, (c, m)))
    slot_of, counts = [{}, {}, {}, {}], [0, 0, 0, 0]
    for s in range(P):
        for i, intervals in enumerate((inbox[s], stash_b[s], stash_w[s], wstash[s])):
            assigned, n = allocate_slots(intervals)
            slot_of[i].update({(s, key): slot for key, slot in assigned.items()})
            counts[i] = max(counts[i], n)
    return slot_of, counts


def _fill(config: PipelineConfig, P: int, slots, device, slot_of, garbage, train: bool):
    """The table (every field of an idle device or unused buffer at its garbage slot), whether
    each slot sends to the next and to the previous device, and each slot's task kinds."""
    schedule, last = config.schedule, config.local_chunks * P - 1
    I, SB, SW, WS = garbage
    F = _F
    table = np.zeros((len(slots), P, len(FIELDS)), np.int32)
    for name, index in (("inbox", I), ("seed", I), ("keep", I), ("from_prev", I),
                        ("from_next", I), ("stash_b", SB), ("stash_w", SW), ("wstash", WS)):
        table[:, :, F[name]] = index
    # Interleaved chunks wrap round (device P - 1 to 0 and back): a ring, forward messages one
    # way and backward ones the other.
    ring = config.virtual_stages > 1
    nxt = [(s + 1) % P if ring else s + 1 for s in range(P)]
    prv = [(s - 1) % P if ring else s - 1 for s in range(P)]
    sends = np.zeros((len(slots), 2), bool)  # (to the next device, to the previous)
    kinds = [set() for _ in slots]

    def deliver(t, s, key, to, forward):
        """Device s's message of slot t goes to device ``to``, into its inbox slot of ``key``
        (a forward's by preference towards the next device, a backward's the previous: with a
        ring of two both ways are one)."""
        at = slot_of[0][(to, key)]
        if to == s:
            table[t, s, F["keep"]] = at
        elif (to == nxt[s]) and (forward or to != prv[s]):
            table[t, to, F["from_prev"]] = at
            sends[t, 0] = True
        else:
            assert to == prv[s], (s, to)
            table[t, to, F["from_next"]] = at
            sends[t, 1] = True

    for t, slot in enumerate(slots):
        for s, op in enumerate(slot):
            if op is None:
                continue
            kind, m, v = op
            c = model_chunk(schedule, P, s, v)
            row = table[t, s]
            kinds[t].add(KINDS.index(kind))
            row[[F["kind"], F["chunk"], F["mb"], F["first"], F["last"]]] = (
                KINDS.index(kind), v, m, c == 0, c == last)
            if kind == "F":
                if c > 0:
                    row[F["inbox"]] = slot_of[0][(s, ("x", c, m))]
                if train:
                    row[F["stash_b"]] = slot_of[1][(s, (c, m))]
                    if config.split:
                        row[F["stash_w"]] = slot_of[2][(s, (c, m))]
                    if c == last:
                        row[F["seed"]] = slot_of[0][(s, ("g", c, m))]
                if c < last:
                    deliver(t, s, ("x", c + 1, m), device[c + 1], True)
            elif kind in ("B", "BW"):  # reads the cotangent and B's residuals (B: writes W's)
                row[F["inbox"]] = slot_of[0][(s, ("g", c, m))]
                row[F["stash_b"]] = slot_of[1][(s, (c, m))]
                if kind == "B":
                    row[F["wstash"]] = slot_of[3][(s, (c, m))]
                if c > 0:
                    deliver(t, s, ("g", c - 1, m), device[c - 1], False)
            else:  # W reads the weight-only residuals and B's
                row[F["stash_w"]] = slot_of[2][(s, (c, m))]
                row[F["wstash"]] = slot_of[3][(s, (c, m))]
    return table, sends, kinds


def _segments(kinds, sends, phases: int):
    """The ticks cut into segments ``(start, stop, phases)`` of equal :data:`Phase` s."""
    def signature(tick):
        return tuple((tuple(sorted(kinds[t])), bool(sends[t, 0]), bool(sends[t, 1]))
                     for t in range(tick * phases, (tick + 1) * phases))

    ticks = len(kinds) // phases
    segments, start = [], 0
    for t in range(1, ticks + 1):
        if t == ticks or signature(t) != signature(start):
            segments.append((start, t, signature(start)))
            start = t
    # Every segment is a loop with its own buffers: where sends alternate slot by slot (zb-v,
    # two stages) one loop per slot costs memory and compile time. Past MAX_SEGMENTS, runs
    # shorter than MIN_RUN ticks join the segment before them (the union of their kinds and
    # exchanges); a joined slot with nothing to send one way still permutes (its idle fill),
    # counted in ``permutes``.
    joined = []
    for seg in segments:
        if len(segments) > MAX_SEGMENTS and joined and seg[1] - seg[0] < MIN_RUN:
            prev = joined.pop()
            seg = (prev[0], seg[1], tuple(
                (tuple(sorted(set(a[0]) | set(b[0]))), a[1] or b[1], a[2] or b[2])
                for a, b in zip(prev[2], seg[2])))
        joined.append(seg)
    return tuple(joined)


def unit_order(units: int, stages: int, virtual_stages: int = 1, *,
               schedule: str = "interleaved-1f1b") -> np.ndarray:
    """``order[g]``: the model unit stored at position g of the stacked axis, so that a
    contiguous split over ``stages`` gives device s its model chunks in local order: with V
    virtual stages the chunks ``v P + s`` (Megatron's round-robin), with ``zb-v`` chunk s and
    then chunk 2P - 1 - s."""
    P = stages
    V = virtual_stages * chunks_of(schedule, P)
    per_chunk = units // (P * V)
    g = np.arange(units)
    s, within = divmod(g, V * per_chunk)
    v, j = divmod(within, per_chunk)
    c = np.array([model_chunk(schedule, P, int(a), int(b)) for a, b in zip(s, v)])
    return c * per_chunk + j
