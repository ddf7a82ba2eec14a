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

The step is composed of parts, one idea each, in this order: :mod:`jphantom.step.layout` (the
parameters' specs and shardings, the batch's axes), :mod:`jphantom.step.grads` (each rank's loss
share and gradient: the weighted loss, accumulation, the MoE balance), :mod:`jphantom.step.reduce`
(the gradients' reductions, ZeRO's gathers and scatters), then the optimizer update after the
``shard_map``; a ``stage`` axis runs the blocks through :mod:`jphantom.step.pipeline`'s executors,
``spmd="gspmd"`` is :mod:`jphantom.step.gspmd`'s baseline. Steps built from these parts for other
purposes (SAMO, the compute-only step) are in :mod:`jphantom.experimental`.

ZeRO over ``data`` (Cheng et al.; Rajbhandari et al. 2020): ``zero=1`` shards the optimizer state
(the update runs on each rank's slice and the new parameters are all-gathered), ``zero=2`` also
reduce-scatters the gradients inside the ``shard_map``, ``zero=3`` also stores the parameters
sharded and all-gathers them at the start of the step (the gradient's reduce-scatter is that
all-gather's transpose). Each parameter splits along its largest dimension no other axis splits
that ``data`` divides (:func:`jphantom.zero.choose_dim`); one with none stays replicated.
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

from jphantom import comm
from jphantom import remat as remat_module
from jphantom import token_mean
from jphantom.errors import ConfigError, check_int
from jphantom.nn import attention as attention_module
from jphantom.nn import dropout as dropout_module
from jphantom.nn import metadata
from jphantom.nn.stack import Stacked, set_remat
from jphantom.precision import Precision
from jphantom import zero as zero_module
from jphantom.step.layout import (CONTEXT, ParamLayout, TrainState, batch_axes_of,
                                   batch_spec_of, check_batch_specs, check_mesh, group_by,
                                   private_copy, replace_dropout, warn_unstacked_blocks)
from jphantom.step.grads import GradParts
from jphantom.step.gspmd import GspmdParts
from jphantom.step.pipeline import PipelineParts
from jphantom.step.reduce import ReduceParts


class TrainStep(GradParts, ReduceParts, PipelineParts, GspmdParts):
    """``state, loss = step(state, *batch)``; built by :func:`make_train_step`."""

    check_vma = True  # shard_map's check of the collectives' axes (jphantom.experimental's off)

    def __init__(self, model: nnx.Module, mesh: Mesh, optimizer: optax.GradientTransformation,
                 loss_fn: Callable, *, zero: int = 0, accumulate: int = 1,
                 precision: str | Precision = "float32", remat: str = "none",
                 pipeline=None, spmd: str = "shard_map", donate: bool = True,
                 batch_specs=None, attention: str | None = None,
                 dropout_seed: int = 0):
        if not isinstance(model, nnx.Module):
            raise ConfigError(f"make_train_step takes an nnx.Module, not {type(model).__name__}")
        model = private_copy(model)
        self.dropout = replace_dropout(model)  # the step's keys (jphantom.nn.dropout)
        self.dropout_seed = check_int("dropout_seed", dropout_seed, minimum=0)
        self.mesh = check_mesh(mesh)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise ConfigError("optimizer must be an optax.GradientTransformation, e.g. "
                              "optax.adamw(3e-4)")
        if not callable(loss_fn):
            raise ConfigError("loss_fn must be a function loss_fn(model, *batch) -> mean loss")
        self.zero = zero_module.check(zero)
        self.accumulate = check_int("accumulate", accumulate)
        self.precision = Precision.named(precision)
        if self.precision.dynamic:  # loss scaling needs float32 master weights to update
            stored = {str(leaf.dtype) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))
                      if jnp.issubdtype(leaf.dtype, jnp.floating)}
            if stored - {"float32", "float64"}:
                raise ConfigError(f"precision={self.precision.name!r} computes in float16 and "
                                  f"updates float32 master weights, but the model's parameters "
                                  f"are {', '.join(sorted(stored))}: build the model in float32 "
                                  "(the policy casts it for the forward), or train in its dtype "
                                  "with precision='float32'")
        self.attention = (None if attention is None
                          else attention_module.check_implementation(attention))
        self.platform = attention_module.platform_of(self.mesh.devices.flat[0])
        remat_module.check(remat)
        stacked = any(isinstance(m, Stacked) for _, m in nnx.iter_modules(model))
        if remat != "none" and not stacked:
            raise ConfigError(f"remat={remat!r} checkpoints the blocks of a "
                              "jphantom.nn.Stacked; the model has none: stack its repeated "
                              "blocks with Stacked, or leave remat out")
        if stacked:  # the step's option is the blocks' policy ("none" resets an earlier one)
            set_remat(model, remat)
        self.batch_axes = batch_axes_of(mesh)
        self.batch_ranks = math.prod(dict(mesh.shape)[a] for a in self.batch_axes)
        if zero and "data" not in mesh.axis_names:
            raise ConfigError(f"zero={zero} shards over the 'data' axis: add it to the mesh")
        if spmd not in ("shard_map", "gspmd"):
            raise ConfigError(f"spmd={spmd!r}: 'shard_map' (the parallel layers' own "
                              "collectives) or 'gspmd' (annotations, jit's collectives)")
        self.spmd = spmd
        if spmd == "gspmd":
            parallel = [type(m).__name__ for _, m in nnx.iter_modules(model)
                        if callable(getattr(m, "dense_equivalent", None))]
            if parallel:
                raise ConfigError(f"spmd='gspmd' runs the plain model with sharding annotations "
                                  f"(jphantom.plans.annotate); it holds parallel layers "
                                  f"({parallel[0]}): annotate a plain model instead")
            if pipeline is not None and (pipeline.schedule != "gpipe"
                                         or pipeline.virtual_stages != 1):
                raise ConfigError(
                    f"spmd='gspmd' pipelines by differentiating a loop of forward ticks (Praxis, "
                    f"MaxText), so every backward runs after every forward: its schedule is "
                    f"GPipe, not {pipeline.schedule!r} (with {pipeline.virtual_stages} virtual "
                    "stages); 1F1B and interleaving order the backward by hand: use the "
                    "shard_map step (strategy 'tensor' with model=1, or 'phantom')")
        if self.dropout and (pipeline is not None or "stage" in mesh.axis_names
                             or spmd != "shard_map"):
            what = ("a pipeline" if pipeline is not None or "stage" in mesh.axis_names
                    else "spmd='gspmd'")
            self.refuse_dropout(what)
        self.pipeline, self.stack = self._pipeline(model, mesh, pipeline)
        self.layout = ParamLayout.of(model, mesh, zero)
        if zero == 3 and pipeline is None and spmd == "shard_map":  # GSPMD: jit's gathers
            warn_unstacked_blocks(model, self.layout)
        if self.pipeline is not None:
            self._pipeline_layout(model)
        self.model_template = model
        if self.dropout:  # the step count, the dropout keys' (checkpointed with the state)
            optimizer = dropout_module.counting(optimizer)
        if self.precision.dynamic:  # the scale lives in the optimizer state (checkpointed)
            from jphantom.precision import dynamic_loss_scale
            optimizer = dynamic_loss_scale(optimizer, initial=self.precision.loss_scale,
                                           period=self.precision.period)
        self.optimizer, self.loss_fn = optimizer, loss_fn
        layout = self.layout
        self.param_specs = layout.zero_specs() if zero == 3 else layout.specs
        self.grad_specs = layout.zero_specs() if zero >= 2 else layout.specs
        self.opt_param_specs = layout.zero_specs() if zero >= 1 else layout.specs
        self.batch_spec = batch_spec_of(mesh)
        self.context = attention_module.context_of(model)  # (C, balanced) or None
        if pipeline is not None and any(type(m) is attention_module.RingAttention
                                        for _, m in nnx.iter_modules(model)):
            raise ConfigError("ring attention inside a pipeline: its collective-permutes would "
                              "run in the schedule's conditional slots, which XLA:CPU aborts "
                              "on; with a 'stage' axis use context_attention='all-gather' "
                              "(--context-attention all-gather)")
        if dict(self.mesh.shape).get(CONTEXT, 1) > 1 and self.context is None:
            raise ConfigError("the mesh has a 'context' axis but the model's attention does not "
                              "run over it: parallelize it with jphantom.plans.context(model)")
        self.batch_specs = check_batch_specs(batch_specs, self.mesh)
        self.donate = donate
        self._step = None

    def refuse_dropout(self, what: str) -> None:
        """The model's dropout layers cannot train under ``what``: a ConfigError naming one."""
        raise ConfigError(f"{self.dropout[0]}: nnx.Dropout trains in the shard_map step without a "
                          f"pipeline; {what} does not draw its masks yet: set its rate to 0 (or "
                          "deterministic=True) there")

    # -- shardings ---------------------------------------------------------------------------

    def _pure(self, leaves):
        return jax.tree.unflatten(self.layout.pure_treedef, list(leaves))

    def _shardings(self, specs):
        return self._pure([NamedSharding(self.mesh, s) for s in specs])

    def param_shardings(self):
        return self._shardings(self.param_specs)

    def _opt_shardings(self, params_shape):
        specs = self._pure(self.opt_param_specs)
        state = jax.eval_shape(self.optimizer.init, params_shape)
        return optax.tree_map_params(
            self.optimizer, lambda _, spec: NamedSharding(self.mesh, spec), state, specs,
            transform_non_params=lambda _: NamedSharding(self.mesh, P()),
            is_leaf=lambda s: isinstance(s, P))

    # -- init --------------------------------------------------------------------------------

    def batch_shardings(self, count: int) -> tuple[NamedSharding, ...]:
        """The shardings of ``count`` batch arrays (their specs on this step's mesh)."""
        return tuple(NamedSharding(self.mesh, s) for s in self._specs_of_batch(count))

    def init(self, params=None, *, create: Callable[..., nnx.Module] | None = None,
             key: jax.Array | None = None) -> TrainState:
        """Parameters in their shards and the optimizer state created in its shards. The
        parameters are the model's current ones, or ``params`` (a dict like
        ``TrainState.params``), or those of ``create()`` (``create(key)`` when a ``key`` is given:
        one compilation serves every seed), which builds the (parallelised) model:
        run under ``jax.jit`` with the parameters' shardings as outputs, so every parameter is
        created directly in its shards and no device ever holds the whole model. With
        ``create``, the model given to :func:`make_train_step` may be abstract
        (``nnx.eval_shape(create)``)."""
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
                params = jax.jit(self._reorder, out_shardings=self.param_shardings())(params)
        return self.init_state(params)

    def init_state(self, params) -> TrainState:
        """The state of ``params`` (in their shards): the optimizer state created in its shards."""
        shape = jax.eval_shape(lambda p: p, params)
        opt_state = jax.jit(self.optimizer.init,
                            out_shardings=self._opt_shardings(shape))(params)
        return TrainState(params, opt_state)

    def abstract_state(self) -> TrainState:
        """The state's ``ShapeDtypeStruct``s with their shardings (nothing allocated): what
        ``step.lower(step.abstract_state(), *batch)`` compiles for."""
        params = self._pure([jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                  sharding=NamedSharding(self.mesh, spec))
                             for a, spec in zip(self.layout.shapes, self.param_specs)])
        shapes = jax.eval_shape(self.optimizer.init, params)
        shardings = self._opt_shardings(params)
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
                return self._reorder(pure)

            cache[(create, keyed)] = jax.jit(build, out_shardings=self.param_shardings())
        return cache[(create, keyed)]

    # -- per rank ----------------------------------------------------------------------------

    def _specs_of_batch(self, count: int) -> tuple[P, ...]:
        if self.batch_specs is None:
            return (self.batch_spec,) * count
        if len(self.batch_specs) == 1:
            return self.batch_specs * count
        if len(self.batch_specs) != count:
            raise ConfigError(f"batch_specs has {len(self.batch_specs)} entries for {count} "
                              "batch arrays")
        return self.batch_specs

    def value_and_grad(self) -> Callable:
        """``(params, *batch) -> (loss, grads)``: the ``shard_map`` alone (grads as a dict like
        ``params``, with ZeRO-2/3 their shards; the batch in :meth:`context_order`)."""
        if self.spmd == "gspmd":
            return self._gspmd_value_and_grad()

        def run(params, *batch, scale=None, key=None):
            leaves = jax.tree.leaves(params)
            # after the batch, replicated: the dynamic loss scale, the dropout key's data
            extra = {name: value for name, value in (("scale", scale), ("key", key))
                     if value is not None}

            def per_rank(leaves, *args):
                split = len(args) - len(extra)
                return self._per_rank(leaves, *args[:split], **dict(zip(extra, args[split:])))

            fn = self.over_mesh(per_rank, len(batch), out_specs=(P(), list(self.grad_specs)),
                                after=(P(),) * len(extra), check_vma=self.check_vma)
            loss, grads = fn(tuple(leaves), *batch, *extra.values())
            return loss, self._pure(grads)

        return run

    def _evaluate(self, fn: Callable) -> Callable:
        """``fn(model, *batch)`` -> a scalar mean or a dict of them, as global means, jitted
        (forward only)."""
        if self.spmd == "gspmd":
            return self._gspmd_evaluate(fn)

        def per_rank(leaves, *batch):
            model = self._model(leaves, train=False)
            out = fn(model, *self.precision.cast(batch))
            weighted = token_mean.terms(out)
            if weighted is not None:  # a global token mean
                weight = token_mean.global_weight(weighted.weight,
                                                  metadata.varying_axes(weighted.total))
                return self.global_value(token_mean.shares(weighted, weight))

            def total(value):
                value = jnp.asarray(value)
                value = value.astype(jnp.promote_types(value.dtype, jnp.float32))
                return self.global_value(self._mean_share(value)[0])

            return jax.tree.map(total, out)

        @jax.jit
        def evaluate(params, *batch):
            fn_ = self.over_mesh(per_rank, len(batch), out_specs=P())
            return fn_(tuple(jax.tree.leaves(params)), *batch)

        return lambda params, *batch: evaluate(params, *self.context_order(batch))

    def loss(self) -> Callable:
        """``loss(params, *batch) -> global mean loss`` (evaluation), jitted: forward only (a
        pipeline's through its executor, gradients discarded)."""
        if self.spmd == "gspmd":  # a pipeline's through its forward ticks
            return jax.jit(self._gspmd_loss)
        if self.pipeline is not None:
            return self._pipeline_loss()
        return self._evaluate(self.loss_fn)

    def over_mesh(self, per_rank: Callable, batch_arrays: int, *, out_specs, before=(),
                  after=(), check_vma: bool = True) -> Callable:
        """``per_rank(leaves, *before, *batch, *after)`` as this step's ``shard_map`` over the
        whole mesh: the parameters' leaves in their specs, then the arguments of specs ``before``,
        the ``batch_arrays`` batch arrays split over the batch axes, those of specs ``after``.
        The training step, its evaluation and SAMO's step all run through it."""
        return shard_map(per_rank, self.mesh,
                         (tuple(self.param_specs), *before,
                          *self._specs_of_batch(batch_arrays), *after), out_specs,
                         check_vma=check_vma)

    def metrics(self, metrics_fn: Callable) -> Callable:
        """``metrics(params, *batch) -> dict``: ``metrics_fn(model, *batch)`` returns a dict of
        means over the batch it is given (a language model's cross-entropy without auxiliary
        losses, the fraction of tokens an MoE router dropped); the result holds their global
        means. Forward only, jitted; pipelined steps run the model unpipelined."""
        if self.pipeline is not None:
            raise ConfigError("metrics of a pipelined step: evaluate with step.loss()")
        return self._evaluate(metrics_fn)

    def _build(self):
        run = self.value_and_grad()
        param_sh = self.param_shardings()

        dynamic = self.precision.dynamic

        def step(state: TrainState, *batch):
            scale = state.opt_state.scale if dynamic else None
            key = None
            if self.dropout:  # this step's masks: the count the optimizer state carries
                counter = state.opt_state.inner if dynamic else state.opt_state
                key = dropout_module.step_key(self.dropout_seed, counter.count)
            keyed = {} if key is None else {"key": key}
            loss, grads = run(state.params, *batch, scale=scale, **keyed)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            params = jax.lax.with_sharding_constraint(params, param_sh)
            return TrainState(params, opt_state), loss

        return jax.jit(step, donate_argnums=(0,) if self.donate else ())

    def __call__(self, state: TrainState, *batch):
        if not batch:
            raise ConfigError("step(state, *batch) needs the batch arrays loss_fn takes")
        self.check_batch(*batch)
        if self._step is None:
            self._step = self._build()
        return self._step(state, *self.context_order(batch))

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
        for b, spec in zip(batch, self._specs_of_batch(len(batch))):
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

    def lower(self, state: TrainState, *batch):
        """The jitted step lowered for ``state`` and ``batch`` (``.compile().as_text()`` for HLO)."""
        if self._step is None:
            self._step = self._build()
        return self._step.lower(state, *batch)

    def model(self, state: TrainState) -> nnx.Module:
        """The model holding ``state``'s parameters (global arrays), for evaluation or saving."""
        params = state.params
        if self._unit_order() is not None:  # interleaved stages: back to the layers' order
            params = jax.jit(lambda p: self._reorder(p, inverse=True))(params)
        return self.layout.model_of(jax.tree.leaves(params))


def make_train_step(model: nnx.Module, mesh: Mesh, optimizer: optax.GradientTransformation,
                    loss_fn: Callable, **options) -> TrainStep:
    """The training step of ``model`` on ``mesh``: ``step.init()`` then ``state, loss =
    step(state, *batch)`` (module docstring). Options: ``zero`` (0-3), ``accumulate``
    (micro-batches per step, one reduction), ``precision`` (float32, bf16, float16),
    ``remat`` (checkpoint policy of the model's Stacked blocks), ``pipeline`` (a
    :class:`~jphantom.pipeline.runner.PipelineConfig`, with a ``stage`` axis), ``spmd``
    (``"shard_map"``, or ``"gspmd"``: the plain model with :func:`jphantom.plans.annotate`'s
    sharding metadata, collectives chosen by ``jax.jit``, the baseline), ``donate``,
    ``batch_specs`` (the batch arrays' ``PartitionSpec``s: default, each split on its first
    dimension over the batch axes), ``attention`` (``auto``, ``xla`` or ``cudnn``: the kernel of the model's attention cores,
    :func:`jphantom.nn.attention.choose`; default ``None``: as the model built them).

    Experimental steps built from this one's parts live in :mod:`jphantom.experimental`: SAMO
    (:func:`jphantom.experimental.samo.make_samo_step`) and the step without its reductions
    (:func:`jphantom.experimental.compute_only.make_compute_only_step`)."""
    for name, where in (("samo", "samo.make_samo_step"),
                        ("communicate", "compute_only.make_compute_only_step")):
        if name in options:
            raise ConfigError(f"{name}= is an experimental step: "
                              f"jphantom.experimental.{where}(model, mesh, optimizer, loss_fn, ...)")
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

    return lambda *inputs: forward(leaves, *inputs)
