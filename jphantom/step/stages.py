"""A pipeline's cut of the model (the ``stage`` axis): the model's one :class:`Stacked` cut into
stages at its leading layer axis (:func:`cut_into_stages`), and which parameters are the stacked
blocks', how they form one block's state, and the order interleaved (virtual) stages and zb-v's
chunks store the layers in (:class:`PipelineLayout`; Narayanan et al. 2021's round robin, Qi et
al. 2024's V shape). The pipelined gradients are :mod:`jphantom.step.pipeline`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn import metadata
from jphantom.nn.stack import Stacked
from jphantom.step.layout import is_variable, path_key


def cut_into_stages(model, mesh, pipeline, accumulate: int):
    """With a ``stage`` axis: the validated schedule (default: the
    :class:`~jphantom.pipeline.config.PipelineConfig` defaults, one micro-batch per stage) and
    ``(path, stacked)``, the model's one :class:`Stacked` whose parameters' leading layer axis is
    now split over ``stage`` (its sharding metadata set on the step's private copy); else
    ``(None, None)``."""
    if "stage" not in mesh.axis_names:
        if pipeline is not None:
            raise ConfigError("pipeline= needs a 'stage' axis in the mesh")
        return None, None
    from jphantom.pipeline.config import PipelineConfig

    stages = dict(mesh.shape)["stage"]
    pipeline = pipeline if pipeline is not None else PipelineConfig(microbatches=stages)
    if not isinstance(pipeline, PipelineConfig):
        raise ConfigError("pipeline must be a jphantom.pipeline.runner.PipelineConfig")
    if accumulate != 1:
        raise ConfigError("a pipeline accumulates through its micro-batches: leave "
                          "accumulate out and set PipelineConfig(microbatches=...)")
    stacks = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Stacked)]
    if len(stacks) != 1:
        raise ConfigError(f"a 'stage' axis cuts the model's repeated blocks into stages: the "
                          f"model must hold exactly one jphantom.nn.Stacked (it holds "
                          f"{len(stacks)}); stack its blocks with Stacked(make_block, layers, "
                          "rngs=rngs)")
    path, stacked = stacks[0]
    pipeline.check(stages, stacked.layers, "layers")
    for _, variable in nnx.iter_graph(stacked.block):  # layer axis over stage
        if isinstance(variable, nnx.Param):
            axes = metadata.axes_of(variable)
            if axes[0] not in (None, "stage"):
                raise ConfigError(f"a stacked parameter already splits its layer axis over "
                                  f"{axes[0]!r}")
            variable.set_metadata("out_sharding", ("stage", *axes[1:]))
    return pipeline, (tuple(path), stacked)


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """Which pure-order leaves belong to the stacked blocks, how they form the block's state
    (``nnx.split(stacked.block)``), and the order the stacked layers are stored in."""

    pipeline: Any  # the PipelineConfig
    stages: int
    path: tuple
    stacked: Stacked
    pure_treedef: Any
    stacked_index: tuple[int, ...]
    rest_index: tuple[int, ...]
    block_graph: Any
    block_treedef: Any
    block_order: tuple[int, ...]

    @classmethod
    def of(cls, model, mesh, pipeline, stack, ready, pure_treedef) -> "PipelineLayout":
        """Of ``model`` cut at ``stack`` (:func:`cut_into_stages`); ``ready(module)`` sets a
        module up to compute (precision, kernels) as each rank does."""
        path, stacked = stack
        pure = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
        paths = [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]
        prefix = (*path, "block")
        stacked_index = tuple(i for i, p in enumerate(paths) if p[:len(prefix)] == prefix)
        rest_index = tuple(i for i, p in enumerate(paths) if p[:len(prefix)] != prefix)
        block = nnx.merge(*nnx.split(stacked.block))  # a copy (arrays shared) set up to compute
        block_graph, block_state, _ = nnx.split(ready(block), nnx.Param, ...)
        block_vars = jax.tree_util.tree_flatten_with_path(block_state, is_leaf=is_variable)[0]
        relative = {paths[i][len(prefix):]: k for k, i in enumerate(stacked_index)}
        return cls(pipeline, dict(mesh.shape)["stage"], path, stacked, pure_treedef, stacked_index, rest_index, block_graph,
                   jax.tree.structure(block_state),
                   tuple(relative[path_key(p)] for p, _ in block_vars))

    def split(self, leaves):
        """Pure-order ``leaves`` as (the stacked blocks', the rest)."""
        return ([leaves[i] for i in self.stacked_index], [leaves[i] for i in self.rest_index])

    def join(self, stacked, rest):
        """:meth:`split`'s inverse."""
        leaves = [None] * (len(stacked) + len(rest))
        for i, x in zip(self.stacked_index, stacked):
            leaves[i] = x
        for i, x in zip(self.rest_index, rest):
            leaves[i] = x
        return leaves

    def unit_order(self):
        """Several model chunks per device: ``order[g]``, the layer stored at position g of the
        stacked axis, so that the contiguous split over ``stage`` gives device s its model
        chunks (v P + s with V virtual stages, Megatron's round robin; s and 2P - 1 - s with
        zb-v); ``None`` with one chunk per device."""
        from jphantom.pipeline.table import unit_order

        if self.pipeline.local_chunks == 1:
            return None
        return unit_order(self.stacked.layers, self.stages, self.pipeline.virtual_stages,
                          schedule=self.pipeline.schedule)

    def reorder(self, params, inverse: bool = False):
        """``params`` (a pure dict) with the stacked layers in storage order (or back)."""
        import numpy as np

        order = self.unit_order()
        if order is None:
            return params
        index = np.argsort(order) if inverse else order
        leaves = list(jax.tree.leaves(params))
        for i in self.stacked_index:
            leaves[i] = leaves[i][index]
        return jax.tree.unflatten(self.pure_treedef, leaves)
