"""How a strategy splits a model's layers: one object per plan (a strategy's
:attr:`jphantom.registry.strategies.Strategy.layers`, applied by
:meth:`jphantom.registry.strategies.Strategy.plan`), with a builder for each model program it splits
(``lm``: GPT-2 and the Llama family, through :mod:`jphantom.plans`; ``ffn``: Seal et al.'s FFN).

- :data:`MEGATRON` (``tensor``): a language model takes its family's declared Megatron plan (or
  the walker's), column/row pairs with f and g (Shoeybi et al. 2019), the vocabulary split where
  ``model`` divides it; the FFN an ``entry`` gather, pairs (``first`` column, ``second`` row), a
  lone ``last`` column and an ``exit`` scatter after a row layer.
- :data:`ANNOTATE` (``gspmd``): the same plan as GSPMD annotations (jit's collectives); the FFN's
  kernels annotated split on their outputs over ``model``.
- :data:`T1` (``tensor-t1``): every FFN layer :class:`~jphantom.nn.tensor.T1Linear` (Seal et al.'s
  TP); no language-model builder.
- :data:`PHANTOM` (``phantom``, ``phantom-unfused``): every layer phantom (Seal et al.), the
  strategy's ``fused`` decompressor.
- :data:`PMM3D` (``pmm3d`` and its variants): every layer AxoNN's 3D matmul with the strategy's
  ``weights``; the FFN's ``first`` normal, ``second`` transposed, ``last`` normal.

What a plan splits is what a family runs (:meth:`LayerPlan.builds`): a builder for its program,
and for pmm3d no per-head q/k norms. Imports no jax until a model is split: a configuration asks
which strategies a family runs as it validates.
"""

from __future__ import annotations

from typing import Any

from jphantom.registry import strategies
from jphantom.errors import ConfigError


class LayerPlan:
    """A plan of a strategy's layers (module docstring): ``lm(model, strategy, mesh, family,
    **options)`` and ``ffn(model, strategy, mesh, ghost_width=...)``, where it splits them."""

    def builds(self, family) -> bool:
        """Whether it splits the layers of ``family``'s model (a
        :class:`jphantom.registry.families.Family`): it has a builder for the family's program."""
        return hasattr(self, family.program)


def declared(family, model, walker, **options) -> dict:
    """The Megatron plan ``family`` declares for ``model`` (:attr:`jphantom.registry.families.Family.plan`),
    or the walker's (``walker(model, **options)``)."""
    hook = None if family is None else family.plan
    found = None if hook is None else hook(model, **options)
    return walker(model, **options) if found is None else found


def _present(model, plan: dict) -> dict:
    """The entries of ``plan`` for the FFN's layers that exist (``last`` only at odd depth)."""
    return {path: style for path, style in plan.items()
            if path.split(".")[0] in ("entry", "exit")
            or getattr(model, path.split(".")[0]) is not None}


class Megatron(LayerPlan):
    """Megatron's column/row pairs with f and g (Shoeybi et al. 2019; ``tensor``)."""

    def lm(self, model, strategy, mesh, family, *, sequence_parallel=False, dtd=False,
           collective_matmul=False, **_):
        from jphantom import plans

        plan = declared(family, model, plans.megatron, sequence_parallel=sequence_parallel,
                        dtd=dtd, collective_matmul=collective_matmul)
        plans.parallelize(model, mesh.shape, _replicate_odd_vocabulary(model, plan, mesh,
                                                                       sequence_parallel))

    def ffn(self, model, strategy, mesh, **_):
        from jphantom import plans

        plans.parallelize(model, mesh.shape, _present(model, {
            "entry": "gather", "layers.block.first": "column", "layers.block.second": "row",
            "last": "column", "exit": "scatter" if model.last is None else "replicate"}))


class Annotate(LayerPlan):
    """Megatron's plan as GSPMD annotations; ``jax.jit`` chooses the collectives (``gspmd``)."""

    def lm(self, model, strategy, mesh, family, **_):
        from jphantom import plans

        plans.annotate(model, mesh.shape, declared(family, model, plans.megatron))

    def ffn(self, model, strategy, mesh, **_):
        from jphantom import plans

        plans.annotate(model, mesh.shape, {"layers.block.linear": "column"})


class RowSharded(LayerPlan):
    """Seal et al.'s TP: row-sharded weights (``tensor-t1``; the FFN only)."""

    def ffn(self, model, strategy, mesh, **_):
        from jphantom import plans

        plans.parallelize(model, mesh.shape, {"layers.block.linear": "t1"})


class Phantom(LayerPlan):
    """Phantom parallelism (Seal et al.): every layer's off-diagonal blocks replaced by k ghost
    neurons per rank; the strategy's ``fused`` decompressor."""

    def lm(self, model, strategy, mesh, family, *, ghost_width=None, **_):
        from jphantom import plans

        strategies.check_ghost_width(strategy.name, ghost_width)
        plans.parallelize(model, mesh.shape, plans.phantom(model, ghost_width=ghost_width),
                          fused=strategy.fused)

    def ffn(self, model, strategy, mesh, *, ghost_width=None, **_):
        from jphantom import plans

        plans.parallelize(model, mesh.shape, {"layers.block.linear": plans.Style(
            "phantom", ghost_width=ghost_width)}, fused=strategy.fused)


class Pmm3d(LayerPlan):
    """AxoNN's 3D parallel matrix multiply (Singh's thesis ch. 5); the strategy's ``weights``."""

    def builds(self, family) -> bool:
        """Also: a family with per-head q/k norms is not split (a head's features would be split
        over ``y``, and the norm needs the whole head)."""
        return super().builds(family) and not family.per_head_norms

    def lm(self, model, strategy, mesh, family, **_):
        from jphantom import plans

        plans.parallelize(model, mesh.shape, plans.pmm3d(model, weights=strategy.weights))

    def ffn(self, model, strategy, mesh, **_):
        from jphantom import plans

        normal = plans.Style("pmm3d", role="normal", weights=strategy.weights)
        plans.parallelize(model, mesh.shape, _present(model, {
            "layers.block.first": normal, "last": normal,
            "layers.block.second": plans.Style("pmm3d", role="transposed",
                                               weights=strategy.weights)}))


MEGATRON, ANNOTATE, T1, PHANTOM, PMM3D = Megatron(), Annotate(), RowSharded(), Phantom(), Pmm3d()
"""The plans the registry's strategies name (module docstring)."""


def _replicate_odd_vocabulary(model, plan: dict, mesh: Any, sequence_parallel: bool) -> dict:
    """Megatron's plan with the vocabulary layers (token table, untied head) and the final norm
    replicated when the ``model`` axis does not divide the vocabulary (GPT-2's 50257 = 29 x 1733
    on 2, 4 or 8 ranks): every rank then computes the whole logits, exactly, at p times the head's
    work (a warning says so). Sequence parallelism needs the split head (its stream holds S/p
    tokens per rank): refused by name."""
    import warnings

    from jphantom import plans
    from jphantom.errors import JPhantomWarning

    p = mesh.size("model")
    odd = [path for path, style in plan.items() if style == "vocab"
           and _vocabulary_of(plans.modules_by_path(model)[path][1]) % p]
    if not odd:
        return plan
    vocab = _vocabulary_of(plans.modules_by_path(model)[odd[0]][1])
    if sequence_parallel:
        raise ConfigError(f"vocab_size={vocab} is not divisible by the model axis size {p}: "
                          "sequence parallelism splits the LM head over it; pick a model axis "
                          f"dividing {vocab}, or leave --sequence-parallel out")
    warnings.warn(f"vocab_size={vocab} is not divisible by the model axis size {p}: the "
                  f"embedding and the LM head ({', '.join(odd)}) stay replicated and every rank "
                  "computes the whole logits (exact; the vocabulary-parallel head needs a "
                  "divisible vocabulary)", JPhantomWarning, stacklevel=4)
    plan = dict(plan)
    for path, style in list(plan.items()):
        if path in odd or (style in ("input", "sequence") and path.split(".")[-1] in
                           ("ln_f", "norm", "final_norm", "final_layernorm")):
            plan[path] = "replicate"
    return plan


def _vocabulary_of(module) -> int:
    from flax import nnx

    return module.num_embeddings if isinstance(module, nnx.Embed) else module.out_features
