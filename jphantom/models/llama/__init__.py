"""The Llama family (Touvron et al. 2023; Mixtral, Jiang et al. 2024, with ``experts > 0``) and
its presets: Mistral, Qwen2, Qwen3, Qwen3-MoE and Gemma 3's text model, one Flax NNX module under
six registered families. Importing the package registers them (:mod:`jphantom.registry.families`).

- :mod:`~jphantom.models.llama.config`: the shape, :class:`LlamaConfig`;
- :mod:`~jphantom.models.llama.model`: the NNX module, :class:`Llama` (no collective);
  :func:`lm_loss` is the zoo's one loss, :func:`jphantom.models.lm_loss`;
- :mod:`~jphantom.models.llama.hf`: Hugging Face checkpoints in and out (:func:`load_hf` reads
  ``config.json`` and ``model.safetensors`` (one file) into the module, :func:`save_hf` writes them
  back in the same layout, tensor for tensor: bit-exact);
- :mod:`~jphantom.models.llama.family`: what the registry reads (FLOPs, the planner's shape, the
  configuration of a run's model section) and :func:`register_variant`;
- :mod:`~jphantom.models.llama.variants`: the presets registered as ``llama``, ``mistral``,
  ``qwen2``, ``qwen3``, ``qwen3_moe`` and ``gemma3``.

The shape, the family and its presets import no jax; the module's and the checkpoints' names
load on first use.
"""

from jphantom.models.llama.config import ARCHITECTURES, DTYPES, LAYER_TYPES, LlamaConfig
from jphantom.models.llama.family import (default_intermediate, family_config,
                                          flops_per_token, plan_shape, register_variant)
from jphantom.models.llama import variants  # noqa: F401  (registers the six families)

_LAZY = {**{name: "jphantom.models.llama.model" for name in ("LlamaMLP", "LlamaAttention",
                                                             "LlamaBlock", "Llama", "MoE",
                                                             "rope")},
         "lm_loss": "jphantom.models",
         **{name: "jphantom.models.llama.hf" for name in ("HF_FIELDS", "config_from_hf",
                                                          "config_to_hf", "from_hf_tensors",
                                                          "load_hf", "save_hf", "to_hf_tensors")},
         "causal_attention": "jphantom.nn.attention"}
__all__ = ["LlamaConfig", "Llama", "lm_loss", "load_hf", "save_hf", "rope", "causal_attention"]


_RENAMED = {"Attention": "LlamaAttention", "Block": "LlamaBlock", "MLP": "LlamaMLP"}
"""The blocks' old names, which GPT-2's shared (:mod:`jphantom.models.gpt2`: ``GPT2Attention``,
...): read with a DeprecationWarning; they go in the next release."""


def __getattr__(name):
    """The names above load on first use (module docstring); an old name of :data:`_RENAMED`
    with a DeprecationWarning."""
    import importlib

    if name in _RENAMED:
        import warnings

        warnings.warn(f"jphantom.models.llama: {name} is now {_RENAMED[name]}; the old name goes "
                      "in the next release", DeprecationWarning, stacklevel=2)
        name = _RENAMED[name]
    if name not in _LAZY:
        raise AttributeError(f"module 'jphantom.models.llama' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
