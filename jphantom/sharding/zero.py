"""ZeRO (seed 001 Sec. 1.3-1.5; Rajbhandari et al. 2020): what the ``data`` axis shards.

A setting of the data axis, applied to any manual :class:`jphantom.step.Program` (tensor, phantom,
pipelines) by :func:`apply`; :mod:`jphantom.step` runs the collectives, all explicit:

=====  ==========================  ===================================================  ===========
stage  sharded over ``data``       one step, per parameter of P elements (D data ranks)  seed 001
=====  ==========================  ===================================================  ===========
0      nothing                     all-reduce of the gradient (P), replicated update      2P
1      optimizer state             all-reduce of the gradient, update of the own 1/D      2P + P
                                   slice, all-gather of the updated slices (P)
2      optimizer state, gradients  reduce-scatter of the gradient (P/D out), update of    2P
                                   the own slice, all-gather of the updated slices (P)
3      + parameters                all-gather of the parameters at the start of the       2P
                                   step (P), reduce-scatter of the gradient (its
                                   transpose under autodiff), local update
=====  ==========================  ===================================================  ===========

ZeRO-3 gathers layer by layer: the layers stacked over depth (a model's
:class:`jphantom.pipeline.runner.Stages`) are split along a dimension other than the layer axis,
and each layer all-gathers its own parameters inside the layers' ``lax.scan``
(:func:`jphantom.remat.fetch_scope`), under ``jax.checkpoint`` with the gathered copy never saved,
so the backward scan gathers each layer again and only one layer is ever whole; the gradient's
reduce-scatter (the gather's transpose) runs per layer too. The parameters outside the stack
(embeddings, final norm, head) are gathered once per step, as are all parameters of a program
without stages (the Megatron FFN of odd depth) or with its own backward (pipelines).

Each parameter is split over ``data`` along one dimension that no other mesh axis splits: the
largest whose size is divisible by D (:func:`layout`). A parameter with no such dimension (a bias
of odd size, a scalar) stays replicated and is handled as in plain data parallelism; the memory
report counts it as overhead.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from jphantom.errors import ConfigError

DATA_AXIS = "data"
STAGES = (0, 1, 2, 3)


def spec_axes(spec: P) -> set[str]:
    """The mesh axes a PartitionSpec splits on."""
    axes = set()
    for entry in spec:
        if entry is None:
            continue
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return axes


def choose_dim(shape: tuple[int, ...], spec: P, data: int, stacked: bool = False) -> int:
    """The dimension of a parameter to split over ``data``: the largest one no other axis splits
    whose size is divisible by ``data`` (for ``stacked`` layers never the leading layer axis, so
    that each layer's slice is split the same way); -1 when there is none (the parameter stays
    replicated)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    candidates = [i for i, (size, entry) in enumerate(zip(shape, entries))
                  if entry is None and size % data == 0 and size >= data
                  and not (stacked and i == 0)]
    return max(candidates, key=lambda i: (shape[i], -i)) if candidates else -1


def sharded_spec(spec: P, dim: int, ndim: int) -> P:
    """``spec`` with ``data`` on ``dim`` (unchanged for ``dim == -1``)."""
    if dim < 0:
        return spec
    entries = list(tuple(spec) + (None,) * (ndim - len(spec)))
    entries[dim] = DATA_AXIS
    return P(*entries)


def stacked_flags(program, tree):
    """Per parameter: is it stacked over layers (applied one layer at a time)? From the
    program's :class:`jphantom.pipeline.runner.Stages`; all False without them."""
    if program.stages is None:
        return jax.tree.map(lambda _: False, tree)
    stacked, rest = program.stages.split(tree)
    return program.stages.join(jax.tree.map(lambda _: True, stacked),
                               jax.tree.map(lambda _: False, rest))


def check(stage) -> int:
    if stage not in STAGES or isinstance(stage, bool):
        raise ConfigError(f"zero={stage!r}: use 0 (plain data parallelism), 1 (optimizer state "
                          "sharded), 2 (+ gradients) or 3 (+ parameters, FSDP)")
    return stage


def apply(program, stage: int):
    """``program`` with ZeRO ``stage`` on its ``data`` axis (module docstring)."""
    if check(stage) == 0:
        return program
    if not program.manual:
        raise ConfigError(f"ZeRO shards the data axis of the one-shard_map step; strategy "
                          f"{program.strategy!r} is not per-rank: use tensor or phantom (model=1 "
                          "for none)")
    mesh = program.mesh
    data = mesh.size(DATA_AXIS)
    if DATA_AXIS not in mesh.shape:
        raise ConfigError(f"zero={stage} shards over the 'data' axis: add it to the mesh, e.g. "
                          f"'data=2,{mesh}'")
    shapes = jax.eval_shape(program.init, jax.random.PRNGKey(0))
    is_spec = lambda s: isinstance(s, P)
    stacked = stacked_flags(program, shapes)
    dims = jax.tree.map(lambda a, s, k: choose_dim(a.shape, s, data, k), shapes,
                        program.param_specs, stacked, is_leaf=is_spec)
    if any(DATA_AXIS in spec_axes(s) for s in jax.tree.leaves(program.param_specs, is_leaf=is_spec)):
        raise ConfigError("a parameter is already split over 'data'")
    state_specs = jax.tree.map(lambda a, s, d: sharded_spec(s, d, a.ndim), shapes,
                               program.param_specs, dims, is_leaf=is_spec)
    changes = {"zero": stage, "zero_dims": dims, "state_specs_override": state_specs,
               "options": {**program.options, "zero": stage}}
    if stage == 3:
        changes["param_specs"] = state_specs
    return dataclasses.replace(program, **changes)


# --------------------------------------------------------------------------------------------------
# Per rank (inside the step's shard_map)
# --------------------------------------------------------------------------------------------------


def own(x: jax.Array, dim: int) -> jax.Array:
    """This data rank's slice of a replicated parameter along ``dim``."""
    if dim < 0:
        return x
    size = x.shape[dim] // lax.axis_size(DATA_AXIS)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(DATA_AXIS) * size, size, axis=dim)


def gather(x: jax.Array, dim: int, *, invariant: bool) -> jax.Array:
    """All-gather of the slices along ``dim`` (``invariant``: a replicated result, the updated
    parameters of ZeRO-1/2; otherwise varying, ZeRO-3's gather whose transpose is a
    reduce-scatter)."""
    if dim < 0:
        return x
    return lax.all_gather(x, DATA_AXIS, axis=dim, tiled=True,
                          to="invarying" if invariant else "varying")


def reduce_scatter(g: jax.Array, dim: int) -> jax.Array:
    """Sum over ``data`` of per-rank gradients, each rank keeping its slice along ``dim``."""
    return lax.psum_scatter(g, DATA_AXIS, scatter_dimension=dim, tiled=True)


def layer_dims(stacked_shards, stacked_dims):
    """The split dimension of each stacked parameter counted from the end (a layer's slice drops
    the leading axes, the trailing ones stay), or ``"replicated"``."""
    return jax.tree.map(lambda a, d: d - a.ndim if d >= 0 else "replicated", stacked_shards,
                        stacked_dims)


def gathered_layer(params, dims):
    """ZeRO-3 inside a layer: this layer's parameters all-gathered over ``data`` (``dims`` from
    :func:`layer_dims`); run again by the backward of the checkpointed layer."""
    return jax.tree.map(
        lambda x, d: lax.pcast(x, DATA_AXIS, to="varying") if d == "replicated"
        else gather(x, x.ndim + d, invariant=False), params, dims)


def gathered_params(shards, dims):
    """ZeRO-3: the full parameters (replicated leaves marked varying over ``data``)."""
    return jax.tree.map(
        lambda x, d: gather(x, d, invariant=False) if d >= 0
        else lax.pcast(x, DATA_AXIS, to="varying"), shards, dims)


class LayerFetch:
    """ZeRO-3 inside a :class:`jphantom.nn.Stacked`: ``fetch(layer_state)`` all-gathers each of
    one layer's parameters over ``data`` along its split dimension (``dims``: per leaf of the
    block's state, in ``jax.tree.leaves`` order, the dimension of the *stacked* array, -1 for a
    leaf left replicated) and names the result :data:`jphantom.remat.FETCHED`, so the
    checkpointed layer never keeps it: the backward gathers again and only one layer is ever
    whole. The gather's transpose, per layer in the backward scan, is the gradient's
    reduce-scatter."""

    def __init__(self, dims):
        self.dims = tuple(dims)

    def __call__(self, layer_state):
        from jax.ad_checkpoint import checkpoint_name

        from jphantom.remat import FETCHED

        leaves, treedef = jax.tree.flatten(layer_state)
        if len(leaves) != len(self.dims):
            raise ValueError(f"LayerFetch of {len(self.dims)} parameters applied to "
                             f"{len(leaves)}")
        gathered = [x if d < 0 else checkpoint_name(gather(x, d - 1, invariant=False), FETCHED)
                    for x, d in zip(leaves, self.dims)]
        return jax.tree.unflatten(treedef, gathered)
