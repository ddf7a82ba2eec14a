"""The step's pipeline part (the ``stage`` axis): the model's one :class:`Stacked` cut into stages
at its leading layer axis, the storage order of interleaved (virtual) stages and zb-v's chunks,
and the two ways the step runs a schedule: the per-rank executor of
:mod:`jphantom.pipeline.runner` (F, B, W and whole-backward tasks: GPipe, 1F1B, interleaved
1F1B, ZB-H1, ZB-V), and GSPMD's tick loop differentiated by jax (the baseline, as MaxText
pipelines). The micro-batches'
routing fractions (MoE) and token weights are computed over the whole batch first, so the
pipelined loss and gradients equal the unpipelined step's. :class:`jphantom.train_step.TrainStep`
takes these methods from :class:`PipelineParts`; they read its layout, mesh and precision.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom import comm
from jphantom import token_mean
from jphantom import zero as zero_module
from jphantom.errors import ConfigError
from jphantom.nn import balance as balance_module
from jphantom.nn import metadata
from jphantom.nn.stack import Stacked
from jphantom.pipeline.buffers import interleave_microbatches, split_microbatches, zeros_of
from jphantom.step.layout import group_by, is_variable, path_key


class PipelineParts:
    """The pipeline methods of :class:`jphantom.train_step.TrainStep` (see the module)."""

    def _pipeline(self, model, mesh, pipeline):
        """With a ``stage`` axis: the model's one :class:`Stacked` cut into stages (its parameters'
        leading layer axis split over ``stage``) and the validated schedule; else ``None``."""
        if "stage" not in mesh.axis_names:
            if pipeline is not None:
                raise ConfigError("pipeline= needs a 'stage' axis in the mesh")
            return None, None
        from jphantom.pipeline.config import PipelineConfig

        stages = dict(mesh.shape)["stage"]
        pipeline = pipeline if pipeline is not None else PipelineConfig(microbatches=stages)
        if not isinstance(pipeline, PipelineConfig):
            raise ConfigError("pipeline must be a jphantom.pipeline.runner.PipelineConfig")
        if self.accumulate != 1:
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

    def _pipeline_layout(self, model):
        """Which pure-order leaves belong to the stacked blocks, and how they form the block's
        state (``nnx.split(stacked.block)``)."""
        path, stacked = self.stack
        pure = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
        paths = [path_key(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]
        prefix = (*path, "block")
        self.stacked_index = tuple(i for i, p in enumerate(paths) if p[:len(prefix)] == prefix)
        self.rest_index = tuple(i for i, p in enumerate(paths) if p[:len(prefix)] != prefix)
        block = nnx.merge(*nnx.split(stacked.block))  # a copy (arrays shared) set up to compute
        block_graph, block_state, _ = nnx.split(self._ready(block), nnx.Param, ...)
        block_vars = jax.tree_util.tree_flatten_with_path(block_state, is_leaf=is_variable)[0]
        relative = {paths[i][len(prefix):]: k for k, i in enumerate(self.stacked_index)}
        self.block_graph = block_graph
        self.block_treedef = jax.tree.structure(block_state)
        self.block_order = tuple(relative[path_key(p)] for p, _ in block_vars)

    def _split(self, leaves):
        return ([leaves[i] for i in self.stacked_index], [leaves[i] for i in self.rest_index])

    def _join(self, stacked, rest):
        leaves = [None] * (len(stacked) + len(rest))
        for i, x in zip(self.stacked_index, stacked):
            leaves[i] = x
        for i, x in zip(self.rest_index, rest):
            leaves[i] = x
        return leaves

    def _unit_order(self):
        """Several model chunks per device: ``order[g]``, the layer stored at position g of the
        stacked axis, so that the contiguous split over ``stage`` gives device s its model
        chunks (v P + s with V virtual stages, Megatron's round robin; s and 2P - 1 - s with
        zb-v); ``None`` with one chunk per device."""
        from jphantom.pipeline.table import unit_order

        if self.pipeline is None or self.pipeline.local_chunks == 1:
            return None
        return unit_order(self.stack[1].layers, dict(self.mesh.shape)["stage"],
                          self.pipeline.virtual_stages, schedule=self.pipeline.schedule)

    def to_model_order(self, tree):
        """A dict like ``TrainState.params`` (parameters or gradients) with interleaved stages'
        stacked layers back in the model's order (unchanged otherwise)."""
        return self._reorder(tree, inverse=True)

    def _reorder(self, params, inverse: bool = False):
        """``params`` (a pure dict) with the stacked layers in storage order (or back)."""
        import numpy as np

        order = self._unit_order()
        if order is None:
            return params
        index = np.argsort(order) if inverse else order
        leaves = list(jax.tree.leaves(params))
        for i in self.stacked_index:
            leaves[i] = leaves[i][index]
        return self._pure(leaves)

    def _pipeline_balance(self, leaves, inputs, targets):
        """A pipelined step's :meth:`_balance_fraction`: the forward slots of the schedule, each
        last stage summing the MoE layers' router statistics of its micro-batches (the
        statistics ride with the activations, [L_moe, 2E] per micro-batch), all-reduced over
        ``stage``. ``None`` when the model has no MoE layers or does not take part."""
        if not self._takes_balance():
            return None
        rows = inputs.shape[0] // self.pipeline.microbatches
        shape = jax.eval_shape(
            lambda l, i, t: self._model(l, train=False).balance_statistics(i, t),
            leaves, inputs[:rows], targets[:rows])
        if shape is None:
            return None
        total = self._pipeline_value_and_grad(leaves, inputs, targets, train=False,
                                              statistics=True)
        total = comm.psum(total, "stage")  # non-zero on the last stage only
        return balance_module.fractions(total)

    def _pipeline_value_and_grad(self, leaves, inputs, targets, *, train: bool = True,
                                 scale=1.0, balance=None, statistics: bool = False):
        """The model cut at its :class:`Stacked` and run by the pipeline executor
        (:func:`jphantom.pipeline.runner.run`, every schedule, its own backward): the part of
        ``loss_fn`` before the blocks on the first stage, the blocks' layers split over ``stage``
        (model chunks of L / (P V) layers: :func:`jphantom.pipeline.table.unit_order`),
        the part after them (head, loss) on the last.
        ``train=False``: the forward slots only, the loss share alone (``statistics``: the MoE
        layers' router statistics summed over the micro-batches instead, :meth:`_pipeline_balance`).
        ``balance``: the whole batch's routing fractions, given to each micro-batch's loss."""
        from jphantom.nn.stack import Capture, Feed, StackInput, apply_blocks
        from jphantom.pipeline import runner
        from jphantom.plans import set_submodule

        cast, loss_fn, layout = self.precision.cast, self.loss_fn, self.layout
        stack_path, stacked_module = self.stack
        remat = stacked_module.remat
        micro = self.pipeline.microbatches
        stacked_now, rest_now = self._split(leaves)
        rows = inputs.shape[0] // micro
        dummy_inputs = jnp.zeros((rows, *inputs.shape[1:]), inputs.dtype)
        dummy_targets = jnp.zeros((rows, *targets.shape[1:]), targets.dtype)

        def model_with(rest, stand_in):
            model = self._ready(layout.model_of(cast(self._join(stacked_now, rest))))
            set_submodule(model, stack_path, stand_in)
            return model

        def run_model(model, inputs_mb, targets_mb):
            if statistics:
                return model.balance_statistics(inputs_mb, targets_mb)
            with balance_module.given(balance):
                return loss_fn(model, inputs_mb, targets_mb)

        def first(rest, inputs_mb):
            try:
                run_model(model_with(rest, Capture()), inputs_mb, dummy_targets)
            except StackInput as entered:
                return entered.h
            raise ConfigError("loss_fn never called the model's Stacked blocks: a pipeline cuts "
                              "the model there")

        stages_count = dict(self.mesh.shape)["stage"]
        per_chunk = stacked_module.layers // (stages_count * self.pipeline.local_chunks)

        def body(chunk, x, c):
            state = jax.tree.unflatten(self.block_treedef,
                                       [cast(chunk[k]) for k in self.block_order])
            return apply_blocks(self.block_graph, state, x, remat=remat,
                                with_index=stacked_module.with_index, offset=c * per_chunk)

        weight = None if statistics else self._pipeline_weight(
            first, lambda out, t: run_model(model_with(rest_now, Feed(lambda: out)),
                                            dummy_inputs, t),
            rest_now, inputs[:rows], targets, micro)

        def last(rest, out, targets_mb, microbatches):
            model = model_with(rest, Feed(lambda: out))
            if statistics:
                return run_model(model, dummy_inputs, targets_mb)
            loss = run_model(model, dummy_inputs, targets_mb)
            weighted = token_mean.terms(loss)
            if weighted is not None:  # its part of the global token mean
                if weight is None:
                    raise ConfigError("loss_fn returned a scalar for one micro-batch and "
                                      "(total, weight) for another")
                return token_mean.shares(weighted, weight, micro=microbatches,
                                         exclude=("stage",)) * scale
            loss = jnp.asarray(loss)
            loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
            return self._mean_share(loss, exclude=("stage",))[0] / microbatches * scale

        stages = runner.Stages(units=stacked_module.layers, unit_name="layers", first=first,
                               body=body, last=last)
        plan = runner.plan(self.pipeline, stages_count, train=train)
        stacked, rest = self._split(leaves)
        if not train:
            return runner.run(stages, self.pipeline, plan, stacked, rest, inputs, targets,
                              train=False)
        loss, d_stacked, d_rest = runner.run(stages, self.pipeline, plan, stacked, rest, inputs,
                                             targets)
        grads = self._join(d_stacked, d_rest)
        return loss, [g.astype(x.dtype) for g, x in zip(grads, leaves)]

    @staticmethod
    def _pipeline_weight(first, loss_after, rest, inputs_mb, targets, micro):
        """A pipelined weighted ``loss_fn``'s global weight over the ``micro`` micro-batches of
        ``targets``, before the schedule runs: ``loss_after(out, targets_mb)`` (the loss after
        the blocks, as the last stage runs it) on a stand-in output of zeros, only its weight
        kept (XLA drops the rest). A weight that depends on the model's output cannot be
        known before the blocks have run: refused. ``None`` for a scalar ``loss_fn``."""
        from jphantom.pipeline.split import needed_inputs

        out = jax.tree.map(zeros_of, jax.eval_shape(first, rest, inputs_mb))
        targets = split_microbatches(targets, micro)
        struct = jax.eval_shape(loss_after, out, targets[0])
        if not isinstance(struct, tuple):
            return None
        weight_of = lambda o, t: token_mean.terms(loss_after(o, t)).weight
        traced = jax.make_jaxpr(weight_of)(out, targets[0])
        if needed_inputs(traced.jaxpr, [True])[:len(jax.tree.leaves(out))] != [False] * len(
                jax.tree.leaves(out)):
            raise ConfigError("a pipelined step needs the loss's weight before the blocks run: "
                              "loss_fn's weight depends on the model's output; count the "
                              "tokens from the targets (a mask, or targets < 0 ignored)")
        weights = lax.map(lambda t: weight_of(out, t), targets)
        return token_mean.global_weight(jnp.sum(weights, axis=0),
                                        metadata.varying_axes(struct[0]), exclude=("stage",))

    def _gspmd_pipeline_loss(self, leaves, inputs, targets, balance=None):
        """GSPMD's pipeline, as a JAX user writes it (Praxis' ``LayerwiseShardablePipelined``,
        MaxText's ``pipeline.py``): the stacked layers reshaped [P, L/P, ...] with the stage
        dimension on ``stage``, a state buffer [P, micro-batch, ...] split the same way, and
        M + P - 1 ticks of ``vmap`` over the stages, each tick rotating the buffer one stage on
        (``jnp.concatenate`` of its last and first P - 1 slots, which the partitioner turns into
        a collective-permute over ``stage``) and feeding micro-batch t to stage 0 in place of
        what the last stage sent round. The loss is the mean of the
        micro-batches' losses; ``jax.grad`` of the loop is the backward, so the schedule is
        GPipe's (every forward tick, then every backward tick). Micro-batch i holds every batch
        rank's i-th slice, as in the shard_map pipeline."""
        from jphantom.nn.stack import Capture, Feed, StackInput, apply_blocks
        from jphantom.plans import set_submodule

        leaves = self.precision.cast(list(leaves))
        stack_path, stacked_module = self.stack
        stages, micro = dict(self.mesh.shape)["stage"], self.pipeline.microbatches
        ranks = self.batch_ranks
        inputs_mb, targets_mb = (interleave_microbatches(b, micro, ranks)
                                 for b in (inputs, targets))
        stacked, rest = self._split(leaves)
        if balance is None and self._takes_balance():
            balance = self._balance_fraction(
                self._ready(self.layout.model_of(leaves)), [inputs_mb, targets_mb])

        def model_with(stand_in):
            model = self._ready(self.layout.model_of(self._join(stacked, rest)))
            set_submodule(model, stack_path, stand_in)
            return model

        def first(inputs_one, targets_one):
            try:
                with balance_module.given(balance):
                    self.loss_fn(model_with(Capture()), inputs_one, targets_one)
            except StackInput as entered:
                return entered.h
            raise ConfigError("loss_fn never called the model's Stacked blocks: a pipeline cuts "
                              "the model there")

        per_stage = stacked_module.layers // stages

        def stage(chunk, x, s):
            state = jax.tree.unflatten(self.block_treedef, [chunk[k] for k in self.block_order])
            return apply_blocks(self.block_graph, state, x, remat=stacked_module.remat,
                                with_index=stacked_module.with_index, offset=s * per_stage)

        def on_stage(tree):  # dimension 0 over ``stage``, the others where the partitioner likes
            return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(
                self.mesh, P("stage", *[P.UNCONSTRAINED] * (a.ndim - 1)))), tree)

        xs = jax.vmap(first)(inputs_mb, targets_mb)  # [M, b, ...]: every micro-batch embedded
        chunks = on_stage([a.reshape(stages, per_stage, *a.shape[1:]) for a in stacked])
        buffer = on_stage(jax.tree.map(lambda a: jnp.zeros((stages, *a.shape[1:]), a.dtype), xs))
        outputs = jax.tree.map(jnp.zeros_like, xs)
        run_stages = jax.vmap(stage, spmd_axis_name="stage")

        def tick(carry, t):
            buffer, outputs = carry
            fed = jax.tree.map(lambda a: lax.dynamic_index_in_dim(
                a, jnp.minimum(t, micro - 1), 0, keepdims=True), xs)
            first_stage = jnp.arange(stages) == 0
            shifted = on_stage(jax.tree.map(
                lambda f, b: jnp.where(first_stage.reshape(-1, *[1] * (b.ndim - 1)), f,
                                       jnp.concatenate([b[-1:], b[:-1]], 0)), fed, buffer))
            buffer = on_stage(run_stages(chunks, shifted, jnp.arange(stages)))
            # the micro-batch leaving the last stage (before tick P - 1 what leaves is filler,
            # written to slot 0 and overwritten by micro-batch 0 at tick P - 1)
            done = jnp.maximum(t - (stages - 1), 0)
            outputs = jax.tree.map(lambda o, b: lax.dynamic_update_index_in_dim(o, b[-1], done, 0),
                                   outputs, buffer)
            return (buffer, outputs), None

        (_, outputs), _ = lax.scan(tick, (buffer, outputs), jnp.arange(micro + stages - 1))

        def last(out, inputs_one, targets_one):
            with balance_module.given(balance):
                loss = self.loss_fn(model_with(Feed(lambda: out)), inputs_one, targets_one)
            weighted = token_mean.terms(loss)
            if weighted is not None:
                return tuple(weighted)
            loss = jnp.asarray(loss)
            return loss.astype(jnp.promote_types(loss.dtype, jnp.float32))

        losses = jax.vmap(last)(outputs, inputs_mb, targets_mb)
        if isinstance(losses, tuple):  # a global token mean: the micro-batches' sums
            total, weight, mean = losses
            return jnp.sum(total) / lax.stop_gradient(jnp.sum(weight)) + jnp.mean(mean)
        return jnp.mean(losses)

    def _pipeline_loss(self) -> Callable:
        """Evaluation through the pipeline's forward slots (no backward, no stash)."""
        vary = self.vary_axes()

        def per_rank(leaves, inputs, targets):
            leaves = list(leaves)
            if self.zero == 3:
                leaves = zero_module.gather_together(leaves, self.layout.zero_dims,
                                                     self.layout.zero_axes, invariant=False)
            leaves = group_by(leaves, vary, lambda xs, axes: comm.pcast(xs, axes, to="varying"))
            return self.global_value(self._pipeline_value_and_grad(leaves, inputs, targets,
                                                               train=False))

        @jax.jit
        def evaluate(params, *batch):
            fn = self.over_mesh(per_rank, len(batch), out_specs=P())
            return fn(tuple(jax.tree.leaves(params)), *batch)

        return lambda params, *batch: evaluate(params, *self.context_order(batch))
