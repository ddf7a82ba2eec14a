"""The GSPMD baseline of the step: the plain model with sharding annotations
(:func:`jphantom.plans.annotate`), its global loss differentiated and ``jax.jit``'s partitioner
placing every collective (GSPMD, Xu et al. 2021), as a JAX user would write it; a pipeline runs as
a loop of forward ticks (Praxis, MaxText; :meth:`GspmdGradients.pipeline_loss`).

The shard_map step writes its collectives per rank; this one is the baseline it is measured
against, sharing its layout, precision, accumulation order and MoE balance. :class:`GspmdGradients`
is the step's gradient provider under ``spmd="gspmd"``: it takes global arrays, not a rank's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.step import token_mean
from jphantom.errors import ConfigError
from jphantom.nn import balance as balance_module
from jphantom.pipeline.buffers import interleave_microbatches
from jphantom.step.grads import (Gradients, accumulate, balance_fraction, loss_of, micro_weight,
                                 takes_balance)
from jphantom.step.setup import StepSetup


class GspmdGradients:
    """``loss, grads, weight = provider(params, *batch)`` (a
    :class:`~jphantom.step.grads.Gradients`) on global arrays (module docstring)."""

    scattered = False  # jit's own reductions: no reducer runs after it

    def __init__(self, setup: StepSetup):
        self.setup = setup

    def model(self, params):
        """The model holding ``params`` (global arrays) in the compute precision."""
        setup = self.setup
        return setup.ready(setup.layout.model_of(setup.precision.cast(jax.tree.leaves(params))))

    def batch(self, batch):
        """``batch`` constrained to the step's batch shardings."""
        setup = self.setup
        return [jax.lax.with_sharding_constraint(b, NamedSharding(setup.mesh, s))
                for b, s in zip(batch, setup.specs_of_batch(len(batch)))]

    def loss(self, params, *batch, **options):
        """The global loss of global arrays; ``jax.jit`` places the collectives."""
        return self.loss_and_weight(params, *batch, **options)[0]

    def loss_and_weight(self, params, *batch, balance=None, weight=None, micro=1):
        """``(loss, weight)``: the global loss and, for a weighted ``loss_fn``, its global weight
        (given: a weighted loss' weight over all ``micro`` micro-batches; None for a scalar
        ``loss_fn``)."""
        batch = self.batch(batch)
        if self.setup.pipeline is not None:
            if len(batch) != 2:
                raise ConfigError(f"a pipelined step takes (inputs, targets), got {len(batch)} "
                                  "batch arrays")
            return self.pipeline_loss(jax.tree.leaves(params), *batch, balance=balance)
        out = loss_of(self.setup, self.model(params), batch, balance)
        weighted = token_mean.terms(out, self.setup.loss_fn)
        if weighted is not None:
            weight = lax.stop_gradient(weighted.weight) if weight is None else weight
            return weighted.total / weight + weighted.mean / micro, weight
        loss = jnp.asarray(out)
        return loss.astype(jnp.promote_types(loss.dtype, jnp.float32)), None

    def __call__(self, params, *batch, scale=None):
        """The global loss differentiated, the micro-batches accumulated as the shard_map step
        does, ``jax.jit`` placing the collectives; the gradients in the step's specs."""
        setup = self.setup
        scale = setup.precision.loss_scale if scale is None else scale

        def one(params, batch, scale, balance=None, weight=None, micro=1):
            def scaled(p):
                loss, found = self.loss_and_weight(p, *batch, balance=balance, weight=weight,
                                                   micro=micro)
                return loss * scale, found

            (loss, found), grads = jax.value_and_grad(scaled, has_aux=True)(params)
            return (loss, grads), found

        n = setup.accumulate
        if n == 1:
            (loss, grads), weight = one(params, batch, scale)
        else:  # micro-batch i: every batch rank's i-th slice, as the shard_map step
            micro = [interleave_microbatches(b, n, setup.batch_ranks) for b in batch]
            model = self.model(params)
            balance = balance_fraction(setup, model, micro)
            weight = micro_weight(setup, model, micro, balance)
            options = (scale, balance, weight, n)
            loss, grads = accumulate(lambda mb: one(params, mb, *options)[0], micro,
                                     mean=weight is None)
        grads = jax.tree.map(lambda g, p: (g / scale).astype(p.dtype), grads, params)
        return Gradients(loss / scale, jax.lax.with_sharding_constraint(
            grads, setup.shardings(setup.grad_specs)), weight)

    def evaluate(self, fn):
        """``fn`` on the global arrays, jitted: a scalar mean, a dict of them or a global token
        mean."""
        def global_fn(params, *batch):
            out = fn(self.model(params), *self.setup.precision.cast(self.batch(batch)))
            return token_mean.value(out) if isinstance(out, tuple) else out
        return jax.jit(global_fn)

    def pipeline_loss(self, leaves, inputs, targets, balance=None):
        """GSPMD's pipeline, as a JAX user writes it (Praxis' ``LayerwiseShardablePipelined``,
        MaxText's ``pipeline.py``): the stacked layers reshaped [P, L/P, ...] with the stage
        dimension on ``stage``, a state buffer [P, micro-batch, ...] split the same way, and
        M + P - 1 ticks of ``vmap`` over the stages, each tick rotating the buffer one stage on
        (``jnp.concatenate`` of its last and first P - 1 slots, which the partitioner turns into
        a collective-permute over ``stage``) and feeding micro-batch t to stage 0 in place of
        what the last stage sent round. ``(loss, weight)``: the micro-batches' mean (or global
        token mean, and its weight); ``jax.grad`` of the loop is the backward, so the schedule is
        GPipe's (every forward tick, then every backward tick). Micro-batch i holds every batch
        rank's i-th slice, as in the shard_map pipeline."""
        from jphantom.nn.stack import Capture, Feed, StackInput
        from jphantom.plans import set_submodule

        setup, layout = self.setup, self.setup.stages
        leaves = setup.precision.cast(list(leaves))
        stack_path = layout.path
        stages, micro = layout.stages, setup.pipeline.microbatches
        ranks = setup.batch_ranks
        inputs_mb, targets_mb = (interleave_microbatches(b, micro, ranks)
                                 for b in (inputs, targets))
        stacked, rest = layout.split(leaves)
        if balance is None and takes_balance(setup):
            balance = balance_fraction(
                setup, setup.ready(setup.layout.model_of(leaves)), [inputs_mb, targets_mb])

        def model_with(stand_in):  # given the whole batch's routing fractions
            model = setup.ready(setup.layout.model_of(layout.join(stacked, rest)))
            set_submodule(model, stack_path, stand_in)
            balance_module.give(model, balance)
            return model

        def first(inputs_one, targets_one):
            try:
                setup.loss_fn(model_with(Capture()), inputs_one, targets_one)
            except StackInput as entered:
                return entered.h
            raise ConfigError("loss_fn never called the model's Stacked blocks: a pipeline cuts "
                              "the model there")

        xs = jax.vmap(first)(inputs_mb, targets_mb)  # [M, b, ...]: every micro-batch embedded
        outputs = self._ticks(stacked, xs, stages, micro)

        def last(out, inputs_one, targets_one):
            loss = setup.loss_fn(model_with(Feed(lambda: out)), inputs_one, targets_one)
            weighted = token_mean.terms(loss, setup.loss_fn)
            if weighted is not None:
                return tuple(weighted)
            loss = jnp.asarray(loss)
            return loss.astype(jnp.promote_types(loss.dtype, jnp.float32))

        losses = jax.vmap(last)(outputs, inputs_mb, targets_mb)
        if isinstance(losses, tuple):  # a global token mean: the micro-batches' sums
            total, weight, mean = losses
            return jnp.sum(total) / (w := lax.stop_gradient(jnp.sum(weight))) + jnp.mean(mean), w
        return jnp.mean(losses), None

    def _ticks(self, stacked, xs, stages: int, micro: int):
        """:meth:`pipeline_loss`' M + P - 1 ticks: the micro-batches ``xs`` [M, b, ...] through the
        stacked layers ``stacked`` cut into ``stages`` chunks; what leaves the last stage, per
        micro-batch [M, b, ...]."""
        mesh = self.setup.mesh

        def on_stage(tree):  # dimension 0 over ``stage``, the others where the partitioner likes
            return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(
                mesh, P("stage", *[P.UNCONSTRAINED] * (a.ndim - 1)))), tree)

        chunks = on_stage([a.reshape(stages, -1, *a.shape[1:]) for a in stacked])
        buffer = on_stage(jax.tree.map(lambda a: jnp.zeros((stages, *a.shape[1:]), a.dtype), xs))
        outputs = jax.tree.map(jnp.zeros_like, xs)
        run_stages = jax.vmap(self.stage(), spmd_axis_name="stage")

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
        return outputs

    def stage(self):
        """``stage(chunk, x, s)``: stage ``s``'s layers (its parameters ``chunk``) applied to ``x``
        under the blocks' remat policy (already in the compute precision)."""
        from jphantom.nn.stack import apply_blocks

        layout = self.setup.stages
        stacked = layout.stacked
        per_stage = stacked.layers // layout.stages

        def stage(chunk, x, s):
            state = jax.tree.unflatten(layout.block_treedef, [chunk[k] for k in layout.block_order])
            return apply_blocks(layout.block_graph, state, x, remat=stacked.remat,
                                with_index=stacked.with_index, offset=s * per_stage)

        return stage
