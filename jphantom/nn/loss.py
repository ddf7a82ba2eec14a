"""The language-model loss through whatever head a model has: the one place a model's loss
learns whether its logits are split over the vocabulary.

    loss = jphantom.nn.cross_entropy(self.lm_head, h, targets)     # in a model's loss method

A vocabulary-parallel head (:class:`~jphantom.nn.tensor.VocabParallelHead`, a tied
:class:`~jphantom.nn.tensor.VocabParallelEmbed`, a phantom head) computes it without gathering the
[B, S, V] logits (three all-reduces of B S scalars); a plain ``nnx.Linear`` or ``nnx.Embed``
(``tied=True``: its ``attend``) gives logits and optax's cross-entropy. Both are the mean over the
tokens, in at least float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def cross_entropy(head, h: jax.Array, targets: jax.Array, *, tied: bool = False) -> jax.Array:
    """Mean next-token cross-entropy of ``head`` applied to ``h`` [B, S, h] against ``targets``
    [B, S]. ``tied``: ``head`` is the token embedding, applied with ``attend``."""
    if hasattr(head, "cross_entropy"):
        return head.cross_entropy(h, targets)
    logits = head.attend(h) if tied else head(h)
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
