"""``jphantom.generate(model, prompts, GenerationConfig(...))``: continue token-id prompts of
different lengths with any NNX language model (``model(tokens [B, S]) -> logits [B, S, V]``),
with a key/value cache where the model's attention is jphantom's
(:mod:`jphantom.generation.cache`), else by running the whole sequence each step (exact, slower,
and said so in :attr:`Generation.cached`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jphantom.errors import ConfigError
from jphantom.generation import cache as kv
from jphantom.generation.config import GenerationConfig
from jphantom.generation.loop import PAD, compiled


@dataclasses.dataclass(frozen=True)
class Generation:
    """What :func:`generate` returns. ``tokens`` [B, N] (int32; ``PAD`` = -1 after a row's stop
    token, N = ``max_new_tokens``), ``completions``: each row's generated ids (through its stop
    token), ``logits`` [B, N, V] float32 (with ``return_logits``), ``steps``: decode steps run
    (the first token included), ``bucket``: the padded prompt length compiled for, ``cached``:
    whether a key/value cache ran, ``seconds``: wall time of the call after compilation."""
    tokens: np.ndarray
    completions: list
    logits: np.ndarray | None
    steps: int
    bucket: int
    cached: bool
    seconds: float


def bucket_of(longest: int, unit: int) -> int:
    """The padded prompt length of a batch whose longest prompt has ``longest`` tokens:
    ``unit`` times the next power of two (16, 32, 64, ...), so a handful of programs serve every
    prompt length."""
    size = unit
    while size < longest:
        size *= 2
    return size


def _positions_limit(model) -> int | None:
    config = getattr(model, "config", None)
    for name in ("max_positions", "seq_len"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    return None


def check_routing(model) -> None:
    """Refuse a mixture of experts with a capacity (GPT-2's Switch blocks): which tokens it drops
    depends on the tokens of the call, so a decode step (one token a row) would route otherwise
    than the whole sequence does; dropless routing (``capacity_factor=None``; the Llama family's
    experts) decodes exactly."""
    from jphantom.nn.routing import MoEConfig

    for path, module in nnx.iter_modules(model):
        config = getattr(module, "config", None)
        factor = config.capacity_factor if isinstance(config, MoEConfig) else None
        if factor is not None:
            where = ".".join(str(p) for p in path)
            raise ConfigError(f"generation with a capacity-limited mixture of experts ({where}, "
                              f"capacity_factor={factor}) is not exact: a decode step routes one "
                              "token a row and drops otherwise than the whole sequence; build "
                              "the model with capacity_factor=None (dropless)")


def check_prompts(prompts, vocab: int | None = None) -> list[list[int]]:
    """``prompts`` as lists of token ids: at least one, none empty, ids in ``[0, vocab)``."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ConfigError("prompts must be a non-empty list of token-id lists, e.g. "
                          "[[1, 2, 3], [4, 5]]")
    rows = []
    for index, prompt in enumerate(prompts):
        ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if not ids:
            raise ConfigError(f"prompt {index} is empty: give it at least one token")
        bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ConfigError(f"prompt {index} holds token id {bad[0]} outside [0, {vocab}): "
                              "tokenize with the model's tokenizer")
        rows.append(ids)
    return rows


def _layout(rows, config: GenerationConfig, limit):
    """Right-padded prompts [B, S] and their lengths [B] for the bucket S."""
    longest = max(len(r) for r in rows)
    bucket = bucket_of(longest, config.bucket)
    if limit is not None and bucket + config.max_new_tokens > limit:
        bucket = longest
        if bucket + config.max_new_tokens > limit:
            raise ConfigError(f"a prompt of {longest} tokens and max_new_tokens="
                              f"{config.max_new_tokens} exceed the model's {limit} positions: "
                              "ask for fewer new tokens or shorten the prompt")
    tokens = np.zeros((len(rows), bucket), np.int32)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = row
    return tokens, np.asarray([len(r) for r in rows], np.int32), bucket


def generate(model: nnx.Module, prompts, config: GenerationConfig | None = None, *,
             cache: bool | None = None, mesh=None) -> Generation:
    """Continue each of ``prompts`` (token-id lists of any lengths) with ``model``.
    ``cache``: ``None`` uses the key/value cache where the model's attention cores are jphantom's
    causal ones (and runs the whole sequence each step otherwise), ``True`` insists on it,
    ``False`` never uses it (the reference the cache is tested against). ``mesh``: run on it,
    ``model`` parallelised for it (:func:`jphantom.parallelize`; Megatron tensor parallelism over
    ``model``, rows over ``data``: :mod:`jphantom.generation.sharded`)."""
    config = GenerationConfig() if config is None else config
    if not isinstance(config, GenerationConfig):
        raise ConfigError(f"config must be a GenerationConfig, not {type(config).__name__}")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    rows = check_prompts(prompts, vocab)
    check_routing(model)
    cacheable = bool(kv.cores_of(model))
    if cache and not cacheable:
        raise ConfigError(f"{type(model).__name__} has no jphantom attention core to cache: "
                          "build it from jphantom.nn.attention.CausalAttention, or pass "
                          "cache=None (the whole sequence runs each step)")
    use_cache = cacheable if cache is None else bool(cache)
    runner = kv.with_cache(model) if use_cache else model
    tokens, lengths, bucket = _layout(rows, config, _positions_limit(model))
    out, steps, logits, seconds = _launch(model, runner, mesh, tokens, lengths, config,
                                          use_cache)
    out = np.asarray(out)[:len(rows)]
    logits = None if logits is None else np.asarray(logits)[:len(rows)]
    completions = [[int(t) for t in row if t != PAD] for row in out]
    return Generation(out, completions, logits, int(steps), bucket, use_cache, seconds)


def _launch(model, runner, mesh, tokens, lengths, config, use_cache):
    """The program's outputs and seconds, run on one device or on ``mesh`` (the batch padded
    with copies of its first row to a multiple of the batch axes' ranks)."""
    if mesh is None:
        graphdef, params = nnx.split(runner)
        fn = compiled(graphdef, config, use_cache)
        return _warm(fn, params, jnp.asarray(tokens), jnp.asarray(lengths))
    from jphantom.generation import sharded

    extra = -len(tokens) % sharded.batch_ranks(mesh)
    tokens = np.concatenate([tokens, np.repeat(tokens[:1], extra, 0)])
    lengths = np.concatenate([lengths, np.repeat(lengths[:1], extra, 0)])
    fn, args = sharded.program_and_args(model, mesh, jnp.asarray(tokens), jnp.asarray(lengths),
                                        config, use_cache)
    return _warm(fn, *args)


def _warm(fn, *args):
    """``(*fn(*args), seconds)``: the outputs and the wall time of a call of the jitted ``fn``
    after its compilation (an ahead-of-time ``lower().compile()``, kept per input shapes)."""
    key = (fn, tuple((a.shape, a.dtype, getattr(a, "sharding", None))
                     for a in jax.tree.leaves(args)))
    if key not in _EXECUTABLES:
        _EXECUTABLES[key] = fn.lower(*args).compile()
    start = time.perf_counter()
    out = jax.block_until_ready(_EXECUTABLES[key](*args))
    return (*out, time.perf_counter() - start)


_EXECUTABLES: dict = {}
