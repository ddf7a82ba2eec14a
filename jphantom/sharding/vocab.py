"""Vocabulary-parallel embedding lookup and cross-entropy (Megatron-LM, seed 002 Sec. 3).

The vocabulary V is split over the model axis: rank j holds rows [j V/p, (j+1) V/p) of the token
embedding, or columns of the logits. Neither function ever gathers the [B, S, V] logits: the
cross-entropy all-reduces three per-token scalars.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jphantom import comm


def _vocab_range(local_size: int, axis: str):
    return comm.axis_index(axis) * local_size


def embed_partial(wte_local: jax.Array, tokens: jax.Array, axis: str) -> jax.Array:
    """This rank's share of the embedding of ``tokens`` [B, S]: rows it holds, zeros elsewhere.
    ``wte_local`` [V/p, h]. The caller sums the shares (all-reduce, or reduce-scatter for SP)."""
    local_size = wte_local.shape[0]
    local = tokens - _vocab_range(local_size, axis)
    mine = (local >= 0) & (local < local_size)
    rows = jnp.take(wte_local, jnp.clip(local, 0, local_size - 1), axis=0)
    return jnp.where(mine[..., None], rows, jnp.zeros((), wte_local.dtype))


def cross_entropy_sum(logits_local: jax.Array, targets: jax.Array, axis: str) -> jax.Array:
    """Sum over tokens of -log softmax(logits)[target], logits split over the vocabulary.

    ``logits_local`` [B, S, V/p] (this rank's vocabulary slice), ``targets`` [B, S] global ids.
    Communication: three all-reduces of B x S scalars (max, sum of exponentials, target logit)."""
    local_size = logits_local.shape[-1]
    logits_local = logits_local.astype(jnp.promote_types(logits_local.dtype, jnp.float32))
    peak = comm.pmax(lax.stop_gradient(logits_local.max(axis=-1)), axis)  # all-reduce (max) of B*S
    sum_exp = comm.psum(jnp.exp(logits_local - peak[..., None]).sum(axis=-1), axis)  # all-reduce B*S
    local = targets - _vocab_range(local_size, axis)
    mine = (local >= 0) & (local < local_size)
    picked = jnp.take_along_axis(logits_local, jnp.clip(local, 0, local_size - 1)[..., None],
                                 axis=-1)[..., 0]
    picked = comm.psum(jnp.where(mine, picked, 0.0), axis)  # all-reduce of B*S: the target's logit
    return jnp.sum(jnp.log(sum_exp) + peak - picked)
