"""The Llama family as a Flax NNX module (Llama 2/3 shapes; Mixtral with ``experts > 0``).

Architecture (Touvron et al. 2023; Hugging Face's ``LlamaForCausalLM``): token embedding; L
pre-RMSNorm blocks of causal grouped-query attention with rotary position embeddings (RoPE, the
"rotate half" convention) and a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``; a final RMSNorm; an
untied LM head (tied with ``tie_word_embeddings``). No biases. Mixtral (Jiang et al. 2024,
``MixtralForCausalLM``): the MLP of every block is a mixture of ``experts`` SwiGLU experts with a
softmax router whose top-k weights are renormalised (:mod:`jphantom.nn.moe`), no capacity.

The model holds no collective; :func:`jphantom.plans.megatron` / :func:`jphantom.plans.phantom` and
:func:`jphantom.parallelize` make it parallel. :class:`LlamaAttention` reshapes heads with
``-1`` and reads the sequence length from its projections, so it runs unchanged on a rank's heads
(tensor, phantom) and under sequence parallelism. Module paths (blocks stacked [L, ...] under
``lax.scan``):

    embed_tokens [V, h]            layers.block.input_layernorm, post_attention_layernorm [h]
    layers.block.self_attn.{q_proj [h, H d], k_proj, v_proj [h, K d], o_proj [H d, h]}
    layers.block.mlp.{gate_proj, up_proj [h, f], down_proj [f, h]}                    (Llama)
    layers.block.moe.{router [h, E], experts.{w_gate, w_up [E, h, f], w_down [E, f, h]}} (Mixtral)
    norm [h]                       lm_head [h, V] (absent when tied)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jphantom.step import remat, token_mean
from jphantom.errors import ConfigError
from jphantom.models.llama.config import LlamaConfig
from jphantom.nn.attention import CausalAttention, Positions
from jphantom.nn.attention import packing as packed
from jphantom.nn.attention.packing import Packing
from jphantom.nn.moe import Experts, top_k_gates
from jphantom.nn.loss import cross_entropy_terms
from jphantom.nn.norm import OffsetRMSNorm, RMSNorm
from jphantom.nn import vocab
from jphantom.nn.stack import Stacked


def rope(x: jax.Array, theta: float, positions: jax.Array | None = None,
         length: int | None = None) -> jax.Array:
    """Rotary position embedding of x [B, S, heads, d] (HF's rotate-half) at ``positions`` [S]
    or each row's [B, S] (a packed batch's positions within its documents; default 0..S-1) of a
    sequence of ``length`` tokens (default S): the phases are computed in float64 for the whole
    sequence, then this rank's rows are taken (context parallelism holds positions that are not
    0..S-1)."""
    seq, d = x.shape[1], x.shape[-1]
    length = seq if length is None else length
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None]  # [S, d/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [S, d]
    wide = jnp.promote_types(x.dtype, jnp.float32)
    cos, sin = jnp.asarray(np.cos(angles), wide), jnp.asarray(np.sin(angles), wide)
    if positions is not None:
        cos, sin = jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)
    if cos.ndim == 3:  # each row's positions [B, S, d]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    half = d // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(wide) * cos + rotated.astype(wide) * sin).astype(x.dtype)


def _linear(n_in, n_out, config, rngs, bias=False):
    return nnx.Linear(n_in, n_out, use_bias=bias, param_dtype=jnp.dtype(config.dtype),
                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


def _norm_class(config):
    return OffsetRMSNorm if config.norm_offset else RMSNorm


class LlamaAttention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        h, d = config.hidden, config.dim
        self.q_proj = _linear(h, config.heads * d, config, rngs, config.qkv_bias)
        self.k_proj = _linear(h, config.kv_heads * d, config, rngs, config.qkv_bias)
        self.v_proj = _linear(h, config.kv_heads * d, config, rngs, config.qkv_bias)
        self.o_proj = _linear(config.heads * d, h, config, rngs, config.o_bias)
        if config.qk_norm:  # Qwen3: over each head's d features, shared by the heads
            norm = lambda: _norm_class(config)(d, epsilon=config.rms_norm_eps,
                                               param_dtype=jnp.dtype(config.dtype), rngs=rngs)
            self.q_norm, self.k_norm = norm(), norm()
        self.dim, self.theta = d, config.rope_theta
        # Gemma: scores scaled by query_pre_attn_scalar^-1/2 instead of d^-1/2
        self.q_scale = (None if config.query_pre_attn_scalar is None
                        else float(np.sqrt(d / config.query_pre_attn_scalar)))
        self.mixed = config.mixed_layers  # per layer: its window and RoPE base by its index
        if self.mixed:
            self.full = tuple(t == "full_attention" for t in config.layer_types)
            self.window, self.local_theta = config.sliding_window, config.rope_local_theta
        elif config.layer_types is not None and config.layer_types[0] == "sliding_attention":
            self.theta = config.rope_local_theta or config.rope_theta
        self.positions = Positions()  # context parallelism: this rank's global positions
        # context parallelism: ring or all-gather attention
        self.attend = CausalAttention(window=config.window)
        if self.mixed:  # the local layers' core: the same kernel with its window
            self.attend_local = CausalAttention(window=config.sliding_window)

    def __call__(self, x: jax.Array, index=None, packing: Packing | None = None) -> jax.Array:
        """``packing``: a packed batch's segment ids (the core attends within each document)
        and positions (RoPE's phases), [B, S] as the projections' sequence."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        batch, seq = q.shape[:2]  # the projections' sequence (whole under SP)
        q, k, v = (a.reshape(batch, seq, -1, self.dim) for a in (q, k, v))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        positions, length = self.positions(seq), self.positions.length(seq)
        if packing is not None:
            positions = packing.positions
        if not self.mixed:
            q, k = (rope(a, self.theta, positions, length) for a in (q, k))
        else:
            if not (type(self.attend) is CausalAttention  # or generation's cached core
                    or getattr(self.attend, "selects_window", False)):
                raise ConfigError("local and global layers in one stack (Gemma 3) under context "
                                  "parallelism are not implemented: drop the context axis")
            full = jnp.asarray(self.full)[index]
            q, k = (jnp.where(full, rope(a, self.theta, positions, length),
                              rope(a, self.local_theta, positions, length)) for a in (q, k))
        if self.q_scale is not None:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        if self.mixed:  # this layer's core, each with its own window
            out = packed.attend(self.attend, q, k, v, packing, local=self.attend_local, full=full)
        else:
            out = packed.attend(self.attend, q, k, v, packing)
        return remat.name_out_proj(self.o_proj(out.reshape(batch, seq, -1)))


class LlamaMLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        h, f = config.hidden, config.intermediate
        self.gate_proj = _linear(h, f, config, rngs)
        self.up_proj = _linear(h, f, config, rngs)
        self.down_proj = _linear(f, h, config, rngs)

        self.gelu = config.activation == "gelu_tanh"  # Gemma's GeGLU

    def __call__(self, x):
        # under 16-bit compute the backward keeps the gate's and up's outputs and down's input
        # (Megatron's fused SwiGLU); the activation and its derivative are recomputed from the
        # gate's output. In float32 autodiff's own residuals are kept (no narrower to keep).
        gate, up = self.gate_proj(x), self.up_proj(x)
        glu = _geglu if self.gelu else _swiglu
        if jnp.dtype(gate.dtype).itemsize < 4:
            glu = remat.inputs_kept(glu)
        return remat.name_mlp_out(self.down_proj(glu(gate, up)))


def _swiglu(gate, up):
    return jax.nn.silu(gate) * up


def _geglu(gate, up):
    return jax.nn.gelu(gate, approximate=True) * up


class MoE(nnx.Module):
    """Mixtral's sparse MoE block: softmax router, top-k renormalised, SwiGLU experts."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.router = _linear(config.hidden, config.experts, config, rngs)
        self.experts = Experts(config.hidden, config.intermediate, config.experts, rngs=rngs,
                               top_k=config.top_k, param_dtype=jnp.dtype(config.dtype))
        self.top_k, self.renormalise = config.top_k, config.norm_topk_prob

    def __call__(self, x):
        return self.experts(x, top_k_gates(self.router(x), self.top_k,
                                           renormalise=self.renormalise))


class LlamaBlock(nnx.Module):
    """Llama's pre-norm block; with ``post_norms`` (Gemma) the sandwich: ``input_layernorm``
    before attention, ``post_attention_layernorm`` on its output, ``pre_feedforward_layernorm``
    before the MLP, ``post_feedforward_layernorm`` on its output (those two on the residual
    branch's output: the plans keep them replicated, ``residual_norm``)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        norm = lambda: _norm_class(config)(config.hidden, epsilon=config.rms_norm_eps,
                                           param_dtype=dtype, rngs=rngs)
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(config, rngs=rngs)
        self.post_attention_layernorm = norm()
        self.sandwich = config.post_norms
        if config.post_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
            for output_norm in (self.post_attention_layernorm, self.post_feedforward_layernorm):
                output_norm.residual_norm = True
        if config.experts:
            self.moe = MoE(config, rngs=rngs)
        else:
            self.mlp = LlamaMLP(config, rngs=rngs)

    def __call__(self, carry, index=None):
        """``carry``: the stream h, or ``(h, packing)`` of a packed batch
        (:mod:`jphantom.nn.attention.packing`), returned alike."""
        h, packing = packed.split(carry)
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        if self.sandwich:
            h = h + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(h), index, packing))
            h = h + self.post_feedforward_layernorm(ffn(self.pre_feedforward_layernorm(h)))
        else:
            h = h + self.self_attn(self.input_layernorm(h), index, packing)
            h = h + ffn(self.post_attention_layernorm(h))
        return packed.join(h, packing)


class Llama(nnx.Module):
    """``Llama(config, rngs=nnx.Rngs(0))``; ``model(tokens)`` -> logits [B, S, V];
    ``model.loss(tokens, targets)`` -> mean next-token cross-entropy (vocabulary-parallel when the
    head is)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden, param_dtype=dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = Stacked(lambda r: LlamaBlock(config, rngs=r), config.layers, rngs=rngs,
                              with_index=config.mixed_layers)
        self.norm = _norm_class(config)(config.hidden, epsilon=config.rms_norm_eps,
                                        param_dtype=dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden, config.vocab_size, config, rngs)

    def check_shards(self, num_shards: int, *, shared_kv_heads: bool = False) -> None:
        """Heads split over ``num_shards`` ranks must keep whole key/value groups, or, with
        ``shared_kv_heads`` (the plan's key/value projections ``Style("column", kv_heads=K)``),
        the ranks may outnumber the key/value heads by a whole factor, the query heads dividing
        among them."""
        c = self.config
        if not c.kv_heads % num_shards:
            return
        if shared_kv_heads and not num_shards % c.kv_heads and not c.heads % num_shards:
            return
        if shared_kv_heads and not num_shards % c.kv_heads:
            raise ConfigError(f"heads={c.heads} do not divide among the {num_shards} ranks of "
                              "the model axis: each rank computes a whole number of query heads; "
                              f"pick a model axis dividing {c.heads}")
        raise ConfigError(f"kv_heads={c.kv_heads} is not divisible by the {num_shards} ranks "
                          "of the model axis: each rank needs whole key/value heads (and their "
                          f"{c.heads // c.kv_heads} query heads); pick a model axis dividing "
                          f"{c.kv_heads}" + (f", or one that is a multiple of it dividing the "
                                             f"{c.heads} query heads (plans.megatron shares a "
                                             "key/value head among ranks)"
                                             if not shared_kv_heads else ""))

    def hidden_states(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None) -> jax.Array:
        """The final-normed stream [B, S, h]; ``segment_ids`` and ``positions`` [B, S]: a packed
        batch (:mod:`jphantom.nn.attention.packing`), attention stopping at each document's
        boundary and RoPE at each token's position within its document."""
        packing = packed.packing_of(segment_ids, positions)
        h = self.embed_tokens(tokens)
        pad = self.config.pad_token_id
        if pad is not None:  # nn.Embedding's padding_idx: no gradient reaches that row from a
            h = vocab.without_lookup_gradient(self.embed_tokens, tokens, h, pad)  # lookup
        if self.config.embed_scale:  # Gemma: sqrt(hidden) in the table's dtype
            h = h * jnp.asarray(self.config.hidden ** 0.5,
                                self.embed_tokens.embedding.get_value().dtype).astype(h.dtype)
        return self.norm(packed.split(self.layers(packed.join(h, packing)))[0])

    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        h = self.hidden_states(tokens, segment_ids, positions)
        return self.embed_tokens.attend(h) if self.config.tie_word_embeddings else self.lm_head(h)

    def loss(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None
             ) -> jax.Array:
        """Mean next-token cross-entropy over the counted tokens (``mask`` true, target not
        negative)."""
        return token_mean.value(self.loss_terms(tokens, targets, mask))

    def loss_terms(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                   *, segment_ids: jax.Array | None = None,
                   positions: jax.Array | None = None) -> token_mean.WeightedLoss:
        """``(total, weight)``: the summed cross-entropy of the counted tokens and their number
        (:func:`jphantom.nn.cross_entropy_terms`), for a global token mean; ``segment_ids`` and
        ``positions``: a packed batch (:meth:`hidden_states`)."""
        h = self.hidden_states(tokens, segment_ids, positions)
        if self.config.tie_word_embeddings:
            return token_mean.WeightedLoss(
                *cross_entropy_terms(self.embed_tokens, h, targets, tied=True, mask=mask))
        return token_mean.WeightedLoss(*cross_entropy_terms(self.lm_head, h, targets, mask=mask))
