"""Tensor-parallel (TP) baselines for the dense n x n FFN, with phantom's data layout (features sharded).

Two layouts, both exact re-parallelisations of the same dense model (so they converge like it):

**T1: row-sharded weights** (seed 000 Sec. II-B, Fig. 1a). Rank j holds the output rows
W[j-block, :] [n/p, n]. Forward, per layer: all-gather the n/p-wide activations into [B, n], then one
local GEMM. Backward: the all-gather's conjugate, a reduce-scatter of [B, n] down to [B, n/p]. The
first layer's reduce-scatter would only produce dL/dx, which nobody needs, so XLA removes it:
L all-gathers of B n and L-1 reduce-scatters to B n/p per step. Same sharded I/O as phantom, so the
comparison is exactly "all-gather + reduce-scatter of n/p B versus of k B" (Eq. 9: phantom wins iff
k < n/p).

**tensor: Megatron pairs** (seed 002/003; Shoeybi et al.; "T2" in earlier releases). Layers go in (column-parallel, row-parallel)
pairs. Column-parallel holds W[j-block, :] (output features split), row-parallel W[:, j-block] (input
features split). The conjugate operators f (identity forward / all-reduce backward) before each column
layer and g (all-reduce forward / identity backward) after each row layer are Megatron's
``copy_to_tensor_model_parallel_region`` and ``reduce_from_tensor_model_parallel_region``. To take and
return phantom's feature-sharded activations, the block starts with Megatron's
``gather_from_tensor_model_parallel_region`` (all-gather forward / split backward) and, when the depth
is even, ends with ``scatter_to_tensor_model_parallel_region`` (split forward / all-gather backward); an
odd last layer is a lone column-parallel layer whose output is already feature-sharded. Per step, for
depth L: all-gather B n: 1 forward + (1 if L even) backward; all-reduce B n: floor(L/2) forward (g) +
ceil(L/2) - 1 backward (f; the first f's all-reduce only feeds dL/dx and is removed).

**Against seed 000's Table II.** The paper lists, per TP layer, an all-gather (n/p B) forward, a
reduce-scatter (n/p B) backward, and also a broadcast (n B) forward and an all-reduce (n B) backward,
"because the global layer is required on each rank". Those two extra collectives come from a PyTorch
implementation that keeps the full layer output on every rank (the Colwise/Rowwise concatenation of
Sec. V). T1 is Table II's all-gather/reduce-scatter pair alone, the cheapest TP that keeps the same
feature-sharded layout as phantom; T2 replaces it with Megatron's all-reduce per pair of layers. Neither
needs a broadcast: data arrive already sharded.

Parameters keep the dense model's global shapes (so a checkpoint restores at any degree p); only
their ``PartitionSpec`` says how they are split. T1: ``weight`` [L, n, n] sharded on output rows,
``bias`` [L, n] sharded. Megatron: ``column`` {``weight`` [ceil(L/2), n, n] sharded on output rows,
``bias`` sharded} and ``row`` {``weight`` [floor(L/2), n, n] sharded on input columns, ``bias``
replicated, added after the all-reduce}. Under ``check_vma=True`` Megatron's f is ``lax.pcast(...,
to="varying")`` (its transpose is the all-reduce) and g is ``lax.psum`` (its transpose is free).

The layers run per rank inside the training step's ``shard_map``. Layer 0 (pair 0 for Megatron) is
applied on its own and the rest under ``lax.scan`` (:func:`jphantom.sharding.dense.stack`), so that
XLA still removes the first layer's backward collective, whose only output would be dL/dx.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jphantom import remat
from jphantom.sharding import dense

Params = dict


def param_count(width: int, depth: int, *, include_bias: bool = False) -> int:
    """Same model as dense: L n^2 weights (+ L n biases)."""
    return depth * width * width + (depth * width if include_bias else 0)


# --------------------------------------------------------------------------------------------------
# T1: row-sharded weights, all-gather forward / reduce-scatter backward
# --------------------------------------------------------------------------------------------------


def t1_specs(axis: str = "model") -> dict[str, P]:
    """Dense-shaped [L, n, n] weights sharded on output rows; biases [L, n] sharded."""
    return {"weight": P(None, axis, None), "bias": P(None, axis)}


def t1_per_rank(params: Params, y: jax.Array, *, axis: str) -> jax.Array:
    """T1 FFN on one rank: y [B, n/p] -> [B, n/p]; params weight [L, n/p, n], bias [L, n/p]."""

    def layer(p, y):
        y_full = remat.name_collective(lax.all_gather(y, axis, axis=1, tiled=True))  # [B, n]
        return y_full @ p["weight"].T + p["bias"]  # [B, n/p], own output rows

    return dense.stack(layer, params, y)


# --------------------------------------------------------------------------------------------------
# Megatron column/row pairs with f and g
# --------------------------------------------------------------------------------------------------


def megatron_from_dense(params: Params) -> Params:
    """Dense ``{"weight": [L, n, n], "bias": [L, n]}`` -> ``{"column": ..., "row": ...}`` (even
    layers are column-parallel, odd layers row-parallel)."""
    return {"column": jax.tree.map(lambda a: a[0::2], params),
            "row": jax.tree.map(lambda a: a[1::2], params)}


def megatron_dense_equivalent(params: Params) -> Params:
    """Inverse of :func:`megatron_from_dense`: interleave the column and row layers."""
    column, row = params["column"], params["row"]
    columns, rows = column["weight"].shape[0], row["weight"].shape[0]

    def interleave(c, r):
        pairs = jnp.stack([c[:rows], r], axis=1).reshape(2 * rows, *c.shape[1:])
        return jnp.concatenate([pairs, c[rows:]], axis=0) if columns > rows else pairs

    return jax.tree.map(interleave, column, row)


def megatron_specs(axis: str = "model") -> Params:
    return {"column": {"weight": P(None, axis, None), "bias": P(None, axis)},
            "row": {"weight": P(None, None, axis), "bias": P()}}


def column_parallel(p, y_full, axis):
    """Megatron column-parallel layer: replicated [B, n] in, own output features [B, n/p] out."""
    y_full = lax.pcast(y_full, axis, to="varying")  # f: identity; backward all-reduce of B*n
    return y_full @ p["weight"].T + p["bias"]


def row_parallel(p, y_block, axis):
    """Megatron row-parallel layer: own input features [B, n/p] in, replicated [B, n] out."""
    # g: all-reduce of B*n; backward free
    return remat.name_collective(lax.psum(y_block @ p["weight"].T, axis)) + p["bias"]


def _slice_own(axis, y_full):
    block = y_full.shape[-1] // lax.axis_size(axis)
    return lax.dynamic_slice_in_dim(y_full, lax.axis_index(axis) * block, block, axis=-1)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def scatter_to_model_parallel(axis: str, y_full: jax.Array) -> jax.Array:
    """Megatron's scatter: own slice of replicated [B, n] forward; all-gather of the slices backward."""
    return _slice_own(axis, y_full)


def _scatter_bwd(axis, _, d_block):
    return (lax.all_gather(d_block, axis, axis=1, tiled=True, to="invarying"),)  # all-gather B*n/p


scatter_to_model_parallel.defvjp(lambda axis, y_full: (_slice_own(axis, y_full), None),
                                 _scatter_bwd)


def gather_from_model_parallel(axis: str, y: jax.Array) -> jax.Array:
    """Megatron's gather: feature-sharded [B, n/p] -> replicated [B, n] (all-gather of B*n; its
    transpose keeps the own slice)."""
    return lax.all_gather(y, axis, axis=1, tiled=True, to="invarying")


def megatron_pairs(params: Params, y_full: jax.Array, *, axis: str) -> jax.Array:
    """(column, row) pairs stacked [U, ...] on replicated [B, n]: f, column GEMM, ReLU, row GEMM,
    g; ReLU before each next pair (a pipeline stage's body)."""
    pair = lambda p, h: row_parallel(p["row"], jax.nn.relu(column_parallel(p["column"], h, axis)),
                                     axis)
    return dense.stack(pair, params, y_full)


def megatron_per_rank(params: Params, y: jax.Array, *, axis: str) -> jax.Array:
    """Megatron FFN on one rank: y [B, n/p] -> [B, n/p].

    Entry: Megatron's gather (all-gather forward, own slice backward). Then (column, row) pairs:
    f, column GEMM, ReLU, row GEMM, g; ReLU before each next pair. An odd last layer is a lone
    column-parallel layer (sharded output); an even depth ends with Megatron's scatter.
    """
    y_full = gather_from_model_parallel(axis, y)
    column, row = params["column"], params["row"]
    pairs = row["weight"].shape[0]
    if pairs:
        y_full = megatron_pairs({"column": jax.tree.map(lambda a: a[:pairs], column), "row": row},
                                y_full, axis=axis)
    if column["weight"].shape[0] > pairs:  # odd depth: a last column layer, output already sharded
        last = jax.tree.map(lambda a: a[-1], column)
        return column_parallel(last, jax.nn.relu(y_full) if pairs else y_full, axis)
    return scatter_to_model_parallel(axis, y_full)


def collective_buffers(*, width: int, num_shards: int, depth: int, batch: int,
                       layout: str = "t1") -> dict[str, list[int]]:
    """Per-device result elements of each collective in one training step (module docstring).

    ``layout`` is ``"t1"`` or ``"megatron"``. The backward collective that would only produce dL/dx
    of the input layer is absent (XLA removes it), as are size-1 meshes' no-op collectives.
    """
    n, p, b = width, num_shards, batch
    if layout == "t1":
        return {"all-gather": [b * n] * depth, "reduce-scatter": [b * n // p] * (depth - 1)}
    pairs, odd = divmod(depth, 2)
    column_layers = pairs + odd
    return {
        "all-gather": [b * n] * (1 + (0 if odd else 1)),
        "all-reduce": [b * n] * (pairs + column_layers - 1),
    }


# --------------------------------------------------------------------------------------------------
# Megatron tensor (+ sequence) parallelism for the GPT transformer (seeds 002, 003)
# --------------------------------------------------------------------------------------------------

from jphantom.sharding import vocab  # noqa: E402
from jphantom.sharding.dense import layer_norm  # noqa: E402


def transformer_specs(axis: str | None = "model", *, untied_head: bool = False, config=None,
                      expert_axis: str | None = None) -> dict:
    """PartitionSpecs of the dense GPT-2 layout (:mod:`jphantom.models.transformer`) under Megatron:
    QKV and MLP-up column-parallel (output features, QKV by heads), attention output and MLP-down
    row-parallel (input features), token embedding vocabulary-parallel (rows), the rest replicated.
    With MoE blocks (``config.moe_every``): the router replicated, the experts split over
    ``expert_axis`` and, TED (seed 004 Eq. 7.1), each expert column/row-parallel over ``axis``."""
    column = {"weight": P(None, None, axis), "bias": P(None, axis)}
    row = {"weight": P(None, axis, None), "bias": P()}
    norm = {"scale": P(), "bias": P()}
    attention = {"ln1": norm, "ln2": norm, "attn_out": row,
                 "qkv": {"weight": P(None, None, None, axis), "bias": P(None, None, axis)}}
    specs = {
        "wte": P(axis, None), "wpe": P(),
        "blocks": {**attention, "mlp_up": column, "mlp_down": row},
        "ln_f": {"scale": P(), "bias": P()},
    }
    if config is not None and config.moe_every:
        e = expert_axis
        specs["moe_blocks"] = {**attention, "moe": {
            "router": P(), "w_in": P(None, e, None, axis), "b_in": P(None, e, axis),
            "w_out": P(None, e, axis, None), "b_out": P(None, e, None)}}
        if config.moe_every == 1:
            del specs["blocks"]
    if untied_head:
        specs["head"] = {"weight": P(None, axis), "bias": P(axis)}
    return specs


class TransformerLayers:
    """Megatron layers on one rank (``jphantom.models.transformer.Layers``).

    Without sequence parallelism the residual stream is replicated [B, S, h]; per block:
    forward, g after the attention output and after MLP-down (all-reduce of B S h each); backward,
    f before QKV and before MLP-up (all-reduce of B S h each). With ``sequence_parallel`` the stream
    is sequence-sharded [B, S/p, h] (LayerNorm on S/p tokens) and each all-reduce becomes a
    reduce-scatter to B S h / p plus an all-gather back to B S h, the same network volume
    (seed 003 Sec. 4.2.2); the LayerNorm parameters and the row-parallel biases, which now see only
    S/p tokens, get their gradients all-reduced over the model axis once per step.

    Embedding: vocabulary-parallel lookup, summed by an all-reduce (SP: reduce-scatter) of B S h.
    Head: tied to the token embedding, vocabulary-parallel logits [B, S, V/p] and the
    vocabulary-parallel cross-entropy (:mod:`jphantom.sharding.vocab`); its input goes through f
    (SP: an all-gather of the sequence).
    """

    SP_PARAMS = (("ln1",), ("ln2",), ("attn_out", "bias"), ("mlp_down", "bias"))

    def __init__(self, axis: str, eps: float, sequence_parallel: bool = False, *,
                 expert_axis: str | None = None, batch_axes: tuple[str, ...] = (),
                 dtd: bool = False):
        self.axis, self.eps, self.sequence_parallel = axis, eps, sequence_parallel
        self.expert_axis, self.batch_axes, self.dtd = expert_axis, batch_axes, dtd

    def prepare(self, params):
        if not self.sequence_parallel:
            return params
        # Sequence-parallel parameters see S/p tokens per rank: make them varying over the model
        # axis so that their gradients are all-reduced over it, once per step, after the backward.
        varying = lambda tree: lax.pcast(tree, self.axis, to="varying")
        blocks = dict(params["blocks"])
        for path in self.SP_PARAMS:
            if len(path) == 1:
                blocks[path[0]] = varying(blocks[path[0]])
            else:
                blocks[path[0]] = {**blocks[path[0]], path[1]: varying(blocks[path[0]][path[1]])}
        return {**params, "blocks": blocks, "wpe": varying(params["wpe"]),
                "ln_f": varying(params["ln_f"])}

    def _own_sequence(self, x):
        chunk = x.shape[0] // lax.axis_size(self.axis)
        return lax.dynamic_slice_in_dim(x, lax.axis_index(self.axis) * chunk, chunk, axis=0)

    def embed(self, params, tokens):
        seq = tokens.shape[1]
        partial_sum = vocab.embed_partial(params["wte"], tokens, self.axis)  # [B, S, h]
        if self.sequence_parallel:
            h = lax.psum_scatter(partial_sum, self.axis, scatter_dimension=1, tiled=True)  # RS
            return h + self._own_sequence(params["wpe"][:seq])  # [B, S/p, h]
        return lax.psum(partial_sum, self.axis) + params["wpe"][:seq]  # all-reduce of B*S*h

    def norm(self, p, h):
        return layer_norm(h, p["scale"], p["bias"], self.eps)

    def _to_full(self, x):
        if self.sequence_parallel:  # all-gather of the sequence, B*S*h; backward reduce-scatter
            return remat.name_collective(lax.all_gather(x, self.axis, axis=1, tiled=True))
        return lax.pcast(x, self.axis, to="varying")  # f: identity; backward all-reduce of B*S*h

    def column(self, p, x):
        x = self._to_full(x)
        weight = p["weight"].reshape(p["weight"].shape[0], -1)  # [h, out/p]
        return x @ weight + p["bias"].reshape(-1)

    def row(self, p, x):
        partial_sum = x @ p["weight"]  # [B, S, h] partial over the model axis
        if self.sequence_parallel:  # reduce-scatter to B*S*h/p; backward all-gather
            return remat.name_collective(lax.psum_scatter(
                partial_sum, self.axis, scatter_dimension=1, tiled=True)) + p["bias"]
        return remat.name_collective(lax.psum(partial_sum, self.axis)) + p["bias"]  # g: all-reduce

    def moe(self, p, x, config):
        """TED: experts over ``expert_axis``, each tensor-parallel over the model axis, on the
        replicated stream; DTD as an option (:func:`jphantom.sharding.expert.moe_per_rank`)."""
        from jphantom.sharding import expert

        y, aux = expert.moe_per_rank(p, x.reshape(-1, x.shape[-1]), config,
                                     axis=self.expert_axis, model_axis=self.axis, dtd=self.dtd,
                                     batch_axes=self.batch_axes)
        return y.reshape(x.shape), aux

    def logits(self, params, h):
        """This rank's vocabulary slice of the logits, [B, S, V/p] (full sequence)."""
        return self._to_full(h) @ params["wte"].T

    def loss(self, params, h, targets):
        return vocab.cross_entropy_sum(self.logits(params, h), targets, self.axis)
