"""What the step does when a loss, a gradient or a parameter goes non-finite
(``make_train_step(..., on_nonfinite=...)``), in the names of
:data:`jphantom.registry.nonfinite.NONFINITE`:

- ``"warn"`` (the default): the compiled step is unchanged; each loss the step returns is read
  once it is ready (``jax.Array.is_ready``: never waited for, so no host sync is added) and the
  first non-finite one gives one :class:`jphantom.errors.JPhantomWarning`. A parameter that goes
  non-finite shows in the next step's loss.
- ``"skip"``: the optimizer is wrapped in :func:`keep_if_finite`: an update that would make the
  parameters or the optimizer state non-finite (or whose gradients are) is not applied, and is
  counted (``step.skipped_updates(state)``). The state the step returns is always finite.
- ``"stop"``: ``"skip"``, and after every call the count and the loss are read (one host sync per
  step, what stopping at the step needs): a non-finite one raises
  :class:`jphantom.errors.TrainingDiverged` naming the call, whose ``state`` attribute is the
  state the step returned (finite: the bad update was not applied).
- ``"rollback"``: a ConfigError: only a training loop with checkpoints can reload one.

``watch=False``: a loop judges each loss itself and owns the policy
(:class:`jphantom.loop.trainer.Trainer`, :mod:`jphantom.loop.nonfinite`, which may roll back):
the step reads no loss, and drops a bad update under ``"skip"`` only (:func:`drops_updates`).
``on_nonfinite="ignore"``, the old spelling of that, is accepted with a DeprecationWarning for
one release.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jphantom.errors import JPhantomWarning, TrainingDiverged
from jphantom.registry.nonfinite import check_nonfinite

_PENDING = 4  # losses kept until ready (a loop that never reads them holds no more)


class StepOutput(NamedTuple):
    """What one call of the step returns beside the state (``state, out =
    step.run(state, *batch)``): ``loss``, NaN where nothing was counted; ``weight``, a weighted
    ``loss_fn``'s global weight (:mod:`jphantom.step.token_mean`; ``None`` for a scalar one)."""

    loss: jax.Array
    weight: jax.Array | None = None

    @property
    def skipped(self) -> bool:
        """Whether the update was not applied because nothing was counted (a global weight of
        0: every target ignored or masked): a host read of the weight."""
        return self.weight is not None and float(self.weight) == 0


def check_policy(on_nonfinite, watch: bool = True) -> tuple[str, bool]:
    """``(on_nonfinite, watch)`` checked (module docstring): ``"rollback"`` only with
    ``watch=False``; ``"ignore"`` is ``("warn", False)``, with a DeprecationWarning."""
    if on_nonfinite == "ignore":
        warnings.warn("on_nonfinite='ignore' is deprecated and goes in the next release: pass "
                      "watch=False (the step reads no loss; a loop judges each one)",
                      DeprecationWarning, stacklevel=4)
        return "warn", False
    return check_nonfinite(on_nonfinite, loop=not watch), bool(watch)


def drops_updates(on_nonfinite: str, watch: bool = True) -> bool:
    """Whether the step wraps its optimizer in :func:`keep_if_finite`: under ``"skip"``; under
    ``"stop"`` when the step watches (its TrainingDiverged's ``.state`` is then the finite state
    before the bad update; a loop that stops names its newest checkpoint instead, and its step
    pays no check)."""
    return on_nonfinite == "skip" or (on_nonfinite == "stop" and watch)


def all_finite(tree) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is finite (a scalar bool; integer leaves
    count as finite)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


@jax.jit
def state_is_finite(state) -> jax.Array:
    """:func:`all_finite` of a whole state (parameters and optimizer state), jitted: one
    reduction over it, for a loop that checks before it saves."""
    return all_finite(state)


def keep_if_finite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner``'s update, applied only when the gradients, the new parameters and ``inner``'s
    new state are all finite; otherwise a zero update and ``inner``'s state kept. Its state is
    ``optax.ApplyIfFiniteState`` (``total_notfinite`` counts the dropped updates), like
    ``optax.apply_if_finite``'s, which checks only the gradients: an update that overflows
    finite gradients into infinite parameters (a learning rate far too large) is dropped here."""
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return optax.ApplyIfFiniteState(
            notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True),
            total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

    def update(grads, state, params=None, **extra):
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra)
        result = updates if params is None else optax.apply_updates(params, updates)
        ok = all_finite((grads, result, inner_state))
        keep = functools.partial(jnp.where, ok)
        updates = jax.tree.map(lambda u: keep(u, jnp.zeros_like(u)), updates)
        inner_state = jax.tree.map(keep, inner_state, state.inner_state)
        bad = jnp.logical_not(ok).astype(jnp.int32)
        return updates, optax.ApplyIfFiniteState(
            notfinite_count=jnp.where(ok, 0, state.notfinite_count + 1), last_finite=ok,
            total_notfinite=state.total_notfinite + bad, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def skipped_updates(opt_state) -> int | None:
    """Updates :func:`keep_if_finite` (or ``optax.apply_if_finite``) dropped so far, read from
    ``opt_state`` (a host read); None without either."""
    found = [leaf for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
        x, optax.ApplyIfFiniteState)) if isinstance(leaf, optax.ApplyIfFiniteState)]
    return int(jax.device_get(found[0].total_notfinite)) if found else None


class NonFiniteWatch:
    """The step's side of the policy (module docstring), called with each step's outputs; off
    (``watch=False``) when a loop judges the losses."""

    def __init__(self, policy: str, empty=lambda: 0, watch: bool = True):
        self.policy, self.on = check_policy(policy, watch)
        self.empty, self._empty_seen = empty, 0  # batches with nothing to count, so far
        self.calls = 0
        self.warned = False
        self._pending: list[tuple[int, jax.Array]] = []
        self._skipped = 0

    def __call__(self, state, loss) -> None:
        self.calls += 1
        if not self.on:
            return
        if self.policy == "stop":
            self._stop(state, loss)
            return
        if self.warned:
            return
        self._pending = (self._pending + [(self.calls, loss)])[-_PENDING:]
        while self._pending and _ready(self._pending[0][1]) is not False:
            call, value = self._pending.pop(0)
            if _ready(value) is None:
                continue  # deleted (donated or freed) before it was read
            value = float(value)
            if not math.isfinite(value) and self._empty_seen < self.empty():
                self._empty_seen += 1  # nothing to count: reported, no update (token_mean)
                continue
            if not math.isfinite(value):
                self.warned, self._pending = True, []
                what = ("the update was not applied (on_nonfinite='skip'; "
                        "step.skipped_updates(state) counts them)" if self.policy == "skip" else
                        "the parameters may be non-finite from here on: lower the learning rate "
                        "or check the data; on_nonfinite='skip' or 'stop' keeps the last good "
                        "state")
                warnings.warn(f"the training loss is {value} at call {call} of the step; {what} "
                              "(said once)", JPhantomWarning, stacklevel=3)
                return

    def _stop(self, state, loss) -> None:
        skipped, value = skipped_updates(state.opt_state) or 0, float(loss)
        if not math.isfinite(value) and self._empty_seen < self.empty():
            self._empty_seen += 1  # nothing to count: reported, no update (token_mean)
            return
        if skipped > self._skipped or not math.isfinite(value):
            self._skipped = skipped
            error = TrainingDiverged(
                f"the training loss is {value} at call {self.calls} of the step"
                + (" and its update would make the state non-finite: it was not applied"
                   if skipped else "")
                + " (on_nonfinite='stop'); the error's .state is the finite state the step "
                "returned: lower the learning rate or check the data")
            error.state = state
            raise error


def _ready(array) -> bool | None:
    """Whether ``array`` can be read without waiting (None: it was deleted)."""
    if getattr(array, "is_deleted", lambda: False)():
        return None
    return bool(getattr(array, "is_ready", lambda: True)())
