"""Megatron's f and g (Shoeybi et al., ``copy_to_tensor_model_parallel_region`` and
``reduce_from_tensor_model_parallel_region``) and their sequence-parallel forms (Korthikanti et
al. 2022, Sec. 4.2.2), where the residual stream enters and leaves the tensor-parallel
region.

f is ``comm.pcast(x, axis, to="varying")``: identity forward, its transpose the all-reduce. g is
``lax.psum``: its transpose is free under ``check_vma=True``. Under sequence parallelism the
stream is split over the sequence [B, S/p, h] and each all-reduce becomes a reduce-scatter plus
an all-gather of the same volume."""

from __future__ import annotations

import jax
from jax import lax

from jphantom.runtime import comm
from jphantom.step import remat
from jphantom.nn import metadata


def copy_to_model(x: jax.Array, axis: str) -> jax.Array:
    """Megatron's f: identity forward; the backward all-reduces the gradient over ``axis``."""
    return comm.pcast(x, axis, to="varying")


def gather_sequence(x: jax.Array, axis: str) -> jax.Array:
    """[B, S/p, h] -> [B, S, h]: all-gather of B S h (backward: reduce-scatter). The output is
    named for ``remat="collectives_saveable"`` (kept, never recomputed)."""
    return remat.name_collective(comm.all_gather(x, axis, axis=x.ndim - 2, tiled=True))


def varies_over(x: jax.Array, axis: str) -> bool:
    """Does ``x`` (inside a shard_map) vary over the mesh axis ``axis``?"""
    return axis in metadata.varying_axes(x)


def to_full_sequence(x: jax.Array, axis: str, sequence_parallel: bool) -> jax.Array:
    """The input of a column-parallel layer: the whole sequence, varying over ``axis``.

    Megatron's f where it has not been applied yet: an input already varying over ``axis`` came
    through an :class:`InputNorm` (one f for all the layers it feeds: q, k and v share one
    backward all-reduce) or another layer, and autodiff reduces it there. Under sequence
    parallelism the :class:`InputNorm` before the layer has gathered the sequence already."""
    if sequence_parallel or varies_over(x, axis):
        return x
    return copy_to_model(x, axis)


def reduce_from_model(partial_sum: jax.Array, axis: str, sequence_parallel: bool) -> jax.Array:
    """Megatron's g: all-reduce of the partial sums (SP: reduce-scatter over the sequence),
    named for ``remat="collectives_saveable"`` (kept, never recomputed)."""
    if sequence_parallel:
        return remat.name_collective(comm.psum_scatter(
            partial_sum, axis, scatter_dimension=partial_sum.ndim - 2, tiled=True))
    return remat.name_collective(comm.psum(partial_sum, axis))


def own_sequence(x: jax.Array, axis: str) -> jax.Array:
    """This rank's S/p slice of the sequence dimension (-2) of ``x``."""
    chunk = x.shape[-2] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(x, comm.axis_index(axis) * chunk, chunk, axis=x.ndim - 2)
