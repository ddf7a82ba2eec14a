"""Vocabulary-parallel embedding lookup and cross-entropy (Megatron-LM, Brakel et al. Sec. 3), and
the cross-entropy in chunks of tokens that never holds the [B, S, V] logits.

The vocabulary V is split over the model axis: rank j holds rows [j V/p, (j+1) V/p) of the token
embedding, or columns of the logits. Neither function ever gathers the [B, S, V] logits: the
cross-entropy all-reduces three per-token scalars.

**Chunks** (:func:`chunked_sum`; Liger-Kernel's fused linear cross-entropy and MaxText's vocabulary
tiling do the same): the N tokens are cut into n chunks, each chunk's logits [N/n, V/p] computed
from the head's weight, reduced to its loss and dropped, the chunk's gradients computed in the
same forward (fused) or its logits recomputed in the backward (``jax.checkpoint``, for heads
that hold their own weights). Logits are in the compute dtype; only one chunk is ever widened to
float32. n is the fewest chunks dividing N whose float32 logits hold at most
:data:`LOGITS_CHUNK_ELEMENTS` elements (1 GiB), so small problems run in one chunk, the program
they always ran. The weights' gradients are accumulated over the chunks in float32 (each
chunk's in the weights' dtype, as the unchunked GEMM gives it). Fewer, larger chunks are
faster. Measured on one H200 (``benchmarks/gpu_step.py``: a 1.2B Llama, 16,384 tokens a step,
V = 128256): 8 chunks of 2048 tokens (this limit) 0.3034 s a step, one chunk holding every logit
0.3017 s (7 GiB more peak memory), 32 chunks of 512 tokens (a 2^26 limit) 0.3242 s.
Communication is the same bytes in n pieces: the vocabulary-parallel loss's three all-reduces of
N/n scalars per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jphantom.runtime import comm

LOGITS_CHUNK_ELEMENTS = 2**28  # float32 logits of one chunk: 1 GiB


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
    """Sum over tokens of -log softmax(logits)[target], logits split over the vocabulary; a
    negative target (a masked token) adds nothing.

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
    return jnp.sum(jnp.where(targets >= 0, jnp.log(sum_exp) + peak - picked, 0.0))


def token_chunks(tokens: int, vocab_local: int, max_elements: int | None = None) -> int:
    """The fewest chunks n dividing ``tokens`` whose [tokens/n, vocab_local] logits hold at most
    ``max_elements`` (default :data:`LOGITS_CHUNK_ELEMENTS`) elements (``tokens`` if none)."""
    limit = LOGITS_CHUNK_ELEMENTS if max_elements is None else max_elements
    need = max(1, -(-tokens * vocab_local // limit))
    return next((n for n in range(need, tokens + 1) if tokens % n == 0), tokens)


def chunked_sum(fn: Callable, h: jax.Array, targets: jax.Array, weights: tuple = (), *,
                vocab_local: int, max_elements: int | None = None) -> jax.Array:
    """``fn(h_c, t_c, *weights)`` summed over chunks of the tokens: ``h`` [..., hidden] and
    ``targets`` [...] flattened to N tokens and cut into :func:`token_chunks` chunks; ``fn``
    returns a chunk's summed loss (in float32) and reads no parameter but ``weights``.

    With ``weights`` (a head's weight and bias, in the compute dtype) the sum is *fused*
    (Liger-Kernel's fused linear cross-entropy): the forward computes each chunk's loss and, from
    its ``jax.vjp``, the chunk's gradients for a unit cotangent (dh_c kept, the weights'
    accumulated in float32); the backward only scales them. No logits are stored or
    recomputed: the FLOPs of the unchunked loss, the memory of one chunk. Without ``weights``
    (``fn`` closes over a head of its own) each chunk is ``jax.checkpoint``-ed: its logits are
    recomputed in the backward."""
    tokens = targets.size
    rows, labels = h.reshape(tokens, h.shape[-1]), targets.reshape(tokens)
    chunks = token_chunks(tokens, vocab_local, max_elements)
    if chunks == 1:
        return fn(rows, labels, *weights)
    rows = rows.reshape(chunks, tokens // chunks, rows.shape[-1])
    labels = labels.reshape(chunks, tokens // chunks)
    if weights:
        return _fused_sum(fn, rows, labels, *weights)
    one = jax.checkpoint(fn)
    first = one(rows[0], labels[0])  # the carry starts varying as a chunk's sum does
    total, _ = lax.scan(lambda total, chunk: (total + one(*chunk), None), first,
                        (rows[1:], labels[1:]))
    return total


def _sum_of_chunks(fn, rows, labels, *weights):
    first = fn(rows[0], labels[0], *weights)
    total, _ = lax.scan(lambda total, c: (total + fn(*c, *weights), None), first,
                        (rows[1:], labels[1:]))
    return total


def _sum_and_gradients(fn, rows, labels, *weights):
    """The sum over chunks and its gradients for a unit cotangent: d rows (per chunk, the rows'
    dtype) and d weights, each chunk's in the weights' dtype, accumulated in float32."""

    def chunk(rows_c, labels_c):
        loss, pullback = jax.vjp(lambda x, *w: fn(x, labels_c, *w), rows_c, *weights)
        d_rows, *d_weights = pullback(jnp.ones_like(loss))
        return loss, d_rows, [d.astype(jnp.promote_types(d.dtype, jnp.float32))
                              for d in d_weights]

    loss, d_first, d_weights = chunk(rows[0], labels[0])

    def add(carry, c):
        total, d_total = carry
        loss_c, d_rows, d_w = chunk(*c)
        return (total + loss_c, [a + b for a, b in zip(d_total, d_w)]), d_rows

    (total, d_weights), d_rest = lax.scan(add, (loss, d_weights), (rows[1:], labels[1:]))
    return total, jnp.concatenate([d_first[None], d_rest]), d_weights


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_sum(fn, rows, labels, *weights):
    return _sum_of_chunks(fn, rows, labels, *weights)


def _fused_forward(fn, rows, labels, *weights):
    total, d_rows, d_weights = _sum_and_gradients(fn, rows, labels, *weights)
    dtypes = [jnp.zeros((0,), w.dtype) for w in weights]  # the weights' dtypes, as arrays
    return total, (d_rows, d_weights, labels, dtypes)


def _fused_backward(fn, residuals, g):
    d_rows, d_weights, labels, dtypes = residuals
    zero_labels = np.zeros(labels.shape, jax.dtypes.float0)
    return ((g.astype(d_rows.dtype) * d_rows).astype(d_rows.dtype), zero_labels,
            *((g * d).astype(like.dtype) for d, like in zip(d_weights, dtypes)))


_fused_sum.defvjp(_fused_forward, _fused_backward)


def without_lookup_gradient(embed, tokens: jax.Array, h: jax.Array, row: int) -> jax.Array:
    """``h = embed(tokens)`` with no gradient reaching table row ``row`` from these lookups
    (``torch.nn.Embedding``'s ``padding_idx``): the looked-up vectors of the tokens equal to
    ``row`` are stopped, so the rule is exact whatever splits the table (a vocabulary-parallel
    lookup's sum over ranks; under sequence parallelism the tokens' mask is cut to this rank's
    S/p like the lookup's output). A layer whose output the tokens do not line up with is
    refused by name."""
    from jphantom.errors import ConfigError
    from jphantom.nn.tensor.regions import own_sequence

    mask = (tokens == row)[..., None]
    if getattr(embed, "sequence_parallel", False):  # the lookup reduce-scattered the sequence
        mask = own_sequence(mask, embed.axis)
    if mask.shape[:-1] != h.shape[:-1]:
        raise ConfigError(f"{type(embed).__name__}'s lookup of tokens {tokens.shape} gives "
                          f"{h.shape}: the pad row's gradient cannot be stopped there; use a plan "
                          "that keeps the embedding's output per token, or pad_token_id=None")
    return jnp.where(mask, jax.lax.stop_gradient(h), h)
