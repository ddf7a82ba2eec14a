"""Ready-made plans for :func:`jphantom.parallelize`, built by walking a model's modules.

    plan = jphantom.plans.megatron(model, sequence_parallel=True)
    plan = jphantom.plans.phantom(model, ghost_width=8)

The walk recognises layers by type and by the names the common model families use:

- the token embedding: the ``nnx.Embed`` with the most rows (V); any other ``nnx.Embed`` is a
  position table;
- the LM head: an ``nnx.Linear`` whose outputs are V (a tied head is the embedding itself);
- column-parallel linears (``COLUMN``: q, k, v, up and gate projections) and row-parallel ones
  (``ROW``: attention output and down projections), by their attribute name;
- routers (``ROUTERS``) and norms; :class:`~jphantom.nn.experts.Experts`.

A linear the walk cannot place is a :class:`~jphantom.errors.ConfigError` naming its path: write
that entry of the plan by hand (plans are plain dicts).
"""

from __future__ import annotations

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn.experts import Experts
from jphantom.parallelize import NORMS, Style, modules_by_path

COLUMN = frozenset({"q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key", "value", "up",
                    "up_proj", "gate_proj", "w1", "w3", "fc1", "c_fc", "wi", "mlp_up", "fc_in",
                    "in_proj"})
ROW = frozenset({"o", "o_proj", "out", "out_proj", "down", "down_proj", "w2", "fc2", "c_proj",
                 "wo", "attn_out", "mlp_down", "fc_out"})
ROUTERS = frozenset({"router", "gate"})


def _walk(model: nnx.Module):
    modules = modules_by_path(model)
    embeds = {path: m for path, (_, m) in modules.items() if isinstance(m, nnx.Embed)}
    vocab = max((m.num_embeddings for m in embeds.values()), default=None)
    return modules, embeds, vocab


def _name(path_tuple) -> str:
    return str(path_tuple[-1])


def megatron(model: nnx.Module, *, sequence_parallel: bool = False) -> dict[str, str]:
    """Megatron tensor parallelism (seed 002): q/k/v and up/gate column-parallel, attention output
    and down row-parallel, embedding and head vocabulary-parallel, experts split over their width,
    routers and norms replicated; ``sequence_parallel`` (seed 003): norms and position tables
    ``sequence``."""
    modules, embeds, vocab = _walk(model)
    plan: dict[str, str] = {}
    for path, (path_tuple, module) in modules.items():
        name = _name(path_tuple)
        if isinstance(module, nnx.Embed):
            plan[path] = ("vocab" if module.num_embeddings == vocab
                          else "sequence" if sequence_parallel else "replicate")
        elif isinstance(module, NORMS):
            plan[path] = "sequence" if sequence_parallel else "replicate"
        elif isinstance(module, Experts):
            plan[path] = "experts"
        elif isinstance(module, nnx.Linear):
            if name in ROUTERS:
                plan[path] = "replicate"
            elif name in COLUMN:
                plan[path] = "column"
            elif name in ROW:
                plan[path] = "row"
            elif vocab is not None and module.out_features == vocab:
                plan[path] = "vocab"
            else:
                raise ConfigError(f"plans.megatron cannot tell whether {path} (nnx.Linear "
                                  f"{module.in_features}->{module.out_features}) is column- or "
                                  "row-parallel: build the plan by hand, e.g. "
                                  f"{{**plans.megatron(...), {path!r}: 'column'}} after renaming, "
                                  "or write it whole")
    return plan


def phantom(model: nnx.Module, ghost_width: int = 8) -> dict[str, Style]:
    """Phantom parallelism (seed 000) for a whole model: every linear a phantom layer of k =
    ``ghost_width`` ghost neurons (the LM head with vocabulary-split outputs), embeddings and norms
    split over features, routers row-parallel (their logits all-reduced), experts on the
    feature-split stream."""
    modules, embeds, vocab = _walk(model)
    layer = Style("phantom", ghost_width=ghost_width)
    plan: dict[str, Style] = {}
    for path, (path_tuple, module) in modules.items():
        if isinstance(module, (nnx.Embed, *NORMS, Experts)):
            plan[path] = layer
        elif isinstance(module, nnx.Linear):
            if _name(path_tuple) in ROUTERS:
                plan[path] = Style("row")
            elif vocab is not None and module.out_features == vocab:
                plan[path] = Style("phantom", ghost_width=ghost_width, vocab_output=True)
            else:
                plan[path] = layer
    return plan
