"""Hugging Face checkpoints of the Llama family in and out, without torch: ``config.json`` to
and from :class:`~jphantom.models.llama.config.LlamaConfig` (``LlamaForCausalLM``,
``MixtralForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM``, ``Gemma3ForCausalLM``; what the model cannot reproduce is refused by
name), and the tensors to and from the :class:`~jphantom.models.llama.model.Llama` module.

:func:`load_hf` reads ``config.json`` and ``model.safetensors`` (or its shards) into the module,
:func:`save_hf` writes them back in the same layout, tensor for tensor (``[out, in]`` weights
transposed to Flax's ``[in, out]`` kernels and back: bit-exact).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jphantom.errors import ConfigError
from jphantom.models.llama.config import ARCHITECTURES, LAYER_TYPES, LlamaConfig
from jphantom.models.llama.model import Llama

# LlamaConfig field -> config.json key
HF_FIELDS = {"vocab_size": "vocab_size", "hidden": "hidden_size",
             "intermediate": "intermediate_size", "layers": "num_hidden_layers",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "head_dim": "head_dim", "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps",
             "max_positions": "max_position_embeddings",
             "tie_word_embeddings": "tie_word_embeddings", "experts": "num_local_experts",
             "top_k": "num_experts_per_tok", "pad_token_id": "pad_token_id"}


def _fields(hf: dict) -> dict:
    """The :data:`HF_FIELDS` a ``config.json`` dict gives; a negative ``pad_token_id`` counts
    from the end of the vocabulary, as ``nn.Embedding``'s ``padding_idx`` does."""
    fields = {name: hf[key] for name, key in HF_FIELDS.items() if key in hf}
    pad, vocab = fields.get("pad_token_id"), fields.get("vocab_size")
    if isinstance(pad, int) and isinstance(vocab, int) and -vocab <= pad < 0:
        fields["pad_token_id"] = pad + vocab
    return fields


def config_from_hf(hf: dict) -> LlamaConfig:
    """A :class:`LlamaConfig` of a ``config.json`` dict; what this model cannot reproduce is
    refused by name."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        raise ConfigError(f"model_type={kind!r} is not a Llama-family model "
                          f"({', '.join(ARCHITECTURES)})")
    if hf.get("rope_scaling"):
        raise ConfigError(f"rope_scaling={hf['rope_scaling']!r} is not implemented (plain RoPE "
                          "only): use a checkpoint without it")
    if kind == "gemma3_text":
        return _gemma3_from_hf(hf)
    rope = hf.get("rope_parameters") or {}  # where transformers 5 keeps RoPE's settings
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_parameters.rope_type={rope['rope_type']!r} is not implemented "
                          "(plain RoPE only): use a checkpoint without RoPE scaling")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not implemented: the MLP here has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is implemented")
    if kind in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise ConfigError(f"use_sliding_window=true ({kind}'s windowed layers from "
                          "max_window_layers on) is not implemented: full causal attention, or "
                          "a window on every layer (mistral)")
    if kind == "qwen3" and hf.get("attention_bias"):
        raise ConfigError("attention_bias=true on qwen3 is not implemented")
    fields = _fields(hf)
    # biases: Llama's attention_bias puts one on q, k, v and o; Qwen2 always has q, k, v ones
    fields["qkv_bias"] = kind == "qwen2" or bool(hf.get("attention_bias"))
    fields["o_bias"] = kind != "qwen2" and bool(hf.get("attention_bias"))
    fields["qk_norm"] = kind in ("qwen3", "qwen3_moe")
    if kind in ("mistral", "mixtral") and hf.get("sliding_window"):
        fields["sliding_window"] = int(hf["sliding_window"])
    fields["hf_type"] = kind if kind in ("mistral", "qwen2", "qwen3", "qwen3_moe") else None
    if kind == "qwen3_moe":  # every layer sparse, its experts moe_intermediate_size wide
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise ConfigError(f"decoder_sparse_step={hf.get('decoder_sparse_step')}, "
                              f"mlp_only_layers={hf.get('mlp_only_layers')}: dense layers among "
                              "the sparse ones are not implemented (every layer a mixture)")
        experts = hf.get("num_local_experts", hf.get("num_experts"))  # by transformers version
        if not experts:
            raise ConfigError("a qwen3_moe config.json without num_experts/num_local_experts")
        fields.update(experts=int(experts), intermediate=int(hf["moe_intermediate_size"]),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    if "rope_theta" in rope:
        fields["rope_theta"] = rope["rope_theta"]
    if kind not in ("mixtral", "qwen3_moe"):
        fields.pop("experts", None)
        fields.pop("top_k", None)
    elif "experts" not in fields:
        fields["experts"] = 8
    fields.setdefault("kv_heads", fields.get("heads", 4))
    return LlamaConfig(**fields, dtype=_dtype_of(hf))


def _dtype_of(hf: dict) -> str:
    """The model dtype a ``config.json`` names (``torch_dtype``, or transformers 5's ``dtype``)."""
    named = hf.get("torch_dtype", hf.get("dtype", "float32"))
    return named if named in ("bfloat16", "float16", "float64") else "float32"


def _gemma3_from_hf(hf: dict) -> LlamaConfig:
    """Gemma 3's text model (``gemma3_text``): RoPE per layer type, the sandwich norms, GeGLU;
    what it cannot reproduce is refused by name."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise ConfigError(f"{key}={hf[key]} is not implemented (Gemma 3 has none)")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true is not implemented: causal only")
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias=true on gemma3_text is not implemented")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ConfigError(f"hidden_activation={hf['hidden_activation']!r}: only "
                          "gelu_pytorch_tanh (GeGLU) is implemented")
    rope = hf.get("rope_parameters") or {}
    thetas = {}
    for kind in LAYER_TYPES:
        entry = rope.get(kind) or {}
        if entry.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_parameters.{kind}.rope_type={entry['rope_type']!r} is not "
                              "implemented (plain RoPE only; Gemma 3 1B's checkpoints have it)")
        thetas[kind] = entry.get("rope_theta")
    fields = _fields(hf)
    for name in ("experts", "top_k", "rope_theta", "tie_word_embeddings"):
        fields.pop(name, None)
    layer_types = tuple(hf.get("layer_types") or ())
    return LlamaConfig(**fields, rope_theta=float(thetas["full_attention"] or hf.get(
                           "rope_theta", 1e6)),
                       rope_local_theta=float(thetas["sliding_attention"] or hf.get(
                           "rope_local_base_freq", 1e4)),
                       layer_types=layer_types or None, sliding_window=hf.get("sliding_window"),
                       qk_norm=True, norm_offset=True, post_norms=True, activation="gelu_tanh",
                       embed_scale=True,
                       query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
                       hf_type="gemma3_text",
                       dtype=_dtype_of(hf))


def config_to_hf(config: LlamaConfig, extra: dict | None = None) -> dict:
    """The ``config.json`` dict: ``extra`` (what a loaded file had) updated with the model's
    fields."""
    out = dict(extra or {})
    out.update({"model_type": config.model_type,
                "architectures": [ARCHITECTURES[config.model_type]], "hidden_act": "silu",
                "torch_dtype": config.dtype})
    for name, key in HF_FIELDS.items():
        if name in ("experts", "top_k") and not config.experts:
            continue
        value = getattr(config, name)
        if value is not None:
            out[key] = value
    if config.model_type in ("llama", "mistral", "mixtral", "qwen3") and (
            config.o_bias or "attention_bias" in out):
        out["attention_bias"] = config.o_bias
    if config.model_type in ("mistral", "mixtral") and (config.sliding_window
                                                        or "sliding_window" in out):
        out["sliding_window"] = config.sliding_window
    if config.model_type == "gemma3_text":
        out.pop("hidden_act", None)
        out.pop("rope_theta", None)
        out.update(hidden_activation="gelu_pytorch_tanh", sliding_window=config.sliding_window,
                   query_pre_attn_scalar=(int(config.query_pre_attn_scalar)
                                          if float(config.query_pre_attn_scalar).is_integer()
                                          else config.query_pre_attn_scalar),
                   layer_types=list(config.layer_types or ()),
                   rope_parameters={"full_attention": {"rope_theta": config.rope_theta,
                                                       "rope_type": "default"},
                                    "sliding_attention": {"rope_theta": config.rope_local_theta,
                                                          "rope_type": "default"}})
    if config.model_type == "qwen3_moe":  # the experts' width has its own key
        out["moe_intermediate_size"] = config.intermediate
        out["intermediate_size"] = (extra or {}).get("intermediate_size", config.intermediate)
        out["norm_topk_prob"] = config.norm_topk_prob
    if isinstance(out.get("rope_parameters"), dict) and config.model_type != "gemma3_text":
        out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": config.rope_theta}
        if "rope_theta" not in (extra or {}):
            del out["rope_theta"]
    return out


def _hf_names(config: LlamaConfig) -> dict[tuple, tuple[str, bool]]:
    """Parameter path (as in the module's pure state dict) -> (HF tensor name pattern, transpose).
    ``{i}`` is the layer index (stacked) and ``{e}`` the expert index."""
    names = {("embed_tokens", "embedding"): ("model.embed_tokens.weight", False),
             ("norm", "scale"): ("model.norm.weight", False)}
    if not config.tie_word_embeddings:
        names[("lm_head", "kernel")] = ("lm_head.weight", True)
    block = ("layers", "block")
    layer = "model.layers.{i}."
    names[(*block, "input_layernorm", "scale")] = (layer + "input_layernorm.weight", False)
    names[(*block, "post_attention_layernorm", "scale")] = (
        layer + "post_attention_layernorm.weight", False)
    if config.post_norms:
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            names[(*block, norm, "scale")] = (layer + f"{norm}.weight", False)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[(*block, "self_attn", proj, "kernel")] = (layer + f"self_attn.{proj}.weight", True)
        if config.qkv_bias and proj != "o_proj" or config.o_bias and proj == "o_proj":
            names[(*block, "self_attn", proj, "bias")] = (layer + f"self_attn.{proj}.bias", False)
    if config.qk_norm:
        for norm in ("q_norm", "k_norm"):
            names[(*block, "self_attn", norm, "scale")] = (layer + f"self_attn.{norm}.weight",
                                                           False)
    if config.experts:
        qwen = config.model_type == "qwen3_moe"
        moe = layer + ("mlp." if qwen else "block_sparse_moe.")
        names[(*block, "moe", "router", "kernel")] = (moe + "gate.weight", True)
        pairs = ((("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")) if qwen
                 else (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")))
        for ours, theirs in pairs:
            names[(*block, "moe", "experts", ours)] = (moe + "experts.{e}." + theirs + ".weight",
                                                       True)
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[(*block, "mlp", proj, "kernel")] = (layer + f"mlp.{proj}.weight", True)
    return names


def to_hf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """The module's parameters as Hugging Face tensors (``[out, in]`` weights), numpy."""
    config = model.config
    _, state, _ = nnx.split(model, nnx.Param, ...)
    pure = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    tensors = {}
    for path, (name, transpose) in _hf_names(config).items():
        value = np.asarray(jax.device_get(pure[path]))
        if "{i}" not in name:
            tensors[name] = np.ascontiguousarray(value.T if transpose else value)
            continue
        for i in range(config.layers):
            layer = value[i]
            if "{e}" in name:
                for e in range(config.experts):
                    tensors[name.format(i=i, e=e)] = np.ascontiguousarray(layer[e].T)
            else:
                tensors[name.format(i=i)] = np.ascontiguousarray(layer.T if transpose else layer)
    return tensors


def from_hf_tensors(config: LlamaConfig, tensors: dict[str, np.ndarray]) -> Llama:
    """A :class:`Llama` holding ``tensors`` (HF names and layout), built without random init."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    shapes = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    pure = {}
    names = _hf_names(config)
    missing = []

    def take(name):
        if name not in tensors:
            missing.append(name)
            return None
        return tensors[name]

    for path, (name, transpose) in names.items():
        shape = shapes[path].shape
        if "{i}" not in name:
            value = take(name)
            value = None if value is None else (value.T if transpose else value)
        else:
            layers = []
            for i in range(config.layers):
                if "{e}" in name:
                    experts = [take(name.format(i=i, e=e)) for e in range(config.experts)]
                    layers.append(None if any(x is None for x in experts)
                                  else np.stack([x.T for x in experts]))
                else:
                    x = take(name.format(i=i))
                    layers.append(None if x is None else (x.T if transpose else x))
            value = None if any(x is None for x in layers) else np.stack(layers)
        if value is not None:
            if tuple(value.shape) != tuple(shape):
                raise ConfigError(f"tensor {name} has shape {value.shape}; config.json implies "
                                  f"{tuple(shape)} for {'.'.join(map(str, path))}")
            pure[path] = jnp.asarray(value)
    if missing:
        raise ConfigError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    expected = {n.format(i=i, e=e) for n, _ in names.values() for i in range(config.layers)
                for e in range(max(config.experts, 1))}
    extra = sorted(set(tensors) - expected - {"lm_head.weight"})
    if extra:
        raise ConfigError(f"the checkpoint has {len(extra)} tensors this model does not use, e.g. "
                          f"{extra[0]}")
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(pure))
    return nnx.merge(graphdef, state, rest)


def load_hf(path) -> Llama:
    """A Hugging Face Llama or Mixtral directory (``config.json`` + ``model.safetensors``, or
    its shards and their index) as a
    :class:`Llama`; the file's other config fields are kept for :func:`save_hf`."""
    from jphantom.models.gpt2.hf import read_tensors  # GPT-2's reader: damage in one line

    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{config_file} not found: a Hugging Face directory holds config.json "
                          "and model.safetensors")
    hf = json.loads(config_file.read_text())
    config = config_from_hf(hf)
    model = from_hf_tensors(config, read_tensors(directory))
    model.hf_config = json.dumps(hf)  # a static string: the file's fields, for save_hf
    return model


def save_hf(path, model: Llama) -> None:
    """Write ``model`` as a Hugging Face directory: ``config.json`` and ``model.safetensors``."""
    from safetensors.numpy import save_file

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    extra = getattr(model, "hf_config", None)
    config = config_to_hf(model.config, json.loads(extra) if extra else None)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(to_hf_tensors(model), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
