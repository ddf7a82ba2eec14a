"""The next token from a step's logits: greedy (argmax), or sampled after temperature, top-k and
top-p (nucleus, Holtzman et al. 2020) in transformers' order of its logits warpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jphantom.generation.config import GenerationConfig


def filtered_logits(logits: jax.Array, config: GenerationConfig) -> jax.Array:
    """``logits`` [B, V] (float32) divided by the temperature, with every token outside the top
    ``top_k`` and outside the nucleus of ``top_p`` set to -inf (the most probable token always
    stays)."""
    logits = logits.astype(jnp.float32) / jnp.float32(config.temperature)
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if config.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        ranked = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the probability of the tokens ranked above
        keep_ranked = before < jnp.float32(config.top_p)
        keep = jnp.zeros_like(keep_ranked).at[
            jnp.arange(logits.shape[0])[:, None], order].set(keep_ranked)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def next_token(logits: jax.Array, key: jax.Array, config: GenerationConfig,
               rows: jax.Array) -> jax.Array:
    """[B] int32: the argmax of ``logits`` [B, V] when greedy, else a draw from
    :func:`filtered_logits` with ``key`` folded with each row's global index ``rows`` [B] (so a
    row draws the same token whichever device holds it)."""
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, rows)
    draw = jax.vmap(lambda k, x: jax.random.categorical(k, x))
    return draw(keys, filtered_logits(logits, config)).astype(jnp.int32)
