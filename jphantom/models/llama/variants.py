"""The Llama family's presets, each registered as a model family (:mod:`jphantom.registry.families`)
of the one Llama block (:mod:`jphantom.models.llama.model`), in the registry's order:

- ``llama``: Llama 2/3 (Touvron et al. 2023); Mixtral's experts (Jiang et al. 2024) with
  ``--moe-every 1``;
- ``mistral``: Mistral (Jiang et al. 2023), sliding-window attention;
- ``qwen2``, ``qwen3``, ``qwen3_moe``: the Qwen families (Qwen Team 2024, 2025);
- ``gemma3``: Gemma 3's text model (Gemma Team 2025).

Mistral (Jiang et al. 2023, Hugging Face's ``MistralForCausalLM``): the Llama block with
sliding-window attention, each token attending itself and the ``sliding_window`` - 1 tokens
before it (the model of :mod:`jphantom.models.llama` with ``sliding_window``). A window shorter
than the sequence changes the result; on GPUs it runs on cuDNN's fused kernel, under all-gather
context attention as a position mask, and ring attention refuses it by name.

    jphantom train --model mistral --sliding-window 64 --seq-len 256 ...

The Qwen families, each exact against Hugging Face's ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``
and ``Qwen3MoeForCausalLM``:

- ``qwen2`` (Qwen Team 2024): biases on the query, key and value projections; an untied head;
- ``qwen3`` (Qwen Team 2025): an RMSNorm over each query and key head before RoPE, no biases,
  tied embeddings;
- ``qwen3_moe``: Qwen3's attention with every MLP a mixture of fine-grained experts (``--experts``
  of ``--intermediate`` width each, top-``k`` routed, the top-k probabilities renormalised;
  checkpoints give the count as ``num_experts`` or ``num_local_experts`` by transformers version).

    jphantom train --model qwen3 --layers 4 --hidden 256 --heads 8 --kv-heads 2 ...

Gemma 3's text model (Gemma Team 2025, Hugging Face's ``Gemma3ForCausalLM``, ``model_type``
``gemma3_text``): RMSNorms that scale by ``1 + w``, sandwich norms around attention and the MLP,
GeGLU with tanh GELU, embeddings scaled by sqrt(hidden), per-head q/k norms, scores scaled by
``query_pre_attn_scalar``^-1/2, tied embeddings, and five sliding-window (local, RoPE base 10^4)
layers for each global one (RoPE base 10^6): each layer picks its window and base by its index
under one scan (a ``lax.cond`` between two fused attention kernels).

    jphantom train --model gemma3 --sliding-window 64 --seq-len 256 ...

Checkpoints with RoPE scaling on the global layers (Gemma 3 4B and larger) are refused by name.
"""

from jphantom.errors import ConfigError
from jphantom.registry.families import EXPERTS, MOE_EVERY, TOP_K
from jphantom.models.llama.family import SLIDING_WINDOW, register_variant

# ----------------------------------------------------------------------------------- Llama


def _check_llama_flags(section) -> None:
    if section.moe_every not in (0, 1):
        raise ConfigError("--model llama's mixture of experts is Mixtral's: --moe-every 1 "
                          "(every block)")


register_variant(
    "llama", "Llama 2/3 (GQA, RoPE, SwiGLU, untied head); Mixtral's experts with --moe-every 1",
    ("llama", "mixtral"), fields=(MOE_EVERY, EXPERTS, TOP_K), check=_check_llama_flags,
    experts=lambda s: s.experts if s.moe_every else 0, top_k=lambda s: s.top_k)


# ---------------------------------------------------------------------------------- Mistral

register_variant(
    "mistral", "Mistral: Llama blocks with sliding-window attention (--sliding-window)",
    ("mistral",), fields=(SLIDING_WINDOW,), sliding_window=lambda s: s.sliding_window,
    hf_type="mistral")

# ------------------------------------------------------------------------------------- Qwen

register_variant(
    "qwen2", "Qwen2: Llama blocks with q/k/v biases, untied head", ("qwen2",),
    qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6, hf_type="qwen2")

register_variant(
    "qwen3", "Qwen3: per-head q/k RMSNorm, tied embeddings", ("qwen3",),
    qk_norm=True, tie_word_embeddings=True, rope_theta=1e6,
    rms_norm_eps=1e-6, hf_type="qwen3")


def _check_moe(section) -> None:
    if section.top_k > section.experts:
        raise ConfigError(f"--top-k {section.top_k} exceeds --experts {section.experts}")


register_variant(
    "qwen3_moe", "Qwen3-MoE: Qwen3 attention, every MLP fine-grained experts (--experts, "
    "--top-k, --intermediate per expert)", ("qwen3_moe",), fields=(EXPERTS, TOP_K),
    check=_check_moe, qk_norm=True, rope_theta=1e6, rms_norm_eps=1e-6,
    experts=lambda s: s.experts, top_k=lambda s: s.top_k, norm_topk_prob=True,
    hf_type="qwen3_moe")

# ---------------------------------------------------------------------------------- Gemma 3


def _layer_types(section) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                 for i in range(section.layers))


register_variant(
    "gemma3", "Gemma 3 text: (1 + w) and sandwich norms, GeGLU, scaled embeddings, 5 local "
    "(--sliding-window) : 1 global layers, tied embeddings", ("gemma3_text",),
    fields=(SLIDING_WINDOW,), aliases=("gemma3_text",),
    norm_offset=True, post_norms=True, activation="gelu_tanh",
    embed_scale=True, qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6,
    rope_theta=1e6, rope_local_theta=1e4, layer_types=_layer_types,
    sliding_window=lambda s: s.sliding_window or 512,
    query_pre_attn_scalar=lambda s: float(s.hidden // s.heads), hf_type="gemma3_text")
