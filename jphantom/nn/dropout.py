"""Dropout inside the SPMD step: one random stream, split per rank, layer and micro-batch.

A user's ``nnx.Dropout`` keeps its random state in the model (an ``nnx.Rngs`` stream that each
call advances), which a step that merges the model from its parameters cannot carry. The step
replaces each one in its private copy of the model by a :class:`Dropout` of the same rate and
broadcast dimensions, and gives each, in the model it merges for a micro-batch, its key as a
value of the model's own state (:func:`give_keys`): a :class:`StepKey` variable, which is step
data, not a parameter (no gradient, no optimizer state, never checkpointed):

    key = fold_in(key(seed), step)                       the step count, in the optimizer state
        -> fold_in(., micro-batch)                       accumulation: each micro-batch its own
        -> fold_in(., the module's path)                 each dropout layer its own stream
        -> fold_in(., layer index)                       inside jphantom.nn.Stacked: the key
                                                         stacked [L] like the layer's parameters,
                                                         which the blocks' scan slices
        -> fold_in(., axis_index(a)) for every mesh axis a the input varies over (at the call)

The last rule is what makes it correct under every layout: ranks that hold the same activation
(tensor parallelism's replicated stream, invariant over ``model``) draw the same mask, and ranks
holding different tokens or features (``data``, ``expert``, ``context``, sequence parallelism's
S/p tokens, a column layer's heads) draw independent ones. Masks are deterministic for a seed and
a layout (another mesh draws other, equally valid, masks), and the training step's evaluation
(``step.loss()``) runs without dropout, as ``model.eval()`` does: a :class:`Dropout` given no
key passes its input through.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from jphantom.runtime import comm
from jphantom.errors import ConfigError
from jphantom.nn.stack import Stacked


class StepKey(nnx.Variable):
    """A :class:`Dropout`'s key for one micro-batch (a typed key; inside ``L`` stacked layers
    ``[L]`` of them, one per layer): set by the step in the model it merges, never a
    parameter."""


def give_keys(model: nnx.Module, key) -> None:
    """Each :class:`Dropout` of ``model`` (a model the step merged for one micro-batch) its
    :class:`StepKey` of ``key`` (module docstring): ``fold_in(key, stream)``, and inside each
    :class:`~jphantom.nn.stack.Stacked` on its path one key per layer ``i``, ``fold_in(., i)``,
    stacked on a leading axis as the layers' parameters are."""
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, Dropout):
            continue
        layers, node = [], model
        for part in path[:-1]:
            node = node[part] if isinstance(part, int) else getattr(node, part)
            if isinstance(node, Stacked):
                layers.append(node.layers)
        module.key = StepKey(_per_layer(jax.random.fold_in(key, module.stream), layers))


def _per_layer(key, layers: list[int]):
    """``key`` folded with each layer index of the stacks ``layers`` (outermost first):
    ``[*layers]`` keys."""
    if not layers:
        return key
    return jax.vmap(lambda i: _per_layer(jax.random.fold_in(key, i), layers[1:]))(
        jnp.arange(layers[0]))


class Dropout(nnx.Module):
    """``nnx.Dropout``'s arithmetic with the step's keys (module docstring): ``x / (1 - rate)``
    where the mask keeps, 0 elsewhere; ``broadcast_dims`` share one mask. ``key``: its
    :class:`StepKey` (:func:`give_keys`), ``None`` outside a training step's micro-batch."""

    def __init__(self, rate: float, *, broadcast_dims=(), deterministic: bool = False,
                 stream: int = 0):
        self.rate, self.broadcast_dims = float(rate), tuple(broadcast_dims)
        self.deterministic, self.stream = bool(deterministic), int(stream)
        self.key: StepKey | None = nnx.data(None)

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
        if deterministic or self.rate == 0.0 or self.key is None:
            return x
        key = self.key.get_value()
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


__all__ = ["Dropout", "StepCount", "StepKey", "counting", "give_keys", "step_key"]
