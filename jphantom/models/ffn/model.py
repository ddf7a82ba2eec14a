"""Seal et al.'s FFN as a Flax NNX module (:class:`FFN`, the layers the package docstring
describes) and its loss, the mean squared error."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jphantom.models.ffn.config import FFNConfig
from jphantom.nn.boundary import Boundary
from jphantom.nn.stack import Stacked


def mse(prediction: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over batch and features (Seal et al.'s loss)."""
    return jnp.mean(jnp.square(prediction - target))


def _linear(width: int, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    """He-initialised n x n layer (W ~ N(0, 2/n), b = 0), ``y = x W + b``, W [n_in, n_out]."""
    return nnx.Linear(width, width, param_dtype=dtype,
                      kernel_init=nnx.initializers.normal(math.sqrt(2.0 / width)), rngs=rngs)


def _relu_unless_first(h: jax.Array, index) -> jax.Array:
    """The ReLU between layers, before every unit but the first (global index 0)."""
    return jnp.where(index > 0, jax.nn.relu(h), h)


class Layer(nnx.Module):
    """One unit of ``pairs=False``: relu (unless first), then ``linear``."""

    def __init__(self, width: int, dtype, *, rngs: nnx.Rngs):
        self.linear = _linear(width, dtype, rngs)

    def __call__(self, h: jax.Array, index) -> jax.Array:
        return self.linear(_relu_unless_first(h, index))


class Pair(nnx.Module):
    """One unit of ``pairs=True``: relu (unless first), ``first``, relu, ``second``."""

    def __init__(self, width: int, dtype, *, rngs: nnx.Rngs):
        self.first = _linear(width, dtype, rngs)
        self.second = _linear(width, dtype, rngs)

    def __call__(self, h: jax.Array, index) -> jax.Array:
        return self.second(jax.nn.relu(self.first(_relu_unless_first(h, index))))


class FFN(nnx.Module):
    """``FFN(config, pairs=False, rngs=nnx.Rngs(0))``; ``model(x)`` -> y [B, n];
    ``model.loss(x, t)`` -> the MSE of the rows and features it is given (module docstring)."""

    def __init__(self, config: FFNConfig, *, pairs: bool = False, rngs: nnx.Rngs):
        self.config, self.pairs = config, bool(pairs)
        dtype = jnp.dtype(config.dtype)
        units, lone = divmod(config.depth, 2) if pairs else (config.depth, 0)
        unit = Pair if pairs else Layer
        self.entry, self.exit = Boundary(), Boundary()
        self.layers = (Stacked(lambda r: unit(config.width, dtype, rngs=r), units, rngs=rngs,
                               with_index=True, peel_first=True) if units else None)
        self.last = _linear(config.width, dtype, rngs) if lone else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.entry(x)
        if self.layers is not None:
            h = self.layers(h)
        if self.last is not None:  # odd depth, pairs: the lone last layer
            h = self.last(jax.nn.relu(h) if self.layers is not None else h)
        return self.exit(h)

    def loss(self, x: jax.Array, t: jax.Array) -> jax.Array:
        """MSE over what this call is given (in at least float32): on a rank inside the step,
        its rows and features; the step averages it over the ranks it varies over."""
        y = self(x)
        wide = jnp.promote_types(y.dtype, jnp.float32)
        return mse(y.astype(wide), t.astype(wide))


def ffn_loss(model: FFN, x: jax.Array, t: jax.Array) -> jax.Array:
    """The FFN's ``loss_fn(model, x, t)`` for :func:`jphantom.make_train_step`."""
    return model.loss(x, t)
