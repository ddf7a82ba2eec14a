"""The step's reductions: which mesh axes each parameter's gradient is summed over, and ZeRO's
gathers before the forward and reduce-scatters after the backward (Cheng et al.; Rajbhandari et
al. 2020, ZeRO).

A rank holds each parameter in the shards its ``PartitionSpec`` names; over every other batch axis
(and the axes its layer reduces over, ``reduce_axes``) the parameter is replicated while each
rank's gradient is only a part of it. The forward takes a private copy of the parameter varying
over those axes (``pcast``, :meth:`jphantom.step.rank_params.RankParameters.vary_params`), so
that its gradient is the rank's part, summed once after the backward by one ``psum`` per group of
parameters sharing the axes (:attr:`Reducer.vary`, :meth:`Reducer.__call__`).

ZeRO over ``data`` (:mod:`jphantom.step.zero` holds the per-rank operations): ZeRO-2 reduce-scatters
each gradient over ``data`` instead of all-reducing it; ZeRO-3 stores the parameters as shards and
all-gathers them before use (the stacked blocks layer by layer through their
:class:`~jphantom.nn.stack.Stacked`'s ``fetch``), the gather's transpose being the gradient's
reduce-scatter. ``master_weights="sharded"`` stores the float32 parameters in those shards too and
gathers them whole, cast to bf16, once per step (the reduce-scatter its transpose, in bf16).

A step's reducer is a part it is built with: :class:`Reducer` (the data-parallel mean, ZeRO-1/2/3
by the setup's ``zero``), or :class:`NoReduction` (each rank's own share, never summed: the
compute-only measurement of :mod:`jphantom.experimental.compute_only`).
"""

from __future__ import annotations

from jphantom.runtime import comm
from jphantom.step import zero as zero_module
from jphantom.step.layout import group_by
from jphantom.step.rank_params import vary_axes
from jphantom.step.setup import StepSetup


class Reducer:
    """The data-parallel reduction of each rank's loss share and gradients after the backward
    (ZeRO-2's reduce-scatters; module docstring): ``loss, grads = reducer(share, grads[,
    scattered])``. What a
    rank's model holds before (the parameters varied, cast, gathered, built) is
    :class:`jphantom.step.rank_params.RankParameters`'."""

    check_vma = True  # the shard_map checks every output's varying axes

    def __init__(self, setup: StepSetup):
        self.setup = setup
        self.vary = vary_axes(setup)  # per leaf: the axes its gradient is summed over

    def __call__(self, share, grads, scattered: bool = False):
        """The global loss of this rank's ``share`` and the gradients summed over the ranks
        (ZeRO-2: reduce-scattered over ``data``, all-reduced over the rest; ``scattered``: the
        provider reduce-scattered them already, per micro-batch,
        :attr:`jphantom.step.grads.LocalGradients.scattered`). A sharded master's gradients
        arrive reduce-scattered by its gather's transpose."""
        setup, vary = self.setup, self.vary
        if setup.zero == 2 and not setup.sharded_master:
            dims, zaxes = setup.layout.zero_dims, setup.layout.zero_axes
            if not scattered:
                grads = [zero_module.reduce_scatter(g, d, z) if d >= 0 else g
                         for g, d, z in zip(grads, dims, zaxes)]
            vary = [tuple(a for a in axes if not (a in z and d >= 0))
                    for axes, d, z in zip(vary, dims, zaxes)]
        grads = group_by(grads, vary, lambda xs, axes: comm.psum(xs, axes))
        return self.setup.global_value(share), grads


class NoReduction(Reducer):
    """Each rank's loss share and gradients as they are, never summed: not a training step's
    reducer but a measurement's (Cheng et al.'s t_compute, :mod:`jphantom.experimental.
    compute_only`); its outputs vary over the batch axes, so the step is built without
    ``check_vma``."""

    check_vma = False

    def __call__(self, share, grads, scattered: bool = False):
        return share, grads
