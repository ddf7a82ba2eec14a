"""Dropout inside the SPMD step: one random stream, split per rank, layer and micro-batch.

A user's ``nnx.Dropout`` keeps its random state in the model (an ``nnx.Rngs`` stream that each
call advances), which a step that merges the model from its parameters cannot carry. The step
replaces each one in its private copy of the model by a :class:`Dropout` of the same rate and
broadcast dimensions that draws its mask from a key the step supplies while it traces
(:func:`keys`):

    key = fold_in(key(seed), step)                       the step count, in the optimizer state
        -> fold_in(., micro-batch)                       accumulation: each micro-batch its own
        -> fold_in(., the module's path)                 each dropout layer its own stream
        -> fold_in(., layer index)                       inside jphantom.nn.Stacked's scan
        -> fold_in(., axis_index(a)) for every mesh axis a the input varies over

The last rule is what makes it correct under every layout: ranks that hold the same activation
(tensor parallelism's replicated stream, invariant over ``model``) draw the same mask, and ranks
holding different tokens or features (``data``, ``expert``, ``context``, sequence parallelism's
S/p tokens, a column layer's heads) draw independent ones. Masks are deterministic for a seed and
a layout (another mesh draws other, equally valid, masks), and the training step's evaluation
(``step.loss()``) runs without dropout, as ``model.eval()`` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from jphantom.runtime import comm
from jphantom.errors import ConfigError

_KEY: contextvars.ContextVar = contextvars.ContextVar("jphantom_dropout_key", default=None)
_LAYER: contextvars.ContextVar = contextvars.ContextVar("jphantom_dropout_layer", default=None)


@contextlib.contextmanager
def keys(key):
    """Dropout layers called inside draw their masks from ``key`` (``None``: they do nothing,
    as in evaluation)."""
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


@contextlib.contextmanager
def layer(index):
    """Inside a stacked layer's call: ``index`` (traced) the layer's global index."""
    token = _LAYER.set(index)
    try:
        yield
    finally:
        _LAYER.reset(token)


class Dropout(nnx.Module):
    """``nnx.Dropout``'s arithmetic with the step's keys (module docstring): ``x / (1 - rate)``
    where the mask keeps, 0 elsewhere; ``broadcast_dims`` share one mask."""

    def __init__(self, rate: float, *, broadcast_dims=(), deterministic: bool = False,
                 stream: int = 0):
        self.rate, self.broadcast_dims = float(rate), tuple(broadcast_dims)
        self.deterministic, self.stream = bool(deterministic), int(stream)

    @classmethod
    def from_module(cls, module: nnx.Dropout, path: str) -> "Dropout":
        if not 0.0 <= module.rate < 1.0:
            raise ConfigError(f"{path}: nnx.Dropout(rate={module.rate}): the rate must be in "
                              "[0, 1)")
        return cls(module.rate, broadcast_dims=module.broadcast_dims,
                   deterministic=bool(module.deterministic),
                   stream=zlib.crc32(path.encode()) & 0x7FFFFFFF)

    def dense_equivalent(self) -> nnx.Dropout:
        """What this layer computes outside the step's keys (evaluation, ``verify``'s
        reference): its input, as a deterministic ``nnx.Dropout``."""
        return nnx.Dropout(self.rate, broadcast_dims=self.broadcast_dims, deterministic=True)

    def __call__(self, x, *, deterministic: bool | None = None, rngs=None):
        deterministic = self.deterministic if deterministic is None else deterministic
        key = _KEY.get()
        if deterministic or self.rate == 0.0 or key is None:
            return x
        key = jax.random.fold_in(key, self.stream)
        index = _LAYER.get()
        if index is not None:
            key = jax.random.fold_in(key, index)
        for axis in sorted(comm.varying_axes(x)):
            key = jax.random.fold_in(key, comm.axis_index(axis))
        shape = tuple(1 if d in {b % x.ndim for b in self.broadcast_dims} else n
                      for d, n in enumerate(x.shape))
        keep = jax.random.bernoulli(key, 1.0 - self.rate, shape)
        return lax.select(jnp.broadcast_to(keep, x.shape), x / (1.0 - self.rate),
                          jnp.zeros_like(x))


class StepCount(NamedTuple):
    """The optimizer state of :func:`counting`: the steps taken (the dropout keys' step)."""

    count: jax.Array
    inner: Any


def counting(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` whose state also counts the updates (checkpointed with it)."""

    def init(params):
        return StepCount(jnp.zeros((), jnp.uint32), inner.init(params))

    def update(grads, state, params=None):
        updates, inner_state = inner.update(grads, state.inner, params)
        return updates, StepCount(state.count + 1, inner_state)

    return optax.GradientTransformation(init, update)


def step_key(seed: int, count) -> jax.Array:
    """The key of step ``count`` (a ``uint32[2]`` key's data, to pass into a ``shard_map``)."""
    return jax.random.key_data(jax.random.fold_in(jax.random.key(seed), count))


__all__ = ["Dropout", "StepCount", "counting", "keys", "layer", "step_key"]
