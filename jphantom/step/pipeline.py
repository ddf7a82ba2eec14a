"""The step's pipeline part (the ``stage`` axis): the model's one :class:`Stacked` cut into stages
at its leading layer axis (:func:`jphantom.step.stages.cut_into_stages`), the storage order of interleaved (virtual)
stages and zb-v's chunks (:class:`~jphantom.step.stages.PipelineLayout`), and the pipelined gradient provider
(:class:`PipelineGradients`): the per-rank executor of :mod:`jphantom.pipeline.runner` (F, B, W
and whole-backward tasks: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V; Huang et al. 2019,
Narayanan et al. 2021, Qi et al. 2024). The micro-batches' routing fractions (MoE) and token
weights are computed over the whole batch first, so the pipelined loss and gradients equal the
unpipelined step's. Batch arrays past ``(inputs, targets)`` (a mask; a packed batch's
segment ids and positions, which ride with the activation through the stages,
:mod:`jphantom.nn.attention.packing`) reach the first stage's part with the inputs and the last
stage's with the targets. ZeRO-3 gathers the parameters once before the schedule;
``master_weights="sharded"`` (Megatron's distributed optimizer) gathers them once in bf16, so no
task casts its chunk, and the executor sums each chunk's gradients in float32 across its tasks.
GSPMD's tick loop (the baseline) is :mod:`jphantom.step.gspmd`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.runtime import comm
from jphantom.step import token_mean
from jphantom.step import zero as zero_module
from jphantom.errors import ConfigError
from jphantom.nn import balance as balance_module
from jphantom.nn import metadata
from jphantom.nn.stack import gathers_stacked
from jphantom.pipeline.buffers import split_microbatches, zeros_of
from jphantom.step.grads import Gradients, takes_balance, unscaled
from jphantom.step.rank_params import RankParameters
from jphantom.step.setup import StepSetup


class PipelineGradients:
    """The pipelined gradient provider: ``share, grads, weight = provider(leaves, inputs,
    targets)`` (a :class:`~jphantom.step.grads.Gradients`), this rank's loss share (non-zero on
    the last stage) and gradients before the reductions, and the global weight (module
    docstring)."""

    scattered = False  # its gradients reach the reducer whole (a pipeline reduces once)

    def __init__(self, setup: StepSetup, params: RankParameters):
        self.setup, self.params, self.stages = setup, params, setup.stages

    def __call__(self, leaves, *batch, scale=None, key=None):
        """``scale``: the loss scale (default the precision's); no dropout in a pipeline."""
        setup = self.setup
        scale = setup.precision.loss_scale if scale is None else scale
        if len(batch) < 2:
            raise ConfigError(f"a pipelined step takes (inputs, targets, ...), got {len(batch)} "
                              "batch arrays")
        leaves = list(leaves)
        varied = self.params.vary_params(leaves)
        scatter = None
        if setup.master_weights == "sharded":  # bf16, gathered once; its transpose scatters
            varied, scatter = jax.vjp(lambda xs: self.params.gather(xs, train=True), varied)
        elif setup.zero == 3:  # gathered once for the whole pipeline; its transpose scatters
            dims, zaxes = setup.layout.zero_dims, setup.layout.zero_axes
            varied, scatter = jax.vjp(
                lambda xs: zero_module.gather_together(xs, dims, zaxes, invariant=False),
                varied)
        balance = self.balance(varied, *batch)
        loss, grads, weight = self.value_and_grad(varied, *batch, scale=scale, balance=balance)
        if scatter is not None:
            (grads,) = scatter(grads)
        return Gradients(*unscaled(loss, grads, leaves, scale), weight)

    def balance(self, leaves, *batch):
        """The whole batch's routing fractions (:func:`jphantom.step.grads.balance_fraction`)
        through the schedule's forward slots, each last stage summing the MoE layers' router
        statistics of its micro-batches (the statistics ride with the activations, [L_moe, 2E]
        per micro-batch), all-reduced over ``stage``. ``None`` when the model has no MoE layers
        or does not take part."""
        if not takes_balance(self.setup):
            return None
        rows = batch[0].shape[0] // self.setup.pipeline.microbatches
        shape = jax.eval_shape(
            lambda l, i, t: self.params.model(l, train=False).balance_statistics(i, t),
            leaves, batch[0][:rows], batch[1][:rows])
        if shape is None:
            return None
        total = self.value_and_grad(leaves, *batch, train=False, statistics=True)
        total = comm.psum(total, "stage")  # non-zero on the last stage only
        return balance_module.fractions(total)

    def value_and_grad(self, leaves, *batch, train: bool = True, scale=1.0, balance=None,
                       statistics: bool = False):
        """The model cut at its :class:`Stacked` and run by the pipeline executor
        (:func:`jphantom.pipeline.runner.run`, every schedule, its own backward): the part of
        ``loss_fn`` before the blocks on the first stage, the blocks' layers split over ``stage``
        (model chunks of L / (P V) layers: :func:`jphantom.pipeline.table.unit_order`),
        the part after them (head, loss) on the last. ``train``: a
        :class:`~jphantom.step.grads.Gradients` (the global weight found before the schedule
        runs, :meth:`weight`); ``train=False``: the forward slots only, the loss share alone
        (``statistics``: the MoE layers' router statistics summed over the micro-batches
        instead, :meth:`balance`).
        ``balance``: the whole batch's routing fractions, given to each micro-batch's loss.
        ``batch``: ``(inputs, targets, *extras)`` (module docstring)."""
        from jphantom.nn.stack import Capture, Feed, StackInput
        from jphantom.pipeline import runner
        from jphantom.plans import set_submodule

        setup, stages_layout = self.setup, self.stages
        cast, loss_fn, layout = setup.precision.cast, setup.loss_fn, setup.layout
        stack_path, stacked_module = stages_layout.path, stages_layout.stacked
        micro = setup.pipeline.microbatches
        stacked_now, rest_now = stages_layout.split(leaves)
        rows = batch[0].shape[0] // micro
        dummy_inputs, dummy_targets = (jnp.zeros((rows, *a.shape[1:]), a.dtype) for a in batch[:2])
        inputs, targets = (batch[0], *batch[2:]), batch[1:]  # what first / last read

        def model_with(rest, stand_in):
            model = setup.ready(layout.model_of(cast(stages_layout.join(stacked_now, rest))))
            set_submodule(model, stack_path, stand_in)
            return model

        def run_model(model, inputs_mb, targets_mb, extras_mb):
            if statistics:
                return model.balance_statistics(inputs_mb, targets_mb)
            balance_module.give(model, balance)  # the whole batch's routing fractions
            return loss_fn(model, inputs_mb, targets_mb, *extras_mb)

        def first(rest, inputs_mb):
            try:
                run_model(model_with(rest, Capture()), inputs_mb[0], dummy_targets,
                          inputs_mb[1:])
            except StackInput as entered:
                return entered.h
            raise ConfigError("loss_fn never called the model's Stacked blocks: a pipeline cuts "
                              "the model there")

        stages_count = stages_layout.stages
        weight = None if statistics else self.weight(
            first, lambda out, t: run_model(model_with(rest_now, Feed(lambda: out)),
                                            dummy_inputs, t[0], t[1:]),
            rest_now, tuple(a[:rows] for a in inputs), targets, micro)

        def last(rest, out, targets_mb, microbatches):
            model = model_with(rest, Feed(lambda: out))
            if statistics:
                return run_model(model, dummy_inputs, targets_mb[0], targets_mb[1:])
            loss = run_model(model, dummy_inputs, targets_mb[0], targets_mb[1:])
            weighted = token_mean.terms(loss, loss_fn)
            if weighted is not None:  # its part of the global token mean
                if weight is None:
                    raise ConfigError("loss_fn returned a scalar for one micro-batch and "
                                      "(total, weight) for another")
                return token_mean.shares(weighted, weight, micro=microbatches,
                                         exclude=("stage",)) * scale
            loss = jnp.asarray(loss)
            loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
            return setup.mean_share(loss, exclude=("stage",))[0] / microbatches * scale

        stacked, rest = stages_layout.split(leaves)
        body, layers = self.body(stacked)
        stages = runner.Stages(units=stacked_module.layers, unit_name="layers", first=first,
                               body=body, last=last, prepare=cast, layers=layers)
        table = runner.schedule_table(setup.pipeline, stages_count, train=train)
        if not train:
            return runner.run(stages, setup.pipeline, table, stacked, rest, inputs, targets,
                              train=False)
        loss, d_stacked, d_rest = runner.run(stages, setup.pipeline, table, stacked, rest, inputs,
                                             targets)
        grads = stages_layout.join(d_stacked, d_rest)
        return Gradients(loss, [g.astype(x.dtype) for g, x in zip(grads, leaves)], weight)

    def body(self, stacked_leaves):
        """``body(chunk, x, c)``: model chunk ``c``'s layers (its parameters ``chunk``, stacked,
        already in the compute precision: the executor casts them, ``Stages.prepare``) applied
        to ``x``, under the blocks' remat policy; where the chunk holds at most
        ``PipelineConfig.unroll_layers`` layers, one by one, ``chunk`` a list of per-layer
        parameters (unless a module gathers its whole stack, ``gathers_stacked``: then the scan
        unrolled). Returns it and how many layers it takes one by one (0: a stack).
        ``stacked_leaves``: the stage's stacked parameters, for the gathering modules."""
        from jphantom.nn.stack import apply_blocks, apply_layers

        setup, layout = self.setup, self.stages
        stacked = layout.stacked
        per_chunk = stacked.layers // (layout.stages * setup.pipeline.local_chunks)
        unroll = per_chunk <= setup.pipeline.unroll_layers
        state_of = lambda chunk: jax.tree.unflatten(  # noqa: E731
            layout.block_treedef, [chunk[k] for k in layout.block_order])
        per_layer = unroll and not gathers_stacked(layout.block_graph, state_of(stacked_leaves))

        def body(chunk, x, c):
            if per_layer:  # Stages.layers: a list of per-layer parameters
                return apply_layers(layout.block_graph, [state_of(layer) for layer in chunk], x,
                                    remat=stacked.remat, with_index=stacked.with_index,
                                    offset=c * per_chunk)
            return apply_blocks(layout.block_graph, state_of(chunk), x, remat=stacked.remat,
                                with_index=stacked.with_index, offset=c * per_chunk,
                                unroll=unroll)

        return body, (per_chunk if per_layer else 0)

    @staticmethod
    def weight(first, loss_after, rest, inputs_mb, targets, micro):
        """A pipelined weighted ``loss_fn``'s global weight over the ``micro`` micro-batches of
        ``targets``, before the schedule runs: ``loss_after(out, targets_mb)`` (the loss after
        the blocks, as the last stage runs it) on a stand-in output of zeros, only its weight
        kept (XLA drops the rest). A weight that depends on the model's output cannot be
        known before the blocks have run: refused. ``None`` for a scalar ``loss_fn``."""
        from jphantom.pipeline.split import needed_inputs

        out = jax.tree.map(zeros_of, jax.eval_shape(first, rest, inputs_mb))
        targets = jax.tree.map(lambda a: split_microbatches(a, micro), targets)
        struct = jax.eval_shape(loss_after, out, jax.tree.map(lambda a: a[0], targets))
        if not isinstance(struct, tuple):
            return None
        weight_of = lambda o, t: token_mean.terms(loss_after(o, t)).weight
        traced = jax.make_jaxpr(weight_of)(out, jax.tree.map(lambda a: a[0], targets))
        if needed_inputs(traced.jaxpr, [True])[:len(jax.tree.leaves(out))] != [False] * len(
                jax.tree.leaves(out)):
            raise ConfigError("a pipelined step needs the loss's weight before the blocks run: "
                              "loss_fn's weight depends on the model's output; count the "
                              "tokens from the targets (a mask, or targets < 0 ignored)")
        weights = lax.map(lambda t: weight_of(out, t), targets)
        return token_mean.global_weight(jnp.sum(weights, axis=0),
                                        metadata.varying_axes(struct[0]), exclude=("stage",))

    def evaluate(self):
        """Per rank: the global loss through the pipeline's forward slots (no backward, no
        stash), for the step's evaluation ``shard_map``."""
        setup = self.setup

        def per_rank(leaves, *batch):
            leaves = list(leaves)
            if setup.zero == 3:
                leaves = zero_module.gather_together(leaves, setup.layout.zero_dims,
                                                     setup.layout.zero_axes, invariant=False)
            leaves = self.params.vary_params(leaves)
            return setup.global_value(self.value_and_grad(leaves, *batch, train=False))

        return per_rank
