"""The registry of parallel FFN strategies: the choice of parallel layer is data, not an ``if``.

A :class:`Strategy` bundles one sharding module's functions behind one interface, so that models,
the training loop, the inspector and the benchmarks take a strategy *name* and never branch on it.

========================  ==============================================================  ==========
name                      what runs                                                        module
========================  ==============================================================  ==========
``dense``                 unsharded FFN on one device (the oracle)                         dense
``gspmd``                 the dense FFN with NamedSharding annotations; jit picks          dense
                          the collectives (what a JAX user writes without jphantom)
``phantom``               phantom parallelism, fused decompressor                          phantom
``phantom-unfused``       phantom parallelism, the paper's p-1 decompressor GEMMs          phantom
``tensor-t1``             TP, row-sharded weights, all-gather / reduce-scatter             tensor
``tensor-t2``             TP, Megatron column/row pairs with f/g                           tensor
========================  ==============================================================  ==========
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.errors import ConfigError
from jphantom.sharding import dense, phantom, tensor


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way of running the FFN. ``sharded`` strategies place params with a leading shard axis."""

    name: str
    family: str  # "dense", "phantom" or "tensor": which model it is (TP and GSPMD are the dense model)
    description: str
    _init: Callable
    _apply: Callable  # (params, x, mesh, axis) -> y
    _dense_equivalent: Callable
    _param_specs: Callable  # (params, axis) -> pytree of PartitionSpec
    uses_ghost_width: bool = False
    single_device: bool = False

    def init(self, key, *, width, depth, num_shards=1, ghost_width=None, dtype=jnp.float32):
        if self.uses_ghost_width:
            if ghost_width is None:
                raise ConfigError(f"strategy {self.name!r} needs ghost_width (k of seed 000)")
            return self._init(key, width=width, depth=depth, num_shards=num_shards,
                              ghost_width=ghost_width, dtype=dtype)
        return self._init(key, width=width, depth=depth, num_shards=num_shards, dtype=dtype)

    def apply(self, params, x, mesh: Mesh | None, axis: str = "model"):
        return self._apply(params, x, mesh, axis)

    def dense_equivalent(self, params):
        return self._dense_equivalent(params)

    def param_specs(self, params, axis: str = "model"):
        return self._param_specs(params, axis)

    def place(self, params, mesh: Mesh | None, axis: str = "model"):
        """Put params on the mesh with this strategy's sharding (single-device: first device)."""
        if self.single_device or mesh is None:
            return jax.device_put(params, jax.devices()[0])
        specs = self.param_specs(params, axis)
        return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)

    def input_sharding(self, mesh: Mesh | None, axis: str = "model"):
        """Activations [batch, width]: features sharded over ``axis`` (replicated for ``dense``)."""
        if self.single_device or mesh is None:
            return jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(mesh, P(None, axis))


def _leading_axis_specs(params, axis):
    return jax.tree.map(lambda _: P(axis), params)


def _dense_init(key, *, width, depth, num_shards, dtype):
    del num_shards
    return dense.init(key, width=width, depth=depth, dtype=dtype)


def _gspmd_apply(params, x, mesh, axis):
    # Pin the activations' layout at every layer boundary, as one would in a MaxText-style model.
    spec = NamedSharding(mesh, P(None, axis))
    x = jax.lax.with_sharding_constraint(x, spec)
    for index, layer in enumerate(params):
        x = x @ layer["weight"].T + layer["bias"]
        x = x if index == len(params) - 1 else jax.nn.relu(x)
        x = jax.lax.with_sharding_constraint(x, spec)
    return x


def _identity(params):
    return params


REGISTRY: dict[str, Strategy] = {}


def _register(strategy: Strategy) -> None:
    REGISTRY[strategy.name] = strategy


_register(Strategy(
    "dense", "dense", "unsharded FFN on one device (the single-device oracle)",
    _dense_init, lambda params, x, mesh, axis: dense.forward(params, x), _identity,
    lambda params, axis: jax.tree.map(lambda _: P(), params), single_device=True,
))
_register(Strategy(
    "gspmd", "dense", "dense FFN, weights row-sharded by NamedSharding; jax.jit chooses collectives",
    _dense_init, _gspmd_apply, _identity, dense.gspmd_specs,
))
for _fused in (True, False):
    _register(Strategy(
        "phantom" if _fused else "phantom-unfused", "phantom",
        "phantom parallelism (seed 000), "
        + ("one fused decompressor GEMM" if _fused else "the paper's p-1 decompressor GEMMs"),
        phantom.init,
        partial(lambda params, x, mesh, axis, fused: phantom.forward(
            params, x, mesh, axis=axis, fused=fused), fused=_fused),
        phantom.dense_equivalent, _leading_axis_specs, uses_ghost_width=True,
    ))
for _layout, _text in (("t1", "TP T1: row-sharded W, all-gather fwd / reduce-scatter bwd"),
                       ("t2", "TP T2: Megatron column/row pairs with f/g all-reduces")):
    _register(Strategy(
        f"tensor-{_layout}", "dense", _text,
        partial(tensor.init, layout=_layout),
        partial(lambda params, x, mesh, axis, layout: tensor.forward(
            params, x, mesh, axis=axis, layout=layout), layout=_layout),
        partial(tensor.dense_equivalent, layout=_layout), _leading_axis_specs,
    ))


def get(name: str) -> Strategy:
    """Look a strategy up by name, with the list of valid names in the error."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {sorted(REGISTRY)}") from None


def param_count(name: str, *, width: int, depth: int, num_shards: int = 1,
                ghost_width: int | None = None) -> int:
    """Weights of the model a strategy trains (biases excluded, as in Table I)."""
    if get(name).family == "phantom":
        return phantom.param_count(width, ghost_width, num_shards, depth)
    return dense.param_count(width, depth)
