"""AxoNN's 3D parallel matrix multiply (Singh's thesis ch. 5, Algorithm 3) as Flax NNX layers, on mesh
axes ``x``, ``y``, ``z`` (rows also over ``data``). The arithmetic and the naming are those of
:mod:`jphantom.nn.pmm3d.ops`: a *normal* layer contracts features split over ``y`` and gives
features split over ``x``, a *transposed* layer the reverse, so q/k/v and up/gate (normal) chain
into the attention output and down projections (transposed) with no re-layout. Per layer, kernel
``W [in, out]`` stored split over the contraction axis on ``in`` and over (output axis, ``z``) on
``out``:

    forward   W = all-gather_z(Ŵ)                          (Eq. 5.1)
              O = all-reduce_contract(I W) + b              (Eq. 5.3)
    backward  dI: all-reduce over the output axis          (Eq. 5.4, by autodiff)
              dŴ: reduce-scatter over z                     (Eq. 5.2, the gather's transpose)

The residual stream is [B/(G_data G_z), S, h/G_y], replicated over ``x``; norms sum their
per-token statistics over ``y`` (:class:`~jphantom.nn.phantom.FeatureParallelNorm` on ``y``),
position tables split their features over ``y``. The token table [V, h] is split like a normal
layer's weight (vocabulary over (x, z), features over y): the lookup all-reduces over ``x``, the
tied head's logits [B, S, V/G_x] all-reduce over ``y`` and the cross-entropy is
vocabulary-parallel over ``x``. An untied head is a normal layer whose outputs are the vocabulary.

A routed mixture of experts (:class:`Pmm3dMoE`, a :class:`~jphantom.nn.moe.SwitchMoE` in the
MLP's place) runs on the same stream: its tokens' features are all-gathered over ``y`` (the router
and every expert contract whole tokens: B S h / (G_data G_z) per layer forward, an all-reduce of
that size backward), the experts are split over ``expert`` (all-to-all dispatch) and their width
over ``x`` (TED over the axis the stream is replicated over: the experts' all-reduce lands the
output replicated over ``x`` as the stream is), and each rank keeps its ``y`` features of the
output. The 3D matmul splits no expert over ``y``: the G_y ranks of a token row compute the same
expert FFNs.

What a layer does with its gathered weight is an option, so any model runs every variant
(:class:`Pmm3dLinear`'s ``weights``): ``kept`` for the backward (default), ``regather`` in the
backward (AxoNN's default; a ``jax.checkpoint`` that saves nothing), or ``deferred``: a
:class:`~jphantom.nn.stack.Stacked` gathers every layer's weight before its scan and the
gradients are reduce-scattered once after the backward.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax import lax

from jphantom.runtime import comm
from jphantom.step import remat
from jphantom.errors import ConfigError
from jphantom.nn import metadata
from jphantom.nn.expert_parallel import ExpertParallelMoE
from jphantom.nn.moe import SwitchMoE
from jphantom.nn.tensor import (gather_vocab, matmul, param_value, plain_embed, plain_linear,
                                 promote_dtypes)
from jphantom.nn.pmm3d import ops as pmm3d_ops
from jphantom.nn import vocab
from jphantom.step import zero as zero_ops

X, Y, Z = pmm3d_ops.X, pmm3d_ops.Y, pmm3d_ops.Z
ROLES = pmm3d_ops.ROLES  # role -> (contraction axis, output axis)
WEIGHTS = ("kept", "regather", "deferred")  # Pmm3dLinear's gathered weights (its docstring)


class Pmm3dLinear(nnx.Module):
    """One Algorithm-3 layer: ``[..., in/G_c] -> [..., out/G_o]`` (``role`` normal: c = y,
    o = x; transposed: c = x, o = y). ``vocab_output``: an LM head (normal), logits split over
    ``x``; ``__call__`` gathers them, :meth:`cross_entropy_sum` never does.

    ``weights``: what happens to the gathered weight ``W = all-gather_z(Ŵ)`` (Eq. 5.1),
    per layer and step (G = n_in n_out / (G_x G_y), the block one rank multiplies with):

    ``"kept"`` (default)
        gathered once in the forward and kept for the backward: one all-gather of G forward,
        one reduce-scatter of its gradient backward (Eq. 5.2); one gathered weight per layer
        alive until its backward.
    ``"regather"`` (AxoNN's default without ``cache_weights``)
        the layer is a ``jax.checkpoint`` that saves nothing (its backward needs only its inputs
        and the gathered weight), so its backward all-gathers the weight again: two all-gathers of G, one reduce-scatter; no gathered
        weight outlives its layer.
    ``"deferred"`` (the dissertation's deferred reduce-scatter)
        inside a :class:`~jphantom.nn.stack.Stacked`, every layer's weight is gathered at once
        before the layers run (:meth:`gather_stacked`, one all-gather of L G per stack) and the
        gradients of the whole stack are reduce-scattered once after the backward (its
        transpose); the whole gathered stack stays alive through the step. A layer outside any
        stack gathers in its call, as ``"kept"``.
    """

    fp8 = False  # the GEMM on FP8 operands (precision='fp8')

    def __init__(self, kernel, bias=None, *, role: str = "normal", vocab_output: bool = False,
                 weights: str = "kept", dtype=None):
        if weights not in WEIGHTS:
            raise ConfigError(f"weights={weights!r}: one of {', '.join(WEIGHTS)}")
        self.role, self.vocab_output, self.dtype = role, vocab_output, dtype
        self.weights = weights
        self.gathered = False  # deferred: set by gather_stacked, the kernel is whole over z
        contract, out = ROLES[role]
        self.kernel = metadata.param(kernel, (contract, (out, Z)))
        self.bias = None if bias is None else metadata.param(bias, (out,))

    @classmethod
    def from_module(cls, linear: nnx.Linear, *, role: str = "normal", vocab_output: bool = False,
                    weights: str = "kept") -> "Pmm3dLinear":
        return cls(linear.kernel.get_value(), param_value(linear.bias), role=role,
                   vocab_output=vocab_output, weights=weights, dtype=linear.dtype)

    def dense_equivalent(self) -> nnx.Linear:
        return plain_linear(self.kernel[...], param_value(self.bias), self.dtype)

    @property
    def stack_gathered(self) -> bool:
        """Whether :meth:`gather_stacked` gathers the stack (``deferred``): then its gradient is
        the whole stack's, which a gradient sink does not take (:mod:`jphantom.nn.sink`)."""
        return self.weights == "deferred"

    def gather_stacked(self) -> None:
        """Called by :class:`~jphantom.nn.stack.Stacked` on the module holding every layer's
        kernel [L, in/G_c, out/(G_o G_z)], before the layers run: ``deferred`` gathers them all
        over z in one all-gather of L G (its transpose, after the backward, the one
        reduce-scatter); the layers then use their slices as they are. Other settings: nothing."""
        if self.weights != "deferred" or self.gathered:
            return
        self.kernel.set_value(pmm3d_ops.gather(self.kernel[...], self.kernel.ndim - 1))
        self.gathered = True

    def local_outputs(self, x: jax.Array) -> jax.Array:
        contract, _ = ROLES[self.role]
        gathered = self.gathered

        def multiply(w, x, bias):
            x, w, bias = promote_dtypes(x, w, bias)
            w = pmm3d_ops.checkpoint_name(w)  # the weight the layer multiplies with
            y = remat.name_collective(comm.psum(matmul(self, x, w), contract))  # Eq. 5.3
            return y if bias is None else y + bias

        def gather(kernel):  # all-gather over z, Eq. 5.1
            return pmm3d_ops.gather(kernel, kernel.ndim - 1)

        bias = param_value(self.bias)
        if gathered:  # deferred: gathered before the layers
            return multiply(self.kernel[...], x, bias)
        if self.weights == "regather":
            # The backward gathers W again from the shard, by construction (the forward keeps
            # the layer's input, not W): AxoNN without cache_weights. Checkpointed, so that
            # what the backward needs of W is W itself (not its named copy).
            multiply = jax.checkpoint(multiply, policy=jax.checkpoint_policies.nothing_saveable)
            return zero_ops.regathered(multiply, gather, [True])(self.kernel[...], x, bias)
        return multiply(gather(self.kernel[...]), x, bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.local_outputs(x)
        return gather_vocab(y, X) if self.vocab_output else y

    def cross_entropy_sum(self, h: jax.Array, targets: jax.Array) -> jax.Array:
        """Summed cross-entropy of the vocabulary-split outputs (negative targets add nothing),
        in chunks of tokens
        (:func:`jphantom.nn.vocab.chunked_sum`; each chunk multiplies as
        :meth:`local_outputs` does, so ``regather`` gathers the weight per chunk)."""
        local = self.kernel.shape[-1] * (1 if self.gathered else lax.axis_size(Z))
        total = vocab.chunked_sum(
            lambda x, t: vocab.cross_entropy_sum(self.local_outputs(x), t, X), h, targets,
            vocab_local=local)
        return total


class Pmm3dEmbed(nnx.Module):
    """The token table [V, h] as a normal layer's weight: vocabulary over (x, z), features over
    y. A lookup gathers the rows over z and all-reduces over x (B S h/G_y); :meth:`attend` and
    :meth:`cross_entropy_sum` are the tied head."""

    def __init__(self, embedding, *, dtype=None):
        self.dtype = dtype
        self.embedding = metadata.param(embedding, ((X, Z), Y))

    @classmethod
    def from_module(cls, embed: nnx.Embed) -> "Pmm3dEmbed":
        return cls(embed.embedding.get_value(), dtype=embed.dtype)

    def dense_equivalent(self) -> nnx.Embed:
        return plain_embed(self.embedding[...], self.dtype)

    def _table(self):
        table = pmm3d_ops.gather(self.embedding[...], 0)  # [V/G_x, h/G_y]
        return table if self.dtype is None else table.astype(self.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return comm.psum(vocab.embed_partial(self._table(), tokens, X), X)  # all-reduce over x

    def local_logits(self, h: jax.Array) -> jax.Array:
        h, table = promote_dtypes(h, self._table())
        return remat.name_collective(comm.psum(h @ table.T, Y))  # [B, S, V/G_x]

    def attend(self, h: jax.Array) -> jax.Array:
        return gather_vocab(self.local_logits(h), X)

    def cross_entropy_sum(self, h: jax.Array, targets: jax.Array) -> jax.Array:
        """The tied head's summed cross-entropy (negative targets add nothing), in chunks of
        tokens (the table gathered once)."""

        def chunk(x, t, table):
            x, table = promote_dtypes(x, table)
            return vocab.cross_entropy_sum(remat.name_collective(comm.psum(x @ table.T, Y)), t, X)

        table = self._table()
        return vocab.chunked_sum(chunk, h, targets, (table,),
                                 vocab_local=table.shape[0])


__all__ = ["Pmm3dLinear", "Pmm3dEmbed"]


class Pmm3dMoE(nnx.Module):
    """A :class:`~jphantom.nn.moe.SwitchMoE` on pmm3d's stream [..., h/G_y] (module
    docstring): ``x [..., h/G_y] -> (y [..., h/G_y], aux)``, the experts an
    :class:`~jphantom.nn.expert_parallel.ExpertParallelMoE` over ``expert_axis`` (E/G experts per rank)
    with their width over ``x`` (TED), on the tokens gathered over ``y``."""

    def __init__(self, moe: ExpertParallelMoE):
        self.moe = moe

    @classmethod
    def from_module(cls, moe: SwitchMoE, *, expert_axis: str | None,
                    batch_axes: tuple[str, ...], tensor: bool) -> "Pmm3dMoE":
        return cls(ExpertParallelMoE.from_module(moe, expert_axis=expert_axis,
                                                 model_axis=X if tensor else None,
                                                 batch_axes=batch_axes))

    def dense_equivalent(self) -> SwitchMoE:
        return self.moe.dense_equivalent()

    def __call__(self, x: jax.Array, fraction: jax.Array | None = None):
        h = x.shape[-1]  # h / G_y
        whole = comm.all_gather(x, Y, axis=x.ndim - 1, tiled=True, to="invarying")
        y, aux = self.moe(whole, fraction)
        if whole.shape[-1] != h:  # this rank's y features (no communication)
            y = jax.lax.dynamic_slice_in_dim(y, comm.axis_index(Y) * h, h, y.ndim - 1)
        return y, aux
