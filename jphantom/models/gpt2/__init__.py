"""GPT-2 (Radford et al. 2019, as Hugging Face's ``GPT2LMHeadModel``): its shape
(:class:`TransformerConfig`, :mod:`~jphantom.models.gpt2.config`), the Flax NNX module built from
plain Flax layers with no collective (:class:`GPT2`, :mod:`~jphantom.models.gpt2.model`: the zoo's
GPT-2 on the same path as any user's model, :func:`jphantom.parallelize` and
:func:`jphantom.make_train_step`), GPT-2's dense parameter dictionary
(:func:`from_dense` / :func:`to_dense`, :mod:`~jphantom.models.gpt2.dense`), Hugging Face
checkpoints read and written without torch (:func:`load` / :func:`save` as the dense dictionary,
:func:`load_hf` / :func:`save_hf` as the module, :mod:`~jphantom.models.gpt2.hf`), as
:mod:`jphantom.models.llama` holds Llama's, and its family registration
(:mod:`~jphantom.models.gpt2.family`). Importing the package registers the ``gpt2`` family and
imports no jax (the shape and the registration need none); the names of the module, the dense
dictionary and the checkpoints load on first use.
"""

from jphantom.models.gpt2.config import DTYPES, LAYER_NORM_EPS, TransformerConfig, moe_fields
from jphantom.models.gpt2.family import FAMILY, family_config, plan_shape

_LAZY = {**{name: "model" for name in ("AUX", "GPT2", "GPT2MLP", "GPT2Attention", "GPT2Block",
                                       "MoEBlock", "MoEGroup")},
         **{name: "dense" for name in ("from_dense", "to_dense")},
         **{name: "hf" for name in ("CONFIG_FILE", "HF_DEFAULTS", "INDEX_FILE", "PREFIX",
                                    "TANH_GELUS", "WEIGHTS_FILE", "config_from_hf",
                                    "config_to_hf", "load", "load_hf", "save", "save_hf",
                                    "to_hf_tensors")}}


_RENAMED = {"Attention": "GPT2Attention", "Block": "GPT2Block", "MLP": "GPT2MLP"}
"""The blocks' old names, which Llama's shared (:mod:`jphantom.models.llama`: ``LlamaAttention``,
...): read with a DeprecationWarning; they go in the next release."""


def __getattr__(name):
    """The names above load on first use (module docstring); an old name of :data:`_RENAMED`
    with a DeprecationWarning."""
    import importlib

    if name in _RENAMED:
        import warnings

        warnings.warn(f"jphantom.models.gpt2: {name} is now {_RENAMED[name]}; the old name goes "
                      "in the next release", DeprecationWarning, stacklevel=2)
        name = _RENAMED[name]
    if name not in _LAZY:
        raise AttributeError(f"module 'jphantom.models.gpt2' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jphantom.models.gpt2.{_LAZY[name]}"), name)
