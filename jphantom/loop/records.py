"""What a training run reports, typed: one :class:`StepRecord` per step (the line
``metrics.jsonl`` gets and every callback's ``on_step_end`` reads), the non-finite policy's
events (:class:`SkippedBatch`, :class:`RolledBack`), and the run's :class:`RunResults`
(``results.json``). Callbacks and ``results.json`` see them as dictionaries (``as_dict``), with
the keys they always had."""

from __future__ import annotations

import dataclasses
from typing import Any


def fresh_history() -> dict:
    """The loss curves a run keeps (and a checkpoint holds): steps and training losses of the
    updates applied, validation steps and losses, MoE dropped fractions."""
    return {"step": [], "train_loss": [], "validation_step": [], "validation_loss": [],
            "dropped_fraction": []}


@dataclasses.dataclass
class StepRecord:
    """One step: its loss, learning rate, gradient norm, seconds, tokens/s, model TFLOP/s per
    device and MFU, peak memory and energy (:mod:`jphantom.costs.metrics`); ``update_skipped`` under a
    skip or rollback policy; ``compiled`` on the step that compiled; the evaluation's
    ``validation_loss`` (and MoE ``dropped_fraction``) on the steps that evaluate."""

    step: int
    train_loss: float | None
    learning_rate: float
    grad_norm: float | None
    step_seconds: float
    tokens_per_second: float
    model_tflops_per_device: float | None
    mfu: float | None
    peak_memory_bytes: int | None
    energy_joules: float | None
    joules_per_token: float | None
    energy_source: str
    update_skipped: bool | None = None
    compiled: bool | None = None
    validation_loss: float | None = None
    dropped_fraction: float | None = None

    _OPTIONAL = ("update_skipped", "compiled", "validation_loss", "dropped_fraction")

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in self._OPTIONAL:  # present only where they apply
            if out[key] is None:
                del out[key]
        return out


@dataclasses.dataclass(frozen=True)
class SkippedBatch:
    """A batch read and not trained on: the one that gave a rolled-back non-finite loss, or one
    with nothing to count (``reason``; every target ignored, the loss's global weight 0)."""

    step: int
    reason: str = "rolled back"

    def as_dict(self) -> dict:
        found = {"step": self.step, "skipped_batch": True}
        return found if self.reason == "rolled back" else {**found, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class RolledBack:
    """A non-finite loss at ``step``: the state went back to ``to_step``'s."""

    step: int
    to_step: int

    def as_dict(self) -> dict:
        return {"step": self.step, "train_loss": None, "nonfinite": True,
                "rolled_back_to": self.to_step}


@dataclasses.dataclass(frozen=True)
class RunResults:
    """What :meth:`jphantom.loop.trainer.Trainer.fit` returns, read by attribute, and ``results.json``
    (:meth:`as_dict`): the configuration, mesh, devices and parameters; final and best
    validation loss; how the run ended (``interrupted``, ``stopped_by``, ``steps_done``, the
    non-finite policy's record); step, compile and wall seconds with throughput and energy; the
    compiled memory; the data, history, loss units, step options, attention kernels and model;
    and, where they apply, the metered energy, the MoE blocks' drops, the pipeline, the text's
    unigram baseline and the checkpoints. ``extra``: what callbacks add at the end
    (``on_train_end``), written into ``results.json`` beside the rest."""

    config: dict
    mesh: str
    devices: list
    params: int
    final_validation_loss: float | None
    best_validation_loss: float | None
    interrupted: bool
    stopped_by: str | None
    steps_done: int
    nonfinite: dict
    median_step_seconds: float | None
    throughput: dict
    step_seconds: list
    compile_seconds: float | None
    compiled_memory_bytes: Any
    wall_seconds: float
    iterations_to_target: int | None
    data: Any
    history: dict
    loss_units: str
    step: dict
    attention: dict | None
    model: dict
    energy: dict | None = None
    moe: dict | None = None
    pipeline: dict | None = None
    unigram_cross_entropy: float | None = None
    validation_over_unigram: float | None = None
    checkpoints: dict | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    _OPTIONAL = ("energy", "moe", "pipeline", "checkpoints")

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra"}
        for key in self._OPTIONAL:
            if out[key] is None:
                del out[key]
        if self.unigram_cross_entropy is None:  # text runs only
            del out["unigram_cross_entropy"], out["validation_over_unigram"]
        return out | self.extra
