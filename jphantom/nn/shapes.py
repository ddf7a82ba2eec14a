"""Small validation helpers shared by the per-rank operations (no collectives here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jphantom.errors import ConfigError


def check_width(width: int, num_shards: int, what: str = "width") -> int:
    """Return the per-shard block ``width / num_shards``, or raise if it does not divide."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ConfigError(f"{what}={width!r} must be an integer >= 1")
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigError(f"num_shards={num_shards!r} must be an integer >= 1")
    if width % num_shards:
        lower = width - width % num_shards
        raise ConfigError(
            f"{what}={width} is not divisible by num_shards={num_shards}: every shard must hold "
            f"{what}/num_shards features. Pick a {what} that is a multiple of {num_shards} "
            f"(e.g. {lower or num_shards} or {lower + num_shards}), or another shard count."
        )
    return width // num_shards


def normal(key: jax.Array, shape, dtype, std: float = 1.0) -> jax.Array:
    """N(0, std^2) of ``shape``, drawn flat and reshaped: jax's partitionable threefry compiles
    slowly for high-rank sharded outputs (7.7 s vs 0.3 s for a phantom FFN's init)."""
    size = 1
    for d in shape:
        size *= d
    return (jax.random.normal(key, (size,), dtype) * std).reshape(shape)


def check_depth(depth: int) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ConfigError(f"depth={depth!r} must be an integer >= 1 (number of weight layers)")


def check_input(x: jax.Array, width: int) -> None:
    if x.ndim != 2 or x.shape[1] != width:
        raise ConfigError(f"input has shape {tuple(x.shape)}; expected [batch, width={width}]")


def offdiagonal_mask(num_shards: int, me: jax.Array, dtype) -> jax.Array:
    """``[p]`` vector, 0 at this rank's own slot and 1 elsewhere (Seal et al. have no D^(j,j))."""
    return (jnp.arange(num_shards) != me).astype(dtype)
