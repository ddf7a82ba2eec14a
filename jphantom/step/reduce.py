"""The step's reductions: which mesh axes each parameter's gradient is summed over, and ZeRO's
gathers before the forward and reduce-scatters after the backward (Cheng et al.; Rajbhandari et
al. 2020, ZeRO).

A rank holds each parameter in the shards its ``PartitionSpec`` names; over every other batch axis
(and the axes its layer reduces over, ``reduce_axes``) the parameter is replicated while each
rank's gradient is only a part of it. The forward takes a private copy of the parameter varying
over those axes (``pcast``), so that its gradient is the rank's part, summed once after the
backward by one ``psum`` per group of parameters sharing the axes (:meth:`ReduceParts.vary_axes`,
:meth:`ReduceParts._per_rank`).

ZeRO over ``data`` (:mod:`jphantom.zero` holds the per-rank operations): ZeRO-2 reduce-scatters
each gradient over ``data`` instead of all-reducing it; ZeRO-3 stores the parameters as shards and
all-gathers them before use (the stacked blocks layer by layer through their
:class:`~jphantom.nn.stack.Stacked`'s ``fetch``), the gather's transpose being the gradient's
reduce-scatter.
"""

from __future__ import annotations

from flax import nnx

from jphantom import comm
from jphantom import zero as zero_module
from jphantom.nn import attention as attention_module
from jphantom.nn.stack import set_fp8
from jphantom.step.layout import CONTEXT, group_by


class ReduceParts:
    """The reductions and ZeRO's gathers of :class:`jphantom.TrainStep` (module docstring)."""

    def vary_axes(self) -> list[tuple[str, ...]]:
        """Per leaf: the axes its (gathered) parameter is replicated over but each rank's
        gradient is only a part (batch axes it is not split on, and its reduce_axes), less
        ``data`` where ZeRO-3's all-gather is that reduction's transpose."""
        out = []
        extra = ("stage",) if self.pipeline is not None and dict(self.mesh.shape)["stage"] > 1 \
            else ()
        if dict(self.mesh.shape).get(CONTEXT, 1) > 1:  # each rank's gradient: its tokens' part
            extra = (CONTEXT, *extra)
        for spec, reduce, dim in zip(self.layout.specs, self.layout.reduce_axes,
                                     self.layout.zero_dims):
            split = zero_module.spec_axes(spec)
            axes = tuple(a for a in self.batch_axes + extra if a not in split)
            axes = axes + tuple(a for a in reduce if a not in axes and a not in split)
            if self.zero == 3 and dim >= 0:  # the gather's transpose is that reduction
                axes = tuple(a for a in axes if a not in self.layout.zero_axes[len(out)])
            out.append(axes)
        return out

    def _model(self, leaves, *, train: bool):
        """The model of this rank's ``leaves`` (cast to the compute dtype). ZeRO-3: the leaves of
        the stacked blocks stay shards, gathered layer by layer by their :class:`Stacked`'s
        ``fetch``; every other leaf is all-gathered here, once (``train``: varying, so that the
        gather's transpose reduce-scatters the gradient)."""
        leaves = self.precision.cast(list(leaves))
        if self.zero != 3:
            return self._ready(self.layout.model_of(leaves))
        stacked = self.layout.stacked if train and self.pipeline is None else frozenset()
        dims, zaxes = self.layout.zero_dims, self.layout.zero_axes
        leaves = zero_module.gather_together(
            leaves, [-1 if i in stacked else d for i, d in enumerate(dims)], zaxes,
            invariant=not train)
        model = self._ready(self.layout.model_of(leaves))
        for path, indices in (self.layout.stacks if stacked else ()):
            module = model
            for part in path:
                module = module[part] if isinstance(part, int) else getattr(module, part)
            module.fetch = zero_module.LayerFetch([dims[i] for i in indices],
                                                  [zaxes[i] for i in indices])
        return model

    def _ready(self, model: nnx.Module) -> nnx.Module:
        """A rank's ``model`` set up to compute: in the precision's dtypes (and FP8 GEMMs), its
        attention cores on the kernel ``attention`` picks for the mesh's platform."""
        model = self.precision.retype(model)
        if self.precision.fp8:
            set_fp8(model)
        return attention_module.configure(model, self.attention, self.platform)

    def _per_rank(self, leaves, *batch, scale=None, key=None):
        loss, grads = self.local_value_and_grad(list(leaves), *batch, scale=scale, key=key)
        dims = self.layout.zero_dims
        vary = self.vary_axes()
        if self.zero == 2:  # reduce-scatter over data, all-reduce over the rest
            zaxes = self.layout.zero_axes
            grads = [zero_module.reduce_scatter(g, d, z) if d >= 0 else g
                     for g, d, z in zip(grads, dims, zaxes)]
            vary = [tuple(a for a in axes if not (a in z and d >= 0))
                    for axes, d, z in zip(vary, dims, zaxes)]
        grads = group_by(grads, vary, lambda xs, axes: comm.psum(xs, axes))
        return self.global_value(loss), grads
