"""All-gather context attention on flash attention's blocks: K and V all-gathered over
``context`` (MaxText's and Llama 3's context parallelism), then this rank's queries attend the
gathered chunks one block at a time with the online softmax of Dao et al. (2022), the blocks merged
by their log-sum-exp (:func:`jphantom.nn.attention.blocks.merge`) and walked in the ring's order
(:func:`jphantom.nn.attention.schedule.schedule`: at step s the chunk of rank (r - s) mod C), so
that each block is a causal diagonal, a whole chunk or half of one: a mask cuDNN's and Pallas'
kernels take, not the layout's position mask.

Why blocks: the einsum path scores [S/C, S] per head and keeps the probabilities for the backward
(Korthikanti et al. 2022's 5 a s^2 b / t bytes a layer, twice: float32 and the compute dtype),
which is what made a 70B pipeline stage need hundreds of GiB. Here the backward
(``jax.custom_vjp``) keeps q, the gathered K and V, the output and the float32 log-sum-exp, and
recomputes each block (flash attention's Alg. 4); the gathered K/V's gradients are summed into
their chunks and the all-gather's transpose (a reduce-scatter over ``context``) sends them home.
No collective runs inside: the gathers are the caller's, so the layer works where ring attention's
collective-permutes cannot (a pipeline's conditional slots)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.runtime import comm
from jphantom.nn.attention.blocks import backward_branches, block_kernels, forward_branches, merge
from jphantom.nn.attention.layout import AXIS
from jphantom.nn.attention.schedule import schedule


def _chunk(x, j, local):
    """Rank j's chunk [B, S/C, ...] of the gathered [B, S, ...]."""
    return lax.dynamic_slice_in_dim(x, j * local, local, axis=1)


def _forward(q, k_all, v_all, size, balanced, kernel):
    """q [B, S/C, Hk, G, d], k_all and v_all [B, S, Hk, d] -> output and log-sum-exp
    (float32)."""
    local, rank = q.shape[1], comm.axis_index(AXIS)
    forward, _ = block_kernels(kernel, 1.0 / math.sqrt(q.shape[-1]))
    own = lambda x: _chunk(x, rank, local)  # noqa: E731
    o, lse = forward(q, own(k_all), own(v_all), True)  # the diagonal block: causal
    table = jnp.asarray(schedule(size))
    branches = [lambda q, k, v, b=b: b(q, k, v, None) for b in forward_branches(balanced, forward)]
    for s in range(1, size):
        j = (rank - s) % size
        o_s, lse_s = lax.switch(table[s, rank], branches, q, _chunk(k_all, j, local),
                                _chunk(v_all, j, local))
        o, lse = merge(o, lse, o_s, lse_s)
    return o, lse


def _attend(q, k_all, v_all, size, balanced, kernel):
    o, _ = _forward(q, k_all, v_all, size, balanced, kernel)
    return o.astype(q.dtype)


def _attend_fwd(q, k_all, v_all, size, balanced, kernel):
    o, lse = _forward(q, k_all, v_all, size, balanced, kernel)
    out = o.astype(q.dtype)
    return out, (q, k_all, v_all, out, lse)


def _add_chunk(acc, g, j, local):
    return lax.dynamic_update_slice_in_dim(acc, _chunk(acc, j, local) + g, j * local, axis=1)


def _attend_bwd(size, balanced, kernel, residuals, do):
    q, k_all, v_all, o, lse = residuals
    local, rank = q.shape[1], comm.axis_index(AXIS)
    _, backward = block_kernels(kernel, 1.0 / math.sqrt(q.shape[-1]))
    do32, o32 = do.astype(jnp.float32), o.astype(jnp.float32)
    delta = jnp.sum(do32 * o32, axis=-1)
    dq, dk, dv = backward(q, _chunk(k_all, rank, local), _chunk(v_all, rank, local), o32, lse,
                          delta, do32, True)
    dk_all = _add_chunk(jnp.zeros(k_all.shape, jnp.float32), dk, rank, local)
    dv_all = _add_chunk(jnp.zeros(v_all.shape, jnp.float32), dv, rank, local)
    table = jnp.asarray(schedule(size))
    branches = [lambda *a, b=b: b(*a, None) for b in backward_branches(balanced, backward)]
    for s in range(1, size):
        j = (rank - s) % size
        dq_s, dk_s, dv_s = lax.switch(table[s, rank], branches, q, _chunk(k_all, j, local),
                                      _chunk(v_all, j, local), o32, do32, lse, delta)
        dq = dq + dq_s
        dk_all, dv_all = _add_chunk(dk_all, dk_s, j, local), _add_chunk(dv_all, dv_s, j, local)
    return dq.astype(q.dtype), dk_all.astype(k_all.dtype), dv_all.astype(v_all.dtype)


_blockwise = jax.custom_vjp(_attend, nondiff_argnums=(3, 4, 5))
_blockwise.defvjp(_attend_fwd, _attend_bwd)


def blockwise_gathered_attention(q, k_all, v_all, *, size: int, balanced: bool = True,
                                 kernel: str = "xla") -> jax.Array:
    """Causal attention of this rank's queries q [B, S/C, Hq, d] over the K and V already
    gathered over ``context`` (k_all, v_all [B, S, Hk, d], in the layout's rank order) ->
    [B, S/C, Hq, d], inside ``shard_map``; ``kernel``: the blocks'
    (:func:`~jphantom.nn.attention.blocks.block_kernels`)."""
    b, s, hq, d = q.shape
    grouped = q.reshape(b, s, k_all.shape[2], hq // k_all.shape[2], d)
    return _blockwise(grouped, k_all, v_all, size, balanced, kernel).reshape(q.shape)
