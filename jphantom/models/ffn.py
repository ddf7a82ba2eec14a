"""The FFN of seed 000 as a Flax NNX module whose parallel layer is chosen by data.

Why NNX: it is Flax's recommended API since 0.11 (Linen is in maintenance), its modules are plain
Python objects holding ``nnx.Param`` state, and ``nnx.split``/``nnx.merge`` give the functional
``(params, apply)`` view our sharded strategies and the training step need. The module holds no
collective: ``strategy`` names an entry of :mod:`jphantom.strategies`, which does the communication.

    model = FFN(width=4096, depth=2, strategy="phantom", ghost_width=16,
                mesh=make_mesh({"model": 8}), rngs=nnx.Rngs(0))
    y = model(x)                      # x [batch, 4096], features sharded over "model"
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jphantom import strategies
from jphantom.errors import ConfigError

MODEL_STRATEGIES = ("dense", "tensor", "phantom")


def registry_name(strategy: str, *, layout: str = "t1", fused: bool = True) -> str:
    """Map the model-level choice (dense / tensor / phantom) to a registry strategy name."""
    if strategy == "dense":
        return "dense"
    if strategy == "tensor":
        return f"tensor-{layout}"
    if strategy == "phantom":
        return "phantom" if fused else "phantom-unfused"
    raise ConfigError(f"strategy={strategy!r} is not one of {MODEL_STRATEGIES}")


class FFN(nnx.Module):
    """Width-``width`` FFN with ``depth`` weight layers; ReLU between layers, none after the last."""

    def __init__(
        self,
        *,
        width: int,
        depth: int,
        strategy: str = "phantom",
        ghost_width: int | None = None,
        layout: str = "t1",
        fused: bool = True,
        mesh: Mesh | None = None,
        axis: str = "model",
        dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.strategy = strategies.get(registry_name(strategy, layout=layout, fused=fused))
        if mesh is None and not self.strategy.single_device:
            raise ConfigError(f"strategy {strategy!r} needs a mesh with axis {axis!r}, e.g. "
                              f"mesh=jphantom.mesh.make_mesh({{{axis!r}: 8}})")
        self.mesh, self.axis = mesh, axis
        num_shards = 1 if self.strategy.single_device else int(mesh.shape[axis])
        params = self.strategy.init(rngs.params(), width=width, depth=depth, num_shards=num_shards,
                                    ghost_width=ghost_width, dtype=dtype)
        params = self.strategy.place(params, mesh, axis)
        self.layers = nnx.List(
            [nnx.Dict({name: nnx.Param(value) for name, value in layer.items()}) for layer in params]
        )

    def params(self) -> list[dict[str, jax.Array]]:
        """The strategy's functional parameter list (see its module for the layouts)."""
        return [{name: param[...] for name, param in layer.items()} for layer in self.layers]

    def dense_equivalent(self) -> list[dict[str, jax.Array]]:
        return self.strategy.dense_equivalent(self.params())

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.strategy.apply(self.params(), x, self.mesh, self.axis)
