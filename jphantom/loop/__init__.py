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
  (what a checkpoint holds beside the state, resuming the same run, the last good state).
"""

from jphantom.loop.checkpoints import RunCheckpoints
from jphantom.loop.evaluation import Evaluator
from jphantom.loop.nonfinite import NonFinitePolicy
from jphantom.loop.records import RolledBack, RunResults, SkippedBatch, StepRecord, fresh_history

__all__ = ["Evaluator", "NonFinitePolicy", "RolledBack", "RunCheckpoints", "RunResults",
           "SkippedBatch", "StepRecord", "fresh_history"]
