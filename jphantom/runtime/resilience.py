"""What a training run does when the cluster or its user stops it: preemption signals, a stuck
rank, non-finite losses.

- :class:`StopOnSignal`: SIGTERM (what SLURM, Kubernetes and spot instances send before they kill
  a job) and SIGINT ask the loop to stop after the step in flight; the run then writes a
  checkpoint of that step, its metrics, ``results.json`` and the plots, and ``jphantom train``
  exits 143 (SIGTERM) or 130 (SIGINT). A second signal stops at once.
- :func:`agree`: with several processes every process stops at the same step (a signal reaches
  them at different moments): one 4-byte all-gather across the processes per step, in
  multi-process runs only.
- :class:`Watchdog`: ``--step-timeout`` seconds for a step (after the first, which compiles) or an
  evaluation; past it the process prints one line naming the step and the timeout and exits
  :data:`TIMEOUT_EXIT` at once, even while its main thread waits in a collective that will never
  finish (jax#38503: no flag of XLA's fires for a rank that does not arrive). Every process that
  waits on the stopped one times out the same way; ``jphantom launch`` names the process that
  stopped first and which ones are suspended.
- ``--on-nonfinite``, what a non-finite loss does, in the names of
  :data:`jphantom.registry.nonfinite.NONFINITE` (:mod:`jphantom.loop.nonfinite` applies them):
  :data:`MAX_CONSECUTIVE_SKIPS` and :data:`MAX_ROLLBACKS` bound ``skip`` and ``rollback``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

MAX_CONSECUTIVE_SKIPS = 10
"""``--on-nonfinite skip``: this many non-finite steps in a row stop the run (diverged, not a
spike)."""
MAX_ROLLBACKS = 5
"""``--on-nonfinite rollback``: this many rollbacks with no checkpoint written since the first of
them stop the run (every retry of the steps since the checkpoint went non-finite)."""
AUTO_TIMEOUT_S = 300.0
"""Without ``--step-timeout``, a run of several processes times its steps once two have run: the
larger of this and 50 times the slowest step so far."""
TIMEOUT_EXIT = 124
"""The exit status of a process whose step ran past ``--step-timeout`` (as ``timeout(1)``'s)."""
EXIT_STATUS = {"SIGTERM": 128 + signal.SIGTERM, "SIGINT": 128 + signal.SIGINT}


class StopOnSignal:
    """While training: the first SIGTERM or SIGINT asks the loop to stop after the step it is in
    (:attr:`requested`, :attr:`name`); a second one raises ``KeyboardInterrupt`` at once. Only in
    the main thread (where Python delivers signals); elsewhere the signals keep their default."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, say):
        self.requested, self.name, self._say, self._previous = False, None, say, {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.name = True, signal.Signals(signum).name
        self._say(f"{self.name}: stopping after this step and writing its checkpoint "
                  f"({self.name} again to stop now)")

    def restore(self):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def agree(flag: bool) -> bool:
    """Whether any process has ``flag`` set (this process's alone with one process): every
    process calls it once per step, so all of them stop at the same step."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


class Watchdog:
    """A daemon thread that ends the process when an armed phase (a step, an evaluation) runs
    past ``timeout`` seconds: one line on stderr, then ``os._exit(TIMEOUT_EXIT)`` (the main thread
    may be blocked in a collective that never returns). ``timeout=None``: never fires."""

    def __init__(self, timeout: float | None, *, rank: int = 0, processes: int = 1):
        self.timeout, self.rank, self.processes = None, rank, processes
        self._phase, self._since = None, None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = None
        self.set_timeout(timeout)

    def set_timeout(self, timeout: float | None) -> None:
        """Time the phases from now on against ``timeout`` (the automatic limit, once the first
        steps have compiled); the thread starts with the first limit."""
        with self._lock:
            self.timeout = timeout
        if timeout is not None and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="jphantom-watchdog",
                                            daemon=True)
            self._thread.start()

    def arm(self, phase: str) -> None:
        """Start timing ``phase`` (e.g. ``"step 12"``)."""
        with self._lock:
            self._phase, self._since = phase, time.monotonic()

    def disarm(self) -> None:
        with self._lock:
            self._phase = self._since = None

    def close(self) -> None:
        self._done.set()
        self.disarm()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, max(0.05, self.timeout / 20))):
            with self._lock:
                phase, since, timeout = self._phase, self._since, self.timeout
            if since is None or time.monotonic() - since <= timeout:
                continue
            who = f"process {self.rank} of {self.processes}: " if self.processes > 1 else ""
            wait = (" (a process stopped, died or never joined the collective; the others wait "
                    "for it)" if self.processes > 1 else "")
            sys.stderr.write(f"jphantom: error: {who}{phase} did not finish within "
                             f"--step-timeout {timeout:g} s{wait}; exiting\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(TIMEOUT_EXIT)

