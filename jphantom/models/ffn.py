"""Seed 000's FFN: L layers of width n, ReLU between them, none after the last, trained on MSE.

The model holds no collective: a strategy (:mod:`jphantom.strategies`) turns an :class:`FFNConfig`
into a :class:`jphantom.step.Program` whose per-rank layers do the communication.

    config = FFNConfig(width=4096, depth=2, ghost_width=16)
    program = strategies.get("phantom").program(config, MeshConfig.parse("data=2,model=4"))

:class:`FFN` is the same model as a Flax NNX module, for users who hold their weights in NNX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jphantom.errors import ConfigError, check_int

DTYPES = ("float32", "bfloat16", "float16", "float64")


def mse(prediction: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over batch and features (seed 000's loss)."""
    return jnp.mean(jnp.square(prediction - target))


@dataclasses.dataclass(frozen=True)
class FFNConfig:
    """The FFN's shape. ``ghost_width`` (k of seed 000) is used by phantom strategies only."""

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
                              "rank, seed 000), e.g. 16")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {DTYPES}")
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ConfigError("dtype='float64' needs 64-bit mode: call "
                              "jax.config.update('jax_enable_x64', True) first, or use float32")


def _wrap(tree):
    if isinstance(tree, dict):
        return nnx.Dict({name: _wrap(value) for name, value in tree.items()})
    return nnx.Param(tree)


def _unwrap(tree):
    if isinstance(tree, (dict, nnx.Dict)):
        return {name: _unwrap(value) for name, value in tree.items()}
    return tree[...]


class FFN(nnx.Module):
    """The FFN as a Flax NNX module whose parallel layer is data (a strategy name).

        model = FFN(FFNConfig(width=64, depth=2, ghost_width=2), strategy="phantom",
                    mesh=make_mesh({"model": 4}), rngs=nnx.Rngs(0))
        y = model(x)      # x [batch, 64], features sharded over "model"
    """

    def __init__(self, config: FFNConfig, *, strategy: str = "phantom", mesh=None,
                 rngs: nnx.Rngs):
        from jphantom import strategies
        from jphantom.mesh import make_mesh, mesh_config_of
        from jphantom.step import init_params, make_forward_fn

        mesh = mesh if mesh is not None else make_mesh({"model": 1}, jax.devices()[:1])
        self.program = strategies.get(strategy).program(config, mesh_config_of(mesh))
        self.mesh = mesh
        self._forward = make_forward_fn(self.program, mesh)
        self.params = _wrap(init_params(self.program, mesh, rngs.params()))

    def arrays(self):
        """The strategy's functional parameters (see its module for the layouts)."""
        return _unwrap(self.params)

    def dense_equivalent(self):
        return self.program.dense_equivalent(self.arrays())

    def __call__(self, x: jax.Array) -> jax.Array:
        return self._forward(self.arrays(), x)
