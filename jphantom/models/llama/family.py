"""What the family registry (:mod:`jphantom.registry.families`) reads of a Llama-family model: its
FLOPs per token, the block shape the planner prices, its configuration from a run's model
section, and :func:`register_variant`, which declares one preset of the Llama block as a family
(:mod:`jphantom.models.llama.variants` declares the zoo's); without jax (the NNX module and the
Hugging Face reader and writer are :class:`~jphantom.registry.families.Lazy` references, imported when a
model is built or a checkpoint read)."""

from __future__ import annotations

import dataclasses

from jphantom.errors import ConfigError
from jphantom.registry.families import GHOST_WIDTH, Field
from jphantom.models.llama.config import LlamaConfig

KV_HEADS = Field("kv_heads", int | None, None,
                 "key/value heads of grouped-query attention (default: heads)", minimum=1)
INTERMEDIATE = Field("intermediate", int | None, None, "MLP width (qwen3_moe: each expert's; "
                     "default 8h/3 rounded up to a multiple of 32)", minimum=1)
SLIDING_WINDOW = Field("sliding_window", int | None, None, "the attention window W (each token "
                       "attends itself and the W-1 before it; gemma3's local layers, default "
                       "512)", minimum=1)
"""The model-section settings the Llama family owns (:class:`jphantom.registry.families.Field`; every
variant reads ``kv_heads``, ``intermediate`` and the shared ghost width, a variant's
``register_variant(fields=...)`` adds its own)."""

HF = "jphantom.models.llama.hf"
"""The module of the family's Hugging Face reader and writer (numpy and jax: imported when
used)."""


def default_intermediate(hidden: int) -> int:
    """Llama's SwiGLU width for ``hidden``: 8h/3 rounded up to a multiple of 32."""
    return -(-8 * hidden // 3 // 32) * 32


def flops_per_token(config: LlamaConfig, seq_len: int) -> int:
    """Forward + backward model FLOPs per token at ``seq_len``: 6 x the weights in matmuls (the
    query, key, value and output projections, the MLP's three matmuls or the router and the k
    experts a token visits, the head) plus attention's 6 L S heads d (QK^T and AV over the causal
    half of the square, forward and backward; sliding windows counted whole)."""
    c = config
    h, d, L = c.hidden, c.dim, c.layers
    attention = h * c.heads * d * 2 + h * c.kv_heads * d * 2
    mlp = (h * c.experts + c.top_k * 3 * h * c.intermediate) if c.experts else (
        3 * h * c.intermediate)
    return 6 * (L * (attention + mlp) + c.vocab_size * h) + 6 * L * seq_len * c.heads * d


def plan_shape(config: LlamaConfig, model: str = "llama"):
    """The dense-block shape :mod:`jphantom.planner` prices (its Llama block: GQA projections and a
    gated MLP; norms, biases and q/k norms are small parameters it leaves out)."""
    from jphantom.perf.axonn_model import GPTShape

    if config.experts:
        raise ConfigError("the planner prices dense blocks; MoE blocks are not modelled: use a "
                          "dense model")
    if config.dim * config.heads != config.hidden:
        raise ConfigError(f"head_dim={config.dim} x heads={config.heads} != hidden="
                          f"{config.hidden}: the planner prices heads of hidden/heads features")
    return GPTShape(config.layers, config.hidden, config.heads, config.max_positions,
                    config.vocab_size, "llama", config.intermediate, config.kv_heads,
                    tied=config.tie_word_embeddings, model=model)


def family_config(section, name: str, **preset) -> LlamaConfig:
    """The :class:`LlamaConfig` of the run's model section (:class:`jphantom.config.ModelConfig`)
    for the Llama-family ``name``: its checkpoint's (``from_hf``) or the section's shape with the
    family's ``preset`` fields (a callable preset is called with the section)."""
    from jphantom.registry import families

    if section.from_hf:
        from jphantom.models.llama.hf import config_from_hf

        config = config_from_hf(families.read_hf_config(section.from_hf, families.get(name)))
        families.check_checkpoint_shape(section, config, {
            "layers": "layers", "hidden": "hidden", "heads": "heads", "vocab": "vocab_size",
            "kv_heads": "kv_heads", "intermediate": "intermediate",
            "sliding_window": "sliding_window"})
        return dataclasses.replace(config, dtype=section.dtype)
    fields = dict(vocab_size=section.vocab, hidden=section.hidden,
                  intermediate=section.intermediate or default_intermediate(section.hidden),
                  layers=section.layers, heads=section.heads,
                  kv_heads=section.kv_heads or section.heads, max_positions=section.seq_len,
                  dtype=section.dtype)
    fields.update({k: v(section) if callable(v) else v for k, v in preset.items()})
    return LlamaConfig(**fields)


def register_variant(name: str, description: str, hf_types: tuple[str, ...], *,
                     fields: tuple[Field, ...] = (), flags: tuple[str, ...] = (), check=None,
                     aliases: tuple[str, ...] = (),
                     **preset):
    """Register a Llama-family variant (one :class:`LlamaConfig` preset, the
    :class:`~jphantom.models.llama.Llama` module, its Hugging Face reader and writer); the
    variant owns the configurations whose :attr:`LlamaConfig.model_type` is in ``hf_types``;
    ``fields``: the model-section settings it reads beyond every variant's (declarations,
    :class:`jphantom.registry.families.Field`; ``flags``: names of fields declared elsewhere);
    what it runs follows from the preset (its per-head q/k norms, ``qk_norm``, leave pmm3d out:
    :meth:`jphantom.registry.strategies.Strategy.runs`)."""
    import functools

    from jphantom.registry import families

    return families.register(families.Family(
        name=name, description=description, config_type=LlamaConfig,
        module=families.Lazy("jphantom.models.llama.model", "Llama"),
        from_flags=lambda section, phantom: family_config(section, name, **preset),
        fields=(KV_HEADS, INTERMEDIATE, GHOST_WIDTH, *fields), flags=flags, hf_types=hf_types,
        config_from_hf=families.Lazy(HF, "config_from_hf"), load_hf=families.Lazy(HF, "load_hf"),
        save_hf=families.Lazy(HF, "save_hf"),
        flops_per_token=flops_per_token, plan_shape=functools.partial(plan_shape, model=name),
        plan=families.Lazy("jphantom.models.llama.plan", "plan"),
        matches=lambda config: config.model_type in hf_types, check=check, aliases=aliases,
        per_head_norms=bool(preset.get("qk_norm"))))
