"""Generation on a mesh, under the plan the model was parallelised with: the prefill and the
decode loop of :func:`jphantom.generation.loop.run` inside one ``jax.jit`` of one
``jax.shard_map`` (:func:`jphantom.step.train_step.shard_map`), each rank running its shard of the
model (:class:`jphantom.step.layout.ParamLayout`, as :func:`jphantom.make_forward_fn` does) on
its rows of the batch. Under Megatron tensor parallelism each rank holds its heads' keys and
values, so the cache is split over ``model`` as the heads are; the rows are split over the batch
axes (``data``); phantom parallelism's layers run their forward (the ghost exchange) as in
training, pmm3d its 3D matrix multiplies over ``x``, ``y``, ``z``, the experts of the MoE
families their all-to-alls over ``expert``: the cache lives in the attention core, which every
plan leaves whole per rank. The loop's stop test is summed over every axis, so all ranks run
the same steps. ``context`` and ``stage`` are refused by name (:func:`check_mesh_axes`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.runtime import comm
from jphantom.errors import ConfigError
from jphantom.generation import cache as kv
from jphantom.generation.config import GenerationConfig
from jphantom.generation.loop import run
from jphantom.step.layout import ParamLayout, batch_axes_of, check_mesh, group_by
from jphantom.step.train_step import shard_map
from jphantom.step import zero as zero_module

UNSPLIT = {"context": "decode holds one token per row: nothing to split over context",
           "stage": "a pipeline's stages are not run by the decode loop yet"}
"""Mesh axes generation refuses (size > 1), and why: never a silent fallback."""


def check_mesh_axes(mesh) -> None:
    """Refuse, by name, a mesh axis (:data:`UNSPLIT`) the decode loop does not run over."""
    for axis, why in UNSPLIT.items():
        if dict(mesh.shape).get(axis, 1) > 1:
            raise ConfigError(f"generation over mesh axis {axis}={dict(mesh.shape)[axis]} is not "
                              f"implemented ({why}): drop {axis}= from the mesh")


def batch_ranks(mesh) -> int:
    """How many ways the rows are split (the product of the batch axes' sizes)."""
    sizes = dict(mesh.shape)
    out = 1
    for axis in batch_axes_of(mesh):
        out *= sizes[axis]
    return out


_PROGRAMS: dict = {}


def _summed(not_done):
    """The rows still going, summed over every axis the count varies over."""
    count = jnp.sum(not_done)
    axes = tuple(sorted(comm.varying_axes(count)))
    return jax.lax.psum(count, axes) if axes else count


def _program(layout, mesh, vary, config: GenerationConfig, use_cache: bool):
    """The jitted ``shard_map`` of :func:`run` (kept per model graph, mesh and configuration:
    jax's cache then serves every prompt of a bucket)."""
    key = (layout.graphdef, mesh, tuple(layout.specs), vary, config, use_cache)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _build(layout, mesh, vary, config, use_cache)
    return _PROGRAMS[key]


def _build(layout, mesh, vary, config: GenerationConfig, use_cache: bool):
    specs = layout.specs
    rows_spec = P(batch_axes_of(mesh) or None)

    def per_rank(leaves, tokens, lengths, rows):
        leaves = group_by(list(leaves), vary, lambda xs, a: comm.pcast(xs, a, to="varying"))
        model = layout.model_of(leaves)
        runner = kv.with_cache(model) if use_cache else model
        graph, params = nnx.split(runner)
        return run(graph, params, tokens, lengths, rows, config, use_cache,
                   unfinished=_summed)

    logits_spec = rows_spec if config.return_logits else None
    fn = shard_map(per_rank, mesh, (tuple(specs), rows_spec, rows_spec, rows_spec),
                   (rows_spec, P(), logits_spec))
    return jax.jit(fn)


def program_and_args(model, mesh, tokens, lengths, config: GenerationConfig, use_cache: bool):
    """``(program, args)``: the jitted :func:`jphantom.generation.loop.run` of ``model``
    (parallelised for ``mesh``) and its arguments for the right-padded ``tokens`` [B, S] (B a
    multiple of :func:`batch_ranks`) and ``lengths`` [B]: the parameters placed in their
    shards."""
    mesh = check_mesh(mesh)
    check_mesh_axes(mesh)
    layout = ParamLayout.of(model, mesh, 0)
    _, state, _ = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(state)
    layout.check_params(params, "generate's model")
    leaves = tuple(jax.device_put(jax.tree.leaves(params),
                                  [NamedSharding(mesh, s) for s in layout.specs]))
    vary = tuple(tuple(a for a in reduce if a not in zero_module.spec_axes(spec))
                 for spec, reduce in zip(layout.specs, layout.reduce_axes))
    fn = _program(layout, mesh, vary, config, use_cache)
    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    return fn, (leaves, tokens, lengths, rows)
