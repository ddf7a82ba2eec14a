"""The step's per-rank loss and gradient, before any reduction: each rank's share of the global
loss, the weighted (global token mean) loss, accumulation over micro-batches and the MoE
whole-batch balance.

- **The loss share.** ``loss_fn(model, *batch)`` returns the mean loss of the rank's batch; the
  step differentiates the rank's share of the global mean (the mean over the batch axes it varies
  over, divided by their size), so that one ``psum`` of the gradients after the backward is the
  global gradient.
- **The weighted loss** (:mod:`jphantom.token_mean`): a ``loss_fn`` returning ``(total, weight[,
  mean])`` trains on ``sum(total) / sum(weight)`` over every rank and micro-batch; the global
  weight is found first (one scalar all-reduce inside the forward), each share is then its part
  of the whole loss.
- **Accumulation**: ``accumulate = n`` micro-batches summed by one ``lax.scan`` before the one
  reduction per step (micro-batch i draws its dropout masks from key i).
- **MoE balance** (:mod:`jphantom.nn.balance`): the whole batch's routing fractions, found by a
  forward pass over the micro-batches without gradient and given to each micro-batch's loss.

:class:`GradParts` is a part of :class:`jphantom.TrainStep`; the reductions after the backward are
:mod:`jphantom.step.reduce`'s, the pipeline's value and gradient :mod:`jphantom.step.pipeline`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jphantom import comm
from jphantom import token_mean
from jphantom.errors import ConfigError
from jphantom.nn import balance as balance_module
from jphantom.nn import dropout as dropout_module
from jphantom.nn import metadata
from jphantom import zero as zero_module
from jphantom.pipeline.buffers import split_microbatches, zeros_of
from jphantom.step.layout import group_by, mean_share


def accumulate(fn, micro, *, mean: bool, indexed: bool = False):
    """``fn(micro_batch[, i])`` summed over the micro-batches ``micro`` (each array [n, ...]) by one
    ``lax.scan`` (``indexed``: each call also gets its index i); ``mean``: divided by n (a scalar
    ``loss_fn``'s mean; a weighted one's shares already sum to the whole loss)."""
    n = micro[0].shape[0]
    call = fn if indexed else (lambda mb, _: fn(mb))
    first = jax.eval_shape(lambda mb: call(mb, 0), [m[0] for m in micro])
    xs = (micro, jnp.arange(n)) if indexed else (micro, None)
    total, _ = lax.scan(lambda acc, x: (jax.tree.map(jnp.add, acc, call(*x)), None),
                        jax.tree.map(zeros_of, first), xs)
    return jax.tree.map(lambda a: a / n, total) if mean else total


class GradParts:
    """The per-rank loss and gradient of :class:`jphantom.TrainStep` (module docstring)."""

    def _mean_share(self, value, exclude=()):
        share, axes = mean_share(value, exclude)
        order = self.mesh.axis_names
        return share, tuple(sorted(axes, key=order.index))

    def _loss(self, model, batch, balance=None):
        """``loss_fn(model, *batch)`` in the compute precision (``balance``: the whole batch's
        routing fractions, given to a micro-batch's loss, :meth:`_balance_fraction`)."""
        with balance_module.given(balance):
            return self.loss_fn(model, *self.precision.cast(batch))

    def _takes_balance(self) -> bool:
        """Whether micro-batches get the whole batch's routing fractions: the model declares
        :mod:`jphantom.nn.balance`'s hook (GPT-2's MoE blocks)."""
        return balance_module.takes_part(self.model_template)

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
        return balance_module.fractions(accumulate(statistics, micro, mean=False))

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

    def local_value_and_grad(self, leaves, *batch, scale=None, key=None):
        """This rank's loss share and gradients, before the reductions. ``scale``: the loss
        scale (a traced scalar under dynamic loss scaling; default the precision's); ``key``:
        the step's dropout key data (none: dropout layers pass their input through)."""
        vary = self.vary_axes()
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
            scatter = None
            if self.zero == 3:  # gathered once for the whole pipeline; its transpose scatters
                dims, zaxes = self.layout.zero_dims, self.layout.zero_axes
                varied, scatter = jax.vjp(
                    lambda xs: zero_module.gather_together(xs, dims, zaxes, invariant=False),
                    varied)
            balance = self._pipeline_balance(varied, *batch)
            loss, grads = self._pipeline_value_and_grad(varied, *batch, scale=scale,
                                                        balance=balance)
            if scatter is not None:
                (grads,) = scatter(grads)
            return unscaled(loss, grads, leaves)
        if self.accumulate == 1:
            return one(leaves, *batch)
        n = self.accumulate
        micro = [split_microbatches(b, n) for b in batch]
        balance = self._balance_fraction(self._model(leaves, train=True), micro)
        # a weighted loss_fn: the global weight of all micro-batches first, each micro-batch's
        # share is then its part of the whole loss (summed, not averaged)
        weight = self._micro_weight(self._model(leaves, train=False), micro, balance)
        options = dict(balance=balance, weight=weight, micro=n)
        # micro-batch i draws its dropout masks from key i
        return accumulate(lambda mb, i: one(leaves, *mb, **options, index=i), micro,
                          mean=weight is None, indexed=True)

    def global_value(self, share):
        """The global value of per-rank shares: one all-reduce over the axes they vary over (a
        pipeline's loss lives on its last stage)."""
        axes = tuple(sorted(metadata.varying_axes(share), key=self.mesh.axis_names.index))
        return comm.psum(share, axes) if axes else share
