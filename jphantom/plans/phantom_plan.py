"""The ready-made plan of phantom parallelism (Seal et al.): every linear a phantom layer of k
ghost neurons, embeddings and norms split over features: :func:`phantom`."""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from jphantom.nn.moe import Experts, SwitchMoE
from jphantom.plans.paths import holds_params, inside
from jphantom.plans.styles import NORMS, Style
from jphantom.plans.walk import (COLUMN, check_fused_qkv, HEAD_NORMS, ROUTERS, ROW,
                                 leaf_name, named_entries, split_features, walk_model)


def phantom(model: nnx.Module, ghost_width: int = 8, *, vocab: str | None = None,
            named: Mapping | None = None) -> dict[str, Style]:
    """Phantom parallelism (Seal et al.) for a whole model: every linear a phantom layer of k =
    ``ghost_width`` ghost neurons (the LM head with vocabulary-split outputs), embeddings and norms
    split over features, routers row-parallel (their logits all-reduced), experts on the
    feature-split stream."""
    modules, embeds, _, vocab = walk_model(model, vocab)
    layer = Style("phantom", ghost_width=ghost_width)
    plan = named_entries(modules, named)
    for path, (path_tuple, module) in modules.items():
        if path in plan or inside(path, plan):
            continue
        if isinstance(module, NORMS) and leaf_name(path_tuple) in HEAD_NORMS:
            plan[path] = "replicate"  # per-head norms: each rank normalises its whole heads
            continue
        if isinstance(module, (nnx.Embed, *NORMS, Experts, SwitchMoE)):
            plan[path] = layer
        elif isinstance(module, nnx.Linear):
            name = leaf_name(path_tuple)
            if name in ROUTERS:
                plan[path] = Style("row")
            elif (vocab is not None and module.out_features == vocab
                  and name not in COLUMN | ROW):  # the LM head, not an MLP as wide as V
                plan[path] = Style("phantom", ghost_width=ghost_width, vocab_output=True)
            else:
                check_fused_qkv(modules, path, "plans.phantom")
                plan[path] = layer
        elif holds_params(module) and not inside(path, plan):
            raise split_features(path, module, "plans.phantom")
    return plan
