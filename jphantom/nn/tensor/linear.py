"""Megatron's column- and row-parallel linears (Shoeybi et al.): ``nnx.Linear`` with its output
features (column) or input features (row) split over the mesh axis, f before a column layer and g
after a row layer; under sequence parallelism (Korthikanti et al.) the column layer takes the
gathered sequence and the row layer reduce-scatters it, optionally as a collective matmul."""

from __future__ import annotations

import jax
from flax import nnx

from jphantom.nn import metadata
from jphantom.nn.tensor.collective_matmul import (SequenceChunks, all_gather_matmul,
                                                  check_collective_matmul, matmul_reduce_scatter)
from jphantom.nn.tensor.dense import matmul, param_value, plain_linear, promote_dtypes
from jphantom.nn.tensor.regions import reduce_from_model, to_full_sequence


class ColumnParallelLinear(nnx.Module):
    """y = f(x) @ W[:, own] + b[own]: output features split over ``axis``.

    kernel [..., in, out] split on ``out``, bias [..., out] split. Input [B, S, in] replicated
    (SP: [B, S/p, in], all-gathered over the sequence first); output [B, S, out/p].
    """

    fp8 = False  # the GEMM on FP8 operands (precision='fp8')

    def __init__(self, kernel, bias=None, *, axis: str = "model",
                 sequence_parallel: bool = False, dtype=None):
        self.axis, self.sequence_parallel, self.dtype = axis, sequence_parallel, dtype
        self.kernel = metadata.param(kernel, (None, axis))
        self.bias = None if bias is None else metadata.param(bias, (axis,))

    @classmethod
    def from_module(cls, linear: nnx.Linear, *, axis: str = "model",
                    sequence_parallel: bool = False) -> "ColumnParallelLinear":
        return cls(linear.kernel.get_value(), param_value(linear.bias), axis=axis,
                   sequence_parallel=sequence_parallel, dtype=linear.dtype)

    def dense_equivalent(self) -> nnx.Linear:
        return plain_linear(self.kernel[...], param_value(self.bias), self.dtype)

    def __call__(self, x) -> jax.Array:
        if isinstance(x, SequenceChunks):  # collective matmul
            if x.whole is None:  # the first layer of the norm: the ring, under its GEMMs
                local, kernel, bias = promote_dtypes(x.local, self.kernel[...], param_value(self.bias))
                y, x.whole = all_gather_matmul(self, local, kernel, self.axis)
                return y if bias is None else y + bias
            x = x.whole  # gathered by the first: multiplied whole
        x = to_full_sequence(x, self.axis, self.sequence_parallel)
        x, kernel, bias = promote_dtypes(x, self.kernel[...], param_value(self.bias))
        y = matmul(self, x, kernel)
        return y if bias is None else y + bias


class RowParallelLinear(nnx.Module):
    """y = g(x_own @ W[own, :]) + b: input features split over ``axis``.

    kernel [..., in, out] split on ``in``, bias [..., out] replicated (added after g; under SP it
    sees S/p tokens per rank, so its gradient is summed over ``axis`` once per step). Input
    [B, S, in/p]; output [B, S, out] replicated (SP: [B, S/p, out]).
    """

    fp8 = False  # the GEMM on FP8 operands (precision='fp8')

    def __init__(self, kernel, bias=None, *, axis: str = "model",
                 sequence_parallel: bool = False, dtype=None, collective_matmul: bool = False):
        self.axis, self.sequence_parallel, self.dtype = axis, sequence_parallel, dtype
        self.collective_matmul = check_collective_matmul(collective_matmul, sequence_parallel)
        self.kernel = metadata.param(kernel, (axis, None))
        reduce = (axis,) if sequence_parallel else ()
        self.bias = None if bias is None else metadata.param(bias, (None,), reduce_axes=reduce)

    @classmethod
    def from_module(cls, linear: nnx.Linear, *, axis: str = "model",
                    sequence_parallel: bool = False,
                    collective_matmul: bool = False) -> "RowParallelLinear":
        return cls(linear.kernel.get_value(), param_value(linear.bias), axis=axis,
                   sequence_parallel=sequence_parallel, dtype=linear.dtype,
                   collective_matmul=collective_matmul)

    def dense_equivalent(self) -> nnx.Linear:
        return plain_linear(self.kernel[...], param_value(self.bias), self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x, kernel, bias = promote_dtypes(x, self.kernel[...], param_value(self.bias))
        if self.collective_matmul:  # the reduce-scatter as p-1 steps under p GEMMs
            y = matmul_reduce_scatter(self, x, kernel, self.axis)
        else:
            y = reduce_from_model(matmul(self, x, kernel), self.axis, self.sequence_parallel)
        return y if bias is None else y + bias
