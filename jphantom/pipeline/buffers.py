"""The pipeline executor's buffers, per rank inside the step's shard_map: micro-batches, slot
buffers written and read at indices the host assigned, the typing of what flows between stages
(dtypes and varying mesh axes), and a ``jax.vjp`` pullback taken apart into the residuals a
stage stashes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.runtime import comm


def zeros_of(struct) -> jax.Array:
    """Zeros of an abstract value (``jax.eval_shape`` inside a shard_map) with its shape, dtype
    and varying mesh axes."""
    zeros = jnp.zeros(struct.shape, struct.dtype)
    varying = tuple(sorted(comm.varying_axes(struct)))  # none outside a shard_map
    return comm.pcast(zeros, varying, to="varying") if varying else zeros



def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    """A rank's batch [B, ...] as ``m`` micro-batches [m, B / m, ...] of consecutive rows."""
    return x.reshape(m, x.shape[0] // m, *x.shape[1:])


def interleave_microbatches(x: jax.Array, m: int, ranks: int) -> jax.Array:
    """A global batch [B, ...] of ``ranks`` batch ranks' consecutive rows as ``m`` micro-batches
    [m, B / m, ...], micro-batch i holding every rank's i-th slice (:func:`split_microbatches`
    of each rank's rows): what the shard_map step's ranks each take, for a global-array step."""
    return (x.reshape(ranks, m, x.shape[0] // (ranks * m), *x.shape[1:]).swapaxes(0, 1)
            .reshape(m, x.shape[0] // m, *x.shape[1:]))



def take_index(tree, i):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def put_slot(buffers, i, values):
    """``buffers`` with slot ``i`` (dimension 0) of each leaf set to ``values`` (cast to it)."""
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0),
                        buffers, values)


def cast_like(tree, like):
    """``tree``'s leaves in ``like``'s dtypes and varying over (at least) its mesh axes
    (activations may be pytrees: an MoE block's ``(h, aux)``, whose statistics start as plain
    zeros; integer leaves' cotangents, float0, become zeros of the leaf's dtype)."""
    def one(a, b):
        a = jnp.zeros(b.shape, b.dtype) if a.dtype == jax.dtypes.float0 else a.astype(b.dtype)
        extra = tuple(sorted(comm.varying_axes(b) - comm.varying_axes(a)))
        return comm.pcast(a, extra, to="varying") if extra else a
    return jax.tree.map(one, tree, like)


def varying_over(x, axis):
    """``x`` also varying over ``axis``."""
    return x if axis in comm.varying_axes(x) else comm.pcast(x, axis, to="varying")


def fill_like(tree, fill):
    """A pytree like ``tree`` filled with ``fill`` (floating leaves; integer leaves with 0)."""
    return jax.tree.map(lambda a: jnp.full_like(a, fill) if jnp.issubdtype(a.dtype, jnp.floating)
                        else jnp.zeros_like(a), tree)


def slot_buffers(value, n, *, garbage: bool = True):
    """A buffer of ``n`` slots shaped like ``value`` (same varying axes), zero-filled, and the
    garbage slot ``n`` an idle device writes to (``garbage=False``: none, its writes skipped by
    :func:`put_live_slot`; at least one slot)."""
    slots = n + 1 if garbage else max(n, 1)
    return jax.tree.map(lambda a: jnp.broadcast_to(jnp.zeros_like(a)[None], (slots, *a.shape)),
                        value)


def put_live_slot(buffers, i, values, n):
    """:func:`put_slot` into buffers of ``n`` slots and no garbage slot (:func:`slot_buffers`
    ``garbage=False``): where ``i`` is ``n`` (an idle device's) nothing is written. The stashes
    are the pipeline's activation memory: without a garbage slot a stage keeps only the residual
    sets its schedule has in flight (Narayanan et al.'s bound), not one more. A one-slot scatter
    whose index ``n``, out of range, is dropped: in place, and the slot is not read first (a
    select between the value and the slot's old contents read it; a ``lax.cond`` around the
    update made XLA copy every stash buffer through both branches)."""
    if n == 0:  # a buffer no task of the schedule writes
        return buffers
    return jax.tree.map(lambda b, v: b.at[i].set(v.astype(b.dtype), mode="drop",
                                                   unique_indices=True), buffers, values)


def vjp_residuals(vjp_fn, chunk_leaves):
    """``jax.vjp``'s Partial -> (treedef, leaves to stash, positions of leaves that are the chunk's
    own parameters: those are re-read at the backward instead of copied)."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    is_param = tuple(next((j for j, p in enumerate(chunk_leaves) if leaf is p), -1)
                     for leaf in leaves)
    return treedef, [leaf for leaf, j in zip(leaves, is_param) if j < 0], is_param


def rebuilder(treedef, is_param):
    """``rebuild(chunk)(residuals)``: a stashed ``jax.vjp`` pullback (or ``jax.linearize``
    function) from its stashed leaves and the chunk's own parameters at the positions
    ``is_param`` names (:func:`vjp_residuals`)."""
    def rebuild(chunk):
        chunk_leaves = jax.tree.leaves(chunk)

        def with_residuals(residuals):
            stored = iter(residuals)
            return jax.tree.unflatten(treedef, [chunk_leaves[j] if j >= 0 else next(stored)
                                                for j in is_param])
        return with_residuals
    return rebuild
