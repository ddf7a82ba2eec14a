"""The Qwen families, as presets of the Llama block (:mod:`jphantom.models.llama`), each exact
against Hugging Face's ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM``:

- ``qwen2`` (Qwen Team 2024): biases on the query, key and value projections; an untied head;
- ``qwen3`` (Qwen Team 2025): an RMSNorm over each query and key head before RoPE, no biases,
  tied embeddings;
- ``qwen3_moe``: Qwen3's attention with every MLP a mixture of fine-grained experts (``--experts``
  of ``--intermediate`` width each, top-``k`` routed, the top-k probabilities renormalised;
  checkpoints give the count as ``num_experts`` or ``num_local_experts`` by transformers version).

    jphantom train --model qwen3 --layers 4 --hidden 256 --heads 8 --kv-heads 2 ...
"""

from jphantom.errors import ConfigError
from jphantom.models.llama import NO_PMM3D, register_variant

QWEN2 = register_variant(
    "qwen2", "Qwen2: Llama blocks with q/k/v biases, untied head", ("qwen2",),
    qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6, hf_type="qwen2")

QWEN3 = register_variant(
    "qwen3", "Qwen3: per-head q/k RMSNorm, tied embeddings", ("qwen3",),
    strategies=NO_PMM3D, qk_norm=True, tie_word_embeddings=True, rope_theta=1e6,
    rms_norm_eps=1e-6, hf_type="qwen3")


def _check_moe(section) -> None:
    if section.top_k > section.experts:
        raise ConfigError(f"--top-k {section.top_k} exceeds --experts {section.experts}")


QWEN3_MOE = register_variant(
    "qwen3_moe", "Qwen3-MoE: Qwen3 attention, every MLP fine-grained experts (--experts, "
    "--top-k, --intermediate per expert)", ("qwen3_moe",), flags=("experts", "top_k"),
    check=_check_moe, strategies=NO_PMM3D, qk_norm=True, rope_theta=1e6, rms_norm_eps=1e-6,
    experts=lambda s: s.experts, top_k=lambda s: s.top_k, norm_topk_prob=True,
    hf_type="qwen3_moe")
