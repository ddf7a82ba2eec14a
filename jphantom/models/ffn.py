"""Seal et al.'s FFN: L layers of width n, ReLU between them, none after the last, trained on MSE.

    y = W_L relu(... relu(W_2 relu(W_1 x + b_1) + b_2) ...) + b_L        x, y [B, n]

:class:`FFN` is a Flax NNX module of plain ``nnx.Linear`` layers holding no collective; a
strategy is a plan applied to it (:func:`jphantom.program.build`, which also validates the
configuration against the mesh):

    program = jphantom.program.build(FFNConfig(width=4096, depth=2, ghost_width=16), "phantom",
                                     "data=2,model=4")
    step = program.train_step(mesh, optax.sgd(0.1))
    state = program.init(step)               # parameters created in their shards
    state, loss = step(state, x, t)          # x, t [B, n]: rows over data, features over model

Structure (module paths a plan names). The layers are stacked with :class:`jphantom.nn.Stacked`
(parameters [U, ...], ``lax.scan``), so compile time is flat in depth, ZeRO-3 gathers one unit at
a time and a ``stage`` axis cuts the units into pipeline stages:

- ``pairs=False`` (phantom, T1, dense, GSPMD): ``layers.block.linear``, one unit per layer
  (U = L).
- ``pairs=True`` (Megatron's column/row pairs, pmm3d's normal/transposed layers: the strategies
  whose consecutive layers alternate): ``layers.block.first`` and ``layers.block.second``, one
  unit per pair of layers (U = floor(L/2)), and ``last``, a lone last layer when L is odd (outside
  the stack: on a pipeline's last stage). ``FFN(config, pairs=True)`` is the same model as
  ``pairs=False``, its parameters grouped differently.
- ``entry`` and ``exit``: :class:`jphantom.nn.boundary.Boundary` (the identity), where Megatron's
  plan gathers the feature-split input and scatters the replicated output back.

Every unit gets its global index (``with_index``) and applies the ReLU before it when the index
is not 0; the first unit runs outside the scan (``peel_first``), so that autodiff drops its input
gradient (nobody needs dL/dx) and with it the collective it would cost.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jphantom.errors import ConfigError, check_int
from jphantom.nn.boundary import Boundary
from jphantom.nn.stack import Stacked

DTYPES = ("float32", "bfloat16", "float16", "float64")


def mse(prediction: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over batch and features (Seal et al.'s loss)."""
    return jnp.mean(jnp.square(prediction - target))


@dataclasses.dataclass(frozen=True)
class FFNConfig:
    """The FFN's shape. ``ghost_width`` (k of Seal et al.) is used by phantom strategies only."""

    width: int
    depth: int = 2
    ghost_width: int | None = None
    dtype: str = "float32"
    model_name = "ffn"

    def __post_init__(self):
        for name in ("width", "depth"):
            check_int(name, getattr(self, name))
        k = self.ghost_width
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"ghost_width={k!r} must be an integer >= 1 (k ghost neurons per "
                              "rank, Seal et al.), e.g. 16")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {DTYPES}")
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ConfigError("dtype='float64' needs 64-bit mode: call "
                              "jax.config.update('jax_enable_x64', True) first, or use float32")


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



def _register():
    from jphantom import families

    return families.register(families.Family(
        name="ffn", description="Seal et al.'s FFN of --width x --depth (its teacher task)",
        config_type=FFNConfig, module=FFN,
        from_flags=lambda section, phantom: FFNConfig(
            section.width, section.depth, section.ghost_width if phantom else None,
            section.dtype),
        flags=("width", "depth", "ghost_width"), common_flags=("dtype",),
        strategies=(*families.LM_STRATEGIES[:3], "tensor-t1", *families.LM_STRATEGIES[3:]),
        flops_per_token=lambda config, seq_len: 6 * config.depth * config.width ** 2,
        program="ffn", defaults="ffn"))


FAMILY = _register()
