"""Seal et al.'s own tensor parallelism (T1, Sec. II-B, Fig. 1a): the weight split on its output
features and the input's features all-gathered in every layer, so input and output keep phantom's
feature-split layout (per layer n_in/p versus phantom's k per token, Seal et al. Eq. 9)."""

from __future__ import annotations

import jax
from flax import nnx

from jphantom.runtime import comm
from jphantom.step import remat
from jphantom.nn import metadata
from jphantom.nn.tensor.dense import matmul, param_value, plain_linear, promote_dtypes


class T1Linear(nnx.Module):
    """Seal et al.'s T1 tensor parallelism (Sec. II-B, Fig. 1a): y[own] = all-gather(x) @ W[:, own]
    + b[own], input and output features split over ``axis``.

    kernel [..., in, out] split on ``out`` (rank j holds output features j n_out/p ..), bias
    [..., out] split. Input [..., in/p] -> all-gather of B n_in -> [..., in] -> output
    [..., out/p]. Backward: the all-gather's transpose, a reduce-scatter of the input gradient
    [..., in] to [..., in/p] (dead for a model's first layer, whose input needs no gradient:
    autodiff drops it). Per layer against phantom's k-wide messages: n_in/p versus k per token
    (Seal et al. Eq. 9)."""

    fp8 = False  # the GEMM on FP8 operands (precision='fp8')

    def __init__(self, kernel, bias=None, *, axis: str = "model", dtype=None):
        self.axis, self.dtype = axis, dtype
        self.kernel = metadata.param(kernel, (None, axis))
        self.bias = None if bias is None else metadata.param(bias, (axis,))

    @classmethod
    def from_module(cls, linear: nnx.Linear, *, axis: str = "model") -> "T1Linear":
        return cls(linear.kernel.get_value(), param_value(linear.bias), axis=axis, dtype=linear.dtype)

    def dense_equivalent(self) -> nnx.Linear:
        return plain_linear(self.kernel[...], param_value(self.bias), self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        # all-gather of B*n_in (its transpose, the backward reduce-scatter to B*n_in/p)
        x_full = remat.name_collective(comm.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True))
        x_full, kernel, bias = promote_dtypes(x_full, self.kernel[...], param_value(self.bias))
        y = matmul(self, x_full, kernel)  # [..., out/p]: this rank's output features
        return y if bias is None else y + bias
