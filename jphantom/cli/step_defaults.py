"""The run ``inspect`` and ``compile`` build from the same flags: their defaults, per model
family, where they differ from ``train``'s (:class:`jphantom.config.RunConfig`'s), in one table.

The same flags build the same model and step in both commands (compile a GPU's step with
``compile``, read the CPU's with ``inspect``, and compare). ``inspect`` defaults to the FFN
(phantom parallelism's teacher task), ``compile`` to Llama. Float32 parameters as ``train`` has
them: ``--dtype bfloat16`` or ``--precision bf16`` for 16-bit runs.
"""

from __future__ import annotations

import argparse

from jphantom.cli.parser import run_settings
from jphantom.config import FLAT

FFN_DEFAULTS = {"width": 4096, "depth": 2, "ghost_width": 16, "dtype": "float32", "batch": 256,
                "optimizer": "sgd", "learning_rate": 0.1, "warmup_steps": 0}
LM_DEFAULTS = {"layers": 4, "hidden": 512, "heads": 8, "seq_len": 256, "vocab": 32000,
               "dtype": "float32", "batch": 64, "ghost_width": 16, "optimizer": "adamw",
               "learning_rate": 3e-4, "warmup_steps": 0}
STEP_DEFAULTS = {"ffn": FFN_DEFAULTS, "lm": LM_DEFAULTS}  # by the family's ``defaults``
INSPECT_MODEL, COMPILE_MODEL = "ffn", "llama"
MODEL_FLAGS = tuple(flat for flat, (section, _) in FLAT.items() if section == "model")
"""Every setting of the model section (the families' declared fields among them)."""
INSPECT_FLAGS = (*MODEL_FLAGS, "mesh", "sequence_parallel",
                 "collective_matmul", "dtd",
                 "context_attention", "load_balance",
                 "schedule", "microbatches", "virtual_stages", "unroll_layers",
                 "accumulate_grads_in", "zero", "accumulate", "clip_norm",
                 "precision", "master_weights", "remat", "cac", "attention", "batch",
                 "optimizer")


def step_settings(args: argparse.Namespace, model: str) -> dict:
    """The flat settings of ``inspect``'s or ``compile``'s run: the model's column of
    :data:`STEP_DEFAULTS` (``model`` unless the file or the flags name another), then
    ``--config``'s file, then the flags."""
    import dataclasses

    from jphantom.registry import families
    from jphantom.config import ModelConfig
    from jphantom.errors import ConfigError

    given = run_settings(args)
    model = given.get("model", model)
    try:
        found = families.get(model)
    except ConfigError:
        return {"model": model, **given}  # refused by name when the run is built
    section = {f.name for f in dataclasses.fields(ModelConfig)}
    defaults = {k: v for k, v in STEP_DEFAULTS[found.defaults].items()
                if k not in section or (k in found.accepted and not (
                    given.get("from_hf") and k in ("layers", "hidden", "heads", "vocab")))}
    return {**defaults, "model": model, **given}


def shown_defaults(model: str) -> dict:
    """What ``--help`` shows as the defaults of :data:`STEP_DEFAULTS` (per family where they
    differ), with ``model`` the command's default model."""
    shown = {"model": model}
    for flat in dict.fromkeys([*LM_DEFAULTS, *FFN_DEFAULTS]):
        lm, ffn = LM_DEFAULTS.get(flat), FFN_DEFAULTS.get(flat)
        if lm == ffn:
            shown[flat] = lm
        elif ffn is None:
            shown[flat] = f"{lm} for language models"
        elif lm is None:
            shown[flat] = f"{ffn} for the FFN"
        else:
            shown[flat] = f"{lm} for language models, {ffn} for the FFN"
    return shown
