"""How the ready-made plans recognise a model's layers, by walking its modules.

The walk recognises layers by type and by the names common model families use: the token table
by how the model uses it (:func:`vocabulary_table`: the only ``nnx.Embed``, the one as large as an
untied head, or the one named like a token table beside position tables; else the caller names
it), any other ``nnx.Embed`` a position table; the LM head an ``nnx.Linear`` with V outputs;
column-parallel linears (:data:`COLUMN`: q, k, v, up and gate projections) and row-parallel ones
(:data:`ROW`: attention output, down projections) by attribute name; routers (:data:`ROUTERS`),
norms and Experts by type. A linear the walk cannot place, or any other module holding parameters
it does not know, is a ConfigError naming its path and class and how to name it: the plans are
exhaustive, never silently partial."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn.moe import SwitchMoE
from jphantom.plans.paths import modules_by_path


COLUMN = frozenset({"q", "k", "v", "qkv", "c_attn", "q_proj", "k_proj", "v_proj", "query",
                    "key", "value", "wq", "wk", "wv", "up", "up_proj", "gate_proj", "w1", "w3",
                    "fc1", "c_fc", "wi", "mlp_up", "fc_in", "in_proj"})
ROW = frozenset({"o", "o_proj", "out", "out_proj", "down", "down_proj", "w2", "fc2", "c_proj",
                 "wo", "attn_out", "mlp_down", "fc_out"})
FUSED_QKV = frozenset({"qkv", "c_attn", "in_proj"})  # one projection for q, k and v
HEAD_NORMS = frozenset({"q_norm", "k_norm"})  # Qwen3, OLMo 2: over each head's features
KV_COLUMNS = frozenset({"k", "v", "k_proj", "v_proj", "key", "value", "wk", "wv"})
ROUTERS = frozenset({"router", "gate"})
# the norm before a block's MLP: when that MLP is a routed mixture of experts (SwitchMoE) it stays
# replicated under Megatron, so that the router runs on the replicated stream and TED's f acts on
# the dispatched buffers (Singh's thesis ch. 7)
MLP_NORMS = frozenset({"ln_2", "post_attention_layernorm", "ffn_norm", "norm2"})


VOCAB_NAMES = frozenset({"wte", "tok", "tok_embeddings", "embed_tokens", "token_embedding",
                         "tokens", "word_embeddings", "embed", "embedding", "tok_emb"})
POSITION_NAMES = frozenset({"wpe", "pos", "pos_embedding", "position_embeddings", "positions",
                            "pos_emb", "position_embedding"})


def walk_model(model: nnx.Module, vocab: str | None = None):
    """The model's modules (those inside a SwitchMoE left out: the MoE is one plan entry), its
    embeddings, and the token table's path and size (:func:`vocabulary_table`)."""
    modules = modules_by_path(model)
    moes = [path for path, (_, m) in modules.items() if isinstance(m, SwitchMoE)]
    modules = {path: entry for path, entry in modules.items()
               if not any(path.startswith(moe + ".") for moe in moes)}
    embeds = {path: m for path, (_, m) in modules.items() if isinstance(m, nnx.Embed)}
    table = vocabulary_table(model, vocab, modules=modules)
    return modules, embeds, table, (None if table is None else embeds[table].num_embeddings)


def vocabulary_table(model: nnx.Module, vocab: str | None = None, *, modules=None) -> str | None:
    """The path of ``model``'s token table, found by how the model uses its embeddings, never by
    their sizes: ``vocab`` when given; the only ``nnx.Embed``; the one as large as an untied LM
    head's outputs (an ``nnx.Linear`` not named like a projection); the one named like a token
    table (:data:`VOCAB_NAMES`) beside ones named like position tables
    (:data:`POSITION_NAMES`). Anything else is a :class:`ConfigError` asking for ``vocab``.
    ``None`` for a model without embeddings."""
    modules = modules_by_path(model) if modules is None else modules
    embeds = {path: m for path, (_, m) in modules.items() if isinstance(m, nnx.Embed)}
    if vocab is not None:
        if vocab not in embeds:
            raise ConfigError(f"vocab={vocab!r} is not an nnx.Embed of {type(model).__name__}; "
                              f"its embeddings: {', '.join(embeds) or 'none'}")
        return vocab
    if len(embeds) <= 1:
        return next(iter(embeds), None)
    heads = {m.out_features for path, (tup, m) in modules.items()
             if isinstance(m, nnx.Linear) and leaf_name(tup) not in COLUMN | ROW | ROUTERS}
    by_head = [path for path, m in embeds.items() if m.num_embeddings in heads]
    if len(by_head) == 1:
        return by_head[0]
    names = {path: path.split(".")[-1] for path in embeds}
    tokens = [p for p, n in names.items() if n in VOCAB_NAMES]
    if len(tokens) == 1 and all(n in POSITION_NAMES for p, n in names.items() if p != tokens[0]):
        return tokens[0]
    raise ConfigError(f"cannot tell which of {type(model).__name__}'s embeddings "
                      f"({', '.join(embeds)}) is the token table (the vocabulary): pass "
                      "vocab='<its path>' to the plan (e.g. plans.megatron(model, vocab=...))")


def leaf_name(path_tuple) -> str:
    return str(path_tuple[-1])


def named_entries(modules: dict, named: Mapping | None) -> dict:
    """The entries of ``named`` (path patterns -> styles) on ``modules``' paths: what a walk
    takes as given."""
    plan = {}
    for pattern, style in (named or {}).items():
        matched = [path for path in modules if fnmatch.fnmatchcase(path, pattern)]
        if not matched:
            raise ConfigError(f"named pattern {pattern!r} matches no module; the modules include: "
                              f"{', '.join(list(modules)[:12])}")
        for path in matched:
            plan[path] = style
    return plan


def split_features(path: str, module, walk: str) -> ConfigError:
    """A module of the user's in a plan that splits every activation's features (phantom,
    pmm3d): it would see a slice of each token's features."""
    kind = type(module).__name__
    return ConfigError(f"{walk} cannot place {path} ({kind}): this plan splits every "
                       "activation's features, so the module would see a slice of each "
                       "token's; register a style for its class (jphantom.register_style) and "
                       f"name it in the plan, or use strategy 'tensor' (plans.megatron)")


def check_fused_qkv(modules: Mapping, path: str, plan_name: str) -> None:
    """A fused q/k/v projection keeps whole heads, each with its q, k and v, under a split of its
    outputs over ranks only when its outputs are ordered head by head (``[heads, 3, head_dim]``,
    as :class:`jphantom.models.gpt2.model.GPT2Attention` orders GPT-2's ``c_attn``). In Hugging
    Face's layout (``q | k | v``) a contiguous split would hand a rank a slice of each instead,
    silently wrong; so the module holding it must declare ``FUSED_QKV_LAYOUT = "heads"``, and
    anything else is refused by name. Any other linear passes."""
    if path.rsplit(".", 1)[-1] not in FUSED_QKV:
        return
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    holder = modules.get(parent, (None, None))[1]
    if getattr(holder, "FUSED_QKV_LAYOUT", None) == "heads":
        return
    owner = type(holder).__name__ if holder is not None else "its module"
    raise ConfigError(
        f"{plan_name}: {path} is a fused q/k/v projection; in Hugging Face's layout (q | k | v "
        "along its outputs) a split of its outputs over ranks gives a rank part of q, k and v "
        "instead of whole heads. Split it into q, k and v linears; or order its outputs head "
        f"by head ([heads, 3, head_dim]) and set FUSED_QKV_LAYOUT = 'heads' on {owner}; or "
        f"name its style yourself (named={{{path!r}: ...}})")
