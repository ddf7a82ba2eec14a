"""The GSPMD baseline of the step: the plain model with sharding annotations
(:func:`jphantom.plans.annotate`), its global loss differentiated and ``jax.jit``'s partitioner
placing every collective (GSPMD, Xu et al. 2021), as a JAX user would write it; a pipeline runs as
a loop of forward ticks (Praxis, MaxText; :meth:`jphantom.step.pipeline.PipelineParts`).

The shard_map step writes its collectives per rank; this one is the baseline it is measured
against, sharing its layout, precision, accumulation order and MoE balance.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding

from jphantom import token_mean
from jphantom.errors import ConfigError
from jphantom.pipeline.buffers import interleave_microbatches
from jphantom.step.grads import accumulate


class GspmdParts:
    """``spmd="gspmd"``'s loss, value-and-grad and evaluation of :class:`jphantom.TrainStep`."""

    def _gspmd_model(self, params):
        """The model holding ``params`` (global arrays) in the compute precision."""
        return self._ready(self.layout.model_of(self.precision.cast(jax.tree.leaves(params))))

    def _gspmd_batch(self, batch):
        """``batch`` constrained to the step's batch shardings."""
        return [jax.lax.with_sharding_constraint(b, NamedSharding(self.mesh, s))
                for b, s in zip(batch, self._specs_of_batch(len(batch)))]

    def _gspmd_loss(self, params, *batch, balance=None, weight=None, micro=1):
        """GSPMD: the global loss of global arrays; ``jax.jit`` places the collectives
        (``weight``: a weighted loss' weight over all ``micro`` micro-batches)."""
        batch = self._gspmd_batch(batch)
        if self.pipeline is not None:
            if len(batch) != 2:
                raise ConfigError(f"a pipelined step takes (inputs, targets), got {len(batch)} "
                                  "batch arrays")
            return self._gspmd_pipeline_loss(jax.tree.leaves(params), *batch, balance=balance)
        out = self._loss(self._gspmd_model(params), batch, balance)
        weighted = token_mean.terms(out)
        if weighted is not None:
            weight = lax.stop_gradient(weighted.weight) if weight is None else weight
            return weighted.total / weight + weighted.mean / micro
        loss = jnp.asarray(out)
        return loss.astype(jnp.promote_types(loss.dtype, jnp.float32))

    def _gspmd_value_and_grad(self) -> Callable:
        """GSPMD's ``(params, *batch) -> (loss, grads)``: the global loss differentiated, the
        micro-batches accumulated as the shard_map step does, ``jax.jit`` placing the
        collectives."""
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
                micro = [interleave_microbatches(b, n, ranks) for b in batch]
                model = self._gspmd_model(params)
                balance = self._balance_fraction(model, micro)
                weight = self._micro_weight(model, micro, balance)
                options = (scale, balance, weight, n)
                loss, grads = accumulate(lambda mb: one(params, mb, *options), micro,
                                         mean=weight is None)
            grads = jax.tree.map(lambda g, p: (g / scale).astype(p.dtype), grads, params)
            return loss / scale, jax.lax.with_sharding_constraint(grads, grad_sh)

        return run_gspmd

    def _gspmd_evaluate(self, fn: Callable) -> Callable:
        """GSPMD's :meth:`_evaluate`: ``fn`` on the global arrays, jitted."""
        def global_fn(params, *batch):
            out = fn(self._gspmd_model(params), *self.precision.cast(self._gspmd_batch(batch)))
            return token_mean.value(out) if isinstance(out, tuple) else out
        return jax.jit(global_fn)
