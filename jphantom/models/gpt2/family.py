"""GPT-2 (Radford et al. 2019) as a model family (:mod:`jphantom.registry.families`): its configuration
from a run's model section, the block shape the planner prices, and its registration (``gpt2``,
alias ``transformer``), without jax (the NNX module and the Hugging Face reader and writer are
:class:`~jphantom.registry.families.Lazy` references, imported when a model is built or a checkpoint
read)."""

from __future__ import annotations

import dataclasses

from jphantom.errors import ConfigError
from jphantom.registry.families import EXPERTS, GHOST_WIDTH, MOE_EVERY, TOP_K, Field
from jphantom.models.gpt2.config import TransformerConfig, moe_fields

CAPACITY_FACTOR = Field(
    "capacity_factor", float, 1.25, "each MoE expert takes capacity_factor x T k / E tokens per "
    "rank; the rest are dropped and counted", minimum=0, above=True)
DROPLESS = Field("dropless", bool, False, "MoE with no capacity, no dropped tokens (grouped "
                 "matmuls, ragged all-to-all)")
"""The model-section settings GPT-2 owns (:class:`jphantom.registry.families.Field`; it reads the shared
ghost width and routed-expert ones too)."""

HF = "jphantom.models.gpt2.hf"
"""The module of GPT-2's Hugging Face reader and writer (numpy and jax: imported when used)."""


def family_config(section, phantom: bool) -> TransformerConfig:
    """The :class:`TransformerConfig` of the run's model section
    (:class:`jphantom.config.ModelConfig`): its checkpoint's (``from_hf``) or the section's shape.
    A phantom GPT-2 has an untied head (its feature-split activations would all-reduce a tied
    head's logits)."""
    from jphantom.registry import families

    ghost = section.ghost_width if phantom else None
    if section.from_hf:
        from jphantom.models.gpt2.hf import config_from_hf

        config = config_from_hf(families.read_hf_config(section.from_hf, families.get("gpt2")))
        families.check_checkpoint_shape(section, config, {
            "layers": "layers", "hidden": "hidden", "heads": "heads", "vocab": "vocab_size"})
        if section.seq_len > config.seq_len:
            raise ConfigError(f"seq_len={section.seq_len} exceeds the checkpoint's "
                              f"{config.seq_len} positions: pass --seq-len {config.seq_len} or "
                              "less")
        return dataclasses.replace(config, dtype=section.dtype, tied_head=not phantom,
                                   ghost_width=ghost)
    return TransformerConfig(vocab_size=section.vocab, seq_len=section.seq_len,
                             hidden=section.hidden, heads=section.heads, layers=section.layers,
                             ghost_width=ghost, dtype=section.dtype, tied_head=not phantom,
                             **moe_fields(section.moe_every, section.experts, section.top_k,
                                          section.capacity_factor, section.dropless))


def check(section) -> None:
    """A run's model section GPT-2 cannot build: a capacity factor with dropless experts."""
    if section.dropless and section.capacity_factor != CAPACITY_FACTOR.default:
        raise ConfigError(f"--capacity-factor {section.capacity_factor:g} does not apply with "
                          "--dropless (no capacity: no token is dropped); leave one out")


def plan_shape(config: TransformerConfig):
    """The dense-block shape :mod:`jphantom.planner` prices (GPT-2's block, tied head)."""
    from jphantom.perf.axonn_model import GPTShape

    if config.moe_every:
        raise ConfigError("the planner prices dense blocks; MoE blocks are not modelled: use a "
                          "dense model")
    return GPTShape(config.layers, config.hidden, config.heads, config.seq_len,
                    config.vocab_size)


def _register():
    from jphantom.registry import families

    return families.register(families.Family(
        name="gpt2", description="GPT-2 (LayerNorm, GELU MLP, learned positions, tied head); "
        "GShard-style routed MoE blocks with --moe-every", config_type=TransformerConfig,
        module=families.Lazy("jphantom.models.gpt2.model", "GPT2"), from_flags=family_config,
        fields=(GHOST_WIDTH, MOE_EVERY, EXPERTS, TOP_K, CAPACITY_FACTOR, DROPLESS),
        hf_types=("gpt2",), config_from_hf=families.Lazy(HF, "config_from_hf"),
        load_hf=families.Lazy(HF, "load_hf"), save_hf=families.Lazy(HF, "save_hf"),
        flops_per_token=lambda config, seq_len: dataclasses.replace(
            config, seq_len=seq_len).flops_per_token(),
        plan_shape=plan_shape, plan=families.Lazy("jphantom.models.gpt2.plan", "plan"), check=check,
        aliases=("transformer",)))


FAMILY = _register()
