"""The ready-made plan of Megatron tensor parallelism (Shoeybi et al., Brakel et al.), with
sequence parallelism (Korthikanti et al. 2022), collective matmul, grouped-query
attention's shared key/value heads and routed experts (expert parallelism, TED, DTD: Singh's
thesis ch. 7): :func:`megatron`."""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn.moe import Experts, SwitchMoE
from jphantom.plans.paths import holds_params, inside, unplaced
from jphantom.plans.styles import NORMS, Style
from jphantom.registry.strategies import check_collective_matmul, check_dtd
from jphantom.plans.walk import (COLUMN, check_fused_qkv, HEAD_NORMS, KV_COLUMNS,
                                 MLP_NORMS, ROUTERS, ROW, leaf_name, named_entries, walk_model)


def megatron(model: nnx.Module, *, sequence_parallel: bool = False, dtd: bool = False,
             collective_matmul: bool = False, kv_heads: int | None = None,
             vocab: str | None = None, named: Mapping | None = None) -> dict[str, str | Style]:
    """Megatron tensor parallelism (Brakel et al.): q/k/v and up/gate column-parallel, attention output
    and down row-parallel, embedding and head vocabulary-parallel, experts split over their width,
    routers replicated, norms ``input`` (f once for the layers they feed: pre-norm blocks);
    ``sequence_parallel`` (Korthikanti et al. 2022): norms and position tables ``sequence``. A routed mixture of
    experts (:class:`~jphantom.nn.moe.SwitchMoE`) is ``experts`` (over ``expert`` and TED;
    ``dtd``: duplicate token dropping) and the norm before it (:data:`MLP_NORMS`) ``replicate``.
    ``collective_matmul`` (with ``sequence_parallel``): the row layers and the norms inside the
    blocks that feed column layers only (not a block's MLP norm where its MLP is a mixture of
    experts, not the final norm before the head) run their collectives as rings under the GEMMs
    (:mod:`jphantom.nn.tensor`). ``kv_heads``: the key/value heads of grouped-query attention
    (the key and value projections then ``Style("column", kv_heads=...)``: with more ranks than
    heads each rank computes the head its query heads share,
    :class:`~jphantom.nn.tensor.SharedHeadsLinear`); default the model's ``config.kv_heads``
    where it has one. ``vocab``: the token table's path (:func:`vocabulary_table`). ``named``:
    path patterns -> styles for modules the walk does not know (taken as given, before the
    walk; a module holding parameters that neither names is an error naming it)."""
    if kv_heads is None:
        kv_heads = getattr(getattr(model, "config", None), "kv_heads", None)
    check_collective_matmul(collective_matmul, sequence_parallel)
    modules, embeds, table, vocab = walk_model(model, vocab)
    expert_blocks = {path_tuple[:i] for path_tuple, module in modules.values()
                     if isinstance(module, (SwitchMoE, Experts)) for i in range(len(path_tuple))}
    cm = lambda name: Style(name, collective_matmul=True) if collective_matmul else name
    moe_blocks = {path_tuple[:-1] for path_tuple, module in modules.values()
                  if isinstance(module, SwitchMoE)}
    check_dtd("tensor", dtd, routed_experts=bool(moe_blocks))  # SwitchMoE layers
    plan = named_entries(modules, named)
    for path, (path_tuple, module) in modules.items():
        name = leaf_name(path_tuple)
        if path in plan or inside(path, plan):
            continue
        if isinstance(module, SwitchMoE):
            plan[path] = Style("experts", dtd=dtd)
        elif isinstance(module, nnx.Embed):
            plan[path] = ("vocab" if path == table
                          else "sequence" if sequence_parallel else "replicate")
        elif isinstance(module, NORMS) and name in HEAD_NORMS:
            plan[path] = "replicate"  # Qwen3's per-head q/k norms: on this rank's heads
        elif isinstance(module, NORMS) and getattr(module, "residual_norm", False):
            plan[path] = "replicate"  # Gemma's norms of a block's outputs: on the residual
        elif isinstance(module, NORMS) and path_tuple[:-1] in moe_blocks and name in MLP_NORMS:
            plan[path] = "replicate"  # the MoE routes the stream as it is (SP: this rank's S/p)
        elif isinstance(module, NORMS):  # pre-norm blocks: every norm feeds column layers
            in_block = len(path_tuple) > 1
            feeds_columns = not (name in MLP_NORMS and path_tuple[:-1] in expert_blocks)
            plan[path] = ("input" if not sequence_parallel
                          else cm("sequence") if in_block and feeds_columns else "sequence")
        elif isinstance(module, Experts):
            plan[path] = "experts"
        elif isinstance(module, (nnx.LinearGeneral, nnx.Einsum)) and name in COLUMN | ROW:
            plan[path] = "row" if name in ROW else "column"  # nnx.MultiHeadAttention's
        elif isinstance(module, nnx.Linear):
            if name in ROUTERS:
                plan[path] = "replicate"
            elif name in COLUMN:
                check_fused_qkv(modules, path, "plans.megatron")
                plan[path] = (Style("column", kv_heads=kv_heads)
                              if kv_heads is not None and name in KV_COLUMNS else "column")
            elif name in ROW:
                plan[path] = cm("row")
            elif vocab is not None and module.out_features == vocab:
                plan[path] = "vocab"
            else:
                raise ConfigError(f"plans.megatron cannot tell whether {path} (nnx.Linear "
                                  f"{module.in_features}->{module.out_features}) is column- or "
                                  "row-parallel: build the plan by hand, e.g. "
                                  f"{{**plans.megatron(...), {path!r}: 'column'}} after renaming, "
                                  "or write it whole")
        elif holds_params(module) and not inside(path, plan):
            raise unplaced(path, module, sequence_parallel, "plans.megatron")
    return plan
