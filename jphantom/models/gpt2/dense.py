"""GPT-2's dense parameter dictionary (the layout :func:`jphantom.models.gpt2.hf.load` and
:func:`~jphantom.models.gpt2.hf.save` read and write) to and from the :class:`GPT2` module, by
slicing only. ``qkv`` is GPT-2's fused ``c_attn``: the dictionary keeps Hugging Face's
[3, heads, d] order of its output features, the module [heads, 3, d]
(:class:`~jphantom.models.gpt2.model.GPT2Attention`); the reordering is a permutation, bit for
bit both ways. MoE blocks have no dense dictionary (refused by name).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from jphantom.errors import ConfigError
from jphantom.models.gpt2.config import TransformerConfig
from jphantom.models.gpt2.model import GPT2

# (our path, dense path): every tensor but the fused QKV, which from_dense / to_dense reorder
_BLOCK = [(("ln_1", "scale"), ("ln1", "scale")), (("ln_1", "bias"), ("ln1", "bias")),
          (("ln_2", "scale"), ("ln2", "scale")), (("ln_2", "bias"), ("ln2", "bias")),
          (("attn", "out", "kernel"), ("attn_out", "weight")),
          (("attn", "out", "bias"), ("attn_out", "bias")),
          (("mlp", "up", "kernel"), ("mlp_up", "weight")), (("mlp", "up", "bias"), ("mlp_up", "bias")),
          (("mlp", "down", "kernel"), ("mlp_down", "weight")),
          (("mlp", "down", "bias"), ("mlp_down", "bias"))]
_TOP = [(("wte", "embedding"), ("wte",)), (("wpe", "embedding"), ("wpe",)),
        (("ln_f", "scale"), ("ln_f", "scale")), (("ln_f", "bias"), ("ln_f", "bias"))]


def _no_moe(config: TransformerConfig) -> None:
    if config.moe_every:
        raise ConfigError("the dense dictionary (and Hugging Face's GPT-2) has no MoE blocks: "
                          "save an MoE GPT-2 with the checkpoint module (Orbax), not as GPT-2 "
                          "tensors")


def from_dense(config: TransformerConfig, params: dict) -> GPT2:
    """The :class:`GPT2` holding the dense dictionary ``params`` (:func:`load`'s layout), by
    slicing only: built abstract, then filled."""
    _no_moe(config)
    abstract = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
    theirs_flat = traverse_util.flatten_dict(params)
    pure = {ours: jnp.asarray(theirs_flat[theirs]) for ours, theirs in _TOP}
    pure.update({("blocks", "block", *ours): jnp.asarray(theirs_flat[("blocks", *theirs)])
                 for ours, theirs in _BLOCK})
    heads, d = config.heads, config.head_dim
    blocks = params["blocks"]
    weight = jnp.asarray(blocks["qkv"]["weight"])  # [L, h, 3, heads * d]
    layers = weight.shape[0]
    pure[("blocks", "block", "attn", "qkv", "kernel")] = weight.reshape(
        layers, -1, 3, heads, d).transpose(0, 1, 3, 2, 4).reshape(layers, -1, 3 * heads * d)
    bias = jnp.asarray(blocks["qkv"]["bias"])  # [L, 3, heads * d]
    pure[("blocks", "block", "attn", "qkv", "bias")] = bias.reshape(
        layers, 3, heads, d).transpose(0, 2, 1, 3).reshape(layers, 3 * heads * d)
    if not config.tied_head:
        pure[("head", "kernel")] = jnp.asarray(params["head"]["weight"])
        pure[("head", "bias")] = jnp.asarray(params["head"]["bias"])
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(pure))
    return nnx.merge(graphdef, state, rest)


def to_dense(model: GPT2) -> dict:
    """The dense dictionary of ``model``'s parameters (numpy), ``qkv`` back in the [3, heads, d]
    order of the fused QKV."""
    _no_moe(model.config)
    _, state, _ = nnx.split(model, nnx.Param, ...)
    pure = jax.device_get(nnx.to_pure_dict(state))
    ours_flat = traverse_util.flatten_dict(pure)
    out = {theirs: np.asarray(ours_flat[ours]) for ours, theirs in _TOP}
    out.update({("blocks", *theirs): np.asarray(ours_flat[("blocks", "block", *ours)])
                for ours, theirs in _BLOCK})
    out = traverse_util.unflatten_dict(out)
    qkv = pure["blocks"]["block"]["attn"]["qkv"]
    heads, d = model.config.heads, model.config.head_dim
    kernel, bias = np.asarray(qkv["kernel"]), np.asarray(qkv["bias"])  # [heads, 3, d] order
    layers = kernel.shape[0]
    out["blocks"]["qkv"] = {
        "weight": kernel.reshape(layers, -1, heads, 3, d).transpose(0, 1, 3, 2, 4).reshape(
            layers, -1, 3, heads * d),
        "bias": bias.reshape(layers, heads, 3, d).transpose(0, 2, 1, 3).reshape(layers, 3,
                                                                             heads * d)}
    if not model.config.tied_head:
        out["head"] = {"weight": np.asarray(pure["head"]["kernel"]),
                       "bias": np.asarray(pure["head"]["bias"])}
    return out
