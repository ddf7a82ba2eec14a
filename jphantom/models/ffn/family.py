"""Seal et al.'s FFN as a model family (:mod:`jphantom.registry.families`): its registration
(``ffn``), its configuration from a run's model section and its FLOPs, without jax (the NNX
module and the builder, :mod:`jphantom.models.ffn.program`, are
:class:`~jphantom.registry.families.Lazy` references, imported when a model is built)."""

from __future__ import annotations

from jphantom.registry.families import GHOST_WIDTH, Field
from jphantom.models.ffn.config import FFNConfig

WIDTH = Field("width", int, 256, "width n of its n x n layers", minimum=1)
DEPTH = Field("depth", int, 2, "its layers L", minimum=1)
"""The model-section settings the FFN owns (:class:`jphantom.registry.families.Field`)."""


def family_config(section, phantom: bool) -> FFNConfig:
    """The :class:`FFNConfig` of the run's model section (:class:`jphantom.config.ModelConfig`):
    phantom's ghost width only under a phantom strategy."""
    return FFNConfig(section.width, section.depth, section.ghost_width if phantom else None,
                     section.dtype)


def _register():
    from jphantom.registry import families

    return families.register(families.Family(
        name="ffn", description="Seal et al.'s FFN of --width x --depth (its teacher task)",
        config_type=FFNConfig, module=families.Lazy("jphantom.models.ffn.model", "FFN"),
        from_flags=family_config,
        fields=(WIDTH, DEPTH, GHOST_WIDTH), common_flags=("dtype",),
        flops_per_token=lambda config, seq_len: 6 * config.depth * config.width ** 2,
        build=families.Lazy("jphantom.models.ffn.program", "build"), program="ffn",
        defaults="ffn"))


FAMILY = _register()
