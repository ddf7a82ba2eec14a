"""One training step = one ``jax.jit`` of one ``jax.shard_map`` over the whole mesh.

A :class:`Program` is what a strategy makes of a model on a mesh: how to initialise the global
parameters, their ``PartitionSpec``s, the batch's specs, and the per-rank loss whose layers call
their collectives on the axes they are given. :func:`make_train_step` wraps it as::

    def per_rank_step(params, opt_state, *batch):                  # inside one jax.shard_map
        varying = lax.pcast(params, ("data",), to="varying")        # each data rank its own copy
        loss, grads = jax.value_and_grad(program.loss)(varying, *batch)  # layers call lax.* on "model"
        grads = lax.psum(grads, ("data",))                          # the one data-parallel reduction
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.psum(loss, loss_axes)

with ``check_vma=True``. Gradients of parameters replicated over ``data`` are reduced once per step,
over ``data``, at the end; reductions over ``model`` a layer needs (a LayerNorm on sequence-sharded
activations) are written in that layer. Parameters are initialised directly into their shards
(:func:`init_params`: ``jax.jit`` with ``out_shardings``), never assembled whole on one host.

Strategies that are not per-rank (``dense``: one device; ``gspmd``: ``NamedSharding`` annotations,
``jax.jit`` chooses the collectives) give a global loss and get a plain ``jax.jit`` step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom import remat as remat_module
from jphantom.errors import ConfigError, check_int
from jphantom.mesh import MeshConfig
from jphantom.precision import Precision
from jphantom.sharding import zero

# Mesh axes that split the batch: ``expert`` too, since the dense blocks of an MoE model run
# data-parallel over it (t5x / DeepSpeed-TED); a gradient is reduced over those of them its
# parameter is replicated on (experts' over ``data`` only, the rest over both).
BATCH_AXES = ("data", "expert")


@dataclasses.dataclass(frozen=True)
class Program:
    """A model under a strategy on a mesh: everything :func:`make_train_step` needs.

    ``loss(params, *batch)`` is per rank (``manual``) and returns this rank's share of the global
    mean loss: the global loss is its sum over ``BATCH_AXES`` and ``loss_partial_axes``.
    Non-manual programs give the global loss of global arrays.
    """

    strategy: str
    model: str
    mesh: MeshConfig
    init: Callable[[jax.Array], Any]
    param_specs: Any
    batch_specs: tuple[P, ...]
    loss: Callable[..., jax.Array]
    manual: bool = True
    binds_mesh: bool = False  # non-manual only: loss and forward are factories taking the Mesh
    loss_partial_axes: tuple[str, ...] = ()
    dense_equivalent: Callable[[Any], Any] | None = None
    forward: Callable[..., jax.Array] | None = None  # per-rank (or global) model output
    output_spec: P | None = None
    param_count: int | None = None
    options: dict = dataclasses.field(default_factory=dict)
    zero: int = 0  # ZeRO stage of the data axis (jphantom.sharding.zero.apply)
    zero_dims: Any = None  # per parameter: the dimension split over data (-1: replicated)
    state_specs_override: Any = None  # specs of gradients and optimizer moments (ZeRO >= 1)
    stages: Any = None  # jphantom.pipeline.runner.Stages: the model cut for pipelining, if it can be
    # per rank (params, *batch) -> (loss share, grads before the data reduction); None: autodiff
    # of ``loss`` (pipelines run their own backward)
    value_and_grad: Callable[..., Any] | None = None
    # (params, *batch) -> dict of this rank's shares of batch totals (cross_entropy; dropped and
    # assignments of MoE routing); global for non-manual programs (a factory if binds_mesh)
    metrics: Callable[..., dict] | None = None

    @property
    def state_specs(self):
        """Specs of the gradients the optimizer sees and of its moments: the parameters' specs,
        or with ZeRO >= 1 the same split over ``data`` too."""
        return self.param_specs if self.state_specs_override is None else self.state_specs_override

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(a for a in BATCH_AXES if a in self.mesh.shape)

    def global_loss(self, mesh: Mesh) -> Callable:
        """Non-manual programs: the loss of global arrays (bound to ``mesh`` where it needs one)."""
        return self.loss(mesh) if self.binds_mesh else self.loss

    def shardings(self, mesh: Mesh, specs=None):
        specs = self.param_specs if specs is None else specs
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                            is_leaf=lambda s: isinstance(s, P))

    def batch_shardings(self, mesh: Mesh):
        return tuple(NamedSharding(mesh, s) for s in self.batch_specs)


def init_params(program: Program, mesh: Mesh, key: jax.Array):
    """Global parameters created directly in their shards (``jax.jit`` with ``out_shardings``)."""
    return jax.jit(program.init, out_shardings=program.shardings(mesh))(key)


def abstract_params(program: Program, mesh: Mesh):
    """``ShapeDtypeStruct``s of the parameters with their shardings (nothing allocated)."""
    shapes = jax.eval_shape(program.init, jax.random.PRNGKey(0))
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                        program.shardings(mesh))


def optimizer_state_specs(optimizer: optax.GradientTransformation, params_shape, param_specs):
    """Specs of ``optimizer.init(params)``: parameter-shaped leaves (moments) follow their
    parameter's spec; everything else (step counts) is replicated."""
    state = jax.eval_shape(optimizer.init, params_shape)
    return optax.tree_map_params(optimizer, lambda _, spec: spec, state, param_specs,
                                 transform_non_params=lambda _: P(),
                                 is_leaf=lambda s: isinstance(s, P))


def sharded(per_rank: Callable, mesh: Mesh, in_specs, out_specs, *, check_vma: bool = True,
            donate_argnums=()) -> Callable:
    """One ``jax.jit`` of one ``jax.shard_map`` over ``mesh``: the only place jphantom opens a
    shard_map (training steps, SAMO's included, evaluation, forward)."""
    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma), donate_argnums=donate_argnums)


def loss_axes(program: Program) -> tuple[str, ...]:
    """The mesh axes the per-rank loss shares are summed over: the batch axes and the program's
    partial-loss axes."""
    return _loss_axes(program)


def _loss_axes(program: Program) -> tuple[str, ...]:
    return program.batch_axes + tuple(a for a in program.loss_partial_axes
                                      if a in program.mesh.shape)


def replicated_axes(spec: P, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``axes`` a parameter of ``spec`` is replicated on: its gradient is summed there."""
    split = zero.spec_axes(spec)
    return tuple(a for a in axes if a not in split)


def _by_replicated_axes(op, tree, specs, axes):
    """``op(leaves, over)`` once per group of leaves replicated on the same batch axes ``over``
    (one collective per group, not one per parameter); leaves split on all of them stay."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, spec in enumerate(treedef.flatten_up_to(specs)):
        groups.setdefault(replicated_axes(spec, axes), []).append(index)
    for over, indices in groups.items():
        if over:
            for index, leaf in zip(indices, op([leaves[i] for i in indices], over)):
                leaves[index] = leaf
    return jax.tree.unflatten(treedef, leaves)


def _vary(params, specs, axes):
    """Each parameter varying over the batch axes it is replicated on (a per-rank copy)."""
    return _by_replicated_axes(lambda xs, over: lax.pcast(xs, over, to="varying"), params, specs,
                               axes)


def _sum_replicated(grads, specs, axes):
    """Each gradient all-reduced over the batch axes its parameter is replicated on."""
    return _by_replicated_axes(lambda xs, over: lax.psum(xs, over), grads, specs, axes)


def zeros_of(struct) -> jax.Array:
    """Zeros of an abstract value (``jax.eval_shape`` inside a shard_map) with its shape, dtype and
    varying mesh axes."""
    zeros = jnp.zeros(struct.shape, struct.dtype)
    varying = tuple(sorted(struct.manual_axis_type.varying))
    return lax.pcast(zeros, varying, to="varying") if varying else zeros


def _per_rank_value_and_grad(program: Program, accumulate: int = 1, remat_policy: str = "none",
                             precision: Precision = Precision(), communicate: bool = True):
    """Per rank: (global loss, gradients reduced over the axes each parameter is replicated on;
    with ZeRO >= 2 this rank's slice of them). ``accumulate``: the batch is split into that many
    micro-batches whose gradients are summed before the one reduction."""
    data, loss_axes = program.batch_axes, _loss_axes(program)
    stage, dims = program.zero, program.zero_dims
    # ZeRO-3 under autodiff: the all-gather's transpose is the gradient's reduce-scatter.
    zero3_autodiff = bool(data) and stage == 3 and program.value_and_grad is None

    def local(params, *batch):  # this rank's loss share and gradients, before the data reduction
        with remat_module.policy_scope(remat_policy):  # every layer traced here is checkpointed so
            return _local(params, *batch)

    cast, scale = precision.cast, precision.loss_scale

    def scaled_loss(params, *batch):  # the policy's compute dtype inside, float32 (or wider) out
        loss = program.loss(cast(params), *cast(batch))
        return loss.astype(jnp.promote_types(loss.dtype, jnp.float32)) * scale

    def unscaled(loss, grads, like):  # gradients back in the master weights' dtype
        return loss / scale, jax.tree.map(lambda g, p: (g / scale).astype(p.dtype), grads, like)

    def zero3_loss(shards, *batch):
        """ZeRO-3: layers gather their own parameters (a fetch scope), the rest once."""
        stages = program.stages
        if stages is None:
            return scaled_loss(zero.gathered_params(shards, dims), *batch)
        stacked, rest = stages.split(shards)
        stacked_dims, rest_dims = stages.split(dims)
        per_layer = zero.layer_dims(stacked, stacked_dims)
        with remat_module.fetch_scope(lambda p: zero.gathered_layer(p, per_layer)):
            return scaled_loss(stages.join(stacked, zero.gathered_params(rest, rest_dims)),
                               *batch)

    def _local(params, *batch):
        if zero3_autodiff:
            return unscaled(*jax.value_and_grad(zero3_loss)(params, *batch), params)
        master = params
        if data and stage == 3:
            params = zero.gathered_params(params, dims)  # pipelines: gathered once per step
        elif data:
            params = _vary(params, program.param_specs, data)
        if program.value_and_grad is not None:  # pipelines run their own backward
            loss, grads = program.value_and_grad(cast(params), *cast(batch))
            return loss.astype(jnp.promote_types(loss.dtype, jnp.float32)), jax.tree.map(
                lambda g, p: g.astype(p.dtype), grads, master)
        return unscaled(*jax.value_and_grad(scaled_loss)(params, *batch), master)

    def reduce(grads):
        if not data or zero3_autodiff or not communicate:
            return grads
        if stage == 0:  # data parallelism: one all-reduce per parameter per step
            return _sum_replicated(grads, program.param_specs, data)

        def one(g, d):
            if d < 0:
                return lax.psum(g, data)
            if stage == 1:  # seed 001's ZeRO-1: all-reduce, keep the own slice
                return zero.own(lax.psum(g, data), d)
            return zero.reduce_scatter(g, d)

        return jax.tree.map(one, grads, dims)

    def value_and_grad(params, *batch):
        if accumulate == 1:
            loss, grads = local(params, *batch)
        else:
            for b in batch:
                if b.shape[0] % accumulate:
                    raise ConfigError(f"the per-data-rank batch {b.shape[0]} is not divisible by "
                                      f"accumulate={accumulate}: pick a multiple")
            micro = [b.reshape(accumulate, b.shape[0] // accumulate, *b.shape[1:]) for b in batch]
            first = jax.eval_shape(local, params, *(m[0] for m in micro))
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            (loss, grads), _ = lax.scan(
                lambda total, mb: (add(total, local(params, *mb)), None),
                jax.tree.map(zeros_of, first), micro)
            loss, grads = jax.tree.map(lambda a: a / accumulate, (loss, grads))
        grads = reduce(grads)
        if loss_axes and communicate:
            loss = lax.psum(loss, loss_axes)  # the reported loss: one scalar all-reduce
        return loss, grads

    return value_and_grad


def _checked_precision(program: Program, precision) -> Precision:
    precision = Precision.named(precision)
    if precision.loss_scale != 1.0 and program.value_and_grad is not None:
        raise ConfigError("loss scaling (float16) is not implemented for pipelines: use bf16")
    return precision


def clip_by_global_norm(grads, specs, max_norm: float):
    """``optax.clip_by_global_norm`` on sharded gradients: the norm is summed over the mesh axes
    each gradient is split on (never over the axes it is replicated on), so it equals the norm of
    the whole model's gradient on one device."""
    by_axes: dict[tuple[str, ...], jax.Array] = {}  # one scalar all-reduce per group of axes
    is_spec = lambda s: isinstance(s, P)
    for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=is_spec)):
        axes = tuple(sorted(zero.spec_axes(spec)))
        by_axes[axes] = by_axes.get(axes, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
    norm = jnp.sqrt(sum(lax.psum(square, axes) if axes else square
                        for axes, square in by_axes.items()))
    scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)


def _per_rank_step(program: Program, optimizer, *, accumulate: int = 1,
                   clip_norm: float | None = None, remat_policy: str = "none",
                   precision: Precision = Precision(), communicate: bool = True):
    value_and_grad = _per_rank_value_and_grad(program, accumulate, remat_policy, precision,
                                              communicate)
    stage, dims = program.zero, program.zero_dims
    sliced = stage in (1, 2) and bool(program.batch_axes)

    def step(params, opt_state, *batch):
        loss, grads = value_and_grad(params, *batch)
        if clip_norm is not None:
            grads = clip_by_global_norm(grads, program.state_specs, clip_norm)
        if sliced:  # ZeRO-1/2: update the own slice, all-gather the updated slices
            shards = jax.tree.map(zero.own, params, dims)
            updates, opt_state = optimizer.update(grads, opt_state, shards)
            shards = optax.apply_updates(shards, updates)
            return (jax.tree.map(lambda x, d: zero.gather(x, d, invariant=True), shards, dims),
                    opt_state, loss)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_value_and_grad(program: Program, mesh: Mesh, *, accumulate: int = 1,
                        remat: str = "none", precision: str | Precision = "float32") -> Callable:
    """``(params, *batch) -> (loss, grads)``: the step without the optimizer (tests, analysis);
    the gradients have ``program.state_specs``."""
    policy = check_step_options(program, accumulate=accumulate, precision=precision, remat=remat)
    if not program.manual:
        return jax.jit(jax.value_and_grad(program.global_loss(mesh)))
    return sharded(_per_rank_value_and_grad(program, accumulate, remat, policy), mesh,
                   (program.param_specs, *program.batch_specs), (P(), program.state_specs))


def check_step_options(program: Program, batch: int | None = None, *, accumulate: int = 1,
                       clip_norm: float | None = None, precision: str | Precision = "float32",
                       remat: str = "none") -> Precision:
    """Validate the step's options against ``program`` (and the global ``batch`` against
    ``accumulate`` when given) before anything compiles; returns the precision policy."""
    check_int("accumulate", accumulate)
    remat_module.check(remat)
    policy = _checked_precision(program, precision)
    if clip_norm is not None and (isinstance(clip_norm, bool)
                                  or not isinstance(clip_norm, (int, float))
                                  or not math.isfinite(clip_norm) or not clip_norm > 0):
        raise ConfigError(f"clip_norm={clip_norm!r} must be a positive number (a global gradient "
                          "norm, e.g. 1.0); leave it out for no clipping")
    if not program.manual and (accumulate > 1 or clip_norm is not None or remat != "none"
                               or not policy.is_default):
        raise ConfigError(f"accumulate, clip_norm, precision and remat run inside the one-"
                          f"shard_map step; strategy {program.strategy!r} is not per-rank: use "
                          "tensor or phantom")
    if accumulate > 1 and program.value_and_grad is not None:
        micro = program.options.get("pipeline", {}).get("microbatches", 1)
        raise ConfigError(f"accumulate={accumulate} on a pipeline: pipelines accumulate through "
                          f"--microbatches; pass --microbatches {micro * accumulate} and leave "
                          "--accumulate out")
    if accumulate > 1 and batch is not None:
        data = math.prod(program.mesh.size(a) for a in program.batch_axes)
        if (batch // data) % accumulate:
            raise ConfigError(f"batch={batch} over {data} batch ranks (data x expert): the "
                              f"per-data-rank batch {batch // data} is not divisible by "
                              f"accumulate={accumulate}: pick a batch that is a multiple of "
                              "data x expert x accumulate")
    return policy


def make_train_step(program: Program, mesh: Mesh, optimizer: optax.GradientTransformation, *,
                    donate: bool = True, accumulate: int = 1,
                    clip_norm: float | None = None, remat: str = "none",
                    precision: str | Precision = "float32", communicate: bool = True) -> Callable:
    """``step(params, opt_state, *batch) -> (params, opt_state, loss)``: one ``jax.jit``; for a
    manual program, of one ``jax.shard_map`` over ``mesh`` holding forward, loss, backward, the
    gradient reductions (ZeRO's where ``program.zero``), global-norm clipping (``clip_norm``) and
    the optax update. ``accumulate``: micro-batches per step, one gradient reduction. ``remat``:
    the activation-checkpointing policy of every layer (:mod:`jphantom.remat`). ``precision``:
    the mixed-precision policy (:mod:`jphantom.precision`: float32, bf16, float16).
    ``communicate=False`` (measurement only, seed 001's breakdown): the same step without its
    data-parallel gradient and loss reductions -- each rank updates with its own gradient, so the
    result is not training; the difference in step time is the reductions' time."""
    precision = check_step_options(program, accumulate=accumulate, clip_norm=clip_norm,
                                   precision=precision, remat=remat)
    donate_argnums = (0, 1) if donate else ()
    if not communicate and (program.zero or not program.manual):
        raise ConfigError("communicate=False measures plain data parallelism of a per-rank "
                          "strategy (zero=0, tensor or phantom)")
    if not program.manual:
        global_loss = program.global_loss(mesh)

        def step(params, opt_state, *batch):
            loss, grads = jax.value_and_grad(global_loss)(params, *batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return jax.jit(step, donate_argnums=donate_argnums)
    params_shape = jax.eval_shape(program.init, jax.random.PRNGKey(0))
    opt_specs = optimizer_state_specs(optimizer, params_shape, program.state_specs)
    return sharded(
        _per_rank_step(program, optimizer, accumulate=accumulate, clip_norm=clip_norm,
                       remat_policy=remat, precision=precision, communicate=communicate),
        mesh, (program.param_specs, opt_specs, *program.batch_specs),
        (program.param_specs, opt_specs, P()), check_vma=communicate,
        donate_argnums=donate_argnums)


def _whole(program: Program, params):
    """Per rank: the parameters the layers use (ZeRO-3's shards all-gathered over ``data``)."""
    if program.zero == 3 and program.batch_axes:
            return zero.gathered_params(params, program.zero_dims)
    return params


def make_loss_fn(program: Program, mesh: Mesh) -> Callable:
    """``loss(params, *batch) -> global mean loss`` (evaluation), jitted."""
    if not program.manual:
        return jax.jit(program.global_loss(mesh))
    loss_axes = _loss_axes(program)

    def per_rank(params, *batch):
        loss = program.loss(_whole(program, params), *batch)
        return lax.psum(loss, loss_axes) if loss_axes else loss

    return sharded(per_rank, mesh, (program.param_specs, *program.batch_specs), P())


def make_metrics_fn(program: Program, mesh: Mesh) -> Callable:
    """``metrics(params, *batch) -> dict`` of batch totals (:attr:`Program.metrics`): the mean
    ``cross_entropy`` without auxiliary losses, and with MoE blocks the ``dropped`` token-expert
    assignments of all ``assignments``; jitted."""
    if program.metrics is None:
        raise ConfigError(f"program {program.strategy}/{program.model} reports no metrics")
    if not program.manual:
        return jax.jit(program.metrics(mesh) if program.binds_mesh else program.metrics)
    axes = program.batch_axes

    def total(x):
        varying = set(jax.typeof(x).manual_axis_type.varying)
        missing = tuple(a for a in axes if a not in varying)
        x = lax.pcast(x, missing, to="varying") if missing else x
        return lax.psum(x, axes) if axes else x

    def per_rank(params, *batch):
        return jax.tree.map(total, program.metrics(_whole(program, params), *batch))

    return sharded(per_rank, mesh, (program.param_specs, *program.batch_specs), P())


def make_forward_fn(program: Program, mesh: Mesh) -> Callable:
    """``forward(params, inputs) -> model output`` with the program's output layout, jitted."""
    if program.forward is None:
        raise ValueError(f"program {program.strategy}/{program.model} has no forward")
    if not program.manual:
        return jax.jit(program.forward(mesh) if program.binds_mesh else program.forward)
    return sharded(lambda params, x: program.forward(_whole(program, params), x), mesh,
                   (program.param_specs, program.batch_specs[0]), program.output_spec)
