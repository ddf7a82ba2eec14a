"""The training step of any Flax NNX model: one ``jax.jit`` holding one ``jax.shard_map``.

    model = jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))
    step = jphantom.make_train_step(model, mesh, optax.adamw(3e-4), loss_fn, zero=1)
    state = step.init()                                  # parameters and optimizer state, sharded
    state, loss = step(state, tokens, targets)           # global batch arrays

``loss_fn(model, *batch)`` is the user's loss as written for one device: it returns the mean loss
of the batch it is given. Inside the step every rank runs it on its share of the batch (the batch
is split on its first dimension over the mesh's batch axes, ``data`` and ``expert``), and::

    def per_rank(params, *batch):                                    # inside one jax.shard_map
        params = pcast(params, replicated batch axes + reduce_axes)  # each rank its own copy
        loss, grads = value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), *batch))(params)
        grads = psum(grads, those axes)                 # one all-reduce per group of parameters
        return psum(loss, batch axes) / ranks, grads    # ZeRO-2: psum_scatter over data

The parallel layers the plan put in the model call their own collectives on ``model`` while
``loss_fn`` runs. The parameters' ``PartitionSpec``s come from their sharding metadata
(:mod:`jphantom.nn.metadata`), read once from ``nnx.split(model)``.

The optimizer update runs after the ``shard_map``, inside the same ``jax.jit``, on the global
gradient arrays with the parameters' shardings kept: every optax transformation sees what it
would see on one device, so ``optax.clip_by_global_norm``, LAMB or Adafactor are exact (the
update's cross-shard reductions, a global norm, are the only collectives jit adds; element-wise
updates add none).

The step is a composition of parts, each built from one checked
:class:`~jphantom.step.setup.StepSetup` and each constructible and testable alone::

    setup = setup_of(model, mesh, loss_fn, **options)   # jphantom.step.setup: checked once
    params = RankParameters(setup)                      # jphantom.step.rank_params: the rank's model
    gradients = LocalGradients(setup, params)           # jphantom.step.grads (or pipeline, gspmd)
    reducer = Reducer(setup)                            # jphantom.step.reduce: DP mean, ZeRO-1/2/3
    update = OptimizerUpdate(optimizer, setup)          # jphantom.step.update: optax after the map

and :meth:`TrainStep.build` reads layout → gradients → reduce → update. The gradient provider is
:class:`~jphantom.step.grads.LocalGradients` (accumulation, the weighted loss, the MoE balance),
:class:`~jphantom.step.pipeline.PipelineGradients` with a ``stage`` axis, or
:class:`~jphantom.step.gspmd.GspmdGradients` for ``spmd="gspmd"`` (global arrays, jit's
collectives); each returns a :class:`~jphantom.step.grads.Gradients` ``(share, grads, weight)``,
the weight (a weighted ``loss_fn``'s global token count, else ``None``) flowing out of the
``shard_map`` to the update's check (:func:`jphantom.step.token_mean.guard`). Steps built for other
purposes plug in a part: the compute-only measurement a
:class:`~jphantom.step.reduce.NoReduction` reducer, SAMO its own compressed reduction and update
(:mod:`jphantom.experimental`).

ZeRO over ``data`` (Cheng et al.; Rajbhandari et al. 2020): ``zero=1`` shards the optimizer state
(the update runs on each rank's slice and the new parameters are all-gathered), ``zero=2`` also
reduce-scatters the gradients inside the ``shard_map`` (accumulating micro-batches: each one's, into
float32 shards, :meth:`jphantom.step.grads.LocalGradients.into_sinks`), ``zero=3`` also stores the parameters
sharded and all-gathers them at the start of the step (the gradient's reduce-scatter is that
all-gather's transpose). ``master_weights="sharded"`` (with ``zero=1`` or ``2`` and bf16) stores the
float32 parameters in those shards as ZeRO-3 does but gathers them whole, in bf16, once per step. Each parameter splits along its largest dimension no other axis splits
that ``data`` divides (:func:`jphantom.step.zero.choose_dim`); one with none stays replicated.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.runtime import comm
from jphantom.step import token_mean
from jphantom.step import zero as zero_module
from jphantom.errors import ConfigError
from jphantom.nn import attention as attention_module
from jphantom.step.precision import Precision
from jphantom.step.grads import Gradients, LocalGradients
from jphantom.step.finite import (NonFiniteWatch, StepOutput, check_policy, drops_updates,
                                  skipped_updates)
from jphantom.step.gspmd import GspmdGradients
from jphantom.step.layout import (CONTEXT, ParamLayout, TrainState, batch_axes_of,
                                   batch_spec_of, check_mesh, group_by, integer_ids_error)
from jphantom.step.memory import check_state_fits
from jphantom.step.pipeline import PipelineGradients
from jphantom.step.rank_params import RankParameters
from jphantom.step.reduce import Reducer
from jphantom.step.setup import StepSetup, setup_of
from jphantom.step.update import OptimizerUpdate, check_learning_rate, check_optimizer


def gradients_of(setup: StepSetup, params: RankParameters):
    """The step's gradient provider: GSPMD's on global arrays, the pipelined one with a
    ``stage`` axis, else each rank's own (accumulating over micro-batches); the per-rank ones
    hold the rank's model through ``params``."""
    if setup.spmd == "gspmd":
        return GspmdGradients(setup)
    if setup.pipeline is not None:
        return PipelineGradients(setup, params)
    return LocalGradients(setup, params)


class TrainStep:
    """``state, loss = step(state, *batch)``; built by :func:`make_train_step` from its parts
    (module docstring): ``setup``, ``params``, ``gradients``, ``reducer`` and ``update``."""

    def __init__(self, model: nnx.Module, mesh: Mesh, optimizer, loss_fn: Callable, *,
                 reducer: type[Reducer] = Reducer, donate: bool = True,
                 on_nonfinite: str = "warn", watch: bool = True, **options):
        check_optimizer(optimizer)
        on_nonfinite, watch = check_policy(on_nonfinite, watch)
        self.setup = setup = setup_of(model, mesh, loss_fn, **options)
        self.update = OptimizerUpdate(optimizer, setup,
                                      keep_finite=drops_updates(on_nonfinite, watch))
        self.reducer = reducer(setup)
        self.params = RankParameters(setup)
        self.gradients = gradients_of(setup, self.params)
        self.donate = donate
        self._step = None
        # the global weights of a weighted loss_fn the step returns, read on the host
        self.weight_report = token_mean.WeightReport(setup.loss_fn)
        self.watch = NonFiniteWatch(on_nonfinite, self.weight_report.skipped_ready, watch)
        # the facts users and tools read, by their names
        self.mesh, self.layout, self.loss_fn = setup.mesh, setup.layout, setup.loss_fn
        self.model_template, self.precision = setup.model_template, setup.precision
        self.zero, self.accumulate, self.spmd = setup.zero, setup.accumulate, setup.spmd
        self.master_weights = setup.master_weights
        self.pipeline, self.stages, self.context = setup.pipeline, setup.stages, setup.context
        self.attention, self.platform = setup.attention, setup.platform
        self.param_specs, self.grad_specs = setup.param_specs, setup.grad_specs
        self.opt_param_specs, self.optimizer = setup.opt_param_specs, self.update.optimizer

    # -- shardings and state -----------------------------------------------------------------

    def param_shardings(self):
        """The parameters' shardings (a pure dict like ``TrainState.params``)."""
        return self.setup.shardings(self.param_specs)

    def batch_shardings(self, count: int) -> tuple[NamedSharding, ...]:
        """The shardings of ``count`` batch arrays (their specs on this step's mesh)."""
        return tuple(NamedSharding(self.mesh, s) for s in self.specs_of_batch(count))

    def specs_of_batch(self, count: int) -> tuple[P, ...]:
        """The ``PartitionSpec``s of ``count`` batch arrays."""
        return self.setup.specs_of_batch(count)

    def init(self, params=None, *, create: Callable[..., nnx.Module] | None = None,
             key: jax.Array | None = None) -> TrainState:
        """Parameters in their shards and the optimizer state created in its shards. The
        parameters are the model's current ones, or ``params`` (a dict like
        ``TrainState.params``), or those of ``create()`` (``create(key)`` when a ``key`` is given:
        one compilation serves every seed), which builds the (parallelised) model:
        run under ``jax.jit`` with the parameters' shardings as outputs, so every parameter is
        created directly in its shards and no device ever holds the whole model. With
        ``create``, the model given to :func:`make_train_step` may be abstract
        (``nnx.eval_shape(create)``). Refused with the estimate, before anything is allocated,
        when the parameters and optimizer state exceed one device's memory
        (:func:`jphantom.step.memory.check_state_fits`)."""
        check_state_fits(self.abstract_state(), self.mesh)
        if create is not None:
            params = self._creator(create, key is not None)(*(() if key is None else (key,)))
        elif params is None:
            _, state, _ = nnx.split(self.model_template, nnx.Param, ...)
            params = nnx.to_pure_dict(state)
            if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(params)):
                raise ConfigError("the model is abstract (nnx.eval_shape): pass "
                                  "step.init(create=...) to create its parameters in their shards")
        if create is None:  # copies in their shards: the step donates its state, never the
            self.layout.check_params(params)  # model's
            params = jax.device_put(params, self.param_shardings(), may_alias=False)
            if self._unit_order() is not None:  # interleaved stages: the storage order
                params = jax.jit(self.stages.reorder,
                                 out_shardings=self.param_shardings())(params)
        return self.init_state(params)

    def init_state(self, params) -> TrainState:
        """The state of ``params`` (in their shards): the optimizer state created in its shards."""
        shape = jax.eval_shape(lambda p: p, params)
        opt_state = jax.jit(self.optimizer.init,
                            out_shardings=self.update.state_shardings(shape))(params)
        check_learning_rate(opt_state)
        return TrainState(params, opt_state)

    def abstract_state(self) -> TrainState:
        """The state's ``ShapeDtypeStruct``s with their shardings (nothing allocated): what
        ``step.lower(step.abstract_state(), *batch)`` compiles for."""
        params = self.setup.pure([jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                  sharding=NamedSharding(self.mesh, spec))
                             for a, spec in zip(self.layout.shapes, self.param_specs)])
        shapes = jax.eval_shape(self.optimizer.init, params)
        shardings = self.update.state_shardings(params)
        opt_state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                 shapes, shardings)
        return TrainState(params, opt_state)

    def _creator(self, create, keyed: bool):
        """``create`` jitted with the parameters' shardings as outputs, once per function."""
        cache = self.__dict__.setdefault("_creators", {})
        if (create, keyed) not in cache:
            def build(*key):
                _, state, _ = nnx.split(create(*key), nnx.Param, ...)
                pure = nnx.to_pure_dict(state)
                if jax.tree.structure(pure) != self.layout.pure_treedef:
                    raise ConfigError("create() built a model whose parameters differ from the "
                                      "model the step was made for: build the same model, "
                                      "parallelised with the same plan")
                return pure if self.stages is None else self.stages.reorder(pure)

            cache[(create, keyed)] = jax.jit(build, out_shardings=self.param_shardings())
        return cache[(create, keyed)]

    def _unit_order(self):
        """The stacked layers' storage order with several model chunks per device, else None."""
        return None if self.stages is None else self.stages.unit_order()

    def to_model_order(self, tree):
        """A dict like ``TrainState.params`` (parameters or gradients) with interleaved stages'
        stacked layers back in the model's order (unchanged otherwise)."""
        return tree if self.stages is None else self.stages.reorder(tree, inverse=True)

    # -- the step ----------------------------------------------------------------------------

    def reduced_gradients(self) -> Callable:
        """``(params, *batch) -> Gradients(loss, grads, weight)``: the global loss, the gradients
        reduced, before the update (grads as a dict like ``params``, with ZeRO-2/3 their shards;
        the batch in :meth:`context_order`), and a weighted ``loss_fn``'s global weight (None for
        a scalar one). Per rank: the gradient provider, then the reducer, in the step's one
        ``shard_map``; GSPMD: the provider on global arrays."""
        if self.spmd == "gspmd":
            return self.gradients

        def run(params, *batch, scale=None, key=None):
            # after the batch, replicated: the dynamic loss scale, the dropout key's data
            extra = {name: value for name, value in (("scale", scale), ("key", key))
                     if value is not None}

            def per_rank(leaves, *args):
                split = len(args) - len(extra)
                share, grads, weight = self.gradients(leaves, *args[:split],
                                                      **dict(zip(extra, args[split:])))
                return (*self.reducer(share, grads, self.gradients.scattered),
                        token_mean.agreed(weight))

            fn = self.over_mesh(per_rank, len(batch),  # a scalar loss_fn's weight: None
                                out_specs=(P(), list(self.grad_specs), P()),
                                after=(P(),) * len(extra), check_vma=self.reducer.check_vma)
            loss, grads, weight = fn(tuple(jax.tree.leaves(params)), *batch, *extra.values())
            return Gradients(loss, self.setup.pure(grads), weight)

        return run

    def value_and_grad(self) -> Callable:
        """``(params, *batch) -> (loss, grads)``: :meth:`reduced_gradients` without the weight."""
        reduced = self.reduced_gradients()

        def value_and_grad(params, *batch, **inputs):
            loss, grads, _ = reduced(params, *batch, **inputs)
            return loss, grads

        return value_and_grad

    def build(self) -> Callable:
        """The jitted ``step(state, *batch) -> (state, loss)``, ``(state, loss, weight)`` for a
        weighted ``loss_fn``: gradients, reduced, then the optimizer update, the state donated.
        A step with other parts (SAMO) builds its own."""
        reduced = self.reduced_gradients()

        def step(state: TrainState, *batch):
            loss, grads, weight = reduced(state.params, *batch, **self.update.inputs(state))
            new = self.update(grads, state)
            if weight is None:  # a scalar loss_fn
                return new, loss
            # a weighted loss_fn: its global weight positive and finite, or no update; the
            # weight returned, read on the host (token_mean.WeightReport)
            return (*token_mean.guard(weight, new, state, loss), weight)

        return jax.jit(step, donate_argnums=(0,) if self.donate else ())

    def __call__(self, state: TrainState, *batch):
        state, out = self._dispatch(state, batch)
        self.watch(state, out.loss)  # on_nonfinite (jphantom.step.finite)
        return state, out.loss

    def run(self, state: TrainState, *batch) -> tuple[TrainState, StepOutput]:
        """``state, out = step.run(state, *batch)``: the step, its outputs as a
        :class:`~jphantom.step.finite.StepOutput` (the loss, a weighted ``loss_fn``'s global
        weight, whether the batch was skipped for want of tokens)."""
        state, out = self._dispatch(state, batch)
        self.watch(state, out.loss)  # on_nonfinite (jphantom.step.finite)
        return state, out

    def _dispatch(self, state: TrainState, batch) -> tuple[TrainState, StepOutput]:
        """The jitted step called on ``batch`` (checked), the weight it returns kept for the
        host's report."""
        if not batch:
            raise ConfigError("step(state, *batch) needs the batch arrays loss_fn takes")
        self.check_batch(*batch)
        self.weight_report.check()  # a negative or non-finite weight a previous call found
        if self._step is None:
            self._step = self.build()
        try:
            state, loss, *weight = self._step(state, *self.context_order(batch))
        except (TypeError, ValueError) as error:  # float token ids, named (layout.py)
            if (named := integer_ids_error(error, batch)) is None:
                raise
            raise named from None
        out = StepOutput(loss, *weight)
        self.weight_report.see(out.weight)
        return state, out

    def skipped_updates(self, state: TrainState) -> int | None:
        """How many updates ``on_nonfinite="skip"`` or ``"stop"`` dropped so far (a host read of
        ``state``'s count; None under other policies)."""
        return skipped_updates(state.opt_state)

    def lower(self, state: TrainState, *batch):
        """The jitted step lowered for ``state`` and ``batch`` (``.compile().as_text()`` for HLO)."""
        if self._step is None:
            self._step = self.build()
        return self._step.lower(state, *batch)

    # -- evaluation --------------------------------------------------------------------------

    def over_mesh(self, per_rank: Callable, batch_arrays: int, *, out_specs, before=(),
                  after=(), check_vma: bool = True) -> Callable:
        """``per_rank(leaves, *before, *batch, *after)`` as this step's ``shard_map`` over the
        whole mesh: the parameters' leaves in their specs, then the arguments of specs ``before``,
        the ``batch_arrays`` batch arrays split over the batch axes, those of specs ``after``.
        The training step, its evaluation and SAMO's step all run through it."""
        return shard_map(per_rank, self.mesh,
                         (tuple(self.param_specs), *before,
                          *self.specs_of_batch(batch_arrays), *after), out_specs,
                         check_vma=check_vma)

    def _evaluate(self, per_rank: Callable) -> Callable:
        """``per_rank(leaves, *batch)`` (a global value) over the mesh, jitted, the batch in
        :meth:`context_order`."""
        @jax.jit
        def evaluate(params, *batch):
            fn = self.over_mesh(per_rank, len(batch), out_specs=P())
            return fn(tuple(jax.tree.leaves(params)), *batch)

        return lambda params, *batch: evaluate(params, *self.context_order(batch))

    def loss(self) -> Callable:
        """``loss(params, *batch) -> global mean loss`` (evaluation), jitted: forward only (a
        pipeline's through its executor, gradients discarded)."""
        if self.spmd == "gspmd":  # a pipeline's through its forward ticks
            return jax.jit(self.gradients.loss)
        if self.pipeline is not None:
            return self._evaluate(self.gradients.evaluate())
        return self._evaluate(self.gradients.evaluate(self.loss_fn))

    def metrics(self, metrics_fn: Callable) -> Callable:
        """``metrics(params, *batch) -> dict``: ``metrics_fn(model, *batch)`` returns a dict of
        means over the batch it is given (a language model's cross-entropy without auxiliary
        losses, the fraction of tokens an MoE router dropped); the result holds their global
        means. Forward only, jitted."""
        if self.pipeline is not None:
            raise ConfigError("metrics of a pipelined step: evaluate with step.loss()")
        if self.spmd == "gspmd":
            return self.gradients.evaluate(metrics_fn)
        return self._evaluate(self.gradients.evaluate(metrics_fn))

    def context_order(self, batch):
        """The batch arrays (their natural order) in the context layout's order: with the
        balanced layout on a ``context`` axis each array's sequence (dimension 1) is reordered so
        that rank r's contiguous part holds chunks r and 2C-1-r
        (:func:`jphantom.nn.attention.to_context_order`); otherwise unchanged. The step and its
        evaluations call it; :meth:`lower` takes arrays already in this order."""
        if self.context is None:
            return tuple(batch)
        size, balanced = self.context
        return tuple(attention_module.to_context_order(b, size, balanced=balanced)
                     if jnp.ndim(b) >= 2 else b for b in batch)

    def check_batch(self, *batch) -> None:
        """Every batch array splits evenly over the mesh axes its spec names (the first
        dimension also over ``accumulate`` micro-batches)."""
        shape = dict(self.mesh.shape)
        for b, spec in zip(batch, self.specs_of_batch(len(batch))):
            dims = jnp.shape(b)
            if len(spec) > len(dims) or not dims:
                raise ConfigError(f"a batch array of shape {dims} cannot be split as {spec}")
            for i, entry in enumerate(spec):
                ranks = math.prod(shape[a] for a in ((entry,) if isinstance(entry, str)
                                                     else entry or ()))
                ranks *= self.accumulate if i == 0 else 1
                if i == 1 and entry == CONTEXT and self.context and self.context[1]:
                    ranks *= 2  # the balanced layout: two chunks per rank
                if dims[i] % ranks:
                    what = " x accumulate" if i == 0 and self.accumulate > 1 else ""
                    raise ConfigError(f"a batch array of shape {dims}: dimension {i} must be a "
                                      f"multiple of {ranks} (mesh axes {entry}{what})")

    def model(self, state: TrainState) -> nnx.Module:
        """The model holding ``state``'s parameters (global arrays), for evaluation or saving."""
        params = state.params
        if self._unit_order() is not None:  # interleaved stages: back to the layers' order
            params = jax.jit(self.to_model_order)(params)
        return self.layout.model_of(jax.tree.leaves(params))


def make_train_step(model: nnx.Module, mesh: Mesh, optimizer: optax.GradientTransformation,
                    loss_fn: Callable, **options) -> TrainStep:
    """The training step of ``model`` on ``mesh``: ``step.init()`` then ``state, loss =
    step(state, *batch)`` (module docstring). Options: ``zero`` (0-3), ``accumulate``
    (micro-batches per step, one reduction), ``precision`` (float32, bf16, float16, fp8: in
    the formats of ``mesh``'s devices, :func:`jphantom.step.fp8.select`), ``master_weights``
    (``"replicated"``, the default: the float32 parameters on every data rank; ``"sharded"``,
    with bf16 and zero=1 or 2: Megatron's distributed optimizer, the float32 master weights
    stored in ZeRO-1's shards over ``data`` beside the Adam moments, all-gathered in bf16 once
    per step, the bf16 gradients reduce-scattered; :mod:`jphantom.step.setup`),
    ``remat`` (checkpoint policy of the model's Stacked blocks), ``pipeline`` (a
    :class:`~jphantom.pipeline.runner.PipelineConfig`, with a ``stage`` axis), ``spmd``
    (``"shard_map"``, or ``"gspmd"``: the plain model with :func:`jphantom.plans.annotate`'s
    sharding metadata, collectives chosen by ``jax.jit``, the baseline), ``donate``,
    ``batch_specs`` (the batch arrays' ``PartitionSpec``s: default, each split on its first
    dimension over the batch axes), ``attention`` (``auto``, ``xla`` or ``cudnn``: the kernel of the model's attention cores,
    :func:`jphantom.nn.attention.choose`; default ``None``: as the model built them),
    ``on_nonfinite`` (``"warn"``, the default: one warning the first time a loss is non-finite,
    no host sync added; ``"skip"``: an update that would make the state non-finite is dropped and
    counted, :meth:`TrainStep.skipped_updates`; ``"stop"``: that, and a
    :class:`~jphantom.errors.TrainingDiverged` at once; ``"rollback"`` is a run's, refused here:
    :mod:`jphantom.step.finite`), ``watch`` (``True``; ``False`` when a loop judges each loss
    itself under its ``on_nonfinite``: the step reads no loss and drops a bad update under
    ``"skip"`` only).

    Experimental steps built from this one's parts live in :mod:`jphantom.experimental`: SAMO
    (:func:`jphantom.experimental.samo.make_samo_step`) and the step without its reductions
    (:func:`jphantom.experimental.compute_only.make_compute_only_step`)."""
    for name, where in (("samo", "samo.make_samo_step"),
                        ("communicate", "compute_only.make_compute_only_step")):
        if name in options:
            raise ConfigError(f"{name}= is an experimental step: "
                              f"jphantom.experimental.{where}(model, mesh, optimizer, loss_fn, ...)")
    if options.get("precision") is not None and Precision.named(options["precision"]).fp8:
        from jphantom.step import fp8  # the devices' FP8 formats, or refused by name, before tracing

        fp8.select(mesh.devices.flat)
    return TrainStep(model, mesh, optimizer, loss_fn, **options)


def shard_map(per_rank: Callable, mesh: Mesh, in_specs, out_specs, *,
              check_vma: bool = True) -> Callable:
    """The one place jphantom opens a ``jax.shard_map``: every program it compiles (a training
    step, its evaluation, SAMO's step, :func:`make_forward_fn`) is ``per_rank`` over the whole
    ``mesh``, with its collectives written inside ``per_rank`` on the axes it names."""
    return jax.shard_map(per_rank, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma)


def make_forward_fn(model: nnx.Module, mesh: Mesh, params=None) -> Callable:
    """``f(*inputs) -> output``: ``model`` applied to global inputs split over the batch axes, in
    one ``jax.jit`` of one ``shard_map``; the output is the model's (full logits for an LM) with
    its first dimension split like the inputs. Uses the model's current parameters, or
    ``params`` (a ``TrainState.params`` dict, which may be ZeRO-3 shards of a step without ZeRO
    here: pass ``step.model(state)`` instead)."""
    mesh = check_mesh(mesh)
    layout = ParamLayout.of(model, mesh, 0)
    if params is None:
        _, state, _ = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(state)
    layout.check_params(params, "make_forward_fn's params=")
    shardings = [NamedSharding(mesh, s) for s in layout.specs]
    leaves = tuple(jax.device_put(jax.tree.leaves(params), shardings))
    batch_spec = batch_spec_of(mesh)
    batch_axes = batch_axes_of(mesh)
    vary = []
    for spec, reduce in zip(layout.specs, layout.reduce_axes):
        split = zero_module.spec_axes(spec)
        vary.append(tuple(a for a in reduce if a not in split))

    def per_rank(leaves, *inputs):
        leaves = group_by(list(leaves), vary, lambda xs, axes: comm.pcast(xs, axes, to="varying"))
        return layout.model_of(leaves)(*inputs)

    @jax.jit
    def forward(leaves, *inputs):  # parameters as arguments, never captured as constants
        out_spec = batch_spec if batch_axes else P()
        fn = shard_map(per_rank, mesh, (tuple(layout.specs), *([batch_spec] * len(inputs))),
                       out_spec)
        return fn(leaves, *inputs)

    def call(*inputs):
        try:
            return forward(leaves, *inputs)
        except (TypeError, ValueError) as error:  # float token ids, named (layout.py)
            if (named := integer_ids_error(error, inputs)) is None:
                raise
            raise named from None

    return call
