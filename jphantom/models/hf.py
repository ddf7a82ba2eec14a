"""Hugging Face checkpoints of the model zoo, in and out, without torch.

    model = jphantom.models.hf.load("path/to/checkpoint")   # GPT-2, Llama, Mixtral, Qwen...
    logits = model(tokens)                                   # [batch, seq] ids -> [batch, seq, V]
    jphantom.models.hf.save("out", model)                    # config.json + model.safetensors

The family is picked by ``config.json``'s ``model_type``: ``gpt2``
(:mod:`jphantom.models.gpt2`), ``llama``, ``mixtral``, ``mistral``, ``qwen2``, ``qwen3``, ``qwen3_moe`` and ``gemma3_text``
(:mod:`jphantom.models.llama`). A load
then a save writes the file's tensors back exactly (names, dtypes, bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

from jphantom.errors import ConfigError

FAMILIES = ("gpt2", "llama", "mixtral", "mistral", "qwen2", "qwen3", "qwen3_moe",
            "gemma3_text")


def model_type(path) -> str:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(f"{config} not found: a Hugging Face checkpoint directory holds "
                          "config.json and model.safetensors")
    kind = json.loads(config.read_text()).get("model_type")
    if kind not in FAMILIES:
        raise ConfigError(f"{config}: model_type={kind!r} is not in the zoo; supported: "
                          f"{', '.join(FAMILIES)}")
    return kind


def load(path):
    """The checkpoint at ``path`` as an ``nnx.Module`` of its family."""
    if model_type(path) == "gpt2":
        from jphantom.models import gpt2

        return gpt2.load_hf(path)
    from jphantom.models import llama

    return llama.load_hf(path)


def save(path, model) -> None:
    """``model`` (a zoo model: GPT-2, the Llama family) as a Hugging Face directory at ``path``."""
    from jphantom.models import llama

    if isinstance(model, llama.Llama):
        return llama.save_hf(path, model)
    from jphantom.models import gpt2

    if isinstance(model, gpt2.GPT2):
        return gpt2.save_hf(path, model)
    raise ConfigError(f"hf.save takes a zoo model (GPT2, Llama), not {type(model).__name__}")
