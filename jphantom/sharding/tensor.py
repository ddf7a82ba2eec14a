"""Tensor-parallel (TP) baselines for the dense n x n FFN, with phantom's data layout (features sharded).

Two layouts, both exact re-parallelisations of the same dense model (so they converge like it):

**T1: row-sharded weights** (seed 000 Sec. II-B, Fig. 1a). Rank j holds the output rows
W[j-block, :] [n/p, n]. Forward, per layer: all-gather the n/p-wide activations into [B, n], then one
local GEMM. Backward: the all-gather's conjugate, a reduce-scatter of [B, n] down to [B, n/p]. The
first layer's reduce-scatter would only produce dL/dx, which nobody needs, so XLA removes it:
L all-gathers of B n and L-1 reduce-scatters to B n/p per step. Same sharded I/O as phantom, so the
comparison is exactly "all-gather + reduce-scatter of n/p B versus of k B" (Eq. 9: phantom wins iff
k < n/p).

**T2: Megatron pairs** (seed 002/003; Shoeybi et al.). Layers go in (column-parallel, row-parallel)
pairs. Column-parallel holds W[j-block, :] (output features split), row-parallel W[:, j-block] (input
features split). The conjugate operators f (identity forward / all-reduce backward) before each column
layer and g (all-reduce forward / identity backward) after each row layer are Megatron's
``copy_to_tensor_model_parallel_region`` and ``reduce_from_tensor_model_parallel_region``. To take and
return phantom's feature-sharded activations, the block starts with Megatron's
``gather_from_tensor_model_parallel_region`` (all-gather forward / split backward) and, when the depth
is even, ends with ``scatter_to_tensor_model_parallel_region`` (split forward / all-gather backward); an
odd last layer is a lone column-parallel layer whose output is already feature-sharded. Per step, for
depth L: all-gather B n: 1 forward + (1 if L even) backward; all-reduce B n: floor(L/2) forward (g) +
ceil(L/2) - 1 backward (f; the first f's all-reduce only feeds dL/dx and is removed).

**Against seed 000's Table II.** The paper lists, per TP layer, an all-gather (n/p B) forward, a
reduce-scatter (n/p B) backward, and also a broadcast (n B) forward and an all-reduce (n B) backward,
"because the global layer is required on each rank". Those two extra collectives come from a PyTorch
implementation that keeps the full layer output on every rank (the Colwise/Rowwise concatenation of
Sec. V). T1 is Table II's all-gather/reduce-scatter pair alone, the cheapest TP that keeps the same
feature-sharded layout as phantom; T2 replaces it with Megatron's all-reduce per pair of layers. Neither
needs a broadcast: data arrive already sharded.

Parameters: every array has a leading shard axis of size p (sharded over ``axis``), as in phantom.
T1 layer: ``weight`` [p, n/p, n], ``bias`` [p, n/p]. T2 column layer: ``weight`` [p, n/p, n], ``bias``
[p, n/p]; T2 row layer: ``weight`` [p, n, n/p], ``bias`` [p, n/p] (rank j adds its bias block to its
own output columns before the all-reduce, so the sum carries the full bias with no replicated
parameter and no extra communication).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jphantom.errors import ConfigError
from jphantom.sharding._common import (
    check_depth,
    check_input,
    check_width,
    model_axis_size,
    relu_between_layers,
)

Params = list[dict[str, jax.Array]]
LAYOUTS = ("t1", "t2")


def _check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ConfigError(f"layout={layout!r} is not a TP layout; use one of {LAYOUTS}")
    return layout


def _is_row_layer(layout: str, index: int) -> bool:
    """T2 alternates column (even index) and row (odd index) layers; T1 has only row-sharded W."""
    return layout == "t2" and index % 2 == 1


def param_count(width: int, depth: int, *, include_bias: bool = False) -> int:
    """Same model as dense: L n^2 weights (+ L n biases)."""
    return depth * width * width + (depth * width if include_bias else 0)


def init(
    key: jax.Array, *, width: int, num_shards: int, depth: int, layout: str = "t1", dtype=jnp.float32
) -> Params:
    """He-initialised (N(0, 2/n)) TP parameters, zero biases; layouts in the module docstring."""
    _check_layout(layout)
    check_width(width, num_shards)
    check_depth(depth)
    layers = []
    for index, layer_key in enumerate(jax.random.split(key, depth)):
        weight = jax.random.normal(layer_key, (width, width), dtype) * math.sqrt(2.0 / width)
        layers.append(_split_dense({"weight": weight, "bias": jnp.zeros(width, dtype)}, num_shards,
                                   _is_row_layer(layout, index)))
    return layers


def _split_dense(layer, num_shards, row_layer):
    n = layer["weight"].shape[0]
    block = n // num_shards
    if row_layer:  # W[:, j-block] -> [p, n, n/p]
        weight = layer["weight"].reshape(n, num_shards, block).transpose(1, 0, 2)
    else:  # W[j-block, :] -> [p, n/p, n]
        weight = layer["weight"].reshape(num_shards, block, n)
    return {"weight": weight, "bias": layer["bias"].reshape(num_shards, block)}


def from_dense(dense_layers, num_shards: int, layout: str = "t1") -> Params:
    """Split dense ``{"weight": [n, n], "bias": [n]}`` layers into this layout (inverse of
    :func:`dense_equivalent`)."""
    _check_layout(layout)
    check_width(dense_layers[0]["weight"].shape[0], num_shards)
    return [_split_dense(layer, num_shards, _is_row_layer(layout, i))
            for i, layer in enumerate(dense_layers)]


def dense_equivalent(params: Params, layout: str = "t1") -> list[dict[str, jax.Array]]:
    """Reassemble the dense ``{"weight": [n, n], "bias": [n]}`` layers (differentiable)."""
    _check_layout(layout)
    layers = []
    for index, layer in enumerate(params):
        p, n = layer["bias"].shape[0], layer["bias"].size
        if _is_row_layer(layout, index):
            weight = layer["weight"].transpose(1, 0, 2).reshape(n, n)
        else:
            weight = layer["weight"].reshape(n, n)
        layers.append({"weight": weight, "bias": layer["bias"].reshape(n)})
    return layers


# --------------------------------------------------------------------------------------------------
# Conjugate communication operators (per rank, inside shard_map). Each is a custom_vjp so that the
# forward and the backward collective are both written here, on the line where they happen.
# --------------------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def gather_features_reduce_scatter_grads(axis, y):
    """T1: all-gather [B, n/p] -> [B, n] forward; reduce-scatter [B, n] -> [B, n/p] backward."""
    return lax.all_gather(y, axis, axis=1, tiled=True)


def _t1_gather_fwd(axis, y):
    return lax.all_gather(y, axis, axis=1, tiled=True), None  # Table II: all-gather of n/p*B


def _t1_gather_bwd(axis, _, d_full):
    # Every rank holds a partial dL/dy_full (through its own rows); sum them and keep own block.
    return (lax.psum_scatter(d_full, axis, scatter_dimension=1, tiled=True),)  # reduce-scatter


gather_features_reduce_scatter_grads.defvjp(_t1_gather_fwd, _t1_gather_bwd)


def _own_block(full, axis, num_shards):
    block = full.shape[-1] // num_shards
    return lax.dynamic_slice_in_dim(full, lax.axis_index(axis) * block, block, axis=-1)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def gather_from_model_parallel(axis, num_shards, y):
    """Megatron's gather: all-gather [B, n/p] -> replicated [B, n] forward; own slice backward."""
    return lax.all_gather(y, axis, axis=1, tiled=True)


def _gather_fwd(axis, num_shards, y):
    return lax.all_gather(y, axis, axis=1, tiled=True), None  # all-gather of n/p*B


def _gather_bwd(axis, num_shards, _, d_full):
    return (_own_block(d_full, axis, num_shards),)  # gradient is replicated: no communication


gather_from_model_parallel.defvjp(_gather_fwd, _gather_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def scatter_to_model_parallel(axis, num_shards, y):
    """Megatron's scatter: own slice of replicated [B, n] forward; all-gather of the slices backward."""
    return _own_block(y, axis, num_shards)


def _scatter_fwd(axis, num_shards, y):
    return _own_block(y, axis, num_shards), None


def _scatter_bwd(axis, num_shards, _, d_block):
    return (lax.all_gather(d_block, axis, axis=1, tiled=True),)  # all-gather of n/p*B


scatter_to_model_parallel.defvjp(_scatter_fwd, _scatter_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def copy_to_model_parallel(axis, y):
    """Megatron's f: identity forward, all-reduce of the input gradient backward."""
    return y


def _copy_fwd(axis, y):
    return y, None


def _copy_bwd(axis, _, d_y):
    return (lax.psum(d_y, axis),)  # all-reduce of n*B


copy_to_model_parallel.defvjp(_copy_fwd, _copy_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def reduce_from_model_parallel(axis, partial_sum):
    """Megatron's g: all-reduce forward, identity backward."""
    return lax.psum(partial_sum, axis)


def _reduce_fwd(axis, partial_sum):
    return lax.psum(partial_sum, axis), None  # all-reduce of n*B


def _reduce_bwd(axis, _, d_y):
    return (d_y,)


reduce_from_model_parallel.defvjp(_reduce_fwd, _reduce_bwd)


# --------------------------------------------------------------------------------------------------
# Per-rank networks
# --------------------------------------------------------------------------------------------------


def _t1_per_rank(axis, layers, y):
    for index, layer in enumerate(layers):
        y_full = gather_features_reduce_scatter_grads(axis, y)  # [B, n]
        z = y_full @ layer["weight"][0].T + layer["bias"][0]  # [B, n/p], own output rows
        y = relu_between_layers(z, index, len(layers))
    return y


def _t2_per_rank(axis, num_shards, layers, y):
    depth = len(layers)
    y = gather_from_model_parallel(axis, num_shards, y)  # [B, n] replicated
    for index, layer in enumerate(layers):
        weight, bias = layer["weight"][0], layer["bias"][0]
        if not _is_row_layer("t2", index):  # column-parallel: replicated in, sharded out
            y = copy_to_model_parallel(axis, y)
            y = relu_between_layers(y @ weight.T + bias, index, depth)  # [B, n/p]
        else:  # row-parallel: sharded in, partial sums out, all-reduced by g
            partial_sum = y @ weight.T  # [B, n]
            block = bias.shape[0]
            offset = lax.axis_index(axis) * block
            partial_sum = lax.dynamic_update_slice_in_dim(
                partial_sum, lax.dynamic_slice_in_dim(partial_sum, offset, block, 1) + bias, offset, 1
            )
            y = reduce_from_model_parallel(axis, partial_sum)  # [B, n] replicated
            y = relu_between_layers(y, index, depth)
    if depth % 2 == 0:
        y = scatter_to_model_parallel(axis, num_shards, y)  # [B, n/p]
    return y


def forward(
    params: Params, x: jax.Array, mesh: Mesh, *, axis: str = "model", layout: str = "t1"
) -> jax.Array:
    """TP FFN: x [batch, n] sharded on features over ``axis`` -> [batch, n], same sharding."""
    _check_layout(layout)
    num_shards = model_axis_size(mesh, axis)
    if params[0]["bias"].shape[0] != num_shards:
        raise ConfigError(
            f"params were built for num_shards={params[0]['bias'].shape[0]} but mesh axis {axis!r} "
            f"has size {num_shards}; re-initialise with num_shards={num_shards}"
        )
    check_input(x, params[0]["bias"].size)
    if layout == "t1":
        per_rank = partial(_t1_per_rank, axis)
    else:
        per_rank = partial(_t2_per_rank, axis, num_shards)
    sharded = jax.shard_map(
        per_rank, mesh=mesh, in_specs=(P(axis), P(None, axis)), out_specs=P(None, axis),
        check_vma=False,
    )
    return sharded(params, x)


def collective_buffers(*, width: int, num_shards: int, depth: int, batch: int,
                       layout: str = "t1") -> dict[str, list[int]]:
    """Per-device result elements of each collective in one training step (module docstring).

    The backward collective that would only produce dL/dx of the input layer is absent (XLA removes
    it), as are size-1 meshes' no-op collectives.
    """
    _check_layout(layout)
    n, p, b = width, num_shards, batch
    if layout == "t1":
        return {"all-gather": [b * n] * depth, "reduce-scatter": [b * n // p] * (depth - 1)}
    pairs, odd = divmod(depth, 2)
    column_layers = pairs + odd
    return {
        "all-gather": [b * n] * (1 + (0 if odd else 1)),
        "all-reduce": [b * n] * (pairs + column_layers - 1),
    }
