"""A run's checkpoints (:class:`RunCheckpoints`): Orbax checkpoints of the state
(:class:`jphantom.loop.checkpointer.Checkpointer`) with what a run needs beside it: the loss history,
the model and corpus that trained it (``--resume`` continues only the same run), the data
stream's position, and where the last good state is when a run stops on a non-finite loss. A run
without ``--checkpoint-dir`` has one too, that saves nothing."""

from __future__ import annotations

import json
import math

from jphantom.errors import ConfigError


class RunCheckpoints:
    """Checkpoints of one run (module docstring). ``identity``: the model and corpus
    (``{"model": {...}, "corpus": {"data", "tokenizer"}}``) saved with each checkpoint."""

    def __init__(self, train, identity: dict):
        self.identity = identity
        self.checkpointer = None
        self.saved_step: int | None = None  # the newest step this run saved
        if train.checkpoint_dir:
            from jphantom.loop.checkpointer import Checkpointer

            self.checkpointer = Checkpointer(train.checkpoint_dir, save_every=train.save_every,
                                             keep=train.keep_checkpoints)

    def __bool__(self) -> bool:
        return self.checkpointer is not None

    def due(self, step: int) -> bool:
        return self.checkpointer is not None and self.checkpointer.due(step)

    def save(self, step: int, state, history: dict, data) -> None:
        """The state after ``step`` with the history, the run's identity and the data's
        position."""
        self.checkpointer.save(step, state.params, state.opt_state,
                               {"history": json.loads(json.dumps(history)), **self.identity},
                               data=data)
        self.saved_step = step

    def steps(self) -> list[int]:
        """The steps saved (every save finished first)."""
        if self.checkpointer is None:
            return []
        self.checkpointer.wait()
        return self.checkpointer.all_steps()

    def restore(self, state, source, step: int | None = None):
        """``(state, step, history)`` of checkpoint ``step`` (default: the newest complete
        one), the data reader put back where that checkpoint left it."""
        from jphantom.step.train_step import TrainState

        params, opt_state, meta = self.checkpointer.restore(state.params, state.opt_state, step)
        if hasattr(source, "restore"):  # a reader with a position: where the checkpoint left it
            if meta.get("data") is None:
                raise ConfigError(f"the checkpoint at step {meta['step']} holds no data position "
                                  "(it was saved by a run on byte-level text): resume with the "
                                  "data and tokenizer that saved it")
            source.restore(meta["data"])
        return TrainState(params, opt_state), meta["step"], meta["history"]

    def check_same_run(self, abstract_state=None, steps: int | None = None) -> None:
        """``--resume`` continues the run that saved the checkpoint: the same model (a changed
        ``--hidden`` is named, not blamed on the mesh) and the same data and tokenizer; with
        ``abstract_state`` (the step's, nothing allocated) the same parameter and optimizer
        shapes, and with ``steps`` a checkpoint before them. Reads the newest checkpoint's JSON
        only, so a run refuses before its step compiles."""
        try:
            meta = self.checkpointer.meta()
        except Exception:  # noqa: BLE001 (a damaged newest checkpoint: restore skips it, says so)
            return
        if meta is None:
            return  # restore says there is no checkpoint
        step, model = meta["step"], self.identity["model"]
        saved = meta.get("model")
        if saved is not None:
            changed = [k for k in sorted(set(saved) | set(model))
                       if saved.get(k) != model.get(k) and k != "dtype"]
            if changed:
                k = changed[0]
                raise ConfigError(f"checkpoint step {step} was saved by model {saved.get('name')} "
                                  f"with {k}={saved.get(k)!r}; this run's has {k}="
                                  f"{model.get(k)!r}: resume with the model flags that saved "
                                  "it, or start a new --checkpoint-dir")
        corpus, ours = meta.get("corpus"), self.identity["corpus"]
        if corpus is not None and corpus != ours:
            raise ConfigError(f"checkpoint step {step} was trained on data={corpus['data']!r} "
                              f"(tokenizer {corpus['tokenizer']!r}); this run reads "
                              f"data={ours['data']!r} (tokenizer {ours['tokenizer']!r}): resume "
                              "with the data that saved it, or start a new --checkpoint-dir")
        if abstract_state is not None:
            self.checkpointer.check_layout(meta, abstract_state.params, abstract_state.opt_state)
        if steps is not None:
            self.check_before(step, steps)

    @staticmethod
    def check_before(step: int, steps: int) -> None:
        """A resumed run has steps left: checkpoint ``step`` is before ``steps``."""
        if step >= steps:
            raise ConfigError(f"the checkpoint is at step {step}, not before steps={steps}: ask "
                              "for more steps to continue")

    def good_steps(self) -> list[int]:
        """The steps saved whose recorded losses are finite (:func:`nonfinite_loss` of their
        history), newest first. Their parameters were finite when written (the trainer writes
        no other state); a rollback checks them again once restored."""
        return [step for step in sorted(self.steps(), reverse=True)
                if nonfinite_loss(self.checkpointer.meta(step).get("history") or {}) is None]

    def drop_after(self, step: int) -> list[int]:
        """Delete the checkpoints newer than ``step`` (a rollback to ``step`` passed them: their
        recorded loss or their parameters are not finite, and the run writes those steps
        again); returns their steps."""
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            self.checkpointer.manager.delete(s)
        return newer

    def last_good(self) -> str:
        """Where the last good state is, for a run that stops on a non-finite loss: the newest
        checkpoint whose recorded losses are finite."""
        if self.checkpointer is None:
            return " (no --checkpoint-dir: no state was saved)"
        steps = self.steps()
        if not steps:
            return f" (no checkpoint in {self.checkpointer.directory} yet)"
        good = self.good_steps()
        if not good:
            return (f" (no checkpoint in {self.checkpointer.directory} records a finite loss: "
                    f"steps {', '.join(map(str, steps))})")
        where = (f"; the last good state is the checkpoint of step {good[0]} in "
                 f"{self.checkpointer.directory}")
        newer = [step for step in steps if step > good[0]]
        if not newer:
            return f"{where} (--resume continues from it)"
        return (f"{where} (newer ones record a non-finite loss and --resume takes the newest: "
                f"move step(s) {', '.join(map(str, newer))} aside to continue from it)")

    def describe(self, resumed_from: int) -> dict | None:
        """``results.json``'s ``checkpoints``: the folder, the steps kept, where it resumed."""
        if self.checkpointer is None:
            return None
        return {"directory": str(self.checkpointer.directory),
                "steps": self.checkpointer.all_steps(), "resumed_from": resumed_from}

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()


def nonfinite_loss(history: dict) -> str | None:
    """What is not finite among the newest training and validation losses ``history`` records
    ("validation loss is inf"), or None when they are finite (or there are none)."""
    for key, name in (("train_loss", "training loss"), ("validation_loss", "validation loss")):
        losses = history.get(key) or []
        if losses and not (losses[-1] is not None and math.isfinite(losses[-1])):
            return f"{name} is {losses[-1]}"
    return None
