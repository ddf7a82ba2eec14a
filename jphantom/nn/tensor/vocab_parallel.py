"""The vocabulary split over the mesh axis (Megatron, Shoeybi et al.): the token embedding whose
lookup sums the ranks' shares (g), the LM head as a column layer over the vocabulary, and their
cross-entropy computed without gathering the logits (:mod:`jphantom.nn.vocab`)."""

from __future__ import annotations

import jax
from flax import nnx

from jphantom.runtime import comm
from jphantom.nn import metadata
from jphantom.nn import vocab
from jphantom.nn.tensor.dense import param_value, plain_embed, plain_linear, promote_dtypes
from jphantom.nn.tensor.linear import ColumnParallelLinear
from jphantom.nn.tensor.regions import reduce_from_model, to_full_sequence


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


def gather_vocab(local_logits: jax.Array, axis: str) -> jax.Array:
    """[..., V/p] -> [..., V] on every rank; the backward keeps the own slice (no communication)."""
    return comm.all_gather(local_logits, axis, axis=local_logits.ndim - 1, tiled=True,
                          to="invarying")
