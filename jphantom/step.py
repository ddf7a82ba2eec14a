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
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.mesh import MeshConfig

BATCH_AXES = ("data",)  # mesh axes that split the batch (ZeRO, experts and pipelines add theirs)


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
    stages: Any = None  # jphantom.pipeline.runner.Stages: the model cut for pipelining, if it can be
    # per rank (params, *batch) -> (loss share, grads before the data reduction); None: autodiff
    # of ``loss`` (pipelines run their own backward)
    value_and_grad: Callable[..., Any] | None = None

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


def _loss_axes(program: Program) -> tuple[str, ...]:
    return program.batch_axes + tuple(a for a in program.loss_partial_axes
                                      if a in program.mesh.shape)


def _per_rank_value_and_grad(program: Program):
    """Per rank: (global loss, gradients reduced over the axes each parameter is replicated on)."""
    data, loss_axes = program.batch_axes, _loss_axes(program)

    def value_and_grad(params, *batch):
        varying = lax.pcast(params, data, to="varying") if data else params
        if program.value_and_grad is not None:
            loss, grads = program.value_and_grad(varying, *batch)
        else:
            loss, grads = jax.value_and_grad(program.loss)(varying, *batch)
        if data:
            grads = lax.psum(grads, data)  # data parallelism: one all-reduce per parameter per step
        if loss_axes:
            loss = lax.psum(loss, loss_axes)  # the reported loss: one scalar all-reduce
        return loss, grads

    return value_and_grad


def _per_rank_step(program: Program, optimizer):
    value_and_grad = _per_rank_value_and_grad(program)

    def step(params, opt_state, *batch):
        loss, grads = value_and_grad(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def make_value_and_grad(program: Program, mesh: Mesh) -> Callable:
    """``(params, *batch) -> (loss, grads)``: the step without the optimizer (tests, analysis)."""
    if not program.manual:
        return jax.jit(jax.value_and_grad(program.global_loss(mesh)))
    return jax.jit(jax.shard_map(
        _per_rank_value_and_grad(program), mesh=mesh,
        in_specs=(program.param_specs, *program.batch_specs),
        out_specs=(P(), program.param_specs), check_vma=True))


def make_train_step(program: Program, mesh: Mesh, optimizer: optax.GradientTransformation, *,
                    donate: bool = True) -> Callable:
    """``step(params, opt_state, *batch) -> (params, opt_state, loss)``: one ``jax.jit``; for a
    manual program, of one ``jax.shard_map`` over ``mesh`` holding forward, loss, backward, the
    gradient reductions and the optax update."""
    donate_argnums = (0, 1) if donate else ()
    if not program.manual:
        global_loss = program.global_loss(mesh)

        def step(params, opt_state, *batch):
            loss, grads = jax.value_and_grad(global_loss)(params, *batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return jax.jit(step, donate_argnums=donate_argnums)
    params_shape = jax.eval_shape(program.init, jax.random.PRNGKey(0))
    opt_specs = optimizer_state_specs(optimizer, params_shape, program.param_specs)
    sharded = jax.shard_map(
        _per_rank_step(program, optimizer), mesh=mesh,
        in_specs=(program.param_specs, opt_specs, *program.batch_specs),
        out_specs=(program.param_specs, opt_specs, P()), check_vma=True)
    return jax.jit(sharded, donate_argnums=donate_argnums)


def make_loss_fn(program: Program, mesh: Mesh) -> Callable:
    """``loss(params, *batch) -> global mean loss`` (evaluation), jitted."""
    if not program.manual:
        return jax.jit(program.global_loss(mesh))
    loss_axes = _loss_axes(program)

    def per_rank(params, *batch):
        loss = program.loss(params, *batch)
        return lax.psum(loss, loss_axes) if loss_axes else loss

    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(program.param_specs,
                                                                *program.batch_specs),
                                 out_specs=P(), check_vma=True))


def make_forward_fn(program: Program, mesh: Mesh) -> Callable:
    """``forward(params, inputs) -> model output`` with the program's output layout, jitted."""
    if program.forward is None:
        raise ValueError(f"program {program.strategy}/{program.model} has no forward")
    if not program.manual:
        return jax.jit(program.forward(mesh) if program.binds_mesh else program.forward)
    return jax.jit(jax.shard_map(program.forward, mesh=mesh,
                                 in_specs=(program.param_specs, program.batch_specs[0]),
                                 out_specs=program.output_spec, check_vma=True))
