"""Hugging Face checkpoints of the model zoo, in and out, without torch.

    model = jphantom.models.hf.load("path/to/checkpoint")   # GPT-2, Llama, Mixtral, Qwen...
    logits = model(tokens)                                   # [batch, seq] ids -> [batch, seq, V]
    jphantom.models.hf.save("out", model)                    # config.json + model.safetensors

The family is the registered one (:mod:`jphantom.registry.families`) that reads ``config.json``'s
``model_type``: ``gpt2`` (:mod:`jphantom.models.gpt2`); ``llama``, ``mixtral``, ``mistral``,
``qwen2``, ``qwen3``, ``qwen3_moe`` and ``gemma3_text`` (:mod:`jphantom.models.llama`, its presets
in :mod:`jphantom.models.llama.variants`). A load then a save writes the file's tensors back
exactly (names, dtypes, bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

from jphantom.errors import ConfigError
from jphantom.registry import families


def model_type(path) -> str:
    """The ``model_type`` of the checkpoint at ``path`` (refused unless a family reads it)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"{config} not found: a Hugging Face checkpoint directory holds "
                          "config.json and model.safetensors")
    try:
        kind = json.loads(config.read_text()).get("model_type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise ConfigError(f"cannot read {config} as a JSON object: {error}") from None
    families.of_hf_type(kind)
    return kind


def load(path):
    """The checkpoint at ``path`` as an ``nnx.Module`` of its family."""
    found = families.of_hf_type(model_type(path))
    if found.load_hf is None:
        raise ConfigError(f"the {found.name} family declares no Hugging Face reader")
    return found.load_hf(path)


def save(path, model) -> None:
    """``model`` (a zoo model: GPT-2, the Llama family, a registered family's) as a Hugging Face
    directory at ``path``."""
    config = getattr(model, "config", None)
    try:
        found = families.of_config(config)
    except ConfigError:
        found = None
    if found is None or found.save_hf is None:
        raise ConfigError(f"hf.save takes a model of a family with a Hugging Face writer (GPT2, "
                          f"the Llama family), not {type(model).__name__}")
    found.save_hf(path, model)
