"""The rank's parameters as its model holds them, before the forward: each replicated leaf
varied over the axes its gradient is summed over, cast to the compute dtype, gathered where ZeRO
stores shards, and built into the rank's model; the reductions after the backward are
:mod:`jphantom.step.reduce`'s.

A rank holds each parameter in the shards its ``PartitionSpec`` names; over every other batch axis
(and the axes its layer reduces over, ``reduce_axes``) the parameter is replicated while each
rank's gradient is only a part of it, so the forward takes a private copy varying over those
axes (``pcast``): its gradient is the rank's part, summed once after the backward. ZeRO-3 (Cheng
et al.; Rajbhandari et al. 2020) keeps the stacked blocks' leaves in shards for their
:class:`~jphantom.nn.stack.Stacked`'s ``fetch`` to gather layer by layer and gathers every other
leaf here, once; ``master_weights="sharded"`` gathers every leaf once, in bf16 (Megatron-LM's
distributed optimizer); either gather's transpose is the gradient's reduce-scatter.
"""

from __future__ import annotations

from flax import nnx

from jphantom.runtime import comm
from jphantom.step import zero as zero_module
from jphantom.step.layout import CONTEXT, group_by, module_at
from jphantom.step.setup import StepSetup


def vary_axes(setup: StepSetup) -> list[tuple[str, ...]]:
    """Per leaf: the axes its (gathered) parameter is replicated over but each rank's gradient is
    only a part (batch axes it is not split on, and its reduce_axes), less ``data`` where
    ZeRO-3's all-gather is that reduction's transpose."""
    out = []
    sizes = dict(setup.mesh.shape)
    layout = setup.layout
    extra = ("stage",) if setup.pipeline is not None and sizes["stage"] > 1 else ()
    if sizes.get(CONTEXT, 1) > 1:  # each rank's gradient: its tokens' part
        extra = (CONTEXT, *extra)
    for spec, reduce, dim in zip(layout.specs, layout.reduce_axes, layout.zero_dims):
        split = zero_module.spec_axes(spec)
        axes = tuple(a for a in setup.batch_axes + extra if a not in split)
        axes = axes + tuple(a for a in reduce if a not in axes and a not in split)
        if setup.sharded_master and dim >= 0:  # the gather's transpose is that reduction
            axes = tuple(a for a in axes if a not in layout.zero_axes[len(out)])
        out.append(axes)
    return out


class RankParameters:
    """The parameter side of a step's gradient providers (module docstring): ``vary_params``,
    ``gather``, ``built`` and ``model`` of the rank's leaves."""

    def __init__(self, setup: StepSetup):
        self.setup = setup
        self.vary = vary_axes(setup)  # per leaf: the axes its gradient is summed over

    def vary_params(self, leaves) -> list:
        """Each rank its own copy of what it holds replicated (``pcast`` to varying over
        :attr:`vary`): the gradient w.r.t. the copy is this rank's part, summed once after the
        backward."""
        return group_by(leaves, self.vary, lambda xs, axes: comm.pcast(xs, axes, to="varying"))

    def model(self, leaves, *, train: bool) -> nnx.Module:
        """The model of this rank's ``leaves`` (cast to the compute dtype). ZeRO-3: the leaves of
        the stacked blocks stay shards, gathered layer by layer by their :class:`Stacked`'s
        ``fetch``; every other leaf is all-gathered here, once (``train``: varying, so that the
        gather's transpose reduce-scatters the gradient). ``master_weights="sharded"``: every
        leaf gathered here, once, in the compute dtype (the bf16 parameters of Megatron's
        distributed optimizer; its transpose the bf16 gradient's reduce-scatter):
        :meth:`built` of :meth:`gather`."""
        return self.built(self.gather(leaves, train=train), train=train)

    def _fetched(self, train: bool) -> frozenset:
        """The leaves ZeRO-3 keeps in shards for the stacked blocks to fetch layer by layer."""
        setup = self.setup
        return (setup.layout.stacked if train and setup.pipeline is None and setup.zero == 3
                and setup.sharded_master else frozenset())

    def gather(self, leaves, *, train: bool) -> list:
        """The rank's ``leaves`` as its model holds them: cast to the compute dtype, and with a
        sharded master gathered whole over ``data`` (but the stacked blocks' under ZeRO-3)."""
        setup, layout = self.setup, self.setup.layout
        leaves = setup.precision.cast(list(leaves))  # a sharded master: gathered in bf16
        if not setup.sharded_master:
            return leaves
        stacked = self._fetched(train)
        return zero_module.gather_together(
            leaves, [-1 if i in stacked else d for i, d in enumerate(layout.zero_dims)],
            layout.zero_axes, invariant=not train)

    def built(self, leaves, *, train: bool) -> nnx.Module:
        """The model of leaves :meth:`gather` gave (ZeRO-3's stacked blocks fetching theirs)."""
        setup, layout = self.setup, self.setup.layout
        model = setup.ready(layout.model_of(leaves))
        stacked = self._fetched(train)
        dims, zaxes = layout.zero_dims, layout.zero_axes
        for path, indices in (layout.stacks if stacked else ()):
            module_at(model, path).fetch = zero_module.LayerFetch([dims[i] for i in indices],
                                                  [zaxes[i] for i in indices])
        return model


__all__ = ["RankParameters", "vary_axes"]
