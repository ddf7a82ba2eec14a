"""How a run ends before its last step (:class:`Stopping`): a callback's request
(``trainer.request_stop(reason)``: the run ends after the current step, with a checkpoint) or a
signal (SIGTERM / Ctrl-C, :class:`jphantom.runtime.resilience.StopOnSignal`: every process agrees
on the step to stop after), and what ``results.json`` records of it."""

from __future__ import annotations

from tqdm.auto import tqdm

from jphantom.runtime.resilience import StopOnSignal, agree


class Stopping:
    """A run's stop requests: ``reason`` (the first callback's) and the step it came at;
    ``interrupted`` once a signal stopped the run."""

    def __init__(self):
        self.reason: str | None = None
        self.step: int | None = None
        self.signal: StopOnSignal | None = None
        self.interrupted = False

    def request(self, reason: str) -> None:
        self.reason = self.reason or reason

    def listen(self) -> None:
        """From now on the first SIGTERM / SIGINT stops the run after its step."""
        self.signal = StopOnSignal(tqdm.write)

    def after(self, step: int) -> tuple[bool, bool]:
        """At the end of ``step``: (whether the run stops here, whether a signal stopped it);
        every process calls it once per step."""
        if self.reason is not None and self.step is None:
            self.step = step
        signalled = agree(self.signal.requested)
        self.interrupted = self.interrupted or signalled
        return self.reason is not None or signalled, signalled

    def stopped_by(self) -> str | None:
        return self.signal.name if self.interrupted else self.reason

    def iterations_to_target(self) -> int | None:
        """The step an early stop on ``target_loss`` came at."""
        return self.step if self.reason == "target_loss" else None

    def close(self) -> None:
        self.signal.restore()
