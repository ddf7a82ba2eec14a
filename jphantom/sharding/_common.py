"""Small helpers shared by the sharded FFN strategies (no collectives here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jphantom.errors import ConfigError
from jphantom.mesh import axis_size


def relu_between_layers(z: jax.Array, layer: int, depth: int) -> jax.Array:
    """Seed 000's FFN: ReLU after every hidden layer, identity after the last (MSE regression)."""
    return z if layer == depth - 1 else jax.nn.relu(z)


def check_width(width: int, num_shards: int) -> int:
    """Return the per-shard block ``width / num_shards``, or raise if it does not divide."""
    if width < 1:
        raise ConfigError(f"width={width} must be >= 1")
    if num_shards < 1:
        raise ConfigError(f"num_shards={num_shards} must be >= 1")
    if width % num_shards:
        lower = width - width % num_shards
        raise ConfigError(
            f"width={width} is not divisible by num_shards={num_shards}: every shard must hold "
            f"width/num_shards features. Pick a width that is a multiple of {num_shards} "
            f"(e.g. {lower or num_shards} or {lower + num_shards})."
        )
    return width // num_shards


def check_depth(depth: int) -> None:
    if depth < 1:
        raise ConfigError(f"depth={depth} must be >= 1 (number of weight layers)")


def model_axis_size(mesh: Mesh, axis: str) -> int:
    """Size of the model axis; other mesh axes must be trivial until data parallelism is composed in."""
    size = axis_size(mesh, axis)
    others = {name: n for name, n in mesh.shape.items() if name != axis and n > 1}
    if others:
        raise ConfigError(
            f"this layer shards only over axis {axis!r}, but the mesh also has {others}; build a mesh "
            f"with only {{{axis!r}: {size}}} (data parallelism is composed separately)"
        )
    return size


def check_input(x: jax.Array, width: int) -> None:
    if x.ndim != 2 or x.shape[1] != width:
        raise ConfigError(f"input has shape {tuple(x.shape)}; expected [batch, width={width}]")


def offdiagonal_mask(num_shards: int, me: jax.Array, dtype) -> jax.Array:
    """``[p]`` vector, 0 at this rank's own slot and 1 elsewhere (seed 000 has no D^(j,j))."""
    return (jnp.arange(num_shards) != me).astype(dtype)
