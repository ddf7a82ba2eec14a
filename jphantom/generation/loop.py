"""Prefill and decode in one compiled program: :func:`compiled` jits, for a prompt bucket
[B, S], a prefill of the right-padded prompts and a ``lax.while_loop`` of decode steps, one token
per row each, over the cache of T = S + max_new_tokens slots. The loop stops when every row has
met a stop token or after ``max_new_tokens``; no step recompiles, and prompts whose longest
fits the same bucket share the program (jax's cache, keyed by the shapes and the static
configuration)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom.generation import cache as kv
from jphantom.generation.config import GenerationConfig
from jphantom.generation.sampling import next_token

PAD = -1
"""What a row's output holds after its stop token."""


def _step_key(seed_key, step):
    return jax.random.fold_in(seed_key, step)


def _prefill(model, tokens, lengths, length: int, use_cache: bool):
    """The logits [B, V] at each row's last prompt token and the cache (``None`` without one)."""
    rows = jnp.arange(tokens.shape[0])
    if not use_cache:
        padded = jnp.pad(tokens, ((0, 0), (0, length - tokens.shape[1])))
        return model(padded)[rows, lengths - 1].astype(jnp.float32), padded
    with kv.decoding("prefill", length) as state:
        logits = model(tokens)
    return logits[rows, lengths - 1].astype(jnp.float32), kv.result(state)


def _decode(model, cache, token, positions, length: int, use_cache: bool):
    """One step: the logits [B, V] after ``token`` [B] at ``positions`` [B], and the new cache.
    Without a cache (a model whose attention jphantom cannot cache) the whole T-token buffer is
    run again, causal, and the logits read at ``positions``: the same numbers, T times the work."""
    rows = jnp.arange(token.shape[0])
    if not use_cache:
        buffer = cache.at[rows, positions].set(token)
        return model(buffer)[rows, positions].astype(jnp.float32), buffer
    with kv.decoding("decode", length, positions=positions, cache=cache) as state:
        logits = model(token[:, None])
    return logits[:, 0].astype(jnp.float32), kv.result(state)


def run(graphdef, params, tokens, lengths, rows, config: GenerationConfig, use_cache: bool,
        unfinished=jnp.sum):
    """``(tokens [B, N], steps, logits [B, N, V] or None)``: the generated tokens (``PAD`` after
    a row's stop token) of right-padded ``tokens`` [B, S] of ``lengths`` [B], rows ``rows`` [B]
    of the whole batch. ``unfinished(not_done [B]) -> int``: how many rows of the whole batch
    are still going (under a mesh summed over its axes, so every rank loops alike)."""
    model = nnx.merge(graphdef, params)
    batch, new = tokens.shape[0], config.max_new_tokens
    length = tokens.shape[1] + new
    key = jax.random.key(config.seed)
    stops = jnp.asarray(config.stop_tokens or (-2,), jnp.int32)
    logits, cache = _prefill(model, tokens, lengths, length, use_cache)
    first = next_token(logits, _step_key(key, 0), config, rows)
    out = jnp.full((batch, new), PAD, jnp.int32).at[:, 0].set(first)
    kept = (jnp.zeros((batch, new, logits.shape[-1]), jnp.float32).at[:, 0].set(logits)
            if config.return_logits else None)
    done = jnp.isin(first, stops)

    def cond(carry):
        step, _, _, _, _, done, _ = carry
        return (step < new) & (unfinished(~done) > 0)

    def body(carry):
        step, cache, token, positions, out, done, kept = carry
        logits, cache = _decode(model, cache, token, positions, length, use_cache)
        token = next_token(logits, _step_key(key, step), config, rows)
        out = out.at[:, step].set(jnp.where(done, PAD, token))
        if kept is not None:
            kept = kept.at[:, step].set(logits)
        token = jnp.where(done, 0, token)  # a stopped row runs on, its output PAD
        done = done | jnp.isin(token, stops)
        return step + 1, cache, token, positions + 1, out, done, kept

    carry = (jnp.int32(1), cache, first, lengths.astype(jnp.int32), out, done, kept)
    step, _, _, _, out, _, kept = lax.while_loop(cond, body, carry)
    return out, step, kept


@functools.lru_cache(maxsize=None)
def compiled(graphdef, config: GenerationConfig, use_cache: bool):
    """The jitted :func:`run` for one model graph and configuration (shapes: jax's cache)."""
    def one_device(params, tokens, lengths):
        rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        return run(graphdef, params, tokens, lengths, rows, config, use_cache)
    return jax.jit(one_device)
