"""Megatron's column and row layers (Shoeybi et al.) for ``nnx.Einsum``: the kernel split along
one letter of the equation (column: the first only the output has; row: the first contracted
with the input), the equation's forms jphantom does not split refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn import metadata
from jphantom.nn.tensor.collective_matmul import SequenceChunks
from jphantom.nn.tensor.dense import param_value, promote_dtypes
from jphantom.nn.tensor.regions import gather_sequence, reduce_from_model, to_full_sequence


def einsum_operands(layer: nnx.Einsum) -> tuple[str, str, str]:
    """``nnx.Einsum``'s equation as (input letters, kernel letters, output letters); forms the
    Einsum layers do not take (an ellipsis, no explicit output, the equation given per call)
    are refused by name."""
    equation = (layer.einsum_str or "").replace(" ", "")
    if "..." in equation or "->" not in equation or equation.count(",") != 1:
        raise ConfigError(f"nnx.Einsum({layer.einsum_str!r}): jphantom splits an Einsum whose "
                          "equation is given at construction with explicit letters, one input "
                          "and the kernel, e.g. 'bsh,hf->bsf'")
    operands, out = equation.split("->")
    lhs, rhs = operands.split(",")
    return lhs, rhs, out


def einsum_split(lhs: str, rhs: str, out: str, *, column: bool) -> str | None:
    """The kernel letter a column layer splits (the first only the output has) or a row layer
    splits (the first it contracts with the input); ``None`` when there is none."""
    letters = [c for c in rhs if (c in out and c not in lhs if column
                                  else c in lhs and c not in out)]
    return letters[0] if letters else None


def _einsum_bias_letters(layer: nnx.Einsum, rhs: str, out: str) -> str:
    """The output letters the bias spans (``nnx.Einsum`` reshapes it to them); a bias of
    another shape is refused by name."""
    letters = "".join(c for c in out if c in rhs)
    if layer.bias is not None:
        core = tuple(layer.kernel_shape[rhs.index(c)] for c in letters)
        if tuple(layer.bias_shape) != core:
            raise ConfigError(f"nnx.Einsum({layer.einsum_str!r}) with bias_shape="
                              f"{tuple(layer.bias_shape)}: a split bias must have the shape of "
                              f"the output axes it spans, {core}")
    return letters


def _einsum(equation: str, kernel, bias, kernel_ndim: int, dtype) -> nnx.Einsum:
    """A plain ``nnx.Einsum`` of ``equation`` holding ``kernel`` (its last ``kernel_ndim`` axes the
    equation's; leading stacked axes kept) and ``bias``."""
    core = kernel.shape[kernel.ndim - kernel_ndim:]
    lhs, rhs, out = equation.replace(" ", "").replace("->", ",").split(",")
    bias_core = tuple(core[rhs.index(c)] for c in out if c in rhs)
    layer = nnx.eval_shape(lambda: nnx.Einsum(equation, core, bias_core if bias is not None
                                              else None, dtype=dtype,
                                              param_dtype=kernel.dtype, rngs=nnx.Rngs(0)))
    layer.kernel = nnx.Param(kernel)
    if bias is not None:
        layer.bias = nnx.Param(bias)
    return layer


class _ParallelEinsum(nnx.Module):
    """What the column and row layers of ``nnx.Einsum`` share: the equation, the kernel split
    along one letter (:func:`einsum_split`), the layer built from an ``nnx.Einsum`` and its dense
    equivalent. ``column`` picks the letter; the subclass places the bias and computes."""

    column: bool
    refusal: str  # why an equation has no letter to split, and what to name it instead

    def __init__(self, kernel, bias=None, *, equation: str, split: str, axis: str = "model",
                 sequence_parallel: bool = False, dtype=None):
        self.axis, self.sequence_parallel, self.dtype = axis, sequence_parallel, dtype
        self.equation = equation
        _, rhs, out = equation.replace("->", ",").split(",")
        self.kernel = metadata.param(kernel, tuple(axis if c == split else None for c in rhs))
        self.bias = None if bias is None else self._bias(bias, split, rhs, out)

    @classmethod
    def from_module(cls, layer: nnx.Einsum, *, axis: str = "model",
                    sequence_parallel: bool = False):
        lhs, rhs, out = einsum_operands(layer)
        split = einsum_split(lhs, rhs, out, column=cls.column)
        if split is None:
            raise ConfigError(f"nnx.Einsum({layer.einsum_str!r}) as a "
                              f"{'column' if cls.column else 'row'} layer: {cls.refusal}")
        if sequence_parallel and not cls.column and len(out) != 3:
            raise ConfigError(f"nnx.Einsum({layer.einsum_str!r}) as a sequence-parallel row "
                              "layer: its output must be [batch, sequence, features] (three "
                              "letters), the sequence reduce-scattered")
        _einsum_bias_letters(layer, rhs, out)
        return cls(layer.kernel.get_value(), param_value(layer.bias), equation=f"{lhs},{rhs}->{out}",
                   split=split, axis=axis, sequence_parallel=sequence_parallel,
                   dtype=layer.dtype)

    def dense_equivalent(self) -> nnx.Einsum:
        rhs = self.equation.split(",")[1].split("->")[0]
        return _einsum(self.equation, self.kernel[...], param_value(self.bias), len(rhs), self.dtype)


class ColumnParallelEinsum(_ParallelEinsum):
    """Megatron's column layer for ``nnx.Einsum``: the first kernel axis that only the output
    has (the heads of 'bsh,hnd->bsnd', the features of 'bsh,hf->bsf') split over ``axis``, the
    bias along the same output axis; the input as :class:`ColumnParallelLinear`'s, the output
    that axis' p-th part."""

    column = True
    refusal = ("no kernel axis is an output axis the input lacks; name it 'row' if it "
               "contracts a split axis, or 'replicate'")

    def _bias(self, bias, split, rhs, out):
        return metadata.param(bias, tuple(self.axis if c == split else None
                                          for c in out if c in rhs))

    def __call__(self, x) -> jax.Array:
        if isinstance(x, SequenceChunks):  # a collective-matmul norm's chunks: gathered whole
            x = x.whole if x.whole is not None else gather_sequence(x.local, self.axis)
        x = to_full_sequence(x, self.axis, self.sequence_parallel)
        return _einsum_call(self.equation, x, self.kernel[...], param_value(self.bias))


class RowParallelEinsum(_ParallelEinsum):
    """Megatron's row layer for ``nnx.Einsum``: the first contracted kernel axis (the heads of
    'bsnd,ndh->bsh', the features of 'bsf,fh->bsh') split over ``axis``, the input arriving split
    along it, the partial sums reduced by g (SP: reduce-scattered over the sequence, the output
    [B, S, h]); the bias replicated, added after g (SP: its gradient summed over ``axis``)."""

    column = False
    refusal = "it contracts no kernel axis with the input; name it 'column' or 'replicate'"

    def _bias(self, bias, split, rhs, out):
        reduce = (self.axis,) if self.sequence_parallel else ()
        return metadata.param(bias, (None,) * len([c for c in out if c in rhs]),
                              reduce_axes=reduce)

    def __call__(self, x) -> jax.Array:
        partial_sum = _einsum_call(self.equation, x, self.kernel[...], None)
        y = reduce_from_model(partial_sum, self.axis, self.sequence_parallel)
        bias = param_value(self.bias)
        return y if bias is None else _einsum_call(self.equation, y, None, bias)


def _einsum_call(equation: str, x, kernel, bias):
    """``nnx.Einsum``'s arithmetic: ``einsum(equation, x, kernel)`` in the promoted dtype, plus
    ``bias`` broadcast over the output letters it spans (``kernel=None``: ``x`` is the output,
    only the bias added)."""
    x, kernel, bias = promote_dtypes(x, kernel, bias)
    _, rhs, out = equation.replace("->", ",").split(",")
    y = x if kernel is None else jnp.einsum(equation, x, kernel)
    if bias is None:
        return y
    spans = [c in rhs for c in out]
    sizes = iter(bias.shape)
    return y + bias.reshape([next(sizes) if s else 1 for s in spans])
