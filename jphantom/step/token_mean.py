"""The global token mean: a loss over padded or masked tokens, as one device computes it.

A ``loss_fn`` given to :func:`jphantom.make_train_step` returns either the mean loss of the batch
it is given (a scalar), or a :class:`WeightedLoss` (any tuple ``(total, weight)`` or
``(total, weight, mean)``): ``total`` the sum of its per-token losses, ``weight`` the number of
tokens it counted (a mask's sum; any non-negative weights), ``mean`` a term that is already a
mean over the batch (an MoE router's load-balancing and z-losses; 0 if absent). On one device
the loss is ``total / weight + mean``; the step's loss is

    L = (sum over ranks and micro-batches of total) / (sum over ranks and micro-batches of weight)
        + the mean over ranks and micro-batches of ``mean``

and its gradient is L's. That is the global token mean MaxText and torchtitan train on (they
divide a global sum by a global token count); a mean of per-rank means, which a scalar
``loss_fn`` gives, differs from it as soon as ranks or micro-batches count different numbers
of tokens (every fine-tuning run's padding).

How the step computes it: the global weight W is summed before any backward, so every rank's
loss is ``total / W`` and one backward gives the gradient, with nothing rescaled afterwards.
Without accumulation W is the all-reduce of ``weight`` (a scalar, one all-reduce over the axes
the tokens are split over) inside the forward. With micro-batches (``accumulate``, pipelines) W
comes from a pass of ``loss_fn`` over the micro-batches that keeps only ``weight``: XLA removes
all of it but the weight's arithmetic when the weight depends on the batch alone (a mask, the
targets' sign), so it costs no GEMM and no collective but the one scalar all-reduce (tested on
the compiled step). A pipeline computes the weight of each micro-batch's loss, on the last
stage, from the targets alone: a weight that depends on the model's output is refused there.

Which ranks' weights are summed: those over which ``total`` varies (``check_vma``'s record: the
batch axes ``data``/``expert``/``z``, ``context``, an axis splitting the data's features), each
rank's ``weight`` counted once per rank holding a distinct ``total``, so a constant weight (a
Python int) counts every rank's tokens.
"""

from __future__ import annotations

import math
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jphantom.runtime.comm import varying_axes
from jphantom.errors import ConfigError


class WeightedLoss(NamedTuple):
    """What a ``loss_fn`` returns for a global token mean (module docstring)."""

    total: Any
    weight: Any
    mean: Any = 0.0


def terms(out, fn=None) -> WeightedLoss | None:
    """``loss_fn``'s output as a :class:`WeightedLoss` in at least float32, or ``None`` when it
    is a scalar mean; anything else is refused, naming ``fn`` (the user's ``loss_fn``), at
    trace time: a part that is not a real number, or of another shape than a scalar, and a
    weight given as a constant that is not positive and finite."""
    if isinstance(out, tuple):
        who = name_of(fn)
        if len(out) not in (2, 3):
            raise ConfigError(f"{who} returned a tuple of {len(out)}: return the scalar mean "
                              "loss, or (total, weight) / (total, weight, mean) for a global "
                              "token mean (jphantom.step.token_mean.WeightedLoss)")
        for name, part in zip(WeightedLoss._fields, out):
            _check_part(who, name, part)
        parts = [x if isinstance(x, (int, float)) else jnp.asarray(x) for x in out]
        total, weight, *mean = [jnp.asarray(x) for x in parts[:2]] + parts[2:]
        wide = lambda x: x.astype(jnp.promote_types(x.dtype, jnp.float32))
        # a mean given as a Python number stays one (weakly typed: it never widens the loss)
        mean = [m if isinstance(m, (int, float)) else wide(m) for m in mean]
        total = wide(total)  # the weight in the total's dtype (a count may be an integer)
        return WeightedLoss(total, weight.astype(total.dtype),
                            *(float(m) if isinstance(m, int) else m for m in mean))
    return None


def name_of(fn) -> str:
    """``loss_fn`` named as the messages name it: ``loss_fn my_loss``."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return "loss_fn" if name is None else f"loss_fn {name}"


def _check_part(who: str, name: str, part) -> None:
    """One of (total, weight, mean): a real scalar (a Python number, or an integer or floating
    array of shape ()); a constant weight also positive and finite."""
    dtype = getattr(part, "dtype", None)
    real = (isinstance(part, (int, float)) and not isinstance(part, bool)) or (
        dtype is not None and (jnp.issubdtype(dtype, jnp.integer)
                               or jnp.issubdtype(dtype, jnp.floating)))
    if not real:
        what = type(part).__name__ if dtype is None else f"an array of {dtype}"
        raise ConfigError(f"{who} returned {name}={part!r:.40} ({what}): each of (total, weight, "
                          "mean) must be a real number, e.g. mask.sum() for the weight")
    if jnp.shape(part) != ():
        raise ConfigError(f"{who}'s {name} has shape {jnp.shape(part)}: each of "
                          "(total, weight, mean) must be a scalar (a sum over the tokens)")
    if name == "weight" and _constant(part) and not (
            math.isfinite(float(part)) and float(part) > 0):
        raise ConfigError(f"{who} returned weight={part}: the weight (the number of tokens the "
                          "total sums) must be positive and finite")


def _constant(part) -> bool:
    """Whether ``part`` is known at trace time: a Python or NumPy number, or a concrete jax array
    (``jnp.float32(0.0)`` made outside the step); a tracer is checked as the step runs."""
    return isinstance(part, (int, float, np.number, np.ndarray)) or (
        isinstance(part, jax.Array) and not isinstance(part, jax.core.Tracer))


def value(out) -> jax.Array:
    """The loss of ``loss_fn``'s output on one device: ``total / weight + mean`` (the weight a
    constant: no gradient flows through it, as in the step) or the scalar."""
    weighted = terms(out)
    if weighted is None:
        return jnp.asarray(out)
    return weighted.total / lax.stop_gradient(weighted.weight) + weighted.mean


def lm_loss_terms(model, tokens, targets, mask=None, **balance) -> WeightedLoss:
    """``loss_fn`` of the zoo's language models (and any model with ``loss_terms``) as a global
    token mean, with or without a mask (:func:`jphantom.models.lm_loss` is the mean loss without
    one): tokens whose target is negative (Hugging Face's ``-100``) or whose ``mask`` is false
    are not counted. A pipelined step's loss takes (tokens, targets): mark the ignored tokens with
    negative targets there. (Its old name here, ``lm_loss``, goes in the next release.)"""
    return model.loss_terms(tokens, targets, mask, **balance)


def __getattr__(name):
    """``lm_loss``: :func:`lm_loss_terms`'s old name, with a DeprecationWarning (the zoo's one
    ``lm_loss`` is :func:`jphantom.models.lm_loss`)."""
    if name == "lm_loss":
        import warnings

        warnings.warn("jphantom.step.token_mean: lm_loss is now lm_loss_terms; the old name goes in "
                      "the next release", DeprecationWarning, stacklevel=2)
        return lm_loss_terms
    raise AttributeError(f"module 'jphantom.step.token_mean' has no attribute {name!r}")


def global_weight(weight, total_axes, exclude=()) -> jax.Array:
    """The sum of ``weight`` over the ranks holding distinct totals (``total_axes``, with
    ``weight``'s own varying axes; ``exclude``: axes not to sum over, a pipeline's ``stage``),
    without gradient: inside a ``shard_map``, one all-reduce of a scalar."""
    weight = lax.stop_gradient(jnp.asarray(weight))
    weight = weight.astype(jnp.promote_types(weight.dtype, jnp.float32))
    axes = [a for a in sorted(set(total_axes) | set(varying_axes(weight))) if a not in exclude]
    if not axes:
        return weight
    from jphantom.runtime import comm

    return comm.psum(weight, tuple(axes))


def shares(weighted: WeightedLoss, weight_total, *, micro: int = 1, exclude=(),
           order=None) -> jax.Array:
    """This rank's share of the global loss: ``total / W`` plus its part of the mean of
    ``mean`` (over ``micro`` micro-batches too), each divided by the ranks over which it is
    invariant but the other varies, so that summing the result over every axis it varies over
    (the step's one all-reduce, ``exclude`` left out) gives L exactly once."""
    total_axes = set(varying_axes(weighted.total)) - set(exclude)
    mean_axes = set(varying_axes(jnp.asarray(weighted.mean))) - set(exclude)
    union = total_axes | mean_axes
    size = lambda axes: math.prod(lax.axis_size(a) for a in axes)
    share = weighted.total / weight_total / size(union - total_axes)
    if isinstance(weighted.mean, float) and weighted.mean == 0.0:  # (total, weight)
        return share
    return share + weighted.mean / (size(union) * micro)


# -- the global weight, checked where the step runs --------------------------------------------

def agreed(weight):
    """The global weight ``weight`` a gradient provider returned (``None``, a scalar
    ``loss_fn``, stays ``None``) the same on every rank: where ranks could differ (an axis the
    provider left out of the sum, a pipeline's ``stage``) the smallest, for :func:`guard`."""
    if weight is None:
        return None
    axes = tuple(sorted(varying_axes(weight)))
    if axes:  # the weight is already global: the ranks of an excluded axis hold the same
        from jphantom.runtime import comm

        weight = -comm.pmax(-weight, axes)
    return weight


def guard(weight, new, old, loss):
    """``(state, loss)`` of a step whose global weight is ``weight``: ``new`` and ``loss`` when
    it is positive and finite; otherwise the update is not applied (``old``, the state before
    the step, is kept) and the loss is NaN (nothing was measured). The step returns the weight
    beside the loss (:class:`jphantom.step.finite.StepOutput`), which :class:`WeightReport`
    reads on the host."""
    ok = (weight > 0) & jnp.isfinite(weight)
    state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    return state, jnp.where(ok, loss, jnp.nan)


class WeightReport:
    """What the step found about the global weights it returned, read on the host once each is
    ready (:meth:`see`; never waited for but by :attr:`skipped`): ``skipped``, the batches it
    did not train on because nothing was counted (a global weight of 0: every target ignored
    or masked), each reported on stderr when read; ``error``, the message of a negative or
    non-finite weight, which the step raises (a ``ConfigError``) at its next call."""

    def __init__(self, fn=None):
        self.name, self._skipped, self.error = name_of(fn), 0, None
        self._pending: list = []  # the weights the step returned, not read yet

    def see(self, weight) -> None:
        """A step's returned global weight (``None``, a scalar ``loss_fn``'s, is not kept)."""
        if weight is not None:
            self._pending.append(weight)
        self.read()

    def read(self, wait: bool = False) -> None:
        """Read the returned weights that are ready (``wait``: all of them), in order."""
        while self._pending:
            weight = self._pending[0]
            if getattr(weight, "is_deleted", lambda: False)():
                self._pending.pop(0)
                continue
            if not (wait or getattr(weight, "is_ready", lambda: True)()):
                return
            self(self._pending.pop(0))

    @property
    def skipped(self) -> int:
        """The batches skipped so far (waits for the weights not read yet)."""
        self.read(wait=True)
        return self._skipped

    def skipped_ready(self) -> int:
        """The batches skipped among the weights ready now (nothing waited for): what a loss
        that is ready can be told apart by, its weight computed with it."""
        self.read()
        return self._skipped

    def __call__(self, weight) -> None:
        weight = float(weight)
        if weight > 0 and math.isfinite(weight):
            return
        if weight == 0:
            self._skipped += 1
            sys.stderr.write(f"jphantom: {self.name} counted nothing in this batch (global weight "
                             "0: every target ignored or masked): the batch is skipped, the "
                             f"update not applied ({self._skipped} skipped so far)\n")
            return
        self.error = (f"{self.name} returned a global weight of {weight}: the weight (the number "
                      "of tokens the total sums, over every rank) must be positive and finite; "
                      "the update was not applied")
        sys.stderr.write(f"jphantom: error: {self.error}\n")

    def check(self) -> None:
        """Raise the error a previous step found (once), the state it returned being the last
        good one. Only the weights ready now are read: a step is never held back waiting for
        the previous one, so a bad weight raises at the first call after it is read (at once
        after :attr:`skipped`, which waits)."""
        self.read()
        if self.error is not None:
            error, self.error = self.error, None
            raise ConfigError(error)


__all__ = ["WeightedLoss", "terms", "value", "lm_loss_terms", "global_weight", "shares",
           "WeightReport", "guard", "agreed", "name_of"]
