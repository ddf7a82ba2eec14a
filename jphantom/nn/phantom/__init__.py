"""Phantom parallelism as Flax NNX layers (Seal et al., Seal et al.).

Every activation is split over the features on ``axis`` (p ranks): rank j holds y^(j) [..., n/p].
A :class:`PhantomLinear` is Seal et al.'s layer, Eq. 11, generalised to rectangular maps
(n_in -> n_out; n_i = n_in / p, n_o = n_out / p):

    g^(j) = C^(j) y^(j)                                   [..., k]   k ghost neurons
    z^(j) = L^(j) y^(j) + sum_{i != j} D^(i,j) g^(i) + b^(j)          [..., n_o]

with one all-gather of k per token forward and, in its ``custom_vjp`` (Eqs. 15-21,
:func:`jphantom.nn.phantom.ops.phantom_layer`), one reduce-scatter of k per token backward.
Parameters (global, the shard dimension p split over ``axis``): ``local`` [p, n_o, n_i],
``compress`` [p, k, n_i], ``decompress`` [p, p, n_o, k] (``[j, i]`` is D^(i,j); own slot zero),
``bias`` [p, n_o]; leading stacked dimensions [L, ...] stay unsplit.

:meth:`PhantomLinear.from_module` makes the phantom layer closest to a dense ``nnx.Linear``: the
diagonal blocks are copied, and each sender's off-diagonal blocks, stacked, get their best rank-k
factorisation (Eckart-Young, by SVD) D C; exact when k >= n_i. :meth:`dense_equivalent` gives back
the dense layer the phantom layer *is* (the single-device oracle).

A phantom model keeps the residual stream feature-split, so the other layers follow: the token and
position embeddings split their features (:class:`FeatureParallelEmbed`, no communication),
LayerNorm and RMSNorm sum their per-token statistics over ``axis`` (two and one all-reduces of
B S scalars), and the LM head is a phantom linear to vocabulary-split logits with the
vocabulary-parallel cross-entropy (never gathering the logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom.runtime import comm
from jphantom.step import fp8 as fp8_ops
from jphantom.errors import ConfigError
from jphantom.nn import metadata
from jphantom.nn import norm as norm_ops
from jphantom.nn.tensor import (gather_vocab, param_value, plain_embed, plain_linear,
                                 promote_dtypes)
from jphantom.nn.phantom import ops as phantom_ops
from jphantom.nn import vocab


def factorise(kernel: jax.Array, bias, num_shards: int, ghost_width: int):
    """The phantom parameters closest to a dense ``kernel`` [n_in, n_out] (``y = x W``): diagonal
    blocks copied, each sender's stacked off-diagonal blocks factorised to rank k by SVD. jax
    operations throughout, so it also runs under ``jax.jit`` (parameters created in their shards)."""
    p, k = num_shards, ghost_width
    wide = jnp.promote_types(kernel.dtype, jnp.float32)
    w = kernel.astype(wide).T  # [n_out, n_in]: block [j, i] acts from sender i to receiver j
    n_out, n_in = w.shape
    n_o, n_i = n_out // p, n_in // p
    blocks = w.reshape(p, n_o, p, n_i).transpose(0, 2, 1, 3)  # [j, i, n_o, n_i]
    local = blocks[jnp.arange(p), jnp.arange(p)]
    compress = jnp.zeros((p, k, n_i), wide)
    decompress = jnp.zeros((p, p, n_o, k), wide)
    for i in range(p if p > 1 else 0):
        others = [j for j in range(p) if j != i]
        stacked = blocks[jnp.asarray(others), i].reshape(len(others) * n_o, n_i)
        u, sigma, vt = jnp.linalg.svd(stacked, full_matrices=False)
        r = min(k, sigma.shape[0])
        compress = compress.at[i, :r].set(vt[:r])
        left = (u[:, :r] * sigma[:r]).reshape(len(others), n_o, r)
        decompress = decompress.at[jnp.asarray(others), i, :, :r].set(left)
    b = jnp.zeros((p, n_o), wide) if bias is None else bias.astype(wide).reshape(p, n_o)
    return local, compress, decompress, b


class PhantomLinear(nnx.Module):
    """Seal et al.'s phantom layer on one rank: y^(j) [..., n_in/p] -> z^(j) [..., n_out/p] (Eq. 11).

    ``vocab_output=True`` makes it an LM head: its outputs are this rank's vocabulary slice;
    ``__call__`` gathers the full logits (all-gather of B S V) and :meth:`cross_entropy_sum` computes
    the loss without gathering them. ``fp8`` (``precision='fp8'``): its GEMMs' operands
    quantised to FP8 (:mod:`jphantom.step.fp8`: E4M3 forward, the output gradient Delta in E5M2), the
    hand-written backward (Eqs. 15-21) unchanged."""

    fp8 = False

    def __init__(self, local, compress, decompress, bias, *, axis: str = "model",
                 fused: bool = True, vocab_output: bool = False, use_bias: bool = True,
                 dtype=None):
        self.axis, self.fused, self.vocab_output, self.dtype = axis, fused, vocab_output, dtype
        self.use_bias = use_bias
        self.num_shards = local.shape[-3]
        self.ghost_width = compress.shape[-2]
        self.local = metadata.param(local, (axis, None, None))
        self.compress = metadata.param(compress, (axis, None, None))
        self.decompress = metadata.param(decompress, (axis, None, None, None))
        self.bias = metadata.param(bias, (axis, None)) if use_bias else None

    @classmethod
    def from_module(cls, linear: nnx.Linear, *, ghost_width: int, num_shards: int,
                    axis: str = "model", fused: bool = True,
                    vocab_output: bool = False) -> "PhantomLinear":
        kernel, bias = linear.kernel.get_value(), param_value(linear.bias)
        n_in, n_out = kernel.shape[-2:]
        for what, n in (("in_features", n_in), ("out_features", n_out)):
            if n % num_shards:
                raise ConfigError(f"{what}={n} is not divisible by the {axis!r} axis "
                                  f"({num_shards} ranks): phantom splits the features evenly")
        lead = kernel.shape[:-2]

        def stacked(kernel, bias):  # every leading (stacked) layer factorised alike
            flat_k = kernel.reshape(-1, n_in, n_out)
            flat_b = None if bias is None else bias.reshape(-1, n_out)
            one = lambda w, b: factorise(w, b, num_shards, ghost_width)
            # one layer after another (lax.map), not vmap: a batched SVD makes jaxlib's CPU
            # LAPACK kernel fan the batch out into the intra-op thread pool it already runs on
            # and wait; with several simulated devices sharing a small pool under jax.jit
            # (step.init's create) every pool thread can end up waiting: a deadlock
            parts = (jax.lax.map(lambda wb: one(*wb), (flat_k, flat_b)) if flat_b is not None
                     else jax.lax.map(lambda w: one(w, None), flat_k))
            return tuple(a.reshape(*lead, *a.shape[1:]).astype(kernel.dtype) for a in parts)

        if isinstance(kernel, jax.ShapeDtypeStruct):  # an abstract model: shapes only
            local, compress, decompress, b = jax.eval_shape(stacked, kernel, bias)
        else:
            local, compress, decompress, b = stacked(kernel, bias)
        return cls(local, compress, decompress, b, axis=axis, fused=fused,
                   vocab_output=vocab_output, use_bias=bias is not None, dtype=linear.dtype)

    def dense_equivalent(self) -> nnx.Linear:
        """The dense ``nnx.Linear`` this phantom layer equals (kernel [..., n_in, n_out])."""
        local = self.local[...]
        bias = (self.bias[...] if self.use_bias
                else jnp.zeros((*local.shape[:-1],), local.dtype))
        arrays = {"local": local, "compress": self.compress[...],
                  "decompress": self.decompress[...], "bias": bias}
        lead = arrays["local"].shape[:-3]
        flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[len(lead):]), arrays)
        weight, bias = jax.vmap(phantom_ops.linear_dense_equivalent)(flat)  # [N, out, in]
        kernel = jnp.swapaxes(weight, -1, -2).reshape(*lead, weight.shape[-1], weight.shape[-2])
        bias = bias.reshape(*lead, -1)
        return plain_linear(kernel, bias if self.use_bias else None, self.dtype)

    def local_outputs(self, x: jax.Array) -> jax.Array:
        """z^(j): this rank's n_out/p output features (Eq. 11; custom backward Eqs. 15-21)."""
        ranks = lax.axis_size(self.axis)
        if ranks != self.num_shards:  # p is part of a phantom model's shapes
            raise ConfigError(f"the phantom layer was built for num_shards={self.num_shards} but "
                              f"mesh axis {self.axis!r} has size {ranks}: build it for this mesh, "
                              f"or run it on a mesh whose {self.axis!r} axis has "
                              f"{self.num_shards} ranks")
        if self.use_bias:
            bias = self.bias[...]
        else:  # no bias: a constant zero (varying, as the custom backward's gradient is)
            bias = jnp.zeros(self.local.shape[:-1], self.local.dtype)
            bias = comm.pcast(bias, tuple(sorted(comm.varying_axes(x) | {self.axis})),
                              to="varying")
        x, local, compress, decompress, bias = promote_dtypes(
            x, self.local[...], self.compress[...], self.decompress[...], bias)
        if self.fp8:  # every GEMM operand of Eqs. 11-21 FP8-representable (jphantom.step.fp8)
            x, local, compress, decompress = (fp8_ops.quantized(a)
                                              for a in (x, local, compress, decompress))
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        z = phantom_ops.phantom_layer(self.axis, self.num_shards, self.fused, rows, local[0],
                                      compress[0], decompress[0], bias[0])  # AG k fwd, RS k bwd
        if self.fp8:  # Delta^(j) in E5M2 for the backward's GEMMs
            z = fp8_ops.quantized_gradient(z)
        return z.reshape(*lead, -1)

    def __call__(self, x: jax.Array) -> jax.Array:
        z = self.local_outputs(x)
        return gather_vocab(z, self.axis) if self.vocab_output else z

    def cross_entropy_sum(self, h: jax.Array, targets: jax.Array) -> jax.Array:
        """Summed cross-entropy of vocabulary-split logits (negative targets add nothing): three
        all-reduces of B S scalars."""
        if not self.vocab_output:
            raise ConfigError("cross_entropy_sum needs the LM head's phantom layer (vocab_output=True)")
        total = vocab.chunked_sum(  # in chunks of tokens, each its own messages
            lambda x, t: vocab.cross_entropy_sum(self.local_outputs(x), t, self.axis), h,
            targets, vocab_local=self.local.shape[-2])
        return total


class FeatureParallelEmbed(nnx.Module):
    """An embedding [V, h] whose features are split over ``axis``: a lookup gives this rank's
    [..., h/p] (no communication). :meth:`attend` (a tied head on feature-split activations)
    all-reduces the full [B, S, V] logits: phantom models use an untied phantom head instead."""

    def __init__(self, embedding, *, axis: str = "model", dtype=None):
        self.axis, self.dtype = axis, dtype
        self.embedding = metadata.param(embedding, (None, axis))

    @classmethod
    def from_module(cls, embed: nnx.Embed, *, axis: str = "model") -> "FeatureParallelEmbed":
        return cls(embed.embedding.get_value(), axis=axis, dtype=embed.dtype)

    def dense_equivalent(self) -> nnx.Embed:
        return plain_embed(self.embedding[...], self.dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table = self.embedding[...]
        return jnp.take(table if self.dtype is None else table.astype(self.dtype), tokens, axis=0)

    def attend(self, h: jax.Array) -> jax.Array:
        h, table = promote_dtypes(h, self.embedding[...])
        return comm.psum(h @ table.T, self.axis)  # all-reduce of B*S*V


class FeatureParallelNorm(nnx.Module):
    """LayerNorm (``kind="layer"``) or RMSNorm (``kind="rms"``) over features split across
    ``axis``: the per-token sums are all-reduced (B S scalars each: two for LayerNorm, one for
    RMSNorm); scale and bias [h] are split like the features."""

    def __init__(self, scale, bias, *, kind: str, epsilon: float, features: int,
                 axis: str = "model", dtype=None):
        self.kind, self.epsilon, self.features, self.axis, self.dtype = (
            kind, epsilon, features, axis, dtype)
        self.scale = None if scale is None else metadata.param(scale, (axis,))
        self.bias = None if bias is None else metadata.param(bias, (axis,))

    @classmethod
    def from_module(cls, norm, *, axis: str = "model") -> "FeatureParallelNorm":
        return cls(param_value(getattr(norm, "scale", None)), param_value(getattr(norm, "bias", None)),
                   kind=norm_ops.kind_of(norm), epsilon=norm.epsilon,
                   features=norm.num_features, axis=axis, dtype=norm.dtype)

    def dense_equivalent(self):
        return norm_ops.plain(self.kind, self.epsilon, self.dtype, param_value(self.scale),
                              param_value(self.bias))

    def __call__(self, x: jax.Array) -> jax.Array:
        # per-token sums all-reduced over the feature axis: B*S scalars each (LayerNorm: two)
        return norm_ops.normalize(x, self.kind, self.epsilon, param_value(self.scale),
                                  param_value(self.bias), axis=self.axis, features=self.features,
                                  dtype=self.dtype)



def check_ghost_width(ghost_width, path: str) -> int:
    if isinstance(ghost_width, bool) or not isinstance(ghost_width, int) or ghost_width < 1:
        raise ConfigError(f"{path}: ghost_width={ghost_width!r} must be an integer >= 1 (k ghost "
                          "neurons per rank, Seal et al.), e.g. 8")
    return ghost_width


__all__ = ["PhantomLinear", "FeatureParallelEmbed", "FeatureParallelNorm", "factorise",
           "check_ghost_width"]
