"""The training loop's parts, each built once by :class:`jphantom.loop.trainer.Trainer` and used by its
``fit`` (torchtitan's ``Trainer`` with its checkpoint manager and metrics processor is the
anchor):

- :mod:`~jphantom.loop.records`: what a run reports, typed: :class:`StepRecord` (a line of
  ``metrics.jsonl``; :class:`SkippedBatch` and :class:`RolledBack` for the non-finite policy's
  events) and :class:`RunResults` (``results.json``);
- :mod:`~jphantom.loop.nonfinite`: :class:`NonFinitePolicy`, what a non-finite loss does (stop,
  skip the update, roll back to the last checkpoint);
- :mod:`~jphantom.loop.evaluation`: :class:`Evaluator`, the held-out loss every ``eval_every``
  steps and at the end;
- :mod:`~jphantom.loop.checkpoints`: :class:`RunCheckpoints`, Orbax checkpoints of this run
  (what a checkpoint holds beside the state, resuming the same run, the last good state);
- :mod:`~jphantom.loop.clock`: :class:`StepClock`, the steps' times and energy, the meter's
  window, a step's rates and the run's throughput;
- :mod:`~jphantom.loop.stopping`: :class:`Stopping`, a callback's stop request and SIGTERM /
  Ctrl-C, and what ``results.json`` records of them.
"""

from jphantom.loop.checkpoints import RunCheckpoints
from jphantom.loop.clock import StepClock
from jphantom.loop.evaluation import Evaluator
from jphantom.loop.nonfinite import NonFinitePolicy
from jphantom.loop.records import RolledBack, RunResults, SkippedBatch, StepRecord, fresh_history
from jphantom.loop.stopping import Stopping

__all__ = ["Evaluator", "NonFinitePolicy", "RolledBack", "RunCheckpoints", "RunResults",
           "SkippedBatch", "StepClock", "StepRecord", "Stopping", "fresh_history"]
