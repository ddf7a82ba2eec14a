"""The ready-made plan of AxoNN's 3D matmul (Singh's thesis ch. 5) on ``x``, ``y``, ``z``:
:func:`pmm3d`."""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn.moe import Experts, SwitchMoE
from jphantom.plans.paths import holds_params, inside
from jphantom.plans.styles import NORMS, Style
from jphantom.plans.walk import (COLUMN, check_fused_qkv, HEAD_NORMS, ROUTERS, ROW,
                                 leaf_name, named_entries, split_features, walk_model)


def pmm3d(model: nnx.Module, *, weights: str = "kept", vocab: str | None = None,
          named: Mapping | None = None) -> dict[str, Style]:
    """AxoNN's 3D matmul (Singh's thesis ch. 5) for a whole model on ``x``, ``y``, ``z``: q/k/v and
    up/gate normal layers, attention output and down transposed, the token table (and an untied
    head) vocabulary over ``x``, norms and position tables over ``y``. ``weights``: the linears'
    gathered weights, ``"kept"``, ``"regather"`` or ``"deferred"``
    (:class:`~jphantom.nn.pmm3d.Pmm3dLinear`; the token table is always kept)."""
    modules, embeds, table, vocab = walk_model(model, vocab)
    plan = named_entries(modules, named)
    for path, (path_tuple, module) in modules.items():
        name = leaf_name(path_tuple)
        if path in plan or inside(path, plan):
            continue
        if isinstance(module, nnx.Embed):
            plan[path] = Style("pmm3d", vocab_output=path == table)
        elif isinstance(module, NORMS) and name in HEAD_NORMS:
            raise ConfigError(f"plans.pmm3d: {path} normalises each attention head, whose "
                              "features pmm3d splits over y; use plans.megatron or "
                              "plans.phantom for a model with per-head q/k norms (Qwen3)")
        elif isinstance(module, NORMS):
            plan[path] = Style("pmm3d")
        elif isinstance(module, SwitchMoE):
            plan[path] = Style("pmm3d")
        elif isinstance(module, Experts) or name in ROUTERS:
            raise ConfigError(f"plans.pmm3d: {path} is part of a mixture of experts that is not "
                              "a routed SwitchMoE (GPT-2's MoE blocks), which pmm3d does not "
                              "split; use strategy 'tensor' (plans.megatron) with an expert axis")
        elif isinstance(module, nnx.Linear):
            if name in COLUMN:
                check_fused_qkv(modules, path, "plans.pmm3d")
                plan[path] = Style("pmm3d", role="normal", weights=weights)
            elif name in ROW:
                plan[path] = Style("pmm3d", role="transposed", weights=weights)
            elif vocab is not None and module.out_features == vocab:
                plan[path] = Style("pmm3d", role="normal", vocab_output=True, weights=weights)
            else:
                raise ConfigError(f"plans.pmm3d cannot tell whether {path} is a normal or a "
                                  "transposed layer: write the plan by hand")
        elif holds_params(module) and not inside(path, plan):
            raise split_features(path, module, "plans.pmm3d")
    return plan
