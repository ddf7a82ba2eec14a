"""The ring's schedule (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise
Transformers", with causal balancing as in Megatron-LM's context parallelism): what each rank does
with the K/V chunk of rank (r - s) mod C at ring step s, and the query-key pairs each rank scores
(:func:`attention_work`)."""

from __future__ import annotations

import numpy as np


# what a rank does with the K/V chunk of rank j at a ring step (s >= 1)
FULL, SKIP = 0, 1  # contiguous layout: j < r attends the whole chunk, j > r nothing
EARLY, LATE = 0, 1  # balanced: j < r both q chunks x j's first chunk; j > r r's second x both


def schedule(size: int) -> np.ndarray:
    """[C, C]: at ring step s (row; row 0 is the diagonal step) rank r (column) attends the K/V
    of rank (r - s) mod C as kind 0 (``FULL`` / ``EARLY``: j < r) or 1 (``SKIP`` / ``LATE``:
    j > r); the same table serves both layouts, whose branches differ."""
    table = np.zeros((size, size), np.int32)
    for s in range(1, size):
        for r in range(size):
            table[s, r] = 0 if (r - s) % size < r else 1
    return table


def attention_work(size: int, balanced: bool, local: int) -> list[int]:
    """Query-key pairs each rank scores over the ring (the diagonal step's whole block included),
    for ``local`` tokens per rank: what :class:`RingAttention` computes, from :func:`schedule`."""
    table = schedule(size)
    c = local // 2
    work = []
    for r in range(size):
        pairs = local * local  # step 0: the own chunk(s), one block
        for s in range(1, size):
            kind = table[s, r]
            if balanced:
                pairs += 2 * c * c  # EARLY: 2c x c; LATE: c x 2c
            elif kind == FULL:
                pairs += local * local
        work.append(pairs)
    return work
