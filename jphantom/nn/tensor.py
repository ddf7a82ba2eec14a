"""Megatron tensor (and sequence) parallelism as Flax NNX layers (Shoeybi et al., Brakel et al.;
Korthikanti et al., the Day 66 notes).

Each layer runs on one rank inside the training step's ``shard_map`` and calls its collectives on
the mesh axis it was given (``axis``, default ``"model"``, of size p). Parameters are ``nnx.Param``s
whose sharding metadata names that axis; they keep the dense layer's *global* shapes, so a layer
built :meth:`from_module` a plain ``nnx.Linear`` / ``nnx.Embed`` holds the same numbers and gives
them back with :meth:`dense_equivalent`. Leading stacked dimensions (blocks created under
``nnx.vmap``, [L, ...]) are carried along unsplit.

Activations: B tokens' batch, S sequence, h features. Without sequence parallelism the residual
stream is replicated over ``axis`` [B, S, h]; with it (``sequence_parallel=True``, the Day 66 notes
Sec. 4.2.2) it is split over the sequence [B, S/p, h] and each all-reduce below becomes a
reduce-scatter plus an all-gather of the same volume.

Per call, per rank (elements):

=======================  ==========================================  ============================
layer                    forward                                     backward
=======================  ==========================================  ============================
InputNorm                f: none (SP: all-gather of B S h)            f: all-reduce of B S h (SP:
  (norm before columns)                                              reduce-scatter to B S h / p)
ColumnParallelLinear     f where its input does not vary yet (no     as f
                         InputNorm before it), else none
RowParallelLinear        g: all-reduce of B S h (SP: reduce-scatter)  none (SP: all-gather B S h)
VocabParallelEmbed       all-reduce of B S h (SP: reduce-scatter)     none (SP: all-gather)
VocabParallelHead        f (SP: all-gather); logits stay [B S V/p];   f's all-reduce (SP: RS)
  .cross_entropy_sum     3 all-reduces of B S scalars                 none
  .__call__              + all-gather of B S V (the full logits)      none (a slice)
TensorParallelExperts    f before, g after (as a column/row pair)     f's all-reduce
GatherFeatures           all-gather of B n (feature-split in,        none (keeps the own slice)
                         replicated out)
ScatterFeatures          none (keeps the own slice)                  all-gather of B n
T1Linear (Seal et al.)      all-gather of B n_in (its input's features)  reduce-scatter to B n_in / p
=======================  ==========================================  ============================

**Collective matmul** (``collective_matmul=True`` under sequence parallelism; Wang et al. 2023,
"Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models", which XLA's windowed einsum and torchtitan's async tensor parallelism implement): the
all-gather before the column layers and the reduce-scatter after a row layer are cut into p-1
``ppermute`` steps of one sequence chunk [B, S/p, h] each, and every GEMM into p GEMMs of one
chunk, so that each step's transfer runs under the GEMM of the chunk already at hand:

- :class:`InputNorm` hands the column layers it feeds its own chunk (:class:`SequenceChunks`);
  the first of them passes the chunks around the ring (rank r receives rank r+1's chunk, then
  r+2's, ...) in a loop whose step multiplies the chunk at hand while the next one arrives
  (:func:`all_gather_matmul`), and leaves the gathered sequence for the others (k and v after q,
  up after gate), which multiply it whole: one ring per norm, the all-gather's bytes, with the
  first layer's GEMM under it.
- :class:`RowParallelLinear` computes, in a loop, the partial sum of the chunk that is on its way
  to rank r-1-i at step i while the accumulator from rank r-1 is in flight, and adds them
  (:func:`matmul_reduce_scatter`): after p-1 steps rank r holds the whole sum of its own chunk.

Each is a ``lax.scan``: written out step by step, XLA merges the chunks' GEMMs back into one
(its dot merger and concatenate simplification), and nothing is left to overlap.

The bytes are the all-gather's and the reduce-scatter's, as (p-1) collective-permutes of
B S h / p each; backward, autodiff turns each ring around (the gradients' reduce-scatter and
all-gather, overlapped the same way).

Megatron's f (``copy_to_tensor_model_parallel_region``) is ``comm.pcast(x, axis, to="varying")``:
identity forward, its transpose the all-reduce. g (``reduce_from_...``) is ``lax.psum``: its
transpose is free under ``check_vma=True``.

Seal et al.'s FFN takes and returns activations whose features are split over ``axis`` [B, n/p]
(phantom's layout). Megatron's column/row pairs run on replicated [B, n] between them, so the FFN
enters through :class:`GatherFeatures` (Megatron's ``gather_from_tensor_model_parallel_region``)
and, after a row layer, leaves through :class:`ScatterFeatures` (``scatter_to_...``); after a lone
column layer (odd depth) its output is feature-split already. Seal et al.'s own tensor parallelism
(T1, Sec. II-B, Fig. 1a) is :class:`T1Linear`: the weight split on its output features and the
input's features all-gathered in every layer, so input and output keep phantom's layout.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom import comm
from jphantom import fp8 as fp8_ops
from jphantom import remat
from jphantom.errors import ConfigError
from jphantom.nn import metadata
from jphantom.nn.boundary import Boundary
from jphantom.nn import norm as norm_ops
from jphantom.nn.experts import Experts
from jphantom.nn import vocab


def param_value(p):
    """A parameter's array (or its ShapeDtypeStruct in an abstract model), None for no parameter."""
    return None if p is None else p.get_value()


def promote_dtypes(*arrays):
    dtype = jnp.result_type(*(a for a in arrays if a is not None))
    return tuple(None if a is None else a.astype(dtype) for a in arrays)


def matmul(layer, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x @ kernel`` of ``layer``: on FP8 operands when its ``fp8`` flag is set
    (``precision='fp8'``, :func:`jphantom.nn.stack.set_fp8`)."""
    return fp8_ops.matmul(x, kernel) if layer.fp8 else x @ kernel


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


class SequenceChunks:
    """This rank's chunk [B, S/p, h] of a sequence split over ``axis``, not yet gathered: what a
    collective-matmul :class:`InputNorm` hands the column layers it feeds. The first
    :class:`ColumnParallelLinear` to take it gathers the sequence around the ring with its own
    GEMM under the transfers (:func:`all_gather_matmul`) and leaves the gathered sequence here;
    the others (k and v after q, up after gate) multiply that: one ring per norm, as one
    all-gather was."""

    def __init__(self, local: jax.Array, axis: str):
        self.local, self.axis = local, axis
        self.whole = None  # [B, S, h] once the first column layer has gathered it


def _varying_zeros(shape, like):
    zeros = jnp.zeros(shape, like.dtype)
    axes = tuple(sorted(comm.varying_axes(like)))
    return comm.pcast(zeros, axes, to="varying") if axes else zeros


def all_gather_matmul(layer, x: jax.Array, kernel: jax.Array, axis: str):
    """``(all-gather(x) @ kernel, all-gather(x))`` over the sequence, as a collective matmul:
    x [B, S/p, in] -> ([B, S, out], [B, S, in]). A loop of p-1 steps: each passes the chunk at
    hand to the left neighbour (rank r receives r+1's, then r+2's, ...; p-1
    collective-permutes of B S in / p, the all-gather's bytes) while multiplying it, then the
    last chunk's GEMM."""
    size, rank = lax.axis_size(axis), comm.axis_index(axis)
    chunk, seq = x.shape[-2], x.ndim - 2
    to_left = [(i, (i - 1) % size) for i in range(size)]

    def place(buffer, block, step):
        return lax.dynamic_update_slice_in_dim(buffer, block, ((rank + step) % size) * chunk, seq)

    def step(carry, index):
        held, gathered, out = carry
        arriving = remat.name_collective(lax.ppermute(held, axis, to_left))  # under the GEMM
        out = place(out, matmul(layer, held, kernel), index)
        return (arriving, place(gathered, held, index), out), None

    whole = (*x.shape[:-2], chunk * size)
    y_like = jax.eval_shape(lambda a: matmul(layer, a, kernel), x)
    carry = (x, _varying_zeros((*whole, x.shape[-1]), x),
             _varying_zeros((*whole, y_like.shape[-1]), x).astype(y_like.dtype))
    (last, gathered, out), _ = lax.scan(step, carry, jnp.arange(size - 1))
    out = place(out, matmul(layer, last, kernel), size - 1)
    return out, place(gathered, last, size - 1)


def matmul_reduce_scatter(layer, x: jax.Array, kernel: jax.Array, axis: str) -> jax.Array:
    """(x @ kernel) summed over ``axis`` and scattered over the sequence, as a collective matmul:
    x [B, S, in/p] -> [B, S/p, out]. A loop: step i computes the partial sum of the chunk bound
    for rank r-1-i while the accumulator received from rank r-1 is in flight, then adds them
    (p-1 collective-permutes of B S out / p, the reduce-scatter's bytes)."""
    size, rank = lax.axis_size(axis), comm.axis_index(axis)
    chunk = x.shape[-2] // size
    to_right = [(i, (i + 1) % size) for i in range(size)]

    def part(index):
        rows = lax.dynamic_slice_in_dim(x, (index % size) * chunk, chunk, axis=x.ndim - 2)
        return matmul(layer, rows, kernel)

    def step(total, index):
        arrived = remat.name_collective(lax.ppermute(total, axis, to_right))
        return arrived + part(rank - 1 - index), None

    total, _ = lax.scan(step, part(rank - 1), jnp.arange(1, size))
    return total


def own_sequence(x: jax.Array, axis: str) -> jax.Array:
    """This rank's S/p slice of the sequence dimension (-2) of ``x``."""
    chunk = x.shape[-2] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(x, comm.axis_index(axis) * chunk, chunk, axis=x.ndim - 2)


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
        self.collective_matmul = _check_collective_matmul(collective_matmul, sequence_parallel)
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


class VocabParallelEmbed(nnx.Module):
    """Token embedding with the vocabulary split over ``axis``: rank j holds rows
    [j V/p, (j+1) V/p) of embedding [V, h]; a lookup sums the ranks' shares (all-reduce of B S h;
    SP: reduce-scatter to [B, S/p, h]). :meth:`attend` is a tied LM head (:class:`VocabParallelHead`
    with the embedding as its kernel)."""

    def __init__(self, embedding, *, axis: str = "model", sequence_parallel: bool = False,
                 dtype=None):
        self.axis, self.sequence_parallel, self.dtype = axis, sequence_parallel, dtype
        self.embedding = metadata.param(embedding, (axis, None))

    @classmethod
    def from_module(cls, embed: nnx.Embed, *, axis: str = "model",
                    sequence_parallel: bool = False) -> "VocabParallelEmbed":
        return cls(embed.embedding.get_value(), axis=axis, sequence_parallel=sequence_parallel,
                   dtype=embed.dtype)

    def dense_equivalent(self) -> nnx.Embed:
        return plain_embed(self.embedding[...], self.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.embedding[...]
        if self.dtype is not None:
            table = table.astype(self.dtype)
        partial_sum = vocab.embed_partial(table, tokens, self.axis)  # [B, S, h], zeros elsewhere
        return reduce_from_model(partial_sum, self.axis, self.sequence_parallel)

    def local_logits(self, h: jax.Array) -> jax.Array:
        """This rank's vocabulary slice of the tied head's logits, [B, S, V/p]."""
        h = to_full_sequence(h, self.axis, self.sequence_parallel)
        h, table = promote_dtypes(h, self.embedding[...])
        return h @ table.T

    def attend(self, h: jax.Array) -> jax.Array:
        """Full logits [B, S, V] (all-gather of B S V; use :meth:`cross_entropy_sum` to avoid it)."""
        return gather_vocab(self.local_logits(h), self.axis)

    def cross_entropy_sum(self, h: jax.Array, targets: jax.Array) -> jax.Array:
        """Summed next-token cross-entropy of the tied head over the tokens whose target is not
        negative, without gathering the logits, in chunks of tokens (:func:`jphantom.nn.vocab.chunked_sum`)."""
        h = to_full_sequence(h, self.axis, self.sequence_parallel)

        def chunk(x, t, table):
            x, table = promote_dtypes(x, table)
            return vocab.cross_entropy_sum(x @ table.T, t, self.axis)  # 3 all-reduces of N/n

        table = self.embedding[...]
        return vocab.chunked_sum(chunk, h, targets, (table,),
                                 vocab_local=table.shape[0])


class VocabParallelHead(nnx.Module):
    """LM head ``h -> logits`` with the vocabulary split over ``axis`` (a column-parallel linear
    whose outputs are the vocabulary). kernel [h, V] split on V, bias [V] split."""

    def __init__(self, kernel, bias=None, *, axis: str = "model", sequence_parallel: bool = False,
                 dtype=None):
        self.axis, self.sequence_parallel, self.dtype = axis, sequence_parallel, dtype
        self.kernel = metadata.param(kernel, (None, axis))
        self.bias = None if bias is None else metadata.param(bias, (axis,))

    from_module = classmethod(ColumnParallelLinear.from_module.__func__)

    def dense_equivalent(self) -> nnx.Linear:
        return plain_linear(self.kernel[...], param_value(self.bias), self.dtype)

    def local_logits(self, h: jax.Array) -> jax.Array:
        h = to_full_sequence(h, self.axis, self.sequence_parallel)
        h, kernel, bias = promote_dtypes(h, self.kernel[...], param_value(self.bias))
        y = h @ kernel
        return y if bias is None else y + bias

    def __call__(self, h: jax.Array) -> jax.Array:
        """Full logits [B, S, V]: an all-gather of B S V (a loss through
        :func:`jphantom.nn.cross_entropy` never does it)."""
        return gather_vocab(self.local_logits(h), self.axis)

    def cross_entropy_sum(self, h: jax.Array, targets: jax.Array) -> jax.Array:
        """Summed cross-entropy over the tokens whose target is not negative: three
        all-reduces of B S scalars, in chunks of tokens (:func:`jphantom.nn.vocab.chunked_sum`)."""
        h = to_full_sequence(h, self.axis, self.sequence_parallel)

        def chunk(x, t, kernel, bias=None):
            x, kernel, bias = promote_dtypes(x, kernel, bias)
            y = x @ kernel
            return vocab.cross_entropy_sum(y if bias is None else y + bias, t, self.axis)

        kernel = self.kernel[...]
        weights = (kernel,) + (() if self.bias is None else (self.bias[...],))
        return vocab.chunked_sum(chunk, h, targets, weights,
                                 vocab_local=kernel.shape[-1])


class SequenceParallelEmbed(nnx.Module):
    """Learned position embedding under sequence parallelism: ``positions`` [S] looked up in the
    replicated table [S_max, h], this rank's S/p rows kept (no communication; the table's gradient
    is summed over ``axis`` once per step)."""

    def __init__(self, embedding, *, axis: str = "model", dtype=None):
        self.axis, self.dtype = axis, dtype
        self.embedding = metadata.param(embedding, (None, None), reduce_axes=(axis,))

    @classmethod
    def from_module(cls, embed: nnx.Embed, *, axis: str = "model") -> "SequenceParallelEmbed":
        return cls(embed.embedding.get_value(), axis=axis, dtype=embed.dtype)

    def dense_equivalent(self) -> nnx.Embed:
        return plain_embed(self.embedding[...], self.dtype)

    def __call__(self, positions: jax.Array) -> jax.Array:
        table = self.embedding[...]
        if self.dtype is not None:
            table = table.astype(self.dtype)
        return own_sequence(jnp.take(table, positions, axis=0), self.axis)


class InputNorm(nnx.Module):
    """A LayerNorm or RMSNorm whose output feeds tensor-parallel layers: Megatron's f applied once
    to its output (identity forward, one all-reduce of B S h backward for every layer it feeds),
    or under sequence parallelism the all-gather of the sequence (B S h; backward reduce-scatter),
    the norm running on this rank's S/p tokens with its parameters' gradients summed over
    ``axis`` once per step. Parameters keep the plain norm's names (``scale``, ``bias``)."""

    def __init__(self, scale, bias, *, kind: str, epsilon: float, axis: str = "model",
                 sequence_parallel: bool = False, dtype=None, collective_matmul: bool = False):
        self.kind, self.epsilon, self.axis, self.dtype = kind, epsilon, axis, dtype
        self.sequence_parallel = sequence_parallel
        self.collective_matmul = _check_collective_matmul(collective_matmul, sequence_parallel)
        reduce = (axis,) if sequence_parallel else ()
        self.scale = None if scale is None else metadata.param(scale, (None,), reduce_axes=reduce)
        self.bias = None if bias is None else metadata.param(bias, (None,), reduce_axes=reduce)

    @classmethod
    def from_module(cls, norm, *, axis: str = "model", sequence_parallel: bool = False,
                    collective_matmul: bool = False) -> "InputNorm":
        return cls(param_value(getattr(norm, "scale", None)), param_value(getattr(norm, "bias", None)),
                   kind=norm_ops.kind_of(norm), epsilon=norm.epsilon, axis=axis,
                   sequence_parallel=sequence_parallel, dtype=norm.dtype,
                   collective_matmul=collective_matmul)

    def dense_equivalent(self):
        return norm_ops.plain(self.kind, self.epsilon, self.dtype, param_value(self.scale),
                              param_value(self.bias))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = norm_ops.normalize(x, self.kind, self.epsilon, param_value(self.scale), param_value(self.bias),
                               dtype=self.dtype)
        if self.collective_matmul:  # gathered by the first column layer, under its GEMMs
            return SequenceChunks(y, self.axis)
        if self.sequence_parallel:
            return gather_sequence(y, self.axis)  # all-gather of B*S*h, once for its layers
        return copy_to_model(y, self.axis)  # f: backward all-reduce of B*S*h, once


class PerTokenSequence(nnx.Module):
    """A per-token module of your own before column layers under sequence parallelism (a norm
    that is not ``nnx.LayerNorm`` / ``nnx.RMSNorm``, such as Gemma's ``x / rms(x) * (1 + w)``):
    ``inner`` runs on this rank's S/p tokens, then the sequence is all-gathered once for the
    layers it feeds, as :class:`InputNorm` does (B S h; backward reduce-scatter). Its parameters
    stay whole on every rank, their gradients summed over ``axis`` once per step (each rank saw
    S/p tokens). Plan style ``sequence`` on a module jphantom does not know; right only for a
    module that treats each token alone."""

    def __init__(self, inner: nnx.Module, *, axis: str = "model"):
        graphdef, state = nnx.split(inner)
        self.inner = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))  # its own variables
        self.axis = axis
        for _, variable in nnx.iter_graph(self.inner):
            if isinstance(variable, nnx.Param):
                variable.set_metadata("reduce_axes", (axis,))

    @classmethod
    def from_module(cls, module: nnx.Module, *, axis: str = "model") -> "PerTokenSequence":
        return cls(module, axis=axis)

    def dense_equivalent(self) -> nnx.Module:
        graphdef, state = nnx.split(self.inner)
        inner = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
        for _, variable in nnx.iter_graph(inner):
            if isinstance(variable, nnx.Param):
                variable.set_metadata("reduce_axes", ())
        return inner

    def __call__(self, x: jax.Array) -> jax.Array:
        return gather_sequence(self.inner(x), self.axis)  # all-gather of B*S*h, once


class TensorParallelExperts(nnx.Module):
    """A mixture of SwiGLU experts with every expert's FFN width split over ``axis`` (TED's tensor
    part, Singh's thesis Eq. 7.1, without an expert axis): w_gate, w_up [E, h, f] split on f,
    w_down [E, f, h] split on f; f before, g after, as a column/row pair.

    ``feature_split=True`` (phantom models, whose stream is [B, S, h/p]): the input's features are
    all-gathered (B S h; backward reduce-scatter) and the output reduce-scattered back to h/p
    (B S h; backward all-gather), the gates being replicated already."""

    fp8 = False  # the experts' GEMMs on FP8 operands (precision='fp8')

    def __init__(self, w_gate, w_up, w_down, *, axis: str = "model",
                 sequence_parallel: bool = False, feature_split: bool = False,
                 top_k: int | None = None):
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.feature_split, self.top_k = feature_split, top_k
        self.w_gate = metadata.param(w_gate, (None, None, axis))
        self.w_up = metadata.param(w_up, (None, None, axis))
        self.w_down = metadata.param(w_down, (None, axis, None))

    @classmethod
    def from_module(cls, experts: Experts, *, axis: str = "model",
                    sequence_parallel: bool = False,
                    feature_split: bool = False) -> "TensorParallelExperts":
        return cls(experts.w_gate.get_value(), experts.w_up.get_value(), experts.w_down.get_value(), axis=axis,
                   sequence_parallel=sequence_parallel, feature_split=feature_split,
                   top_k=experts.top_k)

    def dense_equivalent(self) -> Experts:
        return Experts.of(self.w_gate[...], self.w_up[...], self.w_down[...], top_k=self.top_k)

    def __call__(self, x: jax.Array, gates: jax.Array) -> jax.Array:
        if self.feature_split:
            x = comm.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True)  # [.., h]
            partial_sum = Experts.apply(x, gates, self.w_gate[...], self.w_up[...],
                                        self.w_down[...], fp8=self.fp8)
            return comm.psum_scatter(partial_sum, self.axis, scatter_dimension=x.ndim - 1,
                                    tiled=True)  # [.., h/p]
        x = to_full_sequence(x, self.axis, self.sequence_parallel)
        partial_sum = Experts.apply(x, gates, self.w_gate[...], self.w_up[...], self.w_down[...],
                                    fp8=self.fp8)
        return reduce_from_model(partial_sum, self.axis, self.sequence_parallel)


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


def _check_collective_matmul(collective_matmul: bool, sequence_parallel: bool) -> bool:
    if collective_matmul and not sequence_parallel:
        raise ConfigError("collective_matmul overlaps sequence parallelism's all-gathers and "
                          "reduce-scatters with the GEMMs: turn sequence parallelism on too")
    return bool(collective_matmul)


def gather_vocab(local_logits: jax.Array, axis: str) -> jax.Array:
    """[..., V/p] -> [..., V] on every rank; the backward keeps the own slice (no communication)."""
    return comm.all_gather(local_logits, axis, axis=local_logits.ndim - 1, tiled=True,
                          to="invarying")


def plain_linear(kernel, bias, dtype) -> nnx.Linear:
    """A plain ``nnx.Linear`` holding ``kernel`` [..., in, out] and ``bias``."""
    linear = nnx.Linear(kernel.shape[-2], kernel.shape[-1], use_bias=bias is not None,
                        dtype=dtype, param_dtype=kernel.dtype, rngs=nnx.Rngs(0))
    linear.kernel = nnx.Param(kernel)
    if bias is not None:
        linear.bias = nnx.Param(bias)
    return linear


def plain_embed(embedding, dtype) -> nnx.Embed:
    embed = nnx.Embed(embedding.shape[-2], embedding.shape[-1], dtype=dtype,
                      param_dtype=embedding.dtype, rngs=nnx.Rngs(0))
    embed.embedding = nnx.Param(embedding)
    return embed
