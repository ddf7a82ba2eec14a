"""The feature gather and scatter at a feature-split model's boundaries (Megatron's
``gather_from_tensor_model_parallel_region`` and ``scatter_to_...``, Shoeybi et al.): Seal et al.'s
FFN takes and returns activations whose features are split over the mesh axis [B, n/p] (phantom's
layout), Megatron's column/row pairs run on replicated [B, n] between them, so the FFN enters
through :class:`GatherFeatures` and, after a row layer, leaves through :class:`ScatterFeatures`."""

from __future__ import annotations

from functools import partial

import jax
from flax import nnx
from jax import lax

from jphantom.runtime import comm
from jphantom.nn.boundary import Boundary


class GatherFeatures(nnx.Module):
    """Megatron's ``gather_from_tensor_model_parallel_region`` on the features: [..., n/p] split
    over ``axis`` -> [..., n] replicated (invariant over ``axis``): an all-gather of B n forward;
    backward, this rank's slice of the (replicated) gradient, no communication. Replaces a
    :class:`~jphantom.nn.boundary.Boundary` (style ``gather``)."""

    def __init__(self, *, axis: str = "model"):
        self.axis = axis

    @classmethod
    def from_module(cls, boundary: Boundary, *, axis: str = "model") -> "GatherFeatures":
        return cls(axis=axis)

    def dense_equivalent(self) -> Boundary:
        return Boundary()

    def __call__(self, x: jax.Array) -> jax.Array:
        return comm.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True, to="invarying")


def _own_features(axis: str, x: jax.Array) -> jax.Array:
    block = x.shape[-1] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(x, comm.axis_index(axis) * block, block, axis=x.ndim - 1)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def scatter_features(axis: str, x: jax.Array) -> jax.Array:
    """Megatron's ``scatter_to_tensor_model_parallel_region``: this rank's slice [..., n/p] of
    the replicated [..., n]; backward, the all-gather of the slices' gradients (B n)."""
    return _own_features(axis, x)


def _scatter_features_bwd(axis, _, d_own):
    # all-gather of B*n/p from each rank; the input was replicated, so is its gradient
    return (comm.all_gather(d_own, axis, axis=d_own.ndim - 1, tiled=True, to="invarying"),)


scatter_features.defvjp(lambda axis, x: (_own_features(axis, x), None), _scatter_features_bwd)


class ScatterFeatures(nnx.Module):
    """Megatron's ``scatter_to_tensor_model_parallel_region`` on the features: [..., n]
    replicated over ``axis`` -> this rank's [..., n/p] (no communication forward); backward, an
    all-gather of B n. Replaces a :class:`~jphantom.nn.boundary.Boundary` (style ``scatter``)."""

    def __init__(self, *, axis: str = "model"):
        self.axis = axis

    @classmethod
    def from_module(cls, boundary: Boundary, *, axis: str = "model") -> "ScatterFeatures":
        return cls(axis=axis)

    def dense_equivalent(self) -> Boundary:
        return Boundary()

    def __call__(self, x: jax.Array) -> jax.Array:
        return scatter_features(self.axis, x)
