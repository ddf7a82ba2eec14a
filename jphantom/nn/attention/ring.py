"""Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers"):
K/V chunks passed around the ring of ``context`` ranks with ``lax.ppermute``, each step's block
merged by its log-sum-exp, fully masked chunks skipped; the backward (``jax.custom_vjp``) passes
K/V around the ring again and carries dK/dV accumulators home, storing no K/V of the forward's
steps (:func:`ring_attention`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jphantom import comm
from jphantom.errors import ConfigError
from jphantom.nn.attention.blocks import backward_branches, block_kernels, forward_branches, merge
from jphantom.nn.attention.layout import AXIS
from jphantom.nn.attention.schedule import schedule


def _ring_perm(size: int):
    return [(i, (i + 1) % size) for i in range(size)]


def _segments(q_seg, k_seg):
    return None if q_seg is None else (q_seg, k_seg)


def _ring_forward(q, k, v, seg, size, balanced, kernel):
    """q [B, S/C, Hk, G, d], k and v [B, S/C, Hk, d] (``seg``: their segment ids [B, S/C] or
    None; a packed batch's travel around the ring with K/V) -> output and log-sum-exp
    (float32)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    rank = comm.axis_index(AXIS)
    forward, _ = block_kernels(kernel, scale)
    o, lse = forward(q, k, v, True, _segments(seg, seg))  # the diagonal step: causal
    table = jnp.asarray(schedule(size))
    branches = forward_branches(balanced, forward)
    kv = (k, v, seg)
    for s in range(1, size):
        kv = lax.ppermute(kv, AXIS, _ring_perm(size))
        o_s, lse_s = lax.switch(table[s, rank], branches, q, kv[0], kv[1],
                                _segments(seg, kv[2]))
        o, lse = merge(o, lse, o_s, lse_s)
    return o, lse


def _ring(q, k, v, seg, size, balanced, kernel):
    o, _ = _ring_forward(q, k, v, seg, size, balanced, kernel)
    return o.astype(q.dtype)


def _ring_fwd(q, k, v, seg, size, balanced, kernel):
    o, lse = _ring_forward(q, k, v, seg, size, balanced, kernel)
    out = o.astype(q.dtype)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(size, balanced, kernel, residuals, do):
    q, k, v, seg, o, lse = residuals
    scale = 1.0 / math.sqrt(q.shape[-1])
    rank = comm.axis_index(AXIS)
    _, backward = block_kernels(kernel, scale)
    do32, o32 = do.astype(jnp.float32), o.astype(jnp.float32)
    delta = jnp.sum(do32 * o32, axis=-1)
    dq, dk, dv = backward(q, k, v, o32, lse, delta, do32, True, _segments(seg, seg))
    table = jnp.asarray(schedule(size))
    branches = backward_branches(balanced, backward)
    perm = _ring_perm(size)
    kv, carried = (k, v, seg), None
    for s in range(1, size):
        kv = lax.ppermute(kv, AXIS, perm)
        dq_s, dk_s, dv_s = lax.switch(table[s, rank], branches, q, kv[0], kv[1], o32, do32, lse,
                                      delta, _segments(seg, kv[2]))
        dq = dq + dq_s
        if carried is None:  # the accumulator of rank r-1's chunk starts here
            carried = (dk_s, dv_s)
        else:  # rank r-1 carried it one step: add this rank's part
            carried = lax.ppermute(carried, AXIS, perm)
            carried = (carried[0] + dk_s, carried[1] + dv_s)
    if carried is not None:  # after step C-1 it holds rank r+1's chunk: one step home
        carried = lax.ppermute(carried, AXIS, perm)
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
