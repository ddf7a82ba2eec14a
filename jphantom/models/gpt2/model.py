"""GPT-2 as a Flax NNX module (Radford et al. 2019, as Hugging Face's ``GPT2LMHeadModel``),
built from plain Flax layers with no collective, with optional mixture-of-experts blocks.

:class:`GPT2`'s module paths (blocks stacked [L, ...] under ``lax.scan``):

    wte [V, h]   wpe [S, h]   ln_f        blocks.block.{ln_1, ln_2}
    blocks.block.attn.qkv [h, 3h]   blocks.block.attn.out [h, h]
    blocks.block.mlp.{up [h, 4h], down [4h, h]}   head [h, V] (only with ``tied_head=False``)

``qkv`` is GPT-2's fused ``c_attn`` with its output features reordered from Hugging Face's
[3, heads, d] to [heads, 3, d], so that any split of them over ranks keeps whole heads
(:class:`GPT2Attention`); the reordering is a permutation, bit for bit both ways
(:func:`from_dense` / :func:`to_dense` convert from and to the dense dictionary that
:func:`load` and :func:`save` read and write).

Mixture of experts (``moe_every=n``; Singh's thesis ch. 7): every n-th block (blocks n-1, 2n-1, ...)
replaces its MLP by a :class:`~jphantom.nn.moe.SwitchMoE`: a router [h, E] and ``experts``
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
(:class:`~jphantom.nn.expert_parallel.ExpertParallelMoE`, :class:`~jphantom.nn.expert_parallel.PhantomMoE`), whose
load-balancing statistics are summed over the batch's ranks: the loss does not depend on the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jphantom.step import remat, token_mean
from jphantom.errors import ConfigError
from jphantom.models.gpt2.config import TransformerConfig
from jphantom.nn import balance
from jphantom.nn.attention import CausalAttention, Positions
from jphantom.nn.attention import packing as packed
from jphantom.nn.attention.packing import Packing
from jphantom.nn.moe import SwitchMoE
from jphantom.nn.loss import cross_entropy_terms
from jphantom.nn.stack import Stacked

AUX = ("load_balance", "z_loss", "dropped")


def _linear(n_in, n_out, dtype, rngs):
    return nnx.Linear(n_in, n_out, param_dtype=dtype, kernel_init=nnx.initializers.normal(0.02),
                      rngs=rngs)


class GPT2Attention(nnx.Module):
    """Causal multi-head attention with GPT-2's fused projection ``qkv`` [h, 3h], its output
    features ordered [heads, 3, d] (head by head, its q, k and v): a contiguous split of the
    outputs over p ranks (Megatron's column layer, phantom's feature split) gives each rank whole
    heads with their q, k and v, and the projection stays one layer (one phantom ghost exchange,
    as Seal et al.'s phantom transformer has). ``FUSED_QKV_LAYOUT`` declares that order to the
    plans (:func:`jphantom.plans.walk.check_fused_qkv`)."""

    FUSED_QKV_LAYOUT = "heads"

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        h, dtype = config.hidden, jnp.dtype(config.dtype)
        self.qkv = _linear(h, 3 * h, dtype, rngs)
        self.out = _linear(h, h, dtype, rngs)
        self.head_dim = config.head_dim
        self.attend = CausalAttention()  # context parallelism: ring or all-gather attention

    def __call__(self, x, packing: Packing | None = None):
        """``packing``: a packed batch's segment ids, the core attending within each document."""
        qkv = self.qkv(x)
        batch, seq = qkv.shape[:2]  # whole sequence, this rank's heads
        qkv = qkv.reshape(batch, seq, -1, 3, self.head_dim)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        out = packed.attend(self.attend, q, k, v, packing).reshape(batch, seq, -1)
        return remat.name_out_proj(self.out(out))


class GPT2MLP(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        h, dtype = config.hidden, jnp.dtype(config.dtype)
        self.up, self.down = _linear(h, 4 * h, dtype, rngs), _linear(4 * h, h, dtype, rngs)

    def __call__(self, x):
        return remat.name_mlp_out(self.down(jax.nn.gelu(self.up(x), approximate=True)))


def _norm(config: TransformerConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(config.hidden, epsilon=config.layer_norm_eps,
                         param_dtype=jnp.dtype(config.dtype), use_fast_variance=False,
                         rngs=rngs)  # HF's centred variance


class GPT2Block(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.ln_1, self.attn = _norm(config, rngs), GPT2Attention(config, rngs=rngs)
        self.ln_2, self.mlp = _norm(config, rngs), GPT2MLP(config, rngs=rngs)

    def __call__(self, carry):
        """``carry``: h, or ``(h, packing)`` of a packed batch, returned alike."""
        h, packing = packed.split(carry)
        h = h + self.attn(self.ln_1(h), packing)
        return packed.join(h + self.mlp(self.ln_2(h)), packing)


class MoEBlock(nnx.Module):
    """A block whose MLP is the mixture of experts: ``h -> (h, aux of the MoE layer)``."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        h, moe = config.hidden, config.moe
        self.ln_1, self.attn = _norm(config, rngs), GPT2Attention(config, rngs=rngs)
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
        self.dense = nnx.List([GPT2Block(config, rngs=rngs) for _ in range(config.moe_every - 1)])
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
            self.blocks = Stacked(lambda r: GPT2Block(config, rngs=r), config.layers, rngs=rngs)
        self.ln_f = nnx.LayerNorm(config.hidden, epsilon=config.layer_norm_eps,
                                  param_dtype=dtype, use_fast_variance=False, rngs=rngs)
        if not config.tied_head:
            self.head = _linear(config.hidden, config.vocab_size, dtype, rngs)

    def check_shards(self, num_shards: int) -> None:
        if self.config.heads % num_shards:
            raise ConfigError(f"heads={self.config.heads} is not divisible by the {num_shards} "
                              "ranks that split them: pick an axis size dividing the heads")

    def trunk(self, tokens: jax.Array, *, statistics: bool = False,
              segment_ids: jax.Array | None = None, positions: jax.Array | None = None):
        """The final-normed stream [B, S, h] and the MoE blocks' aux summed over them (``None``
        without MoE blocks); the whole batch's routing fractions [L_moe, E] a training step gives
        a micro-batch (:func:`jphantom.nn.balance.current`) and ``statistics``:
        :class:`MoEGroup`'s optional entries. ``segment_ids`` and ``positions`` [B, S]: a packed
        batch (:mod:`jphantom.nn.attention.packing`), attention within each document and the
        position table read at each token's position in it."""
        packing = packed.packing_of(segment_ids, positions)
        if packing is not None and self.config.moe_every:
            raise ConfigError("GPT-2's routed MoE blocks with a packed batch: their capacity "
                              "and load-balancing statistics would count pad tokens; use "
                              "--model llama --moe-every 1 (dropless experts) or unpacked "
                              "batches")
        if packing is not None:
            h = self.wte(tokens) + self.wpe(packing.positions)
            return self.ln_f(packed.split(self.blocks((h, packing)))[0]), None
        h = self.wte(tokens) + self.wpe(self.positions(tokens.shape[1]))
        if not self.config.moe_every:
            return self.ln_f(self.blocks(h)), None
        wide = jnp.promote_types(h.dtype, jnp.float32)  # the router's statistics' dtype
        zero = {"load_balance": jnp.zeros((), wide), "z_loss": jnp.zeros((), wide),
                "dropped": jnp.zeros((), wide)}  # floats: a pipeline exchanges the carry
        experts = self.config.moe.experts
        fraction = balance.current(self)  # a step's micro-batch: the whole batch's
        if fraction is not None:
            zero["fraction"] = jnp.asarray(fraction, wide)
        if statistics:
            zero["statistics"] = jnp.zeros((self.config.moe_layers, 2 * experts), wide)
        h, aux = self.blocks((h, zero))
        return self.ln_f(h), aux

    def balance_statistics(self, tokens: jax.Array, targets: jax.Array | None = None,
                           mask: jax.Array | None = None, *packed_batch):
        """[L_moe, 2E] per MoE block: how many of the batch's tokens chose each expert first, and
        the sum of each expert's probability (over the whole batch: the ranks' statistics are
        summed); ``None`` without MoE blocks. A training step that accumulates micro-batches
        runs this on each first and gives :meth:`loss` the whole batch's fractions, so the
        load-balancing loss is the whole batch's, as without accumulation."""
        if not self.config.moe_every:
            return None
        if packed_batch:  # (tokens, targets, segment_ids, positions)
            self.trunk(tokens, segment_ids=mask, positions=packed_batch[0])  # refused by name
        return self.trunk(tokens, statistics=True)[1]["statistics"]

    def hidden_states(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None) -> jax.Array:
        return self.trunk(tokens, segment_ids=segment_ids, positions=positions)[0]

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        h = self.hidden_states(tokens, segment_ids, positions)
        return self.wte.attend(h) if self.config.tied_head else self.head(h)

    def _cross_entropy(self, h, targets, mask=None):
        if self.config.tied_head:
            return cross_entropy_terms(self.wte, h, targets, tied=True, mask=mask)
        return cross_entropy_terms(self.head, h, targets, mask=mask)

    def loss(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None
             ) -> jax.Array:
        """Mean next-token cross-entropy over the counted tokens (``mask`` true, target not
        negative), plus, with MoE blocks, ``balance_weight`` x the load-balancing loss and
        ``z_weight`` x the router z-loss, summed over the MoE blocks (over every token; when
        ``tokens`` is a micro-batch of a step, with the whole batch's routing fractions:
        :mod:`jphantom.nn.balance`, :meth:`balance_statistics`)."""
        return token_mean.value(self.loss_terms(tokens, targets, mask))

    def loss_terms(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                   *, segment_ids: jax.Array | None = None,
                   positions: jax.Array | None = None) -> token_mean.WeightedLoss:
        """``(total, weight, mean)``: the counted tokens' summed cross-entropy, their number and
        the MoE auxiliary losses (a mean already), for a global token mean
        (:mod:`jphantom.step.token_mean`); ``segment_ids`` and ``positions``: a packed batch
        (:meth:`trunk`)."""
        h, aux = self.trunk(tokens, segment_ids=segment_ids, positions=positions)
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
