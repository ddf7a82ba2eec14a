"""The unsharded dense FFN: the single-device oracle every parallel strategy is tested against.

Layers are ``{"weight": [n, n], "bias": [n]}`` with ``y = x W^T + b``; ReLU between layers, none after
the last (seed 000's FFN). :func:`shard_for_gspmd` places the same weights with ``NamedSharding``
annotations so that ``jax.jit`` (GSPMD) chooses the collectives itself: the baseline a JAX user would
write without any hand-written parallel layer.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.sharding._common import check_depth, check_width, relu_between_layers

Params = list[dict[str, jax.Array]]


def init(key: jax.Array, *, width: int, depth: int, dtype=jnp.float32) -> Params:
    """He-initialised dense layers, W ~ N(0, 2/n), zero biases."""
    check_width(width, 1)
    check_depth(depth)
    return [
        {
            "weight": jax.random.normal(k, (width, width), dtype) * math.sqrt(2.0 / width),
            "bias": jnp.zeros((width,), dtype),
        }
        for k in jax.random.split(key, depth)
    ]


def forward(params: Params, x: jax.Array) -> jax.Array:
    """Plain MLP on whatever devices ``x`` and ``params`` live on."""
    for index, layer in enumerate(params):
        x = relu_between_layers(x @ layer["weight"].T + layer["bias"], index, len(params))
    return x


def param_count(width: int, depth: int, *, include_bias: bool = False) -> int:
    """L n^2 weights (Table I's TP model size), plus L n biases if asked."""
    return depth * width * width + (depth * width if include_bias else 0)


def gspmd_specs(params: Params, axis: str = "model") -> list[dict[str, P]]:
    """Row-sharded weights (output features over ``axis``), sharded biases: the layout GSPMD is given."""
    return [{"weight": P(axis, None), "bias": P(axis)} for _ in params]


def shard_for_gspmd(params: Params, mesh: Mesh, axis: str = "model") -> Params:
    """Place dense params with NamedSharding annotations; ``jax.jit`` then inserts the collectives."""
    specs = gspmd_specs(params, axis)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
