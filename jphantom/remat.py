"""Activation checkpointing per layer, with named ``jax.checkpoint`` policies.

Every stack of blocks (:class:`jphantom.nn.Stacked`) applies each block through
:func:`checkpointed` with its ``remat`` attribute, which the training step sets
(``make_train_step(..., remat=...)``, :func:`jphantom.nn.set_remat`). Models stay free of the
choice: the step says how, the layers say what (they name their collectives' outputs,
:func:`name_collective`).

Policies (their names :data:`NAMES`, which a run's configuration validates against without jax;
the ``jax.checkpoint`` policies ``POLICIES``, imported with jax on first use):

``none``
    keep every residual autodiff wants (no recompute).
``nothing_saveable``
    keep only each layer's input; the backward recomputes the layer's forward (Chen et al.'s
    sqrt-memory scheme per layer; the recompute repeats the layer's collectives).
``dots_saveable``
    keep the matmul outputs (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``),
    recompute the element-wise work.
``collectives_saveable``
    keep the outputs of the layer's collectives -- every tensor-parallel all-gather / all-reduce
    output is named ``"collective"`` (:func:`name_collective`) -- so a recompute never repeats a
    collective; everything else is recomputed.
``dots_collectives_saveable``
    both: the matmul outputs and the collectives' outputs (a row-parallel layer's all-reduced
    output too, which ``dots_saveable`` recomputes, repeating its all-reduce): what a layer
    scan on a CPU or GPU runs fastest with when memory allows (it stores far fewer bytes than
    ``none``, whose scan stacks every intermediate: ``benchmarks/peer_maxtext.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jphantom.errors import ConfigError

COLLECTIVE = "collective"

NAMES = ("none", "nothing_saveable", "dots_saveable", "collectives_saveable",
         "dots_collectives_saveable")
"""The policies by name (module docstring)."""


@functools.cache
def policies() -> dict[str, Callable | None]:
    """The ``jax.checkpoint`` policy of each name of :data:`NAMES` (``None`` for ``none``), the
    same objects on every call (``POLICIES``)."""
    import jax

    saveable = jax.checkpoint_policies
    return {
        "none": None,
        "nothing_saveable": saveable.nothing_saveable,
        "dots_saveable": saveable.dots_with_no_batch_dims_saveable,
        "collectives_saveable": saveable.save_only_these_names(COLLECTIVE),
        "dots_collectives_saveable": saveable.save_from_both_policies(
            saveable.dots_with_no_batch_dims_saveable,
            saveable.save_only_these_names(COLLECTIVE)),
    }


def __getattr__(name):
    """``POLICIES`` (:func:`policies`) loads with jax on first use: importing the module, and
    checking a name, import none."""
    if name == "POLICIES":
        return policies()
    raise AttributeError(f"module 'jphantom.remat' has no attribute {name!r}")


def check(name: str) -> str:
    if name not in NAMES:
        raise ConfigError(f"remat={name!r}: use one of {', '.join(NAMES)}")
    return name


def with_cac(name: str, cac: bool) -> str:
    """The policy of ``--remat name --cac``: Singh's communication-aware checkpointing is
    checkpointing every layer while keeping the collectives' outputs, ``collectives_saveable``."""
    check(name)
    if not cac:
        return name
    if name not in ("none", "collectives_saveable"):
        raise ConfigError(f"cac keeps collective outputs (remat='collectives_saveable'); it "
                          f"contradicts remat={name!r}: give one of them")
    return "collectives_saveable"


def checkpointed(fn: Callable, name: str, *, fetched: bool = False) -> Callable:
    """``fn`` (one layer) under ``jax.checkpoint`` with policy ``name``; ``fetched``: the layer's
    parameters are ZeRO-3's gathered ones (:meth:`jphantom.zero.LayerFetch.around`
    keeps every residual but them), so under ``none`` it keeps its matmul outputs
    (``dots_saveable``): keeping everything would keep values derived from the parameters, such
    as a transposed weight, whole."""
    import jax

    check(name)
    if fetched and name == "none":
        name = "dots_saveable"
    return fn if name == "none" else jax.checkpoint(fn, policy=policies()[name])


def name_collective(x):
    """Mark a collective's output, so that ``collectives_saveable`` keeps it."""
    from jax.ad_checkpoint import checkpoint_name

    return checkpoint_name(x, COLLECTIVE)


def residual_bytes(fn: Callable, params, x, policy: str) -> int:
    """Bytes autodiff keeps between the forward and the backward of one call ``fn(params, x)``
    under ``policy``: the leaves of ``jax.vjp``'s residuals other than the parameters and the
    input themselves (which live anyway). The prediction of what a policy saves per layer.
    Abstract: nothing is computed. Inside a ``shard_map`` (collectives) call it per rank."""
    import jax

    wrapped = fn if check(policy) == "none" else jax.checkpoint(fn, policy=policies()[policy])

    def probe(p, x):
        _, vjp_fn = jax.vjp(wrapped, p, x)
        inputs = jax.tree.leaves((p, x))
        return [leaf for leaf in jax.tree.leaves(vjp_fn) if not any(leaf is q for q in inputs)]

    return sum(a.size * a.dtype.itemsize for a in jax.eval_shape(probe, params, x))
