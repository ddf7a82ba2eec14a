"""Sequence parallelism's boundaries (Korthikanti et al. 2022, Sec. 4.2.2): the
per-token modules before the column layers (a norm, a module of your own, a learned position
embedding) run on this rank's S/p tokens, their parameters' gradients summed over the mesh axis
once per step, and the sequence is all-gathered once for the layers they feed. Without sequence
parallelism :class:`InputNorm` applies Megatron's f once, for all of them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jphantom.nn import metadata
from jphantom.nn import norm as norm_ops
from jphantom.nn.tensor.collective_matmul import SequenceChunks, check_collective_matmul
from jphantom.nn.tensor.dense import param_value, plain_embed
from jphantom.nn.tensor.regions import copy_to_model, gather_sequence, own_sequence


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
        self.collective_matmul = check_collective_matmul(collective_matmul, sequence_parallel)
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

    @property
    def gathers_sequence(self) -> str | None:
        """The axis this norm all-gathers the sequence over (:func:`jphantom.step.remat.regathering`
        has the backward gather it again rather than keep the whole sequence)."""
        return self.axis if self.sequence_parallel and not self.collective_matmul else None

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

    @property
    def gathers_sequence(self) -> str:
        return self.axis

    def dense_equivalent(self) -> nnx.Module:
        graphdef, state = nnx.split(self.inner)
        inner = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
        for _, variable in nnx.iter_graph(inner):
            if isinstance(variable, nnx.Param):
                variable.set_metadata("reduce_axes", ())
        return inner

    def __call__(self, x: jax.Array) -> jax.Array:
        return gather_sequence(self.inner(x), self.axis)  # all-gather of B*S*h, once
