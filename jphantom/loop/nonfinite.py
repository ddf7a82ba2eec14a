"""What a non-finite training loss, or an update that leaves non-finite parameters or optimizer
state, does in a run (``--on-nonfinite``, a name of
:data:`jphantom.registry.nonfinite.NONFINITE`), as one object, :class:`NonFinitePolicy`. The
run's step is built with the same name and ``watch=False`` (it reads no loss; this object judges
each one):

- ``warn``: the run goes on; the first non-finite loss prints one line;
- ``skip``: the update is not applied (the step wraps its optimizer in
  :func:`jphantom.step.finite.keep_if_finite`, whose count of dropped updates
  :func:`jphantom.step.finite.skipped_updates` reads); after
  :data:`jphantom.runtime.resilience.MAX_CONSECUTIVE_SKIPS` in a row the run stops;
- ``stop`` (the default): the run ends with :class:`jphantom.errors.TrainingDiverged`, naming
  the step and where the last good state is (its newest checkpoint: the step adds no check);
- ``rollback``: the state, the history and the data stream go back to the newest checkpoint
  whose recorded loss and parameters are finite (or the start), and the batch that gave the bad
  step is read but not trained on when the run gets there again; after
  :data:`jphantom.runtime.resilience.MAX_ROLLBACKS` rollbacks with no checkpoint written between
  them the run stops.

Under ``rollback`` the state is checked after every step (one jitted reduction,
:func:`jphantom.step.finite.state_is_finite`), so the step whose update made the parameters
non-finite is the one rolled back, even when its own loss was finite. Under every policy a
checkpoint is written only of a finite state whose recorded losses are finite, and a run that
ends with non-finite parameters or final loss says so and fails. The policy keeps the record
``results.json`` gets (``skipped_steps``, ``skipped_updates``, ``rollbacks``,
``skipped_batches``)."""

from __future__ import annotations

import math

from jphantom.errors import TrainingDiverged
from jphantom.runtime.resilience import MAX_CONSECUTIVE_SKIPS, MAX_ROLLBACKS
from jphantom.step.finite import skipped_updates


class NonFinitePolicy:
    """One run's non-finite policy (module docstring). ``config``: the run's configuration
    (named in the messages); ``opt_state``: the optimizer's state at the start."""

    def __init__(self, config, opt_state):
        self.config = config
        self.name = config.train.on_nonfinite
        self.skipped_steps: list[int] = []
        self.rollbacks: list[dict] = []
        self.skipped_batches: list[int] = []
        self.empty_batches: list[int] = []  # batches with nothing to count (no update)
        self._bad_batches: set[int] = set()
        self._in_a_row = 0
        self._rollbacks_in_a_row = 0
        self._warned = False
        self.reset(opt_state)

    @property
    def checks_state(self) -> bool:
        """Whether the loop checks the state after each step: under ``rollback``, so that the
        batch whose update broke a finite-loss step is the one skipped. ``skip`` keeps the state
        finite; under ``stop`` the next step's loss, the checkpoint writer and the end of the run
        see a broken state, and the default step pays no extra pass over the state."""
        return self.name == "rollback"

    def reset(self, opt_state) -> None:
        """The optimizer's count of dropped updates starts again from ``opt_state``'s."""
        self._dropped = skipped_updates(opt_state) or 0

    def skips_batch(self, index: int) -> bool:
        """Whether batch ``index`` gave a rolled-back non-finite loss: then it is not trained
        on (once), and recorded."""
        if index not in self._bad_batches:
            return False
        self._bad_batches.discard(index)
        self.skipped_batches.append(index + 1)
        return True

    def judge(self, index: int, loss: float, opt_state, last_good,
              state_finite: bool = True) -> str:
        """After step ``index`` with training ``loss`` (``state_finite``: whether the state it
        left is): ``"ok"``, ``"warned"`` (``warn``'s first non-finite step: the run says
        :meth:`warning` and goes on), ``"skipped"`` (the update was dropped and the run goes on)
        or ``"rollback"``; raises :class:`~jphantom.errors.TrainingDiverged` when the run must
        stop (``last_good()``: where the last good state is, appended to the message)."""
        skipped = False  # skip: keep_if_finite counted a dropped update
        if self.name == "skip":
            dropped = skipped_updates(opt_state)
            skipped, self._dropped = dropped > self._dropped, dropped
        if math.isfinite(loss) and not skipped and state_finite:
            self._in_a_row = 0
            return "ok"
        if self.name == "rollback":
            return "rollback"
        if self.name == "warn":
            warned, self._warned = self._warned, True
            return "ok" if warned else "warned"
        what = self.describe(index, loss, state_finite)
        if self.name == "skip" and skipped:
            self._in_a_row += 1
            self.skipped_steps.append(index + 1)
            if self._in_a_row >= MAX_CONSECUTIVE_SKIPS:
                raise TrainingDiverged(f"{what}; {self._in_a_row} updates in a row were "
                                       "skipped: lower the learning rate or check the data"
                                       + last_good())
            return "skipped"
        raise TrainingDiverged(f"{what}: lower the learning rate or check the data"
                               + last_good())

    def rolling_back(self, index: int, loss: float, state_finite: bool, last_good) -> None:
        """Before a rollback at step ``index``: raises
        :class:`~jphantom.errors.TrainingDiverged` once :data:`MAX_ROLLBACKS` rollbacks ran
        with no checkpoint written since the first of them."""
        if self._rollbacks_in_a_row >= MAX_ROLLBACKS:
            raise TrainingDiverged(f"{self.describe(index, loss, state_finite)}; "
                                   f"{self._rollbacks_in_a_row} rollbacks without a new "
                                   "checkpoint: lower the learning rate or check the data"
                                   + last_good())

    def rolled_back(self, index: int, to_step: int, opt_state) -> None:
        """Record a rollback at step ``index`` to ``to_step``'s state; its batch will be
        skipped."""
        self.reset(opt_state)
        self._rollbacks_in_a_row += 1
        self.rollbacks.append({"at_step": index + 1, "to_step": to_step})
        self._bad_batches.add(index)

    def nothing_counted(self, index: int) -> None:
        """Batch ``index`` had nothing to count (the loss's global weight 0): the step applied no
        update; recorded, not judged."""
        self.empty_batches.append(index + 1)

    def saved(self) -> None:
        """A checkpoint was written: the run made progress since its last rollback."""
        self._rollbacks_in_a_row = 0

    def warning(self, index: int, loss: float) -> str:
        """The line ``warn`` prints once, at its first non-finite step ``index``."""
        return (f"{self.describe(index, loss)}: going on (--on-nonfinite warn, "
                "said once); lower the learning rate or check the data (skip, stop or rollback "
                "keep the last good state)")

    def describe(self, index: int, loss: float, state_finite: bool = True) -> str:
        c = self.config
        what = (f"training loss is {loss} at step {index + 1}"
                if state_finite or not math.isfinite(loss) else
                f"the parameters or optimizer state are not finite after step {index + 1} "
                f"(its training loss {loss})")
        return (f"{what} ({c.model.name}, {c.parallel.strategy}, precision "
                f"{c.step.precision}, dtype {c.model.dtype}, "
                f"learning_rate={c.train.learning_rate:g})")

    def record(self) -> dict:
        """``results.json``'s ``nonfinite``."""
        return {"policy": self.name, "skipped_steps": self.skipped_steps,
                "skipped_updates": len(self.skipped_steps), "rollbacks": self.rollbacks,
                "skipped_batches": self.skipped_batches, "empty_batches": self.empty_batches}


def summary(record: dict, steps: int) -> str | None:
    """The line saying what ``--on-nonfinite`` did (None when it did nothing)."""
    parts = []
    if record.get("skipped_updates"):
        shown = ", ".join(map(str, record["skipped_steps"][:10]))
        more = "" if len(record["skipped_steps"]) <= 10 else ", ..."
        parts.append(f"skipped {record['skipped_updates']} of {steps} updates (steps "
                     f"{shown}{more}: non-finite)")
    if record.get("rollbacks"):
        parts.append(f"rolled back {len(record['rollbacks'])} time(s), skipping batch(es) "
                     + ", ".join(map(str, record["skipped_batches"][:10])))
    line = "non-finite: " + "; ".join(parts) if parts else None
    if record.get("empty_batches"):
        empty = (f"{len(record['empty_batches'])} batch(es) had nothing to count (every target "
                 "ignored) and trained nothing: steps "
                 + ", ".join(map(str, record["empty_batches"][:10])))
        line = empty if line is None else f"{line}; {empty}"
    return line
