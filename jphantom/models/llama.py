"""The Llama family as a Flax NNX module (Llama 2/3 shapes; Mixtral with ``experts > 0``), and
Hugging Face checkpoints in and out.

Architecture (Touvron et al. 2023; Hugging Face's ``LlamaForCausalLM``): token embedding; L
pre-RMSNorm blocks of causal grouped-query attention with rotary position embeddings (RoPE, the
"rotate half" convention) and a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``; a final RMSNorm; an
untied LM head (tied with ``tie_word_embeddings``). No biases. Mixtral (Jiang et al. 2024,
``MixtralForCausalLM``): the MLP of every block is a mixture of ``experts`` SwiGLU experts with a
softmax router whose top-k weights are renormalised (:mod:`jphantom.nn.experts`), no capacity.

The model holds no collective; :func:`jphantom.plans.megatron` / :func:`jphantom.plans.phantom` and
:func:`jphantom.parallelize` make it parallel. Attention reshapes heads with ``-1`` and reads the
sequence length from its projections, so it runs unchanged on a rank's heads (tensor, phantom) and
under sequence parallelism. Module paths (blocks stacked [L, ...] under ``lax.scan``):

    embed_tokens [V, h]            layers.block.input_layernorm, post_attention_layernorm [h]
    layers.block.self_attn.{q_proj [h, H d], k_proj, v_proj [h, K d], o_proj [H d, h]}
    layers.block.mlp.{gate_proj, up_proj [h, f], down_proj [f, h]}                    (Llama)
    layers.block.moe.{router [h, E], experts.{w_gate, w_up [E, h, f], w_down [E, f, h]}} (Mixtral)
    norm [h]                       lm_head [h, V] (absent when tied)

Hugging Face checkpoints: :func:`load_hf` reads ``config.json`` and ``model.safetensors`` (one file)
into the module, :func:`save_hf` writes them back in the same layout, tensor for tensor
(``[out, in]`` weights transposed to Flax's ``[in, out]`` kernels and back: bit-exact).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jphantom import token_mean
from jphantom.errors import ConfigError, check_int
from jphantom.nn.attention import CausalAttention, Positions, causal_attention
from jphantom.nn.experts import Experts, top_k_gates
from jphantom.nn.loss import cross_entropy_terms
from jphantom.nn.norm import OffsetRMSNorm
from jphantom.nn.stack import Stacked

DTYPES = ("float32", "bfloat16", "float16", "float64")
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama (or, with ``experts``, Mixtral) shape; field names follow the model, the HF names are
    in :data:`HF_FIELDS`."""

    vocab_size: int = 256
    hidden: int = 64
    intermediate: int = 172
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # default hidden / heads
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_positions: int = 2048
    tie_word_embeddings: bool = False
    experts: int = 0  # 0: Llama's dense MLP; E > 0: Mixtral's mixture of E experts
    top_k: int = 2
    dtype: str = "float32"
    qkv_bias: bool = False  # Qwen2: biases on the query, key and value projections
    o_bias: bool = False  # Llama's attention_bias: on the output projection too
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before RoPE
    sliding_window: int | None = None  # Mistral: each token attends itself and the W-1 before
    hf_type: str | None = None  # the Hugging Face model_type (default llama / mixtral)
    norm_topk_prob: bool = True  # the top-k gates renormalised (Mixtral; Qwen3-MoE's flag)
    # Gemma 3: (1 + w) norms, sandwich norms around attention and MLP, GeGLU (tanh GELU),
    # embeddings times sqrt(hidden), scores scaled by query_pre_attn_scalar^-1/2, and local
    # (sliding-window, rope_local_theta) and global layers (layer_types)
    norm_offset: bool = False
    post_norms: bool = False
    activation: str = "silu"  # or "gelu_tanh"
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] | None = None  # per layer: sliding_attention / full_attention
    rope_local_theta: float | None = None  # the sliding layers' RoPE base
    model_name = "llama"

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "intermediate", "layers", "heads", "kv_heads",
                     "max_positions"):
            check_int(name, getattr(self, name))
        check_int("experts", self.experts, minimum=0)
        if self.head_dim is not None:
            check_int("head_dim", self.head_dim)
        elif self.hidden % self.heads:
            raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}: give "
                              "head_dim, or heads dividing hidden")
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}: "
                              "grouped-query attention shares each key/value head among "
                              "heads/kv_heads query heads")
        if self.experts:
            check_int("top_k", self.top_k)
            if self.top_k > self.experts:
                raise ConfigError(f"top_k={self.top_k} exceeds experts={self.experts}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {DTYPES}")
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window)
        if self.activation not in ("silu", "gelu_tanh"):
            raise ConfigError(f"activation={self.activation!r}: 'silu' (SwiGLU) or 'gelu_tanh' "
                              "(Gemma's GeGLU)")
        if self.layer_types is not None:
            kinds = set(self.layer_types)
            if len(self.layer_types) != self.layers or not kinds <= set(LAYER_TYPES):
                raise ConfigError(f"layer_types={self.layer_types!r}: one of {LAYER_TYPES} for "
                                  f"each of the {self.layers} layers")
            if "sliding_attention" in kinds and self.sliding_window is None:
                raise ConfigError("layer_types has sliding_attention layers: give sliding_window")
            if self.experts:
                raise ConfigError("layer_types with experts is not implemented")
        if self.hf_type is not None and self.hf_type not in ARCHITECTURES:
            raise ConfigError(f"hf_type={self.hf_type!r}; use one of {tuple(ARCHITECTURES)}")
        if self.hf_type in ("qwen2", "qwen3", "mistral", "llama") and self.experts:
            raise ConfigError(f"hf_type={self.hf_type!r} has no experts: leave experts out, or "
                              "use mixtral or qwen3_moe")
        if self.hf_type == "qwen3_moe" and not self.experts:
            raise ConfigError("hf_type='qwen3_moe' needs experts > 0")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name}={value!r} must be a positive number")

    @property
    def mixed_layers(self) -> bool:
        """Local and global layers under one scan (Gemma 3): each layer picks its window and
        RoPE base by its index."""
        return self.layer_types is not None and len(set(self.layer_types)) > 1

    @property
    def window(self) -> int | None:
        """The static sliding window of every layer (``None``: full, or mixed layers)."""
        if self.layer_types is not None:
            if self.mixed_layers or self.layer_types[0] == "full_attention":
                return None
        return self.sliding_window

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def model_type(self) -> str:
        return self.hf_type or ("mixtral" if self.experts else "llama")

    def param_count(self) -> int:
        h, f, L, v = self.hidden, self.intermediate, self.layers, self.vocab_size
        attention = h * self.heads * self.dim * 2 + h * self.kv_heads * self.dim * 2
        attention += (self.heads + 2 * self.kv_heads) * self.dim * self.qkv_bias
        attention += h * self.o_bias + 2 * self.dim * self.qk_norm + 2 * h * self.post_norms
        mlp = (h * self.experts + self.experts * 3 * h * f) if self.experts else 3 * h * f
        head = 0 if self.tie_word_embeddings else h * v
        return v * h + L * (attention + mlp + 2 * h) + h + head


def rope(x: jax.Array, theta: float, positions: jax.Array | None = None,
         length: int | None = None) -> jax.Array:
    """Rotary position embedding of x [B, S, heads, d] (HF's rotate-half) at ``positions`` [S]
    (default 0..S-1) of a sequence of ``length`` tokens (default S): the phases are computed in
    float64 for the whole sequence, then this rank's rows are taken (context parallelism holds
    positions that are not 0..S-1)."""
    seq, d = x.shape[1], x.shape[-1]
    length = seq if length is None else length
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None]  # [S, d/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [S, d]
    wide = jnp.promote_types(x.dtype, jnp.float32)
    cos, sin = jnp.asarray(np.cos(angles), wide), jnp.asarray(np.sin(angles), wide)
    if positions is not None:
        cos, sin = jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    half = d // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(wide) * cos + rotated.astype(wide) * sin).astype(x.dtype)


def _linear(n_in, n_out, config, rngs, bias=False):
    return nnx.Linear(n_in, n_out, use_bias=bias, param_dtype=jnp.dtype(config.dtype),
                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


def _norm_class(config):
    return OffsetRMSNorm if config.norm_offset else nnx.RMSNorm


class Attention(nnx.Module):
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

    def __call__(self, x: jax.Array, index=None) -> jax.Array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        batch, seq = q.shape[:2]  # the projections' sequence (whole under SP)
        q, k, v = (a.reshape(batch, seq, -1, self.dim) for a in (q, k, v))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        positions, length = self.positions(seq), self.positions.length(seq)
        if not self.mixed:
            q, k = (rope(a, self.theta, positions, length) for a in (q, k))
        else:
            if type(self.attend) is not CausalAttention:
                raise ConfigError("local and global layers in one stack (Gemma 3) under context "
                                  "parallelism are not implemented: drop the context axis")
            full = jnp.asarray(self.full)[index]
            q, k = (jnp.where(full, rope(a, self.theta, positions, length),
                              rope(a, self.local_theta, positions, length)) for a in (q, k))
        if self.q_scale is not None:
            q = q * jnp.asarray(self.q_scale, q.dtype)
        if self.mixed:  # this layer's core, each on the fused kernel with its own window
            out = lax.cond(full, self.attend, self.attend_local, q, k, v)
        else:
            out = self.attend(q, k, v)
        return self.o_proj(out.reshape(batch, seq, -1))


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        h, f = config.hidden, config.intermediate
        self.gate_proj = _linear(h, f, config, rngs)
        self.up_proj = _linear(h, f, config, rngs)
        self.down_proj = _linear(f, h, config, rngs)

        self.gelu = config.activation == "gelu_tanh"  # Gemma's GeGLU

    def __call__(self, x):
        gate = self.gate_proj(x)
        gate = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


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


class Block(nnx.Module):
    """Llama's pre-norm block; with ``post_norms`` (Gemma) the sandwich: ``input_layernorm``
    before attention, ``post_attention_layernorm`` on its output, ``pre_feedforward_layernorm``
    before the MLP, ``post_feedforward_layernorm`` on its output (those two on the residual
    branch's output: the plans keep them replicated, ``residual_norm``)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        norm = lambda: _norm_class(config)(config.hidden, epsilon=config.rms_norm_eps,
                                           param_dtype=dtype, rngs=rngs)
        self.input_layernorm = norm()
        self.self_attn = Attention(config, rngs=rngs)
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
            self.mlp = MLP(config, rngs=rngs)

    def __call__(self, h, index=None):
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        if self.sandwich:
            h = h + self.post_attention_layernorm(
                self.self_attn(self.input_layernorm(h), index))
            return h + self.post_feedforward_layernorm(ffn(self.pre_feedforward_layernorm(h)))
        h = h + self.self_attn(self.input_layernorm(h), index)
        return h + ffn(self.post_attention_layernorm(h))


class Llama(nnx.Module):
    """``Llama(config, rngs=nnx.Rngs(0))``; ``model(tokens)`` -> logits [B, S, V];
    ``model.loss(tokens, targets)`` -> mean next-token cross-entropy (vocabulary-parallel when the
    head is)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.dtype)
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden, param_dtype=dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.layers = Stacked(lambda r: Block(config, rngs=r), config.layers, rngs=rngs,
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

    def hidden_states(self, tokens: jax.Array) -> jax.Array:
        h = self.embed_tokens(tokens)
        if self.config.embed_scale:  # Gemma: sqrt(hidden) in the table's dtype
            h = h * jnp.asarray(self.config.hidden ** 0.5,
                                self.embed_tokens.embedding.get_value().dtype).astype(h.dtype)
        return self.norm(self.layers(h))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.hidden_states(tokens)
        return self.embed_tokens.attend(h) if self.config.tie_word_embeddings else self.lm_head(h)

    def loss(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None
             ) -> jax.Array:
        """Mean next-token cross-entropy over the counted tokens (``mask`` true, target not
        negative)."""
        return token_mean.value(self.loss_terms(tokens, targets, mask))

    def loss_terms(self, tokens: jax.Array, targets: jax.Array, mask: jax.Array | None = None
                   ) -> token_mean.WeightedLoss:
        """``(total, weight)``: the summed cross-entropy of the counted tokens and their number
        (:func:`jphantom.nn.cross_entropy_terms`), for a global token mean."""
        h = self.hidden_states(tokens)
        if self.config.tie_word_embeddings:
            return token_mean.WeightedLoss(
                *cross_entropy_terms(self.embed_tokens, h, targets, tied=True, mask=mask))
        return token_mean.WeightedLoss(*cross_entropy_terms(self.lm_head, h, targets, mask=mask))


def lm_loss(model, tokens, targets, mask=None):
    """``loss_fn`` for :func:`jphantom.make_train_step` of the zoo's language models: the mean
    next-token loss, or with ``mask`` (a third batch array) the global token mean's terms."""
    if mask is None:
        return model.loss(tokens, targets)
    return model.loss_terms(tokens, targets, mask)


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ---------------------------------------------------------------------------------------------

# LlamaConfig field -> config.json key
HF_FIELDS = {"vocab_size": "vocab_size", "hidden": "hidden_size",
             "intermediate": "intermediate_size", "layers": "num_hidden_layers",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "head_dim": "head_dim", "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps",
             "max_positions": "max_position_embeddings",
             "tie_word_embeddings": "tie_word_embeddings", "experts": "num_local_experts",
             "top_k": "num_experts_per_tok"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}


def config_from_hf(hf: dict) -> LlamaConfig:
    """A :class:`LlamaConfig` of a ``config.json`` dict; what this model cannot reproduce is
    refused by name."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ConfigError(f"model_type={kind!r} is not a Llama-family model "
                          f"({', '.join(ARCHITECTURES)})")
    if hf.get("rope_scaling"):
        raise ConfigError(f"rope_scaling={hf['rope_scaling']!r} is not implemented (plain RoPE "
                          "only): use a checkpoint without it")
    if kind == "gemma3_text":
        return _gemma3_from_hf(hf)
    rope = hf.get("rope_parameters") or {}  # where transformers 5 keeps RoPE's settings
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.rope_type={rope['rope_type']!r} is not implemented "
                          "(plain RoPE only): use a checkpoint without RoPE scaling")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not implemented: the MLP here has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is implemented")
    if kind in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise ConfigError(f"use_sliding_window=true ({kind}'s windowed layers from "
                          "max_window_layers on) is not implemented: full causal attention, or "
                          "a window on every layer (mistral)")
    if kind == "qwen3" and hf.get("attention_bias"):
        raise ConfigError("attention_bias=true on qwen3 is not implemented")
    fields = {name: hf[key] for name, key in HF_FIELDS.items() if key in hf}
    # biases: Llama's attention_bias puts one on q, k, v and o; Qwen2 always has q, k, v ones
    fields["qkv_bias"] = kind == "qwen2" or bool(hf.get("attention_bias"))
    fields["o_bias"] = kind != "qwen2" and bool(hf.get("attention_bias"))
    fields["qk_norm"] = kind in ("qwen3", "qwen3_moe")
    if kind in ("mistral", "mixtral") and hf.get("sliding_window"):
        fields["sliding_window"] = int(hf["sliding_window"])
    fields["hf_type"] = kind if kind in ("mistral", "qwen2", "qwen3", "qwen3_moe") else None
    if kind == "qwen3_moe":  # every layer sparse, its experts moe_intermediate_size wide
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ConfigError(f"decoder_sparse_step={hf.get('decoder_sparse_step')}, "
                              f"mlp_only_layers={hf.get('mlp_only_layers')}: dense layers among "
                              "the sparse ones are not implemented (every layer a mixture)")
        experts = hf.get("num_local_experts", hf.get("num_experts"))  # by transformers version
        if not experts:
            raise ConfigError("a qwen3_moe config.json without num_experts/num_local_experts")
        fields.update(experts=int(experts), intermediate=int(hf["moe_intermediate_size"]),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    if kind not in ("mixtral", "qwen3_moe"):
        fields.pop("experts", None)
        fields.pop("top_k", None)
    elif "experts" not in fields:
        fields["experts"] = 8
    fields.setdefault("kv_heads", fields.get("heads", 4))
    return LlamaConfig(**fields, dtype=_dtype_of(hf))


def _dtype_of(hf: dict) -> str:
    """The model dtype a ``config.json`` names (``torch_dtype``, or transformers 5's ``dtype``)."""
    named = hf.get("torch_dtype", hf.get("dtype", "float32"))
    return named if named in ("bfloat16", "float16", "float64") else "float32"


def _gemma3_from_hf(hf: dict) -> LlamaConfig:
    """Gemma 3's text model (``gemma3_text``): RoPE per layer type, the sandwich norms, GeGLU;
    what it cannot reproduce is refused by name."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ConfigError(f"{key}={hf[key]} is not implemented (Gemma 3 has none)")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true is not implemented: causal only")
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias=true on gemma3_text is not implemented")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation={hf['hidden_activation']!r}: only "
                          "gelu_pytorch_tanh (GeGLU) is implemented")
    rope = hf.get("rope_parameters") or {}
    thetas = {}
    for kind in LAYER_TYPES:
        entry = rope.get(kind) or {}
        if entry.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.{kind}.rope_type={entry['rope_type']!r} is not "
                              "implemented (plain RoPE only; Gemma 3 1B's checkpoints have it)")
        thetas[kind] = entry.get("rope_theta")
    fields = {name: hf[key] for name, key in HF_FIELDS.items() if key in hf}
    for name in ("experts", "top_k", "rope_theta", "tie_word_embeddings"):
        fields.pop(name, None)
    layer_types = tuple(hf.get("layer_types") or ())
    return LlamaConfig(**fields, rope_theta=float(thetas["full_attention"] or hf.get(
                           "rope_theta", 1e6)),
                       rope_local_theta=float(thetas["sliding_attention"] or hf.get(
                           "rope_local_base_freq", 1e4)),
                       layer_types=layer_types or None, sliding_window=hf.get("sliding_window"),
                       qk_norm=True, norm_offset=True, post_norms=True, activation="gelu_tanh",
                       embed_scale=True,
                       query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                       hf_type="gemma3_text",
                       dtype=_dtype_of(hf))


def config_to_hf(config: LlamaConfig, extra: dict | None = None) -> dict:
    """The ``config.json`` dict: ``extra`` (what a loaded file had) updated with the model's
    fields."""
    out = dict(extra or {})
    out.update({"model_type": config.model_type,
                "architectures": [ARCHITECTURES[config.model_type]], "hidden_act": "silu",
                "torch_dtype": config.dtype})
    for name, key in HF_FIELDS.items():
        if name in ("experts", "top_k") and not config.experts:
            continue
        value = getattr(config, name)
        if value is not None:
            out[key] = value
    if config.model_type in ("llama", "mistral", "mixtral", "qwen3") and (
            config.o_bias or "attention_bias" in out):
        out["attention_bias"] = config.o_bias
    if config.model_type in ("mistral", "mixtral") and (config.sliding_window
                                                        or "sliding_window" in out):
        out["sliding_window"] = config.sliding_window
    if config.model_type == "gemma3_text":
        out.pop("hidden_act", None)
        out.pop("rope_theta", None)
        out.update(hidden_activation="gelu_pytorch_tanh", sliding_window=config.sliding_window,
                   query_pre_attn_scalar=(int(config.query_pre_attn_scalar)
                                          if float(config.query_pre_attn_scalar).is_integer()
                                          else config.query_pre_attn_scalar),
                   layer_types=list(config.layer_types or ()),
                   rope_parameters={"full_attention": {"rope_theta": config.rope_theta,
                                                       "rope_type": "default"},
                                    "sliding_attention": {"rope_theta": config.rope_local_theta,
                                                          "rope_type": "default"}})
    if config.model_type == "qwen3_moe":  # the experts' width has its own key
        out["moe_intermediate_size"] = config.intermediate
        out["intermediate_size"] = (extra or {}).get("intermediate_size", config.intermediate)
        out["norm_topk_prob"] = config.norm_topk_prob
    if isinstance(out.get("rope_parameters"), dict) and config.model_type != "gemma3_text":
        out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": config.rope_theta}
        if "rope_theta" not in (extra or {}):
            del out["rope_theta"]
    return out


def _hf_names(config: LlamaConfig) -> dict[tuple, tuple[str, bool]]:
    """Parameter path (as in the module's pure state dict) -> (HF tensor name pattern, transpose).
    ``{i}`` is the layer index (stacked) and ``{e}`` the expert index."""
    names = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", False),
             ("norm", "scale"): ("model.norm.weight", False)}
    if not config.tie_word_embeddings:
        names[("lm_head", "kernel")] = ("lm_head.weight", True)
    block = ("layers", "block")
    layer = "model.layers.{i}."
    names[(*block, "input_layernorm", "scale")] = (layer + "input_layernorm.weight", False)
    names[(*block, "post_attention_layernorm", "scale")] = (
        layer + "post_attention_layernorm.weight", False)
    if config.post_norms:
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            names[(*block, norm, "scale")] = (layer + f"{norm}.weight", False)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[(*block, "self_attn", proj, "kernel")] = (layer + f"self_attn.{proj}.weight", True)
        if config.qkv_bias and proj != "o_proj" or config.o_bias and proj == "o_proj":
            names[(*block, "self_attn", proj, "bias")] = (layer + f"self_attn.{proj}.bias", False)
    if config.qk_norm:
        for norm in ("q_norm", "k_norm"):
            names[(*block, "self_attn", norm, "scale")] = (layer + f"self_attn.{norm}.weight",
                                                           False)
    if config.experts:
        qwen = config.model_type == "qwen3_moe"
        moe = layer + ("mlp." if qwen else "block_sparse_moe.")
        names[(*block, "moe", "router", "kernel")] = (moe + "gate.weight", True)
        pairs = ((("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")) if qwen
                 else (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")))
        for ours, theirs in pairs:
            names[(*block, "moe", "experts", ours)] = (moe + "experts.{e}." + theirs + ".weight",
                                                       True)
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[(*block, "mlp", proj, "kernel")] = (layer + f"mlp.{proj}.weight", True)
    return names


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _put(tree, path, value):
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def to_hf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """The module's parameters as Hugging Face tensors (``[out, in]`` weights), numpy."""
    config = model.config
    _, state, _ = nnx.split(model, nnx.Param, ...)
    pure = nnx.to_pure_dict(state)
    tensors = {}
    for path, (name, transpose) in _hf_names(config).items():
        value = np.asarray(jax.device_get(_get(pure, path)))
        if "{i}" not in name:
            tensors[name] = np.ascontiguousarray(value.T if transpose else value)
            continue
        for i in range(config.layers):
            layer = value[i]
            if "{e}" in name:
                for e in range(config.experts):
                    tensors[name.format(i=i, e=e)] = np.ascontiguousarray(layer[e].T)
            else:
                tensors[name.format(i=i)] = np.ascontiguousarray(layer.T if transpose else layer)
    return tensors


def from_hf_tensors(config: LlamaConfig, tensors: dict[str, np.ndarray]) -> Llama:
    """A :class:`Llama` holding ``tensors`` (HF names and layout), built without random init."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    pure = nnx.to_pure_dict(state)
    names = _hf_names(config)
    missing = []

    def take(name):
        if name not in tensors:
            missing.append(name)
            return None
        return tensors[name]

    for path, (name, transpose) in names.items():
        shape = _get(pure, path).shape
        if "{i}" not in name:
            value = take(name)
            value = None if value is None else (value.T if transpose else value)
        else:
            layers = []
            for i in range(config.layers):
                if "{e}" in name:
                    experts = [take(name.format(i=i, e=e)) for e in range(config.experts)]
                    layers.append(None if any(x is None for x in experts)
                                  else np.stack([x.T for x in experts]))
                else:
                    x = take(name.format(i=i))
                    layers.append(None if x is None else (x.T if transpose else x))
            value = None if any(x is None for x in layers) else np.stack(layers)
        if value is not None:
            if tuple(value.shape) != tuple(shape):
                raise ConfigError(f"tensor {name} has shape {value.shape}; config.json implies "
                                  f"{tuple(shape)} for {'.'.join(map(str, path))}")
            _put(pure, path, jnp.asarray(value))
    if missing:
        raise ConfigError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    expected = {n.format(i=i, e=e) for n, _ in names.values() for i in range(config.layers)
                for e in range(max(config.experts, 1))}
    extra = sorted(set(tensors) - expected - {"lm_head.weight"})
    if extra:
        raise ConfigError(f"the checkpoint has {len(extra)} tensors this model does not use, e.g. "
                          f"{extra[0]}")
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state, rest)


def load_hf(path) -> Llama:
    """A Hugging Face Llama or Mixtral directory (``config.json`` + ``model.safetensors``) as a
    :class:`Llama`; the file's other config fields are kept for :func:`save_hf`."""
    from safetensors.numpy import load_file

    directory = Path(path)
    config_file, weights = directory / "config.json", directory / "model.safetensors"
    for f in (config_file, weights):
        if not f.is_file():
            raise ConfigError(f"{f} not found: a Hugging Face directory holds config.json and "
                              "model.safetensors (sharded checkpoints are not supported)")
    hf = json.loads(config_file.read_text())
    config = config_from_hf(hf)
    model = from_hf_tensors(config, load_file(str(weights)))
    model.hf_config = json.dumps(hf)  # a static string: the file's fields, for save_hf
    return model


def save_hf(path, model: Llama) -> None:
    """Write ``model`` as a Hugging Face directory: ``config.json`` and ``model.safetensors``."""
    from safetensors.numpy import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    extra = getattr(model, "hf_config", None)
    config = config_to_hf(model.config, json.loads(extra) if extra else None)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(to_hf_tensors(model), str(directory / "model.safetensors"),
              metadata={"format": "pt"})


__all__ = ["LlamaConfig", "Llama", "lm_loss", "load_hf", "save_hf", "rope", "causal_attention"]


# -------------------------------------------------------------------------------------------------
# The family: what the CLI, the planner and the metrics read (jphantom.families)
# -------------------------------------------------------------------------------------------------


def default_intermediate(hidden: int) -> int:
    """Llama's SwiGLU width for ``hidden``: 8h/3 rounded up to a multiple of 32."""
    return -(-8 * hidden // 3 // 32) * 32


def flops_per_token(config: LlamaConfig, seq_len: int) -> int:
    """Forward + backward model FLOPs per token at ``seq_len``: 6 x the weights in matmuls (the
    query, key, value and output projections, the MLP's three matmuls or the router and the k
    experts a token visits, the head) plus attention's 6 L S heads d (QK^T and AV over the causal
    half of the square, forward and backward; sliding windows counted whole)."""
    c = config
    h, d, L = c.hidden, c.dim, c.layers
    attention = h * c.heads * d * 2 + h * c.kv_heads * d * 2
    mlp = (h * c.experts + c.top_k * 3 * h * c.intermediate) if c.experts else (
        3 * h * c.intermediate)
    return 6 * (L * (attention + mlp) + c.vocab_size * h) + 6 * L * seq_len * c.heads * d


def plan_shape(config: LlamaConfig, model: str = "llama"):
    """The dense-block shape :mod:`jphantom.plan` prices (its Llama block: GQA projections and a
    gated MLP; norms, biases and q/k norms are small parameters it leaves out)."""
    from jphantom.perf.axonn_model import GPTShape

    if config.experts:
        raise ConfigError("the planner prices dense blocks; MoE blocks are not modelled: use a "
                          "dense model")
    if config.dim * config.heads != config.hidden:
        raise ConfigError(f"head_dim={config.dim} x heads={config.heads} != hidden="
                          f"{config.hidden}: the planner prices heads of hidden/heads features")
    return GPTShape(config.layers, config.hidden, config.heads, config.max_positions,
                    config.vocab_size, "llama", config.intermediate, config.kv_heads,
                    tied=config.tie_word_embeddings, model=model)


def family_config(section, name: str, **preset) -> LlamaConfig:
    """The :class:`LlamaConfig` of the run's model section (:class:`jphantom.config.ModelConfig`)
    for the Llama-family ``name``: its checkpoint's (``from_hf``) or the section's shape with the
    family's ``preset`` fields (a callable preset is called with the section)."""
    from jphantom import families

    if section.from_hf:
        config = config_from_hf(families.read_hf_config(section.from_hf, families.get(name)))
        families.check_checkpoint_shape(section, config, {
            "layers": "layers", "hidden": "hidden", "heads": "heads", "vocab": "vocab_size",
            "kv_heads": "kv_heads", "intermediate": "intermediate",
            "sliding_window": "sliding_window"})
        return dataclasses.replace(config, dtype=section.dtype)
    fields = dict(vocab_size=section.vocab, hidden=section.hidden,
                  intermediate=section.intermediate or default_intermediate(section.hidden),
                  layers=section.layers, heads=section.heads,
                  kv_heads=section.kv_heads or section.heads, max_positions=section.seq_len,
                  dtype=section.dtype)
    fields.update({k: v(section) if callable(v) else v for k, v in preset.items()})
    return LlamaConfig(**fields)


def register_variant(name: str, description: str, hf_types: tuple[str, ...], *,
                     flags: tuple[str, ...] = (), check=None, aliases: tuple[str, ...] = (),
                     strategies: tuple[str, ...] | None = None, **preset):
    """Register a Llama-family variant (one :class:`LlamaConfig` preset, this module's model,
    Hugging Face reader and writer); the variant owns the configurations whose
    :attr:`LlamaConfig.model_type` is in ``hf_types``; ``strategies``: what it runs (default
    every language-model strategy)."""
    import functools

    from jphantom import families

    return families.register(families.Family(
        name=name, description=description, config_type=LlamaConfig, module=Llama,
        from_flags=lambda section, phantom: family_config(section, name, **preset),
        flags=("kv_heads", "intermediate", "ghost_width", *flags), hf_types=hf_types,
        config_from_hf=config_from_hf, load_hf=load_hf, save_hf=save_hf,
        flops_per_token=flops_per_token, plan_shape=functools.partial(plan_shape, model=name),
        matches=lambda config: config.model_type in hf_types, check=check, aliases=aliases,
        strategies=families.LM_STRATEGIES if strategies is None else strategies))


NO_PMM3D = ("dense", "gspmd", "tensor", "phantom", "phantom-unfused")
"""What a family with per-head q/k norms runs: pmm3d splits a head's features over ``y``, and
the norm needs the whole head (:func:`jphantom.plans.pmm3d` refuses it by name)."""


def _check_llama_flags(section) -> None:
    if section.moe_every not in (0, 1):
        raise ConfigError("--model llama's mixture of experts is Mixtral's: --moe-every 1 "
                          "(every block)")


register_variant(
    "llama", "Llama 2/3 (GQA, RoPE, SwiGLU, untied head); Mixtral's experts with --moe-every 1",
    ("llama", "mixtral"), flags=("moe_every", "experts", "top_k"), check=_check_llama_flags,
    experts=lambda s: s.experts if s.moe_every else 0, top_k=lambda s: s.top_k)
