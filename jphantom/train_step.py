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

ZeRO over ``data`` (Cheng et al.; Rajbhandari et al. 2020): ``zero=1`` shards the optimizer state
(the update runs on each rank's slice and the new parameters are all-gathered), ``zero=2`` also
reduce-scatters the gradients inside the ``shard_map``, ``zero=3`` also stores the parameters
sharded and all-gathers them at the start of the step (the gradient's reduce-scatter is that
all-gather's transpose). Each parameter splits along its largest dimension no other axis splits
that ``data`` divides (:func:`jphantom.zero.choose_dim`); one with none stays replicated.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom import comm
from jphantom import remat as remat_module
from jphantom import samo as samo_module
from jphantom import token_mean
from jphantom.errors import ConfigError, check_int
from jphantom.nn import attention as attention_module
from jphantom.nn import dropout as dropout_module
from jphantom.nn import metadata
from jphantom.nn.stack import Stacked, set_fp8, set_remat
from jphantom.precision import Precision
from jphantom import zero as zero_module
from jphantom.step.layout import (CONTEXT, ParamLayout, TrainState, batch_axes_of,
                                   batch_spec_of, check_batch_specs, check_mesh, group_by,
                                   mean_share, private_copy, replace_dropout,
                                   warn_unstacked_blocks, zeros_of)
from jphantom.step.pipeline import PipelineParts



class TrainStep(PipelineParts):
    """``state, loss = step(state, *batch)``; built by :func:`make_train_step`."""

    def __init__(self, model: nnx.Module, mesh: Mesh, optimizer: optax.GradientTransformation,
                 loss_fn: Callable, *, zero: int = 0, accumulate: int = 1,
                 precision: str | Precision = "float32", remat: str = "none",
                 pipeline=None, spmd: str = "shard_map", donate: bool = True,
                 batch_specs=None, communicate: bool = True,
                 samo: samo_module.SamoConfig | None = None, attention: str | None = None,
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
        self.data = dict(mesh.shape).get("data", 1)
        if zero and "data" not in mesh.axis_names:
            raise ConfigError(f"zero={zero} shards over the 'data' axis: add it to the mesh")
        if spmd not in ("shard_map", "gspmd"):
            raise ConfigError(f"spmd={spmd!r}: 'shard_map' (the parallel layers' own "
                              "collectives) or 'gspmd' (annotations, jit's collectives)")
        self.spmd = spmd
        self.samo = None if samo is None else samo_module.check(  # SAMO (jphantom.samo)
            samo, mesh, zero=zero, pipeline=pipeline, spmd=spmd)
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
                             or samo is not None or spmd != "shard_map"):
            what = ("a pipeline" if pipeline is not None or "stage" in mesh.axis_names
                    else "SAMO" if samo is not None else "spmd='gspmd'")
            raise ConfigError(f"{self.dropout[0]}: nnx.Dropout trains in the shard_map step "
                              f"without a pipeline; {what} does not draw its masks yet: set "
                              "its rate to 0 (or deterministic=True) there")
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
        self.communicate = bool(communicate)
        if not communicate and (zero or spmd != "shard_map"):
            raise ConfigError("communicate=False measures plain data parallelism of the "
                              "shard_map step: use zero=0")
        self.donate = donate
        self._step = None

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
        if self.samo is not None:  # theta16 dense, master and optimizer state compressed
            return TrainState(*samo_module.init(self, params))
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

    def _vary_axes(self) -> list[tuple[str, ...]]:
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

    def _mean_share(self, value, exclude=()):
        share, axes = mean_share(value, exclude)
        order = self.mesh.axis_names
        return share, tuple(sorted(axes, key=order.index))

    def _loss_share(self, model, batch, balance=None, weight=None, micro=1):
        """This rank's share of the global loss: of the global mean of a scalar ``loss_fn``,
        or of the global token mean of a weighted one (:mod:`jphantom.token_mean`; ``weight``:
        the global weight when micro-batches share it, ``micro`` of them)."""
        out = self._loss(model, batch, balance)
        weighted = token_mean.terms(out)
        if weighted is not None:
            if weight is None:  # one all-reduce of a scalar, inside the forward
                weight = token_mean.global_weight(weighted.weight,
                                                  metadata.varying_axes(weighted.total))
            return token_mean.shares(weighted, weight, micro=micro)
        loss = jnp.asarray(out)
        if loss.shape != ():
            raise ConfigError(f"loss_fn returned shape {loss.shape}; it must return the "
                              "scalar mean loss, or (total, weight) for a global token mean")
        loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
        return self._mean_share(loss)[0]  # this rank's share of the global mean

    def _micro_weight(self, model, micro, balance=None, *, exclude=()):
        """The global weight of a weighted ``loss_fn`` over the micro-batches ``micro`` (each
        array [n, b, ...]): ``loss_fn`` mapped over them keeping only the weight, which XLA
        reduces to the weight's own arithmetic (:mod:`jphantom.token_mean`); ``None`` for a
        scalar ``loss_fn``."""
        struct = jax.eval_shape(lambda *mb: self._loss(model, mb, balance), *(m[0] for m in micro))
        if not isinstance(struct, tuple):
            return None
        weights = lax.map(lambda mb: token_mean.terms(self._loss(model, mb, balance)).weight,
                          micro)
        return token_mean.global_weight(jnp.sum(weights, axis=0),
                                        metadata.varying_axes(struct[0]), exclude)

    def _loss(self, model, batch, balance=None):
        """``loss_fn(model, *batch)`` in the compute precision (``balance``: the whole batch's
        routing fractions, given to a micro-batch's loss, :meth:`_balance_fraction`)."""
        extra = {} if balance is None else {"balance_fraction": balance}
        return self.loss_fn(model, *self.precision.cast(batch), **extra)

    def _takes_balance(self) -> bool:
        """Whether micro-batches get the whole batch's routing fractions: the model defines
        ``balance_statistics`` (GPT-2's MoE blocks) and ``loss_fn`` takes ``balance_fraction``."""
        if not callable(getattr(self.model_template, "balance_statistics", None)):
            return False
        try:
            parameters = inspect.signature(self.loss_fn).parameters.values()
        except (TypeError, ValueError):
            return False
        return any(p.name == "balance_fraction" or p.kind is p.VAR_KEYWORD for p in parameters)

    def _balance_fraction(self, model, micro):
        """The whole batch's routing fractions [L_moe, E] from its micro-batches ``micro`` (each
        array [n, b, ...]): a forward pass over each (no gradient) summing every MoE layer's
        router statistics. ``None`` when the model has no MoE layers or does not take part
        (:meth:`_takes_balance`). With them a micro-batch's load-balancing loss uses the whole
        batch's fractions, so the accumulated loss and gradient equal the unaccumulated step's
        (the fractions count arg-max choices: they carry no gradient)."""
        if not self._takes_balance():
            return None
        statistics = lambda mb: model.balance_statistics(*self.precision.cast(mb))
        shape = jax.eval_shape(statistics, [m[0] for m in micro])
        if shape is None:
            return None
        total, _ = lax.scan(lambda acc, mb: (acc + statistics(mb), None),
                            zeros_of(shape), micro)
        counts = lax.stop_gradient(total[:, :total.shape[-1] // 2])
        return counts / jnp.sum(counts, axis=-1, keepdims=True)

    def _local_value_and_grad(self, leaves, *batch, scale=None, key=None):
        """This rank's loss share and gradients, before the reductions. ``scale``: the loss
        scale (a traced scalar under dynamic loss scaling; default the precision's); ``key``:
        the step's dropout key data (none: dropout layers pass their input through)."""
        vary = self._vary_axes()
        key = None if key is None else jax.random.wrap_key_data(key)
        scale = self.precision.loss_scale if scale is None else scale

        def loss_of(leaves, *batch, balance=None, weight=None, micro=1):
            return self._loss_share(self._model(leaves, train=True), batch, balance, weight,
                                    micro) * scale

        def unscaled(loss, grads, like):  # in float32 (or wider) before the master's dtype
            return loss / scale, [(g.astype(jnp.promote_types(g.dtype, jnp.float32)) / scale
                                   ).astype(x.dtype) for g, x in zip(grads, like)]

        def one(leaves, *batch, balance=None, weight=None, micro=1, index=0):
            # each rank its own copy of what it holds replicated: the gradient w.r.t. the copy
            # is this rank's part, summed once after the backward (_per_rank)
            varied = group_by(leaves, vary, lambda xs, axes: comm.pcast(xs, axes, to="varying"))
            with dropout_module.keys(None if key is None else jax.random.fold_in(key, index)):
                loss, grads = jax.value_and_grad(
                    lambda p, *b: loss_of(p, *b, balance=balance, weight=weight, micro=micro)
                )(varied, *batch)
            return unscaled(loss, grads, leaves)

        if self.pipeline is not None:
            if len(batch) != 2:
                raise ConfigError(f"a pipelined step takes (inputs, targets), got {len(batch)} "
                                  "batch arrays")
            varied = group_by(leaves, vary, lambda xs, axes: comm.pcast(xs, axes, to="varying"))
            if self.zero == 3:  # gathered once for the whole pipeline; its transpose scatters
                dims, zaxes = self.layout.zero_dims, self.layout.zero_axes
                varied, scatter = jax.vjp(
                    lambda xs: zero_module.gather_together(xs, dims, zaxes, invariant=False),
                    varied)
                balance = self._pipeline_balance(varied, *batch)
                loss, grads = self._pipeline_value_and_grad(varied, *batch, scale=scale,
                                                            balance=balance)
                (grads,) = scatter(grads)
                return unscaled(loss, grads, leaves)
            balance = self._pipeline_balance(varied, *batch)
            return unscaled(*self._pipeline_value_and_grad(varied, *batch, scale=scale,
                                                           balance=balance), leaves)
        if self.accumulate == 1:
            return one(leaves, *batch)
        n = self.accumulate
        micro = [b.reshape(n, b.shape[0] // n, *b.shape[1:]) for b in batch]
        balance = self._balance_fraction(self._model(leaves, train=True), micro)
        # a weighted loss_fn: the global weight of all micro-batches first, each micro-batch's
        # share is then its part of the whole loss (summed, not averaged)
        weight = self._micro_weight(self._model(leaves, train=False), micro, balance)
        options = dict(balance=balance, weight=weight, micro=n)
        first = jax.eval_shape(lambda *mb: one(leaves, *mb, **options), *(m[0] for m in micro))
        add = lambda a, b: jax.tree.map(jnp.add, a, b)
        (loss, grads), _ = lax.scan(  # micro-batch i draws its dropout masks from key i
            lambda total, xs: (add(total, one(leaves, *xs[0], **options, index=xs[1])), None),
            jax.tree.map(zeros_of, first), (micro, jnp.arange(n)))
        if weight is not None:
            return loss, grads
        return jax.tree.map(lambda a: a / n, (loss, grads))

    def _per_rank(self, leaves, *batch, scale=None, key=None):
        loss, grads = self._local_value_and_grad(list(leaves), *batch, scale=scale, key=key)
        if not self.communicate:  # Cheng et al.'s t_compute: the step without its reductions
            return loss, grads
        dims = self.layout.zero_dims
        vary = self._vary_axes()
        if self.zero == 2:  # reduce-scatter over data, all-reduce over the rest
            zaxes = self.layout.zero_axes
            grads = [zero_module.reduce_scatter(g, d, z) if d >= 0 else g
                     for g, d, z in zip(grads, dims, zaxes)]
            vary = [tuple(a for a in axes if not (a in z and d >= 0))
                    for axes, d, z in zip(vary, dims, zaxes)]
        grads = group_by(grads, vary, lambda xs, axes: comm.psum(xs, axes))
        return self._global(loss), grads

    def _global(self, share):
        """The global value of per-rank shares: one all-reduce over the axes they vary over (a
        pipeline's loss lives on its last stage)."""
        axes = tuple(sorted(metadata.varying_axes(share), key=self.mesh.axis_names.index))
        return comm.psum(share, axes) if axes else share

    def _specs_of_batch(self, count: int) -> tuple[P, ...]:
        if self.batch_specs is None:
            return (self.batch_spec,) * count
        if len(self.batch_specs) == 1:
            return self.batch_specs * count
        if len(self.batch_specs) != count:
            raise ConfigError(f"batch_specs has {len(self.batch_specs)} entries for {count} "
                              "batch arrays")
        return self.batch_specs

    def _gspmd_loss(self, params, *batch, balance=None, weight=None, micro=1):
        """GSPMD: the global loss of global arrays; ``jax.jit`` places the collectives
        (``weight``: a weighted loss' weight over all ``micro`` micro-batches)."""
        batch = [jax.lax.with_sharding_constraint(b, NamedSharding(self.mesh, s))
                 for b, s in zip(batch, self._specs_of_batch(len(batch)))]
        if self.pipeline is not None:
            if len(batch) != 2:
                raise ConfigError(f"a pipelined step takes (inputs, targets), got {len(batch)} "
                                  "batch arrays")
            return self._gspmd_pipeline_loss(jax.tree.leaves(params), *batch, balance=balance)
        model = self._ready(
            self.layout.model_of(self.precision.cast(jax.tree.leaves(params))))
        out = self._loss(model, batch, balance)
        weighted = token_mean.terms(out)
        if weighted is not None:
            weight = lax.stop_gradient(weighted.weight) if weight is None else weight
            return weighted.total / weight + weighted.mean / micro
        loss = jnp.asarray(out)
        return loss.astype(jnp.promote_types(loss.dtype, jnp.float32))

    def value_and_grad(self) -> Callable:
        """``(params, *batch) -> (loss, grads)``: the ``shard_map`` alone (grads as a dict like
        ``params``, with ZeRO-2/3 their shards; the batch in :meth:`context_order`)."""
        if self.spmd == "gspmd":
            grad_sh = self._shardings(self.grad_specs)

            def one(params, batch, scale, balance=None, weight=None, micro=1):
                return jax.value_and_grad(
                    lambda p: self._gspmd_loss(p, *batch, balance=balance, weight=weight,
                                               micro=micro) * scale)(params)

            def run_gspmd(params, *batch, scale=None):
                scale = self.precision.loss_scale if scale is None else scale
                n = self.accumulate
                if n == 1:
                    loss, grads = one(params, batch, scale)
                else:  # micro-batch i: every batch rank's i-th slice, as the shard_map step
                    ranks = self.batch_ranks
                    micro = [b.reshape(ranks, n, b.shape[0] // (ranks * n), *b.shape[1:])
                             .swapaxes(0, 1).reshape(n, b.shape[0] // n, *b.shape[1:])
                             for b in batch]
                    model = self._ready(self.layout.model_of(
                        self.precision.cast(jax.tree.leaves(params))))
                    balance = self._balance_fraction(model, micro)
                    weight = self._micro_weight(model, micro, balance)
                    options = (scale, balance, weight, n)
                    first = jax.eval_shape(lambda mb: one(params, mb, *options),
                                           [m[0] for m in micro])
                    total, _ = lax.scan(
                        lambda acc, mb: (jax.tree.map(jnp.add, acc,
                                                      one(params, mb, *options)), None),
                        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first), micro)
                    loss, grads = (total if weight is not None
                                   else jax.tree.map(lambda a: a / n, total))
                grads = jax.tree.map(lambda g, p: (g / scale).astype(p.dtype), grads, params)
                return loss / scale, jax.lax.with_sharding_constraint(grads, grad_sh)

            return run_gspmd

        def run(params, *batch, scale=None, key=None):
            leaves = jax.tree.leaves(params)
            # after the batch, replicated: the dynamic loss scale, the dropout key's data
            extra = {name: value for name, value in (("scale", scale), ("key", key))
                     if value is not None}

            def per_rank(leaves, *args):
                split = len(args) - len(extra)
                return self._per_rank(leaves, *args[:split], **dict(zip(extra, args[split:])))

            fn = self.over_mesh(per_rank, len(batch), out_specs=(P(), list(self.grad_specs)),
                                after=(P(),) * len(extra), check_vma=self.communicate)
            loss, grads = fn(tuple(leaves), *batch, *extra.values())
            return loss, self._pure(grads)

        return run

    def _evaluate(self, fn: Callable) -> Callable:
        """``fn(model, *batch)`` -> a scalar mean or a dict of them, as global means, jitted
        (forward only)."""
        if self.spmd == "gspmd":
            def global_fn(params, *batch):
                batch = [jax.lax.with_sharding_constraint(b, NamedSharding(self.mesh, s))
                         for b, s in zip(batch, self._specs_of_batch(len(batch)))]
                model = self._ready(
                    self.layout.model_of(self.precision.cast(jax.tree.leaves(params))))
                out = fn(model, *self.precision.cast(batch))
                return token_mean.value(out) if isinstance(out, tuple) else out
            return jax.jit(global_fn)

        def per_rank(leaves, *batch):
            model = self._model(leaves, train=False)
            out = fn(model, *self.precision.cast(batch))
            weighted = token_mean.terms(out)
            if weighted is not None:  # a global token mean
                weight = token_mean.global_weight(weighted.weight,
                                                  metadata.varying_axes(weighted.total))
                return self._global(token_mean.shares(weighted, weight))

            def total(value):
                value = jnp.asarray(value)
                value = value.astype(jnp.promote_types(value.dtype, jnp.float32))
                return self._global(self._mean_share(value)[0])

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
        if self.samo is not None:  # the gradient compressed before the data all-reduce
            return samo_module.build(self)
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
    dimension over the batch axes), ``communicate=False`` (measurement only, Cheng et al.'s
    breakdown: the step without its gradient and loss reductions; its values are not the
    model's), ``samo`` (a :class:`~jphantom.samo.SamoConfig`: a magnitude-pruned model with
    compressed master weights, optimizer state and gradient all-reduce, Singh's thesis ch. 4),
    ``attention`` (``auto``, ``xla`` or ``cudnn``: the kernel of the model's attention cores,
    :func:`jphantom.nn.attention.choose`; default ``None``: as the model built them)."""
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
