"""Gemma 3's text model (Gemma Team 2025, Hugging Face's ``Gemma3ForCausalLM``,
``model_type`` ``gemma3_text``) as a preset of the Llama block (:mod:`jphantom.models.llama`):
RMSNorms that scale by ``1 + w``, sandwich norms around attention and the MLP, GeGLU with tanh
GELU, embeddings scaled by sqrt(hidden), per-head q/k norms, scores scaled by
``query_pre_attn_scalar``^-1/2, tied embeddings, and five sliding-window (local, RoPE base 10^4)
layers for each global one (RoPE base 10^6): each layer picks its window and base by its index
under one scan (a ``lax.cond`` between two fused attention kernels).

    jphantom train --model gemma3 --sliding-window 64 --seq-len 256 ...

Checkpoints with RoPE scaling on the global layers (Gemma 3 4B and larger) are refused by name.
"""

from jphantom.models.llama import NO_PMM3D, register_variant


def _layer_types(section) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                 for i in range(section.layers))


FAMILY = register_variant(
    "gemma3", "Gemma 3 text: (1 + w) and sandwich norms, GeGLU, scaled embeddings, 5 local "
    "(--sliding-window) : 1 global layers, tied embeddings", ("gemma3_text",),
    flags=("sliding_window",), aliases=("gemma3_text",), strategies=NO_PMM3D,
    norm_offset=True, post_norms=True, activation="gelu_tanh",
    embed_scale=True, qk_norm=True, tie_word_embeddings=True, rms_norm_eps=1e-6,
    rope_theta=1e6, rope_local_theta=1e4, layer_types=_layer_types,
    sliding_window=lambda s: s.sliding_window or 512,
    query_pre_attn_scalar=lambda s: float(s.hidden // s.heads), hf_type="gemma3_text")
