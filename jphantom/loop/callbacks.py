"""What observes the training loop (:class:`jphantom.loop.trainer.Trainer`): :class:`Callback` and the
built-in callbacks ``jphantom train`` runs with (:func:`default_callbacks`): ``metrics.jsonl``
(:class:`MetricsFile`), TensorBoard events (:class:`TensorBoardEvents`), the progress bar
(:class:`ProgressBar`) and the stop at a target loss (:class:`EarlyStop`). A callback gets the
trainer (its ``config``, ``program``, ``step``, ``state``, ``history``, ``first_step``, ``out``
and ``request_stop(reason)``) and each record the loop writes."""

from __future__ import annotations

import json
from pathlib import Path

import jax
from tqdm.auto import tqdm

from jphantom.config import RunConfig
from jphantom.costs.metrics import TensorBoard


# --------------------------------------------------------------------------------------------------


class Callback:
    """Hooks of the training loop, each optional, called in the order of the trainer's callbacks
    (the built-in ones first, then the user's). ``on_step_end`` gets every record the loop writes
    to ``metrics.jsonl`` (a step's, a skipped batch's, a rollback's), evaluation included, after
    the history is updated and before the step's checkpoint; ``on_train_end`` gets the
    :class:`jphantom.loop.RunResults` before ``results.json`` is written (a callback may add to
    their ``extra``, a dictionary ``results.json`` gets too); ``close`` is called however
    the run ends."""

    def on_train_start(self, trainer) -> None:
        pass

    def on_step_end(self, trainer, record: dict) -> None:
        pass

    def on_train_end(self, trainer, results) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsFile(Callback):
    """``metrics.jsonl`` in ``folder``: one JSON line per record, flushed as written (appended to
    when the run resumes)."""

    def __init__(self, folder: Path, *, append: bool = False):
        self.file = (Path(folder) / "metrics.jsonl").open("a" if append else "w")

    def on_step_end(self, trainer, record):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


class TensorBoardEvents(Callback):
    """The records as TensorBoard scalars in ``folder`` (:class:`jphantom.costs.metrics.TensorBoard`)."""

    def __init__(self, folder: Path):
        self.board = TensorBoard(folder)

    def on_step_end(self, trainer, record):
        self.board.write(record)

    def close(self):
        self.board.close()


class ProgressBar(Callback):
    """A tqdm bar over the run's steps: loss, learning rate, gradient norm, tokens/s, MFU and the
    last validation loss."""

    def __init__(self, *, disable: bool = False):
        self.disable, self.bar = disable, None

    def on_train_start(self, trainer):
        config = trainer.config
        self.bar = tqdm(total=config.train.steps, initial=trainer.first_step, unit="step",
                        disable=self.disable, desc=f"{config.model.name} "
                        f"{config.parallel.strategy} {trainer.program.mesh}")

    def on_step_end(self, trainer, record):
        if "learning_rate" in record:  # a step's record (not a skipped batch's, a rollback's)
            self.bar.set_postfix(_postfix(record, trainer.history), refresh=False)
        self.bar.update(record.get("rolled_back_to", record["step"]) - self.bar.n)

    def close(self):
        if self.bar is not None:
            self.bar.close()


class EarlyStop(Callback):
    """Stops the run once a validation loss is at most ``target_loss`` (its step is the results'
    ``iterations_to_target``)."""

    def __init__(self, target_loss: float):
        self.target_loss = target_loss

    def on_step_end(self, trainer, record):
        loss = record.get("validation_loss")
        if loss is not None and loss <= self.target_loss:
            trainer.request_stop("target_loss")


def default_callbacks(config: RunConfig, *, resume: bool | None = None) -> list[Callback]:
    """The callbacks ``jphantom train`` runs with: the metrics file and TensorBoard events where
    this process writes (process 0, with ``train.out``), the progress bar, the early stop."""
    train = config.train
    callbacks = []
    if jax.process_index() == 0 and train.out is not None:
        callbacks.append(MetricsFile(Path(train.out), append=train.resume if resume is None
                                     else resume))
        if train.tensorboard:
            callbacks.append(TensorBoardEvents(Path(train.out) / "tensorboard"))
    callbacks.append(ProgressBar(disable=not train.progress))
    if train.target_loss is not None:
        callbacks.append(EarlyStop(train.target_loss))
    return callbacks


def _postfix(record: dict, history: dict) -> dict:
    """The progress bar's figures: loss, learning rate, gradient norm, tokens/s, MFU (where
    known) and the last validation loss."""
    loss = record["train_loss"]
    shown = {"loss": "nan" if loss is None else f"{loss:.3f}",
             "lr": f"{record['learning_rate']:.2e}"}
    if record["grad_norm"] is not None:
        shown["gnorm"] = f"{record['grad_norm']:.3g}"
    shown["tok/s"] = f"{record['tokens_per_second']:,.0f}"
    if record["mfu"] is not None:
        shown["mfu"] = f"{100 * record['mfu']:.1f}%"
    shown["val"] = (f"{history['validation_loss'][-1]:.3f}" if history["validation_loss"]
                    else "-")
    return shown
