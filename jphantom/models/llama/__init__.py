"""The Llama family (Touvron et al. 2023; Mixtral, Jiang et al. 2024, with ``experts > 0``) and
its presets: Mistral, Qwen2, Qwen3, Qwen3-MoE and Gemma 3's text model, one Flax NNX module under
six registered families. Importing the package registers them (:mod:`jphantom.families`).

- :mod:`~jphantom.models.llama.config`: the shape, :class:`LlamaConfig`;
- :mod:`~jphantom.models.llama.model`: the NNX module, :class:`Llama` (no collective), and
  :func:`lm_loss`;
- :mod:`~jphantom.models.llama.hf`: Hugging Face checkpoints in and out (:func:`load_hf` reads
  ``config.json`` and ``model.safetensors`` (one file) into the module, :func:`save_hf` writes them
  back in the same layout, tensor for tensor: bit-exact);
- :mod:`~jphantom.models.llama.family`: what the registry reads (FLOPs, the planner's shape, the
  configuration of a run's model section) and :func:`register_variant`;
- :mod:`~jphantom.models.llama.variants`: the presets registered as ``llama``, ``mistral``,
  ``qwen2``, ``qwen3``, ``qwen3_moe`` and ``gemma3``.
"""

from jphantom.models.llama.config import ARCHITECTURES, DTYPES, LAYER_TYPES, LlamaConfig
from jphantom.models.llama.model import MLP, Attention, Block, Llama, MoE, lm_loss, rope
from jphantom.models.llama.hf import (HF_FIELDS, config_from_hf, config_to_hf, from_hf_tensors,
                                      load_hf, save_hf, to_hf_tensors)
from jphantom.models.llama.family import (NO_PMM3D, default_intermediate, family_config,
                                          flops_per_token, plan_shape, register_variant)
from jphantom.models.llama import variants  # noqa: F401  (registers the six families)
from jphantom.nn.attention import causal_attention

__all__ = ["LlamaConfig", "Llama", "lm_loss", "load_hf", "save_hf", "rope", "causal_attention"]
