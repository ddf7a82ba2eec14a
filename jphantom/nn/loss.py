"""The language-model loss through whatever head a model has: the one place a model's loss
learns whether its logits are split over the vocabulary.

    loss = jphantom.nn.cross_entropy(self.lm_head, h, targets)     # in a model's loss method
    total, weight = jphantom.nn.cross_entropy_terms(self.lm_head, h, targets, mask=mask)

A vocabulary-parallel head (:class:`~jphantom.nn.tensor.VocabParallelHead`, a tied
:class:`~jphantom.nn.tensor.VocabParallelEmbed`, a phantom head) computes it without gathering the
[B, S, V] logits (three all-reduces of B S scalars); a plain ``nnx.Linear`` or ``nnx.Embed``
(``tied=True``: its ``attend``) gives logits and optax's cross-entropy. Both sum over the tokens
in at least float32, and both run in chunks of tokens
(:func:`jphantom.nn.vocab.chunked_sum`): the [B, S, V] logits are never held, only one
chunk's, in the compute dtype.

**Masked tokens**: a token whose target is negative (Hugging Face's ``-100``) or whose ``mask``
entry is false adds nothing; :func:`cross_entropy` is the mean over the counted tokens and
:func:`cross_entropy_terms` their sum and count, the ``(total, weight)`` a training step turns
into the global token mean over every rank and micro-batch (:mod:`jphantom.step.token_mean`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jphantom.nn import vocab


def cross_entropy(head, h: jax.Array, targets: jax.Array, *, tied: bool = False,
                  mask: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross-entropy of ``head`` applied to ``h`` [B, S, h] against ``targets``
    [B, S], over the tokens counted (``mask`` true and target not negative). ``tied``: ``head``
    is the token embedding, applied with ``attend``."""
    total, weight = cross_entropy_terms(head, h, targets, tied=tied, mask=mask)
    return total / weight


def cross_entropy_terms(head, h: jax.Array, targets: jax.Array, *, tied: bool = False,
                        mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``(total, weight)``: the summed next-token cross-entropy of the counted tokens (``mask``
    true, when given, and target not negative) and their number, in float32."""
    if mask is not None:
        targets = jnp.where(mask, targets, -1)
    total = _total(head, h, targets, tied)
    return total, jnp.sum(targets >= 0, dtype=jnp.float32)


def _total(head, h, targets, tied):
    if hasattr(head, "cross_entropy_sum"):
        return head.cross_entropy_sum(h, targets)
    if tied and isinstance(head, nnx.Embed):  # logits = h E^T in the embedding's dtype
        table = head.embedding[...]
        if head.dtype is not None:
            table = table.astype(head.dtype)
        return vocab.chunked_sum(lambda x, t, e: token_losses(x @ e.T, t), h, targets, (table,),
                                 vocab_local=table.shape[0])
    if not tied and type(head) is nnx.Linear:
        weights = (head.kernel[...],) + (() if head.bias is None else (head.bias[...],))

        def chunk(x, t, kernel, bias=None):  # nnx.Linear's own arithmetic, on one chunk
            x, kernel, bias = head.promote_dtype((x, kernel, bias), dtype=head.dtype)
            logits = head.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                                      precision=head.precision)
            return token_losses(logits if bias is None else logits + bias, t)

        return vocab.chunked_sum(chunk, h, targets, weights, vocab_local=head.out_features)
    call = head.attend if tied else head  # a head of the user's: its own call, in chunks
    return vocab.chunked_sum(lambda x, t: token_losses(call(x), t), h, targets,
                             vocab_local=getattr(head, "out_features", None)
                             or getattr(head, "num_embeddings", 1))


def token_losses(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The summed next-token cross-entropy of ``logits`` [N, V] (any dtype; reduced in at least
    float32) against ``targets`` [N]; a negative target adds nothing."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    return jnp.sum(jnp.where(targets >= 0, losses, 0.0))
