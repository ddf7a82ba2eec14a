"""Megatron's column and row layers (Shoeybi et al.) for ``nnx.LinearGeneral``, the form
``nnx.MultiHeadAttention`` builds its query, key, value and output projections in: the heads axis
split over the mesh axis."""

from __future__ import annotations

import jax
from flax import nnx
from jax import lax

from jphantom.errors import ConfigError
from jphantom.nn import metadata
from jphantom.nn.tensor.collective_matmul import SequenceChunks
from jphantom.nn.tensor.dense import param_value, promote_dtypes
from jphantom.nn.tensor.regions import gather_sequence, reduce_from_model, to_full_sequence


def _general(kernel, bias, in_axes: int, out_axes: int, dtype) -> nnx.LinearGeneral:
    """A plain ``nnx.LinearGeneral`` holding ``kernel`` [..., *in, *out] (its last ``in_axes``
    input axes contracted; leading stacked axes kept) and ``bias`` [..., *out]."""
    core = kernel.shape[kernel.ndim - in_axes - out_axes:]
    layer = nnx.eval_shape(lambda: nnx.LinearGeneral(
        core[:in_axes], core[in_axes:], axis=tuple(range(-in_axes, 0)),
        use_bias=bias is not None, dtype=dtype, param_dtype=kernel.dtype, rngs=nnx.Rngs(0)))
    layer.kernel = nnx.Param(kernel)
    if bias is not None:
        layer.bias = nnx.Param(bias)
    return layer


def _check_general(module: nnx.LinearGeneral, *, column: bool) -> None:
    """Refuses by name the ``nnx.LinearGeneral`` forms the general column and row layers do not
    take."""
    ins = len(module.in_features)
    trailing = all(a < 0 for a in module.axis) and tuple(sorted(module.axis)) == tuple(
        range(-ins, 0))
    if module.batch_axis or not trailing or (column and ins != 1) or (
            not column and len(module.out_features) != 1):
        raise ConfigError(f"nnx.LinearGeneral(in_features={module.in_features}, out_features="
                          f"{module.out_features}, axis={module.axis}) as a "
                          f"{'column' if column else 'row'} layer: jphantom splits one that "
                          "contracts the trailing input axes (column: one of them, row: into "
                          "one output axis) without batch axes: attention's projections as "
                          "nnx.MultiHeadAttention builds them")


class ColumnParallelGeneral(nnx.Module):
    """Megatron's column layer for ``nnx.LinearGeneral`` (``nnx.MultiHeadAttention``'s query,
    key and value): the first output axis (the heads) split over ``axis``. kernel
    [in, out_0, *out_rest] split on out_0, bias [out_0, *out_rest] split on out_0; input as
    :class:`ColumnParallelLinear`'s, output [..., out_0/p, *out_rest]."""

    def __init__(self, kernel, bias=None, *, out_axes: int, axis: str = "model",
                 sequence_parallel: bool = False, dtype=None):
        self.axis, self.sequence_parallel, self.dtype = axis, sequence_parallel, dtype
        self.out_axes = out_axes
        rest = (None,) * (out_axes - 1)
        self.kernel = metadata.param(kernel, (None, axis, *rest))
        self.bias = None if bias is None else metadata.param(bias, (axis, *rest))

    @classmethod
    def from_module(cls, layer: nnx.LinearGeneral, *, axis: str = "model",
                    sequence_parallel: bool = False) -> "ColumnParallelGeneral":
        _check_general(layer, column=True)
        return cls(layer.kernel.get_value(), param_value(layer.bias),
                   out_axes=len(layer.out_features), axis=axis,
                   sequence_parallel=sequence_parallel, dtype=layer.dtype)

    def dense_equivalent(self) -> nnx.LinearGeneral:
        return _general(self.kernel[...], param_value(self.bias), 1, self.out_axes, self.dtype)

    def __call__(self, x, out_sharding=None) -> jax.Array:
        if isinstance(x, SequenceChunks):  # a collective-matmul norm's chunks: gathered whole
            x = x.whole if x.whole is not None else gather_sequence(x.local, self.axis)
        x = to_full_sequence(x, self.axis, self.sequence_parallel)
        x, kernel, bias = promote_dtypes(x, self.kernel[...], param_value(self.bias))
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        return y if bias is None else y + bias


class RowParallelGeneral(nnx.Module):
    """Megatron's row layer for ``nnx.LinearGeneral`` (``nnx.MultiHeadAttention``'s output
    projection): the first contracted input axis (the heads) split over ``axis``, then g.
    kernel [in_0, *in_rest, out] split on in_0, bias [out] replicated (SP: its gradient summed
    over ``axis``); input [..., in_0/p, *in_rest], output as :class:`RowParallelLinear`'s."""

    def __init__(self, kernel, bias=None, *, in_axes: int, axis: str = "model",
                 sequence_parallel: bool = False, dtype=None):
        self.axis, self.sequence_parallel, self.dtype = axis, sequence_parallel, dtype
        self.in_axes = in_axes
        self.kernel = metadata.param(kernel, (axis,) + (None,) * in_axes)
        reduce = (axis,) if sequence_parallel else ()
        self.bias = None if bias is None else metadata.param(bias, (None,), reduce_axes=reduce)

    @classmethod
    def from_module(cls, layer: nnx.LinearGeneral, *, axis: str = "model",
                    sequence_parallel: bool = False) -> "RowParallelGeneral":
        _check_general(layer, column=False)
        return cls(layer.kernel.get_value(), param_value(layer.bias),
                   in_axes=len(layer.in_features), axis=axis,
                   sequence_parallel=sequence_parallel, dtype=layer.dtype)

    def dense_equivalent(self) -> nnx.LinearGeneral:
        return _general(self.kernel[...], param_value(self.bias), self.in_axes, 1, self.dtype)

    def __call__(self, x, out_sharding=None) -> jax.Array:
        x, kernel, bias = promote_dtypes(x, self.kernel[...], param_value(self.bias))
        ins = self.in_axes
        contract = tuple(range(x.ndim - ins, x.ndim))
        partial_sum = lax.dot_general(x, kernel, ((contract, tuple(range(ins))), ((), ())))
        y = reduce_from_model(partial_sum, self.axis, self.sequence_parallel)
        return y if bias is None else y + bias
