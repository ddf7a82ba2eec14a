"""GPT-2 (Radford et al. 2019, as Hugging Face's ``GPT2LMHeadModel``) in one module: its shape
(:class:`TransformerConfig`), the Flax NNX module built from plain Flax layers with no collective
(:class:`GPT2`: the zoo's GPT-2 on the same path as any user's model, :func:`jphantom.parallelize`
and :func:`jphantom.make_train_step`), and Hugging Face checkpoints read and written without torch
(:func:`load` / :func:`save` as GPT-2's dense parameter dictionary, :func:`load_hf` /
:func:`save_hf` as the module), as :mod:`jphantom.models.llama` holds Llama's.

The shape
---------
Architecture (Radford et al. 2019, as Hugging Face's ``GPT2LMHeadModel``): token and learned
position embeddings; ``layers`` pre-LayerNorm blocks of causal multi-head attention and a GELU-tanh
MLP of width 4h, each with a residual connection; a final LayerNorm; an LM head tied to the token
embedding (``tied_head=False``: an untied ``head``, as the phantom-parallel GPT-2 has). No dropout.

Mixture of experts (``moe_every=n``): every n-th block (blocks n-1, 2n-1, ...) replaces its MLP by
a top-k MoE of ``experts`` GELU FFNs of width 4h (:class:`jphantom.nn.experts.SwitchMoE`). The
loss adds ``balance_weight`` x the load-balancing loss and ``z_weight`` x the router z-loss of
every MoE block (Switch Transformer's 0.01, ST-MoE's 0.001).

The module
----------
:class:`GPT2`'s module paths (blocks stacked [L, ...] under ``lax.scan``):

    wte [V, h]   wpe [S, h]   ln_f        blocks.block.{ln_1, ln_2}
    blocks.block.attn.qkv [h, 3h]   blocks.block.attn.out [h, h]
    blocks.block.mlp.{up [h, 4h], down [4h, h]}   head [h, V] (only with ``tied_head=False``)

``qkv`` is GPT-2's fused ``c_attn`` with its output features reordered from Hugging Face's
[3, heads, d] to [heads, 3, d], so that any split of them over ranks keeps whole heads
(:class:`Attention`); the reordering is a permutation, bit for bit both ways
(:func:`from_dense` / :func:`to_dense` convert from and to the dense dictionary that
:func:`load` and :func:`save` read and write).

Mixture of experts (``moe_every=n``; Singh's thesis ch. 7): every n-th block (blocks n-1, 2n-1, ...)
replaces its MLP by a :class:`~jphantom.nn.experts.SwitchMoE`: a router [h, E] and ``experts``
GELU FFNs of width 4h with biases, top-k routing with a capacity (``capacity_factor``; ``None``:
dropless). The blocks are then stacked as L/n groups, each n-1 plain blocks and one MoE block,
and what flows from group to group is ``(h, aux)``: the MoE blocks add their load-balancing loss,
router z-loss and dropped count to ``aux``. Paths:

    blocks.block.dense.{0..n-2}.{ln_1, attn, ln_2, mlp}     (the group's plain blocks)
    blocks.block.moe_block.{ln_1, attn, ln_2}
    blocks.block.moe_block.moe.{router [h, E], experts.{w_up [E, h, 4h], b_up [E, 4h],
                                                        w_down [E, 4h, h], b_down [E, h]}}

``loss`` = cross-entropy + ``balance_weight`` x load balance + ``z_weight`` x z-loss, each summed
over the MoE blocks (Switch Transformer's 0.01, ST-MoE's 0.001); :meth:`GPT2.metrics` gives the
cross-entropy alone and the dropped assignments. A plan makes the MoE layers parallel
(:class:`~jphantom.nn.expert.ExpertParallelMoE`, :class:`~jphantom.nn.expert.PhantomMoE`), whose
load-balancing statistics are summed over the batch's ranks: the loss does not depend on the mesh.

Hugging Face checkpoints
------------------------
Hugging Face GPT-2 checkpoints: read and write a ``GPT2LMHeadModel`` directory without torch.

A directory as written by ``GPT2LMHeadModel.save_pretrained`` holds ``config.json`` and
``model.safetensors`` (or, for large models, ``model.safetensors.index.json`` with its shards).
:func:`load` turns it into a :class:`TransformerConfig` and GPT-2's
dense parameter layout below (which :func:`from_dense` / ``to_dense``
turn into the NNX module and back); :func:`save` writes the inverse, a directory that
``GPT2LMHeadModel.from_pretrained`` loads. Only ``numpy`` and ``safetensors`` are used.

Tensor names (``P`` is ``transformer.``, the prefix a ``GPT2LMHeadModel`` state dict has; a
``GPT2Model`` and older checkpoints, such as the ``gpt2`` files on the Hub, have none: both load)::

    Hugging Face (x @ W, Conv1D)             jphantom dense layout
    P wte.weight            [V, h]           wte                          [V, h]
    P wpe.weight            [S, h]           wpe                          [S, h]
    P h.{i}.ln_1.weight/bias [h]             blocks.ln1.scale/bias        [L, h]
    P h.{i}.attn.c_attn.weight [h, 3h]       blocks.qkv.weight            [L, h, 3, h]
    P h.{i}.attn.c_attn.bias   [3h]          blocks.qkv.bias              [L, 3, h]
    P h.{i}.attn.c_proj.weight/bias          blocks.attn_out.weight/bias  [L, h, h] / [L, h]
    P h.{i}.ln_2.weight/bias                 blocks.ln2.scale/bias        [L, h]
    P h.{i}.mlp.c_fc.weight/bias             blocks.mlp_up.weight/bias    [L, h, 4h] / [L, 4h]
    P h.{i}.mlp.c_proj.weight/bias           blocks.mlp_down.weight/bias  [L, 4h, h] / [L, h]
    P ln_f.weight/bias                       ln_f.scale/bias              [h]

``c_attn``'s 3h output features are q | k | v, each with the heads contiguous (head j of q is
features j*d .. (j+1)*d), so reshaping [h, 3h] to [h, 3, h] is exactly jphantom's ``qkv`` layout.
``lm_head.weight`` is tied to ``wte`` and is not stored by current transformers; when a file has
it, it must equal ``wte``. The causal-mask buffers ``h.{i}.attn.bias`` / ``h.{i}.attn.masked_bias``
of old checkpoints are ignored.

Every tensor keeps its stored dtype and bits (float32, float16, bfloat16 via ``ml_dtypes``, or
float64): load -> save -> load is bit-exact, and a directory saved by transformers gives back the
same tensor bytes under the same names after load -> save. bfloat16 needs safetensors >= 0.6
(earlier numpy bindings do not know the dtype).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jphantom import token_mean
from jphantom.errors import ConfigError, check_int
from jphantom.nn.attention import CausalAttention, Positions
from jphantom.nn.experts import SwitchMoE
from jphantom.nn.loss import cross_entropy_terms
from jphantom.nn.stack import Stacked
from jphantom.nn.routing import MoEConfig

DTYPES = ("float32", "bfloat16", "float16", "float64")
LAYER_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A GPT-2 shape. ``seq_len`` is the number of positions (``n_positions``). ``ghost_width`` is
    k of every phantom projection (phantom strategies only)."""

    vocab_size: int = 256
    seq_len: int = 128
    hidden: int = 256
    heads: int = 4
    layers: int = 4
    ghost_width: int | None = None
    dtype: str = "float32"
    layer_norm_eps: float = LAYER_NORM_EPS
    tied_head: bool = True
    moe_every: int = 0  # 0: no mixture of experts; n: every n-th block is an MoE block
    experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = 1.25  # None: dropless
    balance_weight: float = 0.01
    z_weight: float = 0.001
    model_name = "transformer"

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "hidden", "heads", "layers"):
            check_int(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}: each "
                              f"head has hidden/heads features; pick heads dividing {self.hidden}")
        k = self.ghost_width
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"ghost_width={k!r} must be an integer >= 1, e.g. 8")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {DTYPES}")
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ConfigError("dtype='float64' needs 64-bit mode: call "
                              "jax.config.update('jax_enable_x64', True) first, or use float32")
        if not (self.layer_norm_eps > 0 and math.isfinite(self.layer_norm_eps)):
            raise ConfigError(f"layer_norm_eps={self.layer_norm_eps} must be a positive number")
        every = self.moe_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"moe_every={every!r} must be an integer >= 0 (0: no MoE blocks; "
                              "n: every n-th block is one)")
        if every:
            if self.layers % every:
                raise ConfigError(f"layers={self.layers} is not divisible by moe_every={every}: "
                                  "every n-th block is an MoE block, so L must be a multiple of n")
            for name in ("balance_weight", "z_weight"):
                value = getattr(self, name)
                if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                    raise ConfigError(f"{name}={value!r} must be a number >= 0")
            self.moe  # validates experts, top_k and capacity_factor

    @property
    def moe(self) -> MoEConfig | None:
        """The MoE layer of the MoE blocks (None without them)."""
        if not self.moe_every:
            return None
        return MoEConfig(self.hidden, self.experts, self.top_k, self.capacity_factor)

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every if self.moe_every else 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def param_count(self, active: bool = False) -> int:
        """Weights and biases of the dense-layout model (tied head counted once); ``active``:
        those one token uses (k of the E experts of an MoE block)."""
        h, v, s, L, Lm = self.hidden, self.vocab_size, self.seq_len, self.layers, self.moe_layers
        attention = 4 * h + (3 * h * h + 3 * h) + (h * h + h)
        mlp = (4 * h * h + 4 * h) + (4 * h * h + h)
        experts = self.top_k if active else self.experts
        blocks = L * attention + (L - Lm) * mlp + Lm * (h * self.experts + experts * mlp)
        return v * h + s * h + blocks + 2 * h + (0 if self.tied_head else h * v + v)

    def flops_per_token(self) -> int:
        """Forward + backward matmul FLOPs per token (6 x weights in matmuls + attention); an MoE
        block counts its router and the k experts a token visits (active parameters)."""
        h, L, s, v, Lm = self.hidden, self.layers, self.seq_len, self.vocab_size, self.moe_layers
        matmul_weights = L * 4 * h * h + (L - Lm) * 8 * h * h + Lm * (
            h * self.experts + self.top_k * 8 * h * h) + v * h
        return 6 * matmul_weights + 6 * L * s * h  # causal attention: QK^T and AV, half the square


def moe_fields(moe_every: int = 0, experts: int = 8, top_k: int = 2,
               capacity_factor: float = 1.25, dropless: bool = False) -> dict:
    """The :class:`TransformerConfig` MoE fields of the CLI's flags (``--dropless``: no capacity)."""
    return {"moe_every": moe_every, "experts": experts, "top_k": top_k,
            "capacity_factor": None if dropless else capacity_factor}

# -------------------------------------------------------------------------------------------------
# The NNX module
# -------------------------------------------------------------------------------------------------

AUX = ("load_balance", "z_loss", "dropped")


def _linear(n_in, n_out, dtype, rngs):
    return nnx.Linear(n_in, n_out, param_dtype=dtype, kernel_init=nnx.initializers.normal(0.02),
                      rngs=rngs)


class Attention(nnx.Module):
    """Causal multi-head attention with GPT-2's fused projection ``qkv`` [h, 3h], its output
    features ordered [heads, 3, d] (head by head, its q, k and v): a contiguous split of the
    outputs over p ranks (Megatron's column layer, phantom's feature split) gives each rank whole
    heads with their q, k and v, and the projection stays one layer (one phantom ghost exchange,
    as Seal et al.'s phantom transformer has)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        h, dtype = config.hidden, jnp.dtype(config.dtype)
        self.qkv = _linear(h, 3 * h, dtype, rngs)
        self.out = _linear(h, h, dtype, rngs)
        self.head_dim = config.head_dim
        self.attend = CausalAttention()  # context parallelism: ring or all-gather attention

    def __call__(self, x):
        qkv = self.qkv(x)
        batch, seq = qkv.shape[:2]  # whole sequence, this rank's heads
        qkv = qkv.reshape(batch, seq, -1, 3, self.head_dim)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        return self.out(self.attend(q, k, v).reshape(batch, seq, -1))


class MLP(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        h, dtype = config.hidden, jnp.dtype(config.dtype)
        self.up, self.down = _linear(h, 4 * h, dtype, rngs), _linear(4 * h, h, dtype, rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x), approximate=True))


def _norm(config: TransformerConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(config.hidden, epsilon=config.layer_norm_eps,
                         param_dtype=jnp.dtype(config.dtype), use_fast_variance=False,
                         rngs=rngs)  # HF's centred variance


class Block(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.ln_1, self.attn = _norm(config, rngs), Attention(config, rngs=rngs)
        self.ln_2, self.mlp = _norm(config, rngs), MLP(config, rngs=rngs)

    def __call__(self, h):
        h = h + self.attn(self.ln_1(h))
        return h + self.mlp(self.ln_2(h))


class MoEBlock(nnx.Module):
    """A block whose MLP is the mixture of experts: ``h -> (h, aux of the MoE layer)``."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        h, moe = config.hidden, config.moe
        self.ln_1, self.attn = _norm(config, rngs), Attention(config, rngs=rngs)
        self.ln_2 = _norm(config, rngs)
        self.moe = SwitchMoE(h, moe.width, moe.experts, top_k=moe.top_k,
                             capacity_factor=moe.capacity_factor,
                             param_dtype=jnp.dtype(config.dtype),
                             kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

    def __call__(self, h, fraction=None):
        h = h + self.attn(self.ln_1(h))
        out, aux = self.moe(self.ln_2(h), fraction)
        return h + out, aux


class MoEGroup(nnx.Module):
    """``moe_every - 1`` plain blocks, then an MoE block: ``(h, aux) -> (h, aux + its aux)``.

    Two optional entries of ``aux`` are per MoE block, [L_moe, ...], the next block's in row 0
    (each group uses or fills row 0 and rolls the rows by one, so after the L_moe groups they are
    in order again): ``fraction`` [L_moe, E], the routing fractions of the whole batch when the
    model runs on a micro-batch of it (:meth:`GPT2.loss`), and ``statistics`` [L_moe, 2E], each
    block's router statistics (:meth:`GPT2.balance_statistics`)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.dense = nnx.List([Block(config, rngs=rngs) for _ in range(config.moe_every - 1)])
        self.moe_block = MoEBlock(config, rngs=rngs)

    def __call__(self, carry):
        h, aux = carry
        for block in self.dense:
            h = block(h)
        fraction = aux.get("fraction")
        h, added = self.moe_block(h, None if fraction is None else fraction[0])
        out = {name: aux[name] + added[name].astype(aux[name].dtype) for name in AUX}
        if fraction is not None:
            out["fraction"] = jnp.roll(fraction, -1, axis=0)
        if "statistics" in aux:
            rows = aux["statistics"].at[0].add(added["statistics"].astype(aux["statistics"].dtype))
            out["statistics"] = jnp.roll(rows, -1, axis=0)
        return h, out


class GPT2(nnx.Module):
    """``GPT2(config, rngs=nnx.Rngs(0))``; ``model(tokens)`` -> logits [B, S, V];
    ``model.loss(tokens, targets)`` -> mean next-token cross-entropy."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        init = nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(config.vocab_size, config.hidden, param_dtype=dtype,
                             embedding_init=init, rngs=rngs)
        self.wpe = nnx.Embed(config.seq_len, config.hidden, param_dtype=dtype,
                             embedding_init=nnx.initializers.normal(0.01), rngs=rngs)
        self.positions = Positions()  # context parallelism: this rank's global positions
        if config.moe_every:  # the first group outside the scan: it gives aux its types
            self.blocks = Stacked(lambda r: MoEGroup(config, rngs=r), config.moe_layers,
                                  rngs=rngs, peel_first=True)
        else:
            self.blocks = Stacked(lambda r: Block(config, rngs=r), config.layers, rngs=rngs)
        self.ln_f = nnx.LayerNorm(config.hidden, epsilon=config.layer_norm_eps,
                                  param_dtype=dtype, use_fast_variance=False, rngs=rngs)
        if not config.tied_head:
            self.head = _linear(config.hidden, config.vocab_size, dtype, rngs)

    def check_shards(self, num_shards: int) -> None:
        if self.config.heads % num_shards:
            raise ConfigError(f"heads={self.config.heads} is not divisible by the {num_shards} "
                              "ranks that split them: pick an axis size dividing the heads")

    def trunk(self, tokens: jax.Array, *, balance_fraction=None, statistics: bool = False):
        """The final-normed stream [B, S, h] and the MoE blocks' aux summed over them (``None``
        without MoE blocks); ``balance_fraction`` [L_moe, E] and ``statistics``: :class:`MoEGroup`'s
        optional entries."""
        h = self.wte(tokens) + self.wpe(self.positions(tokens.shape[1]))
        if not self.config.moe_every:
            return self.ln_f(self.blocks(h)), None
        wide = jnp.promote_types(h.dtype, jnp.float32)  # the router's statistics' dtype
        zero = {"load_balance": jnp.zeros((), wide), "z_loss": jnp.zeros((), wide),
                "dropped": jnp.zeros((), wide)}  # floats: a pipeline exchanges the carry
        experts = self.config.moe.experts
        if balance_fraction is not None:
            zero["fraction"] = jnp.asarray(balance_fraction, wide)
        if statistics:
            zero["statistics"] = jnp.zeros((self.config.moe_layers, 2 * experts), wide)
        h, aux = self.blocks((h, zero))
        return self.ln_f(h), aux

    def balance_statistics(self, tokens: jax.Array, targets: jax.Array | None = None,
                           mask: jax.Array | None = None):
        """[L_moe, 2E] per MoE block: how many of the batch's tokens chose each expert first, and
        the sum of each expert's probability (over the whole batch: the ranks' statistics are
        summed); ``None`` without MoE blocks. A training step that accumulates micro-batches
        runs this on each first and gives :meth:`loss` the whole batch's fractions, so the
        load-balancing loss is the whole batch's, as without accumulation."""
        if not self.config.moe_every:
            return None
        return self.trunk(tokens, statistics=True)[1]["statistics"]

    def hidden_states(self, tokens: jax.Array) -> jax.Array:
        return self.trunk(tokens)[0]

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.hidden_states(tokens)
        return self.wte.attend(h) if self.config.tied_head else self.head(h)

    def _cross_entropy(self, h, targets, mask=None):
        if self.config.tied_head:
            return cross_entropy_terms(self.wte, h, targets, tied=True, mask=mask)
        return cross_entropy_terms(self.head, h, targets, mask=mask)

    def loss(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None, *,
             balance_fraction: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross-entropy over the counted tokens (``mask`` true, target not
        negative), plus, with MoE blocks, ``balance_weight`` x the load-balancing loss and
        ``z_weight`` x the router z-loss, summed over the MoE blocks (over every token).
        ``balance_fraction`` [L_moe, E]: the routing fractions of the whole batch when ``tokens``
        is a micro-batch of it (:meth:`balance_statistics`)."""
        return token_mean.value(self.loss_terms(tokens, targets, mask,
                                                balance_fraction=balance_fraction))

    def loss_terms(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                   *, balance_fraction: jax.Array | None = None) -> token_mean.WeightedLoss:
        """``(total, weight, mean)``: the counted tokens' summed cross-entropy, their number and
        the MoE auxiliary losses (a mean already), for a global token mean
        (:mod:`jphantom.token_mean`)."""
        h, aux = self.trunk(tokens, balance_fraction=balance_fraction)
        total, weight = self._cross_entropy(h, targets, mask)
        if aux is None:
            return token_mean.WeightedLoss(total, weight)
        config = self.config
        extra = config.balance_weight * aux["load_balance"] + config.z_weight * aux["z_loss"]
        return token_mean.WeightedLoss(total, weight, extra.astype(total.dtype))

    def metrics(self, tokens: jax.Array, targets: jax.Array) -> dict:
        """Means over the batch given: ``cross_entropy`` (without the auxiliary losses) and, with
        MoE blocks, ``dropped`` and ``assignments`` per token (k per MoE block; their ratio is the
        fraction of assignments the capacity dropped)."""
        h, aux = self.trunk(tokens)
        out = {"cross_entropy": token_mean.value(self._cross_entropy(h, targets))}
        if aux is not None:
            out["dropped"] = aux["dropped"] / targets.size
            out["assignments"] = jnp.asarray(self.config.top_k * self.config.moe_layers,
                                             jnp.float32)
        return out

    @staticmethod
    def metrics_fn(model: "GPT2", tokens: jax.Array, targets: jax.Array) -> dict:
        """``metrics_fn(model, tokens, targets)`` of :meth:`jphantom.TrainStep.metrics`."""
        return model.metrics(tokens, targets)


# (our path, dense path): every tensor but the fused QKV, which from_dense / to_dense reorder
_BLOCK = [(("ln_1", "scale"), ("ln1", "scale")), (("ln_1", "bias"), ("ln1", "bias")),
          (("ln_2", "scale"), ("ln2", "scale")), (("ln_2", "bias"), ("ln2", "bias")),
          (("attn", "out", "kernel"), ("attn_out", "weight")),
          (("attn", "out", "bias"), ("attn_out", "bias")),
          (("mlp", "up", "kernel"), ("mlp_up", "weight")), (("mlp", "up", "bias"), ("mlp_up", "bias")),
          (("mlp", "down", "kernel"), ("mlp_down", "weight")),
          (("mlp", "down", "bias"), ("mlp_down", "bias"))]
_TOP = [(("wte", "embedding"), ("wte",)), (("wpe", "embedding"), ("wpe",)),
        (("ln_f", "scale"), ("ln_f", "scale")), (("ln_f", "bias"), ("ln_f", "bias"))]


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _put(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _no_moe(config: TransformerConfig) -> None:
    if config.moe_every:
        raise ConfigError("the dense dictionary (and Hugging Face's GPT-2) has no MoE blocks: "
                          "save an MoE GPT-2 with the checkpoint module (Orbax), not as GPT-2 "
                          "tensors")


def from_dense(config: TransformerConfig, params: dict) -> GPT2:
    """The :class:`GPT2` holding the dense dictionary ``params`` (:func:`load`'s layout), by
    slicing only: built abstract, then filled."""
    _no_moe(config)
    abstract = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    pure = nnx.to_pure_dict(state)
    for ours, theirs in _TOP:
        _put(pure, ours, jnp.asarray(_get(params, theirs)))
    blocks = params["blocks"]
    for ours, theirs in _BLOCK:
        _put(pure, ("blocks", "block", *ours), jnp.asarray(_get(blocks, theirs)))
    heads, d = config.heads, config.head_dim
    weight = jnp.asarray(blocks["qkv"]["weight"])  # [L, h, 3, heads * d]
    layers = weight.shape[0]
    _put(pure, ("blocks", "block", "attn", "qkv", "kernel"),
         weight.reshape(layers, -1, 3, heads, d).transpose(0, 1, 3, 2, 4).reshape(layers, -1,
                                                                                 3 * heads * d))
    bias = jnp.asarray(blocks["qkv"]["bias"])  # [L, 3, heads * d]
    _put(pure, ("blocks", "block", "attn", "qkv", "bias"),
         bias.reshape(layers, 3, heads, d).transpose(0, 2, 1, 3).reshape(layers, 3 * heads * d))
    if not config.tied_head:
        _put(pure, ("head", "kernel"), jnp.asarray(params["head"]["weight"]))
        _put(pure, ("head", "bias"), jnp.asarray(params["head"]["bias"]))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state, rest)


def to_dense(model: GPT2) -> dict:
    """The dense dictionary of ``model``'s parameters (numpy), ``qkv`` back in the [3, heads, d]
    order of the fused QKV."""
    _no_moe(model.config)
    _, state, _ = nnx.split(model, nnx.Param, ...)
    pure = jax.device_get(nnx.to_pure_dict(state))
    out: dict = {}
    for ours, theirs in _TOP:
        _put(out, theirs, np.asarray(_get(pure, ours)))
    for ours, theirs in _BLOCK:
        _put(out, ("blocks", *theirs), np.asarray(_get(pure, ("blocks", "block", *ours))))
    qkv = pure["blocks"]["block"]["attn"]["qkv"]
    heads, d = model.config.heads, model.config.head_dim
    kernel, bias = np.asarray(qkv["kernel"]), np.asarray(qkv["bias"])  # [heads, 3, d] order
    layers = kernel.shape[0]
    out["blocks"]["qkv"] = {
        "weight": kernel.reshape(layers, -1, heads, 3, d).transpose(0, 1, 3, 2, 4).reshape(
            layers, -1, 3, heads * d),
        "bias": bias.reshape(layers, heads, 3, d).transpose(0, 2, 1, 3).reshape(layers, 3,
                                                                             heads * d)}
    if not model.config.tied_head:
        out["head"] = {"weight": np.asarray(pure["head"]["kernel"]),
                       "bias": np.asarray(pure["head"]["bias"])}
    return out


def load_hf(path) -> GPT2:
    """A Hugging Face GPT-2 directory (:func:`load`) as a :class:`GPT2`."""
    config, params = load(path)
    return from_dense(config, params)


def save_hf(path, model: GPT2) -> None:
    """``model`` as a Hugging Face GPT-2 directory (:func:`save`)."""
    save(path, model.config, to_dense(model))

# -------------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# -------------------------------------------------------------------------------------------------

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PREFIX = "transformer."  # what GPT2LMHeadModel.save_pretrained writes (transformers 4.x and 5.x)

# Activations that Hugging Face computes as the tanh approximation of GELU (the only one jphantom's
# block has): NewGELUActivation, PytorchGELUTanh and FastGELUActivation are the same function.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")

# GPT2Config's defaults, used for fields a config.json leaves out (as transformers does).
HF_DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
               "n_head": 12, "layer_norm_epsilon": 1e-5}

# Stored dtype <-> TransformerConfig.dtype.
_DTYPE_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "float64": "float64"}

# (Hugging Face name inside block i, jphantom group, jphantom leaf); shapes come from _block_shapes.
_BLOCK_TENSORS = (
    ("ln_1.weight", "ln1", "scale"), ("ln_1.bias", "ln1", "bias"),
    ("attn.c_attn.weight", "qkv", "weight"), ("attn.c_attn.bias", "qkv", "bias"),
    ("attn.c_proj.weight", "attn_out", "weight"), ("attn.c_proj.bias", "attn_out", "bias"),
    ("ln_2.weight", "ln2", "scale"), ("ln_2.bias", "ln2", "bias"),
    ("mlp.c_fc.weight", "mlp_up", "weight"), ("mlp.c_fc.bias", "mlp_up", "bias"),
    ("mlp.c_proj.weight", "mlp_down", "weight"), ("mlp.c_proj.bias", "mlp_down", "bias"),
)
_IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$|^lm_head\.weight$")


def _block_shapes(h: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """HF name -> (HF shape, jphantom per-layer shape)."""
    return {
        "ln_1.weight": ((h,), (h,)), "ln_1.bias": ((h,), (h,)),
        "attn.c_attn.weight": ((h, 3 * h), (h, 3, h)), "attn.c_attn.bias": ((3 * h,), (3, h)),
        "attn.c_proj.weight": ((h, h), (h, h)), "attn.c_proj.bias": ((h,), (h,)),
        "ln_2.weight": ((h,), (h,)), "ln_2.bias": ((h,), (h,)),
        "mlp.c_fc.weight": ((h, 4 * h), (h, 4 * h)), "mlp.c_fc.bias": ((4 * h,), (4 * h,)),
        "mlp.c_proj.weight": ((4 * h, h), (4 * h, h)), "mlp.c_proj.bias": ((h,), (h,)),
    }


# --------------------------------------------------------------------------- config.json


def config_from_hf(hf: dict) -> TransformerConfig:
    """A :class:`TransformerConfig` from a GPT-2 ``config.json`` dict.

    Reads ``vocab_size``, ``n_positions``, ``n_embd``, ``n_head``, ``n_layer`` and
    ``layer_norm_epsilon`` (GPT2Config's defaults where absent). Raises :class:`ConfigError`, naming
    the field and the fix, for anything jphantom's GPT-2 block does not compute: an activation other
    than tanh-GELU, an untied LM head, ``n_inner`` other than 4 * n_embd, unscaled or layer-scaled
    attention, cross-attention. Dropout fields are ignored (jphantom has no dropout). The dtype is
    that of the tensors, set by :func:`load`; this returns float32.
    """
    if not isinstance(hf, dict):
        raise ConfigError(f"{CONFIG_FILE} holds {type(hf).__name__}, expected a JSON object")
    model_type = hf.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise ConfigError(f"{CONFIG_FILE}: model_type={model_type!r}; only 'gpt2' checkpoints "
                          "(GPT2LMHeadModel / GPT2Model) can be loaded")
    act = hf.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        raise ConfigError(f"{CONFIG_FILE}: activation_function={act!r}; jphantom's GPT-2 MLP uses "
                          f"the tanh approximation of GELU: use one of {TANH_GELUS} (GPT-2's is "
                          "'gelu_new')")
    tie = hf.get("tie_word_embeddings", True)
    if tie is not True:
        raise ConfigError(f"{CONFIG_FILE}: tie_word_embeddings={tie!r}; only a head tied to wte is "
                          "supported: set it to true (and drop lm_head.weight) or use a tied model")
    for field, want, fix in (
            ("scale_attn_weights", True, "true (scores divided by sqrt(head_dim))"),
            ("scale_attn_by_inverse_layer_idx", False, "false"),
            ("add_cross_attention", False, "false (a decoder-only GPT-2)")):
        value = hf.get(field, want)
        if value is not want:
            raise ConfigError(f"{CONFIG_FILE}: {field}={value!r} is not supported; set it to {fix}")
    values = {}
    for field in ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer"):
        value = hf.get(field, HF_DEFAULTS[field])
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{CONFIG_FILE}: {field}={value!r} must be an integer >= 1")
        values[field] = value
    if values["n_embd"] % values["n_head"]:
        raise ConfigError(f"{CONFIG_FILE}: n_embd={values['n_embd']} is not divisible by "
                          f"n_head={values['n_head']}; fix one of them")
    inner = hf.get("n_inner")
    if inner is not None and inner != 4 * values["n_embd"]:
        raise ConfigError(f"{CONFIG_FILE}: n_inner={inner!r}; jphantom's MLP is 4 * n_embd = "
                          f"{4 * values['n_embd']} wide: set n_inner to null")
    eps = hf.get("layer_norm_epsilon", HF_DEFAULTS["layer_norm_epsilon"])
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and
                                                                          math.isfinite(eps)):
        raise ConfigError(f"{CONFIG_FILE}: layer_norm_epsilon={eps!r} must be a positive number")
    return TransformerConfig(vocab_size=values["vocab_size"], seq_len=values["n_positions"],
                             hidden=values["n_embd"], heads=values["n_head"],
                             layers=values["n_layer"], layer_norm_eps=float(eps))


def config_to_hf(config: TransformerConfig) -> dict:
    """A complete GPT-2 ``config.json`` dict (as transformers 5 writes it) for ``config``.

    Dropout probabilities are 0.0, which is what jphantom trains with; ``bos_token_id`` and
    ``eos_token_id`` are the last token (GPT-2's 50256 for its 50257-token vocabulary)."""
    _check_savable(config)
    last = config.vocab_size - 1
    return {
        "activation_function": "gelu_new",
        "add_cross_attention": False,
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "bos_token_id": last,
        "dtype": config.dtype,
        "embd_pdrop": 0.0,
        "eos_token_id": last,
        "initializer_range": 0.02,
        "layer_norm_epsilon": config.layer_norm_eps,
        "model_type": "gpt2",
        "n_embd": config.hidden,
        "n_head": config.heads,
        "n_inner": None,
        "n_layer": config.layers,
        "n_positions": config.seq_len,
        "pad_token_id": None,
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.0,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "summary_activation": None,
        "summary_first_dropout": 0.0,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": config.vocab_size,
    }


def _check_savable(config: TransformerConfig) -> None:
    if not isinstance(config, TransformerConfig):
        raise ConfigError(f"config is a {type(config).__name__}; save() takes a TransformerConfig")
    if not config.tied_head:
        raise ConfigError("config.tied_head=False: a GPT2LMHeadModel's head is tied to wte (and "
                          "has no bias); only tied-head models can be saved")


# --------------------------------------------------------------------------- tensors


def _safetensors():
    """The safetensors package (imported on use, so that jphantom imports without it)."""
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ImportError("jphantom.models.gpt2 needs the safetensors package (>= 0.6 for "
                          "bfloat16): pip install 'safetensors>=0.6'") from None
    return safetensors


def _read_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (one file, or the shards an index names), copied into
    memory so that no array maps a file that a later :func:`save` may replace."""
    safe_open = _safetensors().safe_open
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = [directory / name for name in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"{index}: not a readable safetensors index ({err})") from None
    else:
        other = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.h5")]
        hint = (f" (it has {', '.join(sorted(other))}: re-save it with transformers' "
                "save_pretrained(..., safe_serialization=True) to get model.safetensors)"
                if other else "")
        raise ConfigError(f"{directory} has no {WEIGHTS_FILE} (nor {INDEX_FILE}){hint}")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="np") as f:
                for name in f.keys():
                    if name in tensors:
                        raise ConfigError(f"tensor {name!r} is stored twice (again in {path})")
                    tensors[name] = np.array(f.get_tensor(name), copy=True)
        except ConfigError:
            raise
        except Exception as err:  # safetensors raises its own error types; OSError if missing
            raise ConfigError(f"cannot read {path} as safetensors: {err}") from None
    return tensors


def load(directory) -> tuple[TransformerConfig, dict]:
    """Load a Hugging Face GPT-2 directory (``config.json`` + ``model.safetensors``).

    Returns ``(config, params)``: ``config`` a :class:`TransformerConfig` whose ``dtype`` is the
    stored one, ``params`` GPT-2's dense layout (module docstring above for the name map) as numpy
    arrays of the stored dtype, bit for bit: pass them to :func:`from_dense` (the NNX GPT-2) or ``jax.device_put`` them. Names with or without the
    ``transformer.`` prefix are accepted. Raises :class:`ConfigError` for a missing or unreadable
    file, an unsupported config field, a missing, unexpected or mis-shaped tensor, or tensors of
    different dtypes.
    """
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory} is not a directory; pass the folder that save_pretrained "
                          f"wrote (with {CONFIG_FILE} and {WEIGHTS_FILE})")
    config_path = directory / CONFIG_FILE
    try:
        hf = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{directory} has no {CONFIG_FILE}; a Hugging Face GPT-2 directory "
                          "holds config.json and model.safetensors") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read {config_path} as JSON: {err}") from None
    config = config_from_hf(hf)
    tensors = _read_tensors(directory)

    prefix = PREFIX if PREFIX + "wte.weight" in tensors else ""
    h, L, V, S = config.hidden, config.layers, config.vocab_size, config.seq_len
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        full = prefix + name
        if full not in tensors:
            other = f" (nor {PREFIX + name})" if not prefix else ""
            raise ConfigError(f"tensor {full!r}{other} is missing from {directory}; the checkpoint "
                              f"does not match {CONFIG_FILE} (n_layer={L}) or is not a GPT-2")
        value = tensors[full]
        if tuple(value.shape) != shape:
            raise ConfigError(f"tensor {full!r} has shape {list(value.shape)}; {CONFIG_FILE} "
                              f"(n_embd={h}, vocab_size={V}, n_positions={S}) needs {list(shape)}")
        used.add(full)
        return value

    wte = take("wte.weight", (V, h))
    dtype_name = _DTYPE_NAMES.get(wte.dtype.name)
    if dtype_name is None:
        raise ConfigError(f"tensor {prefix}wte.weight is {wte.dtype.name}; supported dtypes are "
                          f"{sorted(_DTYPE_NAMES)}")
    params = {"wte": wte, "wpe": take("wpe.weight", (S, h)),
              "ln_f": {"scale": take("ln_f.weight", (h,)), "bias": take("ln_f.bias", (h,))}}
    shapes = _block_shapes(h)
    blocks: dict[str, dict[str, np.ndarray]] = {}
    for hf_name, group, leaf in _BLOCK_TENSORS:
        hf_shape, ours = shapes[hf_name]
        layers = [take(f"h.{i}.{hf_name}", hf_shape).reshape(ours) for i in range(L)]
        blocks.setdefault(group, {})[leaf] = np.stack(layers)
    params["blocks"] = blocks

    for name, value in tensors.items():
        if name in used:
            if value.dtype != wte.dtype:
                raise ConfigError(f"tensor {name!r} is {value.dtype.name} but {prefix}wte.weight "
                                  f"is {wte.dtype.name}; jphantom keeps one dtype per model: "
                                  "convert the checkpoint to one dtype first")
        elif name == "lm_head.weight":
            if value.shape != wte.shape or value.tobytes() != wte.tobytes():
                raise ConfigError("tensor 'lm_head.weight' differs from wte.weight: the head is "
                                  "not tied, and jphantom's GPT-2 needs a tied head")
        elif not _IGNORED.match(name):
            raise ConfigError(f"unexpected tensor {name!r} in {directory}: not part of a "
                              f"GPT2LMHeadModel with n_layer={L} (a different architecture, or "
                              f"{CONFIG_FILE} has the wrong n_layer)")
    return dataclasses.replace(config, dtype=dtype_name), params


def to_hf_tensors(config: TransformerConfig, params: dict) -> dict[str, np.ndarray]:
    """The Hugging Face state dict (``transformer.``-prefixed names, no ``lm_head.weight``: what
    transformers 5 writes for a tied ``GPT2LMHeadModel``) of dense ``params``, as contiguous numpy
    arrays of the parameters' own dtype (jax arrays are fetched to the host)."""
    _check_savable(config)
    h, L, V, S = config.hidden, config.layers, config.vocab_size, config.seq_len
    if "head" in params:
        raise ConfigError("params have an untied 'head'; a GPT2LMHeadModel's head is wte itself")

    def get(path: str, shape: tuple[int, ...]) -> np.ndarray:
        node = params
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                raise ConfigError(f"params have no {path!r}; expected GPT-2's dense layout "
                                  "(load, to_dense)")
            node = node[key]
        value = np.asarray(node)
        if tuple(value.shape) != shape:
            raise ConfigError(f"params {path!r} have shape {list(value.shape)}; the config needs "
                              f"{list(shape)}")
        return value

    out = {PREFIX + "wte.weight": get("wte", (V, h)), PREFIX + "wpe.weight": get("wpe", (S, h)),
           PREFIX + "ln_f.weight": get("ln_f.scale", (h,)),
           PREFIX + "ln_f.bias": get("ln_f.bias", (h,))}
    for hf_name, group, leaf in _BLOCK_TENSORS:
        hf_shape, ours = _block_shapes(h)[hf_name]
        stacked = get(f"blocks.{group}.{leaf}", (L, *ours))
        for i in range(L):
            out[f"{PREFIX}h.{i}.{hf_name}"] = stacked[i].reshape(hf_shape)
    dtype = out[PREFIX + "wte.weight"].dtype
    for name, value in out.items():
        if value.dtype != dtype:
            raise ConfigError(f"{name} is {value.dtype.name} but wte is {dtype.name}: a GPT-2 "
                              "checkpoint has one dtype; cast the params first")
    if _DTYPE_NAMES.get(dtype.name) is None:
        raise ConfigError(f"params are {dtype.name}; supported dtypes are {sorted(_DTYPE_NAMES)}")
    return {name: np.ascontiguousarray(value) for name, value in out.items()}


def save(directory, config: TransformerConfig, params: dict) -> None:
    """Write ``params`` (the dense layout, numpy or jax arrays) as a Hugging Face GPT-2 directory.

    Creates ``directory`` if needed and writes ``config.json`` (:func:`config_to_hf`; its ``dtype``
    is the parameters') and ``model.safetensors`` with the names and ``{"format": "pt"}`` metadata
    that ``GPT2LMHeadModel.save_pretrained`` (transformers 5) writes, so ``from_pretrained`` loads
    it. Tensors keep their dtype and bits. Files are written to a temporary name and then renamed,
    so a directory being read is never left half-written. Raises :class:`ConfigError` for an untied
    head, params that do not match ``config``, mixed dtypes, or a directory that holds a sharded
    checkpoint (``model.safetensors.index.json``, which transformers would load instead).
    """
    save_file = _safetensors().numpy.save_file
    tensors = to_hf_tensors(config, params)
    dtype_name = _DTYPE_NAMES[tensors[PREFIX + "wte.weight"].dtype.name]
    hf_config = config_to_hf(dataclasses.replace(config, dtype=dtype_name)
                             if dtype_name != config.dtype else config)
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / INDEX_FILE).exists():
        raise ConfigError(f"{directory} holds a sharded checkpoint ({INDEX_FILE}); save into an "
                          "empty directory, or remove the index and its shards first")

    def write(name: str, writer) -> None:
        tmp = directory / f".{name}.{os.getpid()}.tmp"
        try:
            writer(str(tmp))
            os.replace(tmp, directory / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    write(WEIGHTS_FILE, lambda path: save_file(tensors, path, metadata={"format": "pt"}))
    write(CONFIG_FILE, lambda path: pathlib.Path(path).write_text(
        json.dumps(hf_config, indent=2, sort_keys=True) + "\n"))


# -------------------------------------------------------------------------------------------------
# The family: what the CLI, the planner and the metrics read (jphantom.families)
# -------------------------------------------------------------------------------------------------


def family_config(section, phantom: bool) -> TransformerConfig:
    """The :class:`TransformerConfig` of the run's model section
    (:class:`jphantom.config.ModelConfig`): its checkpoint's (``from_hf``) or the section's shape.
    A phantom GPT-2 has an untied head (its feature-split activations would all-reduce a tied
    head's logits)."""
    from jphantom import families

    ghost = section.ghost_width if phantom else None
    if section.from_hf:
        config = config_from_hf(families.read_hf_config(section.from_hf, families.get("gpt2")))
        families.check_checkpoint_shape(section, config, {
            "layers": "layers", "hidden": "hidden", "heads": "heads", "vocab": "vocab_size"})
        if section.seq_len > config.seq_len:
            raise ConfigError(f"seq_len={section.seq_len} exceeds the checkpoint's "
                              f"{config.seq_len} positions: pass --seq-len {config.seq_len} or "
                              "less")
        return dataclasses.replace(config, dtype=section.dtype, tied_head=not phantom,
                                   ghost_width=ghost)
    return TransformerConfig(vocab_size=section.vocab, seq_len=section.seq_len,
                             hidden=section.hidden, heads=section.heads, layers=section.layers,
                             ghost_width=ghost, dtype=section.dtype, tied_head=not phantom,
                             **moe_fields(section.moe_every, section.experts, section.top_k,
                                          section.capacity_factor, section.dropless))


def plan_shape(config: TransformerConfig):
    """The dense-block shape :mod:`jphantom.plan` prices (GPT-2's block, tied head)."""
    from jphantom.perf.axonn_model import GPTShape

    if config.moe_every:
        raise ConfigError("the planner prices dense blocks; MoE blocks are not modelled: use a "
                          "dense model")
    return GPTShape(config.layers, config.hidden, config.heads, config.seq_len,
                    config.vocab_size)


def _register():
    from jphantom import families

    return families.register(families.Family(
        name="gpt2", description="GPT-2 (LayerNorm, GELU MLP, learned positions, tied head); "
        "GShard-style routed MoE blocks with --moe-every", config_type=TransformerConfig,
        module=GPT2, from_flags=family_config,
        flags=("ghost_width", "moe_every", "experts", "top_k", "capacity_factor", "dropless"),
        hf_types=("gpt2",), config_from_hf=config_from_hf, load_hf=load_hf, save_hf=save_hf,
        flops_per_token=lambda config, seq_len: dataclasses.replace(
            config, seq_len=seq_len).flops_per_token(),
        plan_shape=plan_shape, aliases=("transformer",)))


FAMILY = _register()
