"""Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers"):
K/V chunks passed around the ring of ``context`` ranks with ``lax.ppermute``, each step's block
merged by its log-sum-exp, fully masked chunks skipped; the backward (``jax.custom_vjp``) passes
K/V around the ring again and carries dK/dV accumulators home, storing no K/V of the forward's
steps (:func:`ring_attention`).

The ring is double-buffered, as Megatron-LM's context parallelism and MaxText's ring do: each
step sends the chunk the next step needs before it computes its own block, and an optimization
barrier ties the received chunk to that block's result (:func:`_behind`), so that XLA's
latency-hiding scheduler keeps every transfer in flight under a block of attention; without it
the scheduler chained the transfers back to back ahead of the blocks (it prices neither a
``conditional`` nor a Pallas call). Only the dK/dV accumulators' last step home, after the
backward's last block, has no block left to hide under: the projections' gradients that follow
hide it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.runtime import comm
from jphantom.errors import ConfigError
from jphantom.nn.attention.blocks import backward_branches, block_kernels, forward_branches, merge
from jphantom.nn.attention.layout import AXIS
from jphantom.nn.attention.schedule import schedule


def _ring_perm(size: int):
    return [(i, (i + 1) % size) for i in range(size)]


def _segments(q_seg, k_seg):
    return None if q_seg is None else (q_seg, k_seg)


def _send(x, size):
    """``x`` one step along the ring (rank r's to rank r + 1)."""
    return lax.ppermute(x, AXIS, _ring_perm(size))


def _behind(in_flight, computed):
    """``(in_flight, computed)`` through an optimization barrier: the transfers ``in_flight``
    (issued before a block) are awaited only where the block's results ``computed`` are, so
    XLA's scheduler keeps each transfer under the block it was sent ahead of (double buffering,
    as in Megatron-LM's context parallelism) rather than chaining the ring's transfers ahead of
    the blocks, whose cost it does not see (a ``conditional``, a Pallas custom call)."""
    return lax.optimization_barrier((in_flight, computed))


def _ring_forward(q, k, v, seg, size, balanced, kernel):
    """q [B, S/C, Hk, G, d], k and v [B, S/C, Hk, d] (``seg``: their segment ids [B, S/C] or
    None; a packed batch's travel around the ring with K/V) -> output and log-sum-exp
    (float32). Step s sends its chunk on (step s + 1's) before computing its block."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    rank = comm.axis_index(AXIS)
    forward, _ = block_kernels(kernel, scale)
    table = jnp.asarray(schedule(size))
    branches = forward_branches(balanced, forward)
    kv, o, lse = (k, v, seg), None, None
    for s in range(size):
        ahead = _send(kv, size) if s < size - 1 else None  # step s + 1's chunk, in flight
        if s == 0:  # the diagonal step: causal
            block = forward(q, k, v, True, _segments(seg, seg))
        else:
            block = lax.switch(table[s, rank], branches, q, kv[0], kv[1], _segments(seg, kv[2]))
        if ahead is not None:
            kv, block = _behind(ahead, block)
        o, lse = block if s == 0 else merge(o, lse, *block)
    return o, lse


def _ring(q, k, v, seg, size, balanced, kernel):
    o, _ = _ring_forward(q, k, v, seg, size, balanced, kernel)
    return o.astype(q.dtype)


def _ring_fwd(q, k, v, seg, size, balanced, kernel):
    o, lse = _ring_forward(q, k, v, seg, size, balanced, kernel)
    out = o.astype(q.dtype)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(size, balanced, kernel, residuals, do):
    """The ring again, double-buffered as the forward: step s sends its K/V chunk on and the
    dK/dV accumulator of block s - 1 one rank further before computing block s (the diagonal
    block is step 0's); the accumulator that holds rank r + 1's chunk after step C - 1 goes
    home after the last block, under what follows it (the projections' gradients)."""
    q, k, v, seg, o, lse = residuals
    scale = 1.0 / math.sqrt(q.shape[-1])
    rank = comm.axis_index(AXIS)
    _, backward = block_kernels(kernel, scale)
    do32, o32 = do.astype(jnp.float32), o.astype(jnp.float32)
    delta = jnp.sum(do32 * o32, axis=-1)
    table = jnp.asarray(schedule(size))
    branches = backward_branches(balanced, backward)
    kv, carried, dq, dk, dv = (k, v, seg), None, None, None, None
    for s in range(size):
        ahead = _send(kv, size) if s < size - 1 else None  # step s + 1's chunk
        arriving = _send(carried, size) if carried is not None else None  # rank r-1's, on
        if s == 0:  # the diagonal step: causal
            grads = backward(q, k, v, o32, lse, delta, do32, True, _segments(seg, seg))
        else:
            grads = lax.switch(table[s, rank], branches, q, kv[0], kv[1], o32, do32, lse,
                               delta, _segments(seg, kv[2]))
        (ahead, arriving), grads = _behind((ahead, arriving), grads)
        if s == 0:
            dq, dk, dv = grads
        else:
            dq = dq + grads[0]
            carried = grads[1:] if arriving is None else (arriving[0] + grads[1],
                                                          arriving[1] + grads[2])
        kv = ahead if ahead is not None else kv
    if carried is not None:  # after step C-1 it holds rank r+1's chunk: one step home
        carried = _send(carried, size)
        dk, dv = dk + carried[0], dv + carried[1]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring_attention = jax.custom_vjp(_ring, nondiff_argnums=(4, 5, 6))
_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def _grouped(q, k):
    b, s, hq, d = q.shape
    hk = k.shape[2]
    if hq % hk:
        raise ConfigError(f"{hq} query heads do not share {hk} key/value heads evenly")
    return q.reshape(b, s, hk, hq // hk, d)


def ring_attention(q, k, v, *, size: int, balanced: bool = True, kernel: str = "xla",
                   segment_ids=None) -> jax.Array:
    """Causal attention of this rank's chunk of a sequence split over ``context`` (``size``
    ranks), q [B, S/C, Hq, d], k and v [B, S/C, Hk, d] -> [B, S/C, Hq, d]; inside ``shard_map``.
    ``kernel``: the blocks' (``xla``, ``pallas``; :func:`block_kernels`). ``segment_ids``
    [B, S/C] (a packed batch, this rank's chunk in the layout's order): each K/V chunk's travel
    with it, and a query attends only keys of its own segment."""
    out = _ring_attention(_grouped(q, k), k, v, segment_ids, size, balanced, kernel)
    return out.reshape(q.shape)
