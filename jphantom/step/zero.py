"""ZeRO (Cheng et al. Sec. 1.3-1.5; Rajbhandari et al. 2020): what the ``data`` axis shards.

A setting of the training step's ``data`` axis (``make_train_step(..., zero=Z)``, any strategy
with its own collectives: tensor, phantom, pipelines); :class:`jphantom.TrainStep` runs the
collectives, all explicit. Beside context parallelism "``data``" below reads ``data`` x
``context`` (D their ranks), the ranks holding the same weights (:func:`zero_axes`):

=====  ==========================  ===================================================  ===========
stage  sharded over ``data``       one step, per parameter of P elements (D data ranks)  Cheng et al.
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

ZeRO-3 gathers layer by layer: the blocks of a :class:`jphantom.nn.Stacked` are split along a
dimension other than the layer axis, and each layer all-gathers its own parameters inside the
blocks' ``lax.scan`` (:class:`LayerFetch`, the stack's ``fetch``), under ``jax.checkpoint`` with
the gathered copy never saved, so the backward scan gathers each layer again and only one layer
is ever whole; the gradient's reduce-scatter (the gather's transpose) runs per layer too. The
parameters outside the stack (embeddings, final norm, head) are gathered once per step, as are
all parameters of a pipelined step (its executor runs its own backward).

Each parameter is split over ``data`` along one dimension that no other mesh axis splits: the
largest whose size is divisible by D (:func:`choose_dim`). A parameter with no such dimension (a bias
of odd size, a scalar) stays replicated and is handled as in plain data parallelism; the memory
report counts it as overhead.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jphantom.runtime import comm
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import CONTEXT, DATA, EXPERT

DATA_AXIS = DATA
SHARDING_AXES = (DATA, CONTEXT, EXPERT)  # the batch axes whose replicas ZeRO shards a parameter
# over (Megatron-LM shards its distributed optimizer over data x context, torchtitan its FSDP too)
STAGES = (0, 1, 2, 3)


def zero_axes(spec: P, mesh_axes) -> tuple[str, ...]:
    """The axes ZeRO shards a parameter of ``spec`` over: the batch axes of the mesh that hold
    replicas of it (``data``; ``context``, whose ranks hold the same weights for other tokens of
    the sequence, as Megatron-LM's distributed optimizer shards over its data-parallel group
    with context parallelism and torchtitan's FSDP over ``dp_shard_cp``; and ``expert`` for a
    parameter not split over the experts: a dense parameter beside an expert axis is sharded
    over data x expert, an expert's over data alone, DeepSpeed-MoE's expert-data
    parallelism)."""
    split = spec_axes(spec)
    return tuple(a for a in SHARDING_AXES if a in mesh_axes and a not in split)


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


def sharded_spec(spec: P, dim: int, ndim: int, axes: tuple[str, ...] = (DATA_AXIS,)) -> P:
    """``spec`` with ``axes`` (``data``, or ``data`` and ``expert``) on ``dim`` (unchanged for
    ``dim == -1``)."""
    if dim < 0:
        return spec
    entries = list(tuple(spec) + (None,) * (ndim - len(spec)))
    entries[dim] = axes[0] if len(axes) == 1 else tuple(axes)
    return P(*entries)


def check(stage) -> int:
    if stage not in STAGES or isinstance(stage, bool):
        raise ConfigError(f"zero={stage!r}: use 0 (plain data parallelism), 1 (optimizer state "
                          "sharded), 2 (+ gradients) or 3 (+ parameters, FSDP)")
    return stage


# --------------------------------------------------------------------------------------------------
# Per rank (inside the step's shard_map)
# --------------------------------------------------------------------------------------------------


def own(x: jax.Array, dim: int) -> jax.Array:
    """This data rank's slice of a replicated parameter along ``dim``."""
    if dim < 0:
        return x
    size = x.shape[dim] // lax.axis_size(DATA_AXIS)
    return lax.dynamic_slice_in_dim(x, comm.axis_index(DATA_AXIS) * size, size, axis=dim)


def _group(axes):
    return axes[0] if len(axes) == 1 else tuple(axes)


def gather(x: jax.Array, dim: int, *, invariant: bool,
           axes: tuple[str, ...] = (DATA_AXIS,)) -> jax.Array:
    """All-gather of the slices along ``dim`` over ``axes`` (``invariant``: a replicated result,
    the updated parameters of ZeRO-1/2; otherwise varying, ZeRO-3's gather whose transpose is a
    reduce-scatter)."""
    if dim < 0:
        return x
    return comm.all_gather(x, _group(axes), axis=dim, tiled=True,
                          to="invarying" if invariant else "varying")


def gather_together(leaves, dims, axes, *, invariant: bool) -> list[jax.Array]:
    """:func:`gather` of every leaf with ``dims[i] >= 0``, one all-gather per group of leaves
    sharing their axes, dtype and varying axes, as FSDP's flat parameter: each shard moved so that
    its split dimension leads, flattened and concatenated ([K] per rank), gathered ([G, K]) and
    cut back into the leaves. A layer's parameters then cost one all-gather (and, its transpose,
    one reduce-scatter) instead of one per parameter: the same bytes in fewer collectives, each
    of which synchronises every rank of the group."""
    out = list(leaves)
    groups: dict = {}
    for i, (x, d, a) in enumerate(zip(leaves, dims, axes)):
        if d >= 0:
            key = (tuple(a), jnp.dtype(x.dtype), tuple(sorted(comm.varying_axes(x))))
            groups.setdefault(key, []).append(i)
    for (a, _, _), members in groups.items():
        if len(members) == 1:
            (i,) = members
            out[i] = gather(leaves[i], dims[i], invariant=invariant, axes=a)
            continue
        moved = [jnp.moveaxis(leaves[i], dims[i], 0) for i in members]
        flat = jnp.concatenate([m.reshape(-1) for m in moved])
        whole = comm.all_gather(flat, _group(a), axis=0, tiled=False,
                                to="invarying" if invariant else "varying")  # [G, K]
        offset = 0
        for i, m in zip(members, moved):
            piece = whole[:, offset:offset + m.size].reshape(whole.shape[0] * m.shape[0],
                                                             *m.shape[1:])
            out[i] = jnp.moveaxis(piece, 0, dims[i])
            offset += m.size
    return out


def reduce_scatter(g: jax.Array, dim: int, axes: tuple[str, ...] = (DATA_AXIS,)) -> jax.Array:
    """Sum over ``axes`` of per-rank gradients, each rank keeping its slice along ``dim``."""
    return comm.psum_scatter(g, _group(axes), scatter_dimension=dim, tiled=True)


class GradientScatter:
    """ZeRO-2's reduction of a gradient under accumulation (:mod:`jphantom.nn.sink`'s
    ``reduce``): :func:`reduce_scatter` over ``axes`` along ``dim``, in two halves so that a
    gradient handed from one layer's backward to the next is already in the collective's order:
    :meth:`prepare` moves ``dim`` first (the GEMM that makes the gradient writes it so),
    calling the object reduce-scatters a prepared gradient along it and moves it back."""

    def __init__(self, dim: int, axes: tuple[str, ...] = (DATA_AXIS,)):
        self.dim, self.axes = dim, tuple(axes)

    def prepare(self, g: jax.Array) -> jax.Array:
        return jnp.moveaxis(g, self.dim, 0)

    def __call__(self, prepared: jax.Array) -> jax.Array:
        return jnp.moveaxis(reduce_scatter(prepared, 0, self.axes), 0, self.dim)


class LayerFetch:
    """ZeRO-3 inside a :class:`jphantom.nn.Stacked`: ``fetch(layer_state)`` all-gathers one
    layer's parameters over ``data``, each along its split dimension, in one collective per group
    of like parameters (:func:`gather_together`; ``dims``: per leaf of the
    block's state, in ``jax.tree.leaves`` order, the dimension of the *stacked* array, -1 for a
    leaf left replicated). :meth:`around` runs a layer on what it fetches and gathers again in
    the backward, by construction; the gather's transpose, per layer in the backward scan, is the
    gradient's reduce-scatter."""

    def __init__(self, dims, axes=None):
        self.dims = tuple(dims)
        self.axes = tuple(axes) if axes is not None else ((DATA_AXIS,),) * len(self.dims)

    def __call__(self, layer_state):
        leaves, treedef = jax.tree.flatten(layer_state)
        if len(leaves) != len(self.dims):
            raise ValueError(f"LayerFetch of {len(self.dims)} parameters applied to "
                             f"{len(leaves)}")
        gathered = gather_together(leaves, [d - 1 if d >= 0 else -1 for d in self.dims],
                                   self.axes, invariant=False)
        return jax.tree.unflatten(treedef, gathered)

    def only(self, mask) -> "LayerFetch":
        """This fetch for the leaves ``mask`` marks (the others pass through as shards)."""
        return LayerFetch([d if m else -1 for d, m in zip(self.dims, mask)], self.axes)

    def around(self, layer):
        """``layer(params, carry, index)`` (checkpointed, :func:`jphantom.step.remat.checkpointed`
        with ``fetched=True``) as ``f(shards, carry, index)`` that gathers the parameters for
        the forward and again for the backward (:func:`regathered`)."""
        return regathered(layer, self, [d >= 0 for d in self.dims])


def regathered(fn, fetch, split):
    """``fn(params, *args)`` as ``f(shards, *args)``, ``params = fetch(shards)``, the gather made
    twice by construction: the forward gathers the parameters and keeps ``fn``'s residuals but
    the gathered parameters (``fn`` is checkpointed, so that those are among its residuals
    themselves, not values derived from them); the backward gathers them again from the shards once ``fn``'s output
    gradient exists, and transposes the gather (a reduce-scatter). Only one layer's parameters
    are ever whole. ``split``: per leaf of ``shards``, whether ``fetch`` gathers it.

    The backward's gather reads the shards through ``shards + 0 * g[0]`` (``g`` the output
    gradient): a data dependence, so the compiler can neither merge it with the forward's gather
    (common-subexpression elimination: XLA's CPU pipeline in jax 0.10 drops an
    ``optimization_barrier`` before it runs, and then merges the two; measured) nor hoist it
    before the gradient arrives. The shards are first marked varying over the axes the output
    varies over (those of ``g``), so the added term changes no type; the transpose of that mark
    sums the shard's gradient over them, where autodiff would have summed the whole
    parameter's."""
    def run(shards, *args):
        out_type = jax.eval_shape(lambda s, *a: fn(fetch(s), *a), shards, *args)
        out_axes = set().union(*(comm.varying_axes(o) for o in jax.tree.leaves(out_type)))
        leaves, treedef = jax.tree.flatten(shards)
        leaves = [comm.pcast(x, tuple(sorted(out_axes - comm.varying_axes(x))), to="varying")
                  if s else x for x, s in zip(leaves, split)]
        return _regathered_call(fn, fetch, split)(jax.tree.unflatten(treedef, leaves), *args)

    return run


def _regathered_call(fn, fetch, split):
    """:func:`regathered`'s custom VJP, one per call (what its forward learns of the residuals'
    structure is its own)."""
    static = {}

    @jax.custom_vjp
    def call(shards, *args):
        return fn(fetch(shards), *args)

    def forward(shards, *args):
        full = fetch(shards)
        out, pullback = jax.vjp(fn, full, *args)
        residuals, static["tree"] = jax.tree.flatten(pullback)
        position = {id(x): i for i, (x, s) in enumerate(zip(jax.tree.leaves(full), split)) if s}
        static["where"] = [position.get(id(r), -1) for r in residuals]
        kept = [None if w >= 0 else r for r, w in zip(residuals, static["where"])]
        return out, (shards, kept)

    def backward(saved, g):
        shards, kept = saved
        first = jax.tree.leaves(g)[0].reshape(-1)[0]
        leaves, treedef = jax.tree.flatten(shards)
        leaves = [x + jnp.zeros((), x.dtype) * first.astype(x.dtype) if s else x
                  for x, s in zip(leaves, split)]
        full, fetch_pullback = jax.vjp(fetch, jax.tree.unflatten(treedef, leaves))
        only = getattr(fetch, "only", None)
        if only is not None:  # gather just what the pullback reads (the rest of ``full`` is dead)
            needed = {w for w in static["where"] if w >= 0}
            full = only([i in needed for i in range(len(leaves))])(
                jax.tree.unflatten(treedef, leaves))
        full_leaves = jax.tree.leaves(full)
        pullback = jax.tree.unflatten(static["tree"], [
            full_leaves[w] if w >= 0 else r for r, w in zip(kept, static["where"])])
        d_full, *d_args = pullback(g)
        (d_shards,) = fetch_pullback(d_full)
        return (d_shards, *d_args)

    call.defvjp(forward, backward)
    return call
