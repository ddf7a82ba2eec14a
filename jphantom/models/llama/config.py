"""The Llama family's shape: :class:`LlamaConfig`, one validated dataclass for Llama 2/3
(Touvron et al. 2023), Mixtral (Jiang et al. 2024, ``experts > 0``) and the presets of
:mod:`jphantom.models.llama.variants` (Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3), with the
Hugging Face model types it can stand for (:data:`ARCHITECTURES`)."""

from __future__ import annotations

import dataclasses

from jphantom.errors import ConfigError, check_int
from jphantom.registry.dtypes import DTYPES, check_dtype  # noqa: F401

LAYER_TYPES = ("sliding_attention", "full_attention")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM"}
"""Hugging Face ``model_type`` -> its ``architectures`` class (the values of ``hf_type``)."""


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
    # the pad token (transformers' padding_idx): its embedding row gets no gradient from lookups
    pad_token_id: int | None = None
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
        check_dtype(self.dtype)
        if self.pad_token_id is not None and not (isinstance(self.pad_token_id, int)
                                                  and 0 <= self.pad_token_id < self.vocab_size):
            raise ConfigError(f"pad_token_id={self.pad_token_id!r} is not a token id below "
                              f"vocab_size={self.vocab_size}: give the pad token's id, or None")
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
