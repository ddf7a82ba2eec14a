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

ZeRO-3 here shards the parameters *between* steps (P/D per device at rest, the optimizer and the
gradients likewise) and gathers the whole model once per step; the gathered copy lives through
the backward. Seed 001's ZeRO-3 gathers each layer again for the backward so that only one layer is
ever whole; that needs the gather inside the layers' scan under ``jax.checkpoint`` and is not done
yet (a regather of the whole tree is merged with the first by XLA's CSE).

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


def _spec_axes(spec: P) -> set[str]:
    axes = set()
    for entry in spec:
        if entry is None:
            continue
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return axes


def choose_dim(shape: tuple[int, ...], spec: P, data: int) -> int:
    """The dimension of a parameter to split over ``data``: the largest one no other axis splits
    whose size is divisible by ``data``; -1 when there is none (the parameter stays replicated)."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    candidates = [i for i, (size, entry) in enumerate(zip(shape, entries))
                  if entry is None and size % data == 0 and size >= data]
    return max(candidates, key=lambda i: (shape[i], -i)) if candidates else -1


def sharded_spec(spec: P, dim: int, ndim: int) -> P:
    """``spec`` with ``data`` on ``dim`` (unchanged for ``dim == -1``)."""
    if dim < 0:
        return spec
    entries = list(tuple(spec) + (None,) * (ndim - len(spec)))
    entries[dim] = DATA_AXIS
    return P(*entries)


def apply(program, stage: int):
    """``program`` with ZeRO ``stage`` on its ``data`` axis (module docstring)."""
    if stage not in STAGES:
        raise ConfigError(f"zero={stage!r}: use 0 (plain data parallelism), 1 (optimizer state "
                          "sharded), 2 (+ gradients) or 3 (+ parameters, FSDP)")
    if stage == 0:
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
    dims = jax.tree.map(lambda a, s: choose_dim(a.shape, s, data), shapes, program.param_specs,
                        is_leaf=is_spec)
    if any(DATA_AXIS in _spec_axes(s) for s in jax.tree.leaves(program.param_specs, is_leaf=is_spec)):
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


def gathered_params(shards, dims):
    """ZeRO-3: the full parameters (replicated leaves marked varying over ``data``)."""
    return jax.tree.map(
        lambda x, d: gather(x, d, invariant=False) if d >= 0
        else lax.pcast(x, DATA_AXIS, to="varying"), shards, dims)
