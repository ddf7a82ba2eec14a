"""What a non-finite training loss, or an update that leaves non-finite parameters or optimizer
state, does: :data:`NONFINITE`, the one vocabulary of the step's ``on_nonfinite``
(:mod:`jphantom.step.finite`), a run's ``--on-nonfinite`` (:mod:`jphantom.loop.nonfinite`), the
configuration and the command line, each name meaning the same everywhere:

- ``warn``: training goes on; the first non-finite loss is reported once.
- ``skip``: an update that would make the parameters or the optimizer state non-finite (or whose
  gradients are) is not applied, and is counted (:func:`jphantom.step.finite.keep_if_finite`);
  a run stops after :data:`jphantom.runtime.resilience.MAX_CONSECUTIVE_SKIPS` in a row.
- ``stop``: training stops at the first non-finite loss with
  :class:`jphantom.errors.TrainingDiverged`, saying where the last good state is: the step
  alone drops that update and its error's ``.state`` is the finite state; a run names its newest
  checkpoint (its step adds no check).
- ``rollback``: the newest checkpoint whose recorded loss and parameters are finite is reloaded
  and the batch that gave the bad step is skipped: only a run with checkpoints can, so the step
  alone refuses it.

No jax here: the configuration and the command line check a setting against these names without
importing it.
"""

from __future__ import annotations

from jphantom.errors import ConfigError

NONFINITE = ("warn", "skip", "stop", "rollback")
"""The policies, in the order the help lists them (module docstring)."""

LOOP_ONLY = ("rollback",)
"""The policies only a training loop with checkpoints can apply (not a step called alone)."""


def check_nonfinite(value, *, loop: bool) -> str:
    """``value`` if it names a policy of :data:`NONFINITE` that a training loop (``loop``) or a
    step called alone can apply; else a ConfigError naming it and the fix."""
    if value not in NONFINITE:
        raise ConfigError(f"on_nonfinite={value!r} must be one of "
                          f"{', '.join(map(repr, NONFINITE))}")
    if value in LOOP_ONLY and not loop:
        raise ConfigError(
            f"on_nonfinite={value!r} reloads the newest good checkpoint, which only a training "
            "loop with checkpoints can do (jphantom train --on-nonfinite rollback "
            "--checkpoint-dir DIR --save-every N): a step called alone takes 'stop' (its "
            "TrainingDiverged's .state is the last finite state) or 'skip'")
    return value
