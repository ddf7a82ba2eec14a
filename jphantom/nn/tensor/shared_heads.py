"""Grouped-query attention's key and value heads shared by tensor ranks: fewer key/value heads
than ranks, each rank computing the one head its query heads use, the kernel replicated (as vLLM
and MaxText replicate the key/value heads) and its gradient summed over the mesh axis."""

from __future__ import annotations

import jax
from flax import nnx
from jax import lax

from jphantom.runtime import comm
from jphantom.nn import metadata
from jphantom.nn.tensor.collective_matmul import SequenceChunks
from jphantom.nn.tensor.dense import matmul, param_value, plain_linear, promote_dtypes
from jphantom.nn.tensor.regions import gather_sequence, to_full_sequence


class SharedHeadsLinear(nnx.Module):
    """A column layer whose outputs are ``heads`` heads, fewer than the p ranks of ``axis`` (p a
    multiple of them): grouped-query attention's key and value projections with fewer key/value
    heads than tensor ranks (Qwen2.5-7B's 4 on 8 GPUs). Rank r computes the one head its query
    heads use, head r // (p / heads); every rank holds the whole kernel [in, heads d]
    (replicated, as vLLM and MaxText replicate the key/value heads), and its gradient, each
    rank's part in its head's columns, is summed over ``axis`` once per step, so the p / heads
    ranks that share a head train it together. Output [B, S, d]; the input as
    :class:`ColumnParallelLinear`'s."""

    fp8 = False  # the GEMM on FP8 operands (precision='fp8')

    def __init__(self, kernel, bias=None, *, heads: int, axis: str = "model",
                 sequence_parallel: bool = False, dtype=None):
        self.axis, self.sequence_parallel, self.dtype = axis, sequence_parallel, dtype
        self.heads = heads
        self.kernel = metadata.param(kernel, (None, None), reduce_axes=(axis,))
        self.bias = None if bias is None else metadata.param(bias, (None,), reduce_axes=(axis,))

    @classmethod
    def from_module(cls, linear: nnx.Linear, *, heads: int, axis: str = "model",
                    sequence_parallel: bool = False) -> "SharedHeadsLinear":
        return cls(linear.kernel.get_value(), param_value(linear.bias), heads=heads, axis=axis,
                   sequence_parallel=sequence_parallel, dtype=linear.dtype)

    def dense_equivalent(self) -> nnx.Linear:
        return plain_linear(self.kernel[...], param_value(self.bias), self.dtype)

    def __call__(self, x) -> jax.Array:
        if isinstance(x, SequenceChunks):  # a collective-matmul norm's chunks: gathered whole
            x = x.whole if x.whole is not None else gather_sequence(x.local, self.axis)
        x = to_full_sequence(x, self.axis, self.sequence_parallel)
        x, kernel, bias = promote_dtypes(x, self.kernel[...], param_value(self.bias))
        width = kernel.shape[-1] // self.heads
        head = comm.axis_index(self.axis) // (lax.axis_size(self.axis) // self.heads)
        kernel = lax.dynamic_slice_in_dim(kernel, head * width, width, axis=kernel.ndim - 1)
        y = matmul(self, x, kernel)
        if bias is None:
            return y
        return y + lax.dynamic_slice_in_dim(bias, head * width, width, axis=bias.ndim - 1)
