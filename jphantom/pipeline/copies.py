"""Which of a pipeline slot's two copies of a model chunk each task reads, and when each
device fills them (on the host, from the schedule's table), and the name of a slot's switch
that says how often each of its branches runs.

A GEMM does not read its weights through a slice of the stage's [V, Lc, ...] stack: XLA copies
the slice first, in every task. So with V more than twice the slots of a tick the executor
(:mod:`jphantom.pipeline.runner`) keeps two copies of a chunk per slot, one array per layer
and leaf, and compiles each task kind's branch once per copy. A device's runs of tasks on one
chunk (an interleaved schedule, Narayanan et al. 2021 Sec. 2.2, runs a chunk's P micro-batches
in a row) read the copies in turn; a run's copy is filled ahead of it, and the fills are
gathered into ticks where every device fills at once, since a device filling alone makes its
neighbours wait for it at the slot's permute.
"""

from __future__ import annotations

import numpy as np

from jphantom.pipeline.table import FIELDS

__all__ = ["COPY_FIELDS", "branch_ticks", "chunk_copies", "with_copies", "with_copy"]

# The executor's fields after the table's: which copy a task reads, which copy a device fills
# before its task and with which chunk (chunk_copies)
COPY_FIELDS = ("copy", "fill", "fill_chunk")
_F = {name: i for i, name in enumerate(FIELDS + COPY_FIELDS)}


def branch_ticks(index_of, rows) -> str:
    """The name scope of a slot's switch: ``branch_ticks_<n0>_<n1>_..._of_<t>_ticks``, how many
    of the ``t`` ticks of ``rows`` ([ticks, P, fields]) each branch runs on the device that
    runs it most (``index_of``: (kind, copy) -> branch). What the compiled program's accounting
    counts (:func:`jphantom.analysis.hlo.multipliers`): each branch that often, not once a
    tick, so the two copies' branches of a kind are not both counted in every tick."""
    rows = np.asarray(rows)  # without the copies' fields where the slot keeps none
    copy = np.maximum(rows[..., _F["copy"]], 0) if rows.shape[-1] > _F["copy"] else 0
    taken = index_of[rows[..., _F["kind"]], copy]  # [ticks, P]
    counts = [int((taken == i).sum(axis=0).max()) for i in range(int(index_of.max()) + 1)]
    return f"branch_ticks_{'_'.join(map(str, counts))}_of_{len(rows)}_ticks"


def with_copy(buffers, c):
    """A branch's buffers: with ``c`` (not None) the slot's copy ``c`` of a chunk as ``chunk``."""
    copies = buffers.get("copies")
    buffers = {k: b for k, b in buffers.items() if k != "copies"}
    return buffers if c is None else {**buffers, "chunk": copies[c]}


def with_copies(rows) -> np.ndarray:
    """The table's ``rows`` ([ticks, phases, P, fields]) with the fields :data:`COPY_FIELDS`
    (:func:`chunk_copies`, per phase) appended."""
    extra = np.zeros((*rows.shape[:3], len(COPY_FIELDS)), rows.dtype)
    for p in range(rows.shape[1]):
        kind, chunk = rows[:, p, :, _F["kind"]], rows[:, p, :, _F["chunk"]]
        extra[:, p] = np.stack(chunk_copies(kind, chunk), axis=-1)
    return np.concatenate([rows, extra], axis=-1)


def chunk_copies(kind, chunk):
    """Which of two copies of a chunk each task of a slot reads, and when each device fills
    them, from the slot's ``kind`` and ``chunk`` ([ticks, P]): (copy, fill, fill_chunk), each
    [ticks, P], -1 where none. A device's runs of tasks on one chunk read the copies in turn;
    a run's copy is filled after the run before the last ends and by the run's first task,
    and the fills are gathered into as few ticks as that allows (a tick stabbing as many
    devices' windows as it can). An interleaved schedule's devices each start a chunk's P
    micro-batches one tick after their predecessor, so one fill tick serves every device:
    some device fills a copy in 80 of NeMo's 342 ticks, not 320 (with one copy each device
    would refill in its own tick, and its neighbours wait for it at the next permute)."""
    ticks, devices = kind.shape
    copy, fill = np.full((ticks, devices), -1), np.full((ticks, devices), -1)
    fill_chunk = np.zeros((ticks, devices), chunk.dtype)
    windows = []  # (first tick, last tick, device, copy, chunk)
    for s in range(devices):
        runs = []  # [chunk, first tick, last tick]
        for t in np.flatnonzero(kind[:, s] > 0):
            if runs and runs[-1][0] == chunk[t, s]:
                runs[-1][2] = t
            else:
                runs.append([chunk[t, s], t, t])
        for i, (c, first, last) in enumerate(runs):
            copy[first:last + 1, s] = np.where(kind[first:last + 1, s] > 0, i % 2, -1)
            if i < 2 or runs[i - 2][0] != c:  # the copy does not hold it still
                windows.append((runs[i - 2][2] + 1 if i >= 2 else 0, first, s, i % 2, c))
    stabs = set()
    for lo, hi, s, c, v in sorted(windows, key=lambda w: w[1]):
        free = [t for t in range(lo, hi + 1) if fill[t, s] < 0]
        shared = [t for t in free if t in stabs]
        t = max(shared or free)
        stabs.add(t)
        fill[t, s], fill_chunk[t, s] = c, v
    return copy, fill, fill_chunk
