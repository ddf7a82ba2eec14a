"""A run's clock (:class:`StepClock`): the time since the run began, each step's time and energy
(:class:`jphantom.costs.metrics.StepEnergy`; the first step compiles and is not timed), the energy
meter's window (opened after the first step and closed after the last, both on idle devices, as
Seal et al. exclude initialisation) and what they give: a step's tokens/s, model TFLOP/s per
device and MFU, and the run's throughput (:mod:`jphantom.costs.metrics`)."""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jphantom.costs.metrics import StepEnergy, peak_memory_bytes, peak_tflops


class StepClock:
    """Times and meters one run's steps on ``devices``. ``per_token``: the model's FLOPs per
    token (None: unknown); ``meter``: an energy meter for the run's window, or None; ``start``:
    when the run began (:func:`time.perf_counter`)."""

    def __init__(self, devices: list, per_token: int | None, meter, start: float):
        self.devices, self.per_token, self.meter, self.start = devices, per_token, meter, start
        self.peak = peak_tflops(devices[0])
        self.step_energy = StepEnergy.for_devices(devices)
        self.step_seconds: list[float] = []
        self.metered_steps = 0
        self.compile_seconds: float | None = None
        self.meter_running = False
        self._tick = 0.0

    def begin(self) -> None:
        """The step's window opens (its batch already on the devices)."""
        self.step_energy.begin()
        self._tick = time.perf_counter()

    def end(self) -> tuple[float, float | None]:
        """The step's seconds and joules, once its work is done."""
        elapsed = time.perf_counter() - self._tick
        return elapsed, self.step_energy.end(elapsed)

    def compiled(self, state, more: bool) -> None:
        """After the first step (it compiled): the compile time; the meter's window opens, on
        idle devices, when ``more`` steps follow."""
        self.compile_seconds = time.perf_counter() - self.start
        if self.meter is not None and more:
            jax.block_until_ready(state)
            self.meter.start()
            self.meter_running = True

    def timed(self, elapsed: float) -> None:
        """A compiled step's time (and, with a meter, one more metered step)."""
        self.step_seconds.append(elapsed)
        self.metered_steps += self.meter is not None

    def measures(self, elapsed: float, joules: float | None, tokens: int) -> dict:
        """A step's :class:`jphantom.loop.StepRecord` fields of time, rate and energy."""
        tflops = (None if self.per_token is None else
                  self.per_token * tokens / elapsed / len(self.devices) / 1e12)
        return {"step_seconds": elapsed, "tokens_per_second": tokens / elapsed,
                "model_tflops_per_device": tflops,
                "mfu": None if tflops is None or self.peak is None else tflops / self.peak,
                "peak_memory_bytes": peak_memory_bytes(self.devices), "energy_joules": joules,
                "joules_per_token": self.step_energy.joules_per_token(joules, tokens),
                "energy_source": self.step_energy.source}

    def close(self):
        """Close the step energy and the meter's window; the metered energy (None without a
        meter or a metered step)."""
        self.step_energy.close()
        if self.meter_running:
            measurement = self.meter.stop()
            return measurement if self.metered_steps else None
        return None

    def results(self, energy, tokens: int) -> dict:
        """The run's :class:`jphantom.loop.RunResults` fields of time, throughput and energy
        (``energy``: :meth:`close`'s)."""
        median = float(np.median(self.step_seconds)) if self.step_seconds else None
        found = {"median_step_seconds": median, "throughput": self._throughput(median, tokens),
                 "step_seconds": self.step_seconds, "compile_seconds": self.compile_seconds,
                 "wall_seconds": time.perf_counter() - self.start}
        if energy is not None:
            found["energy"] = {"joules": energy.joules, "metered_steps": self.metered_steps,
                               "joules_per_step": energy.joules / self.metered_steps,
                               "device_names": list(energy.device_names),
                               "mean_watts": energy.mean_watts, "method": energy.method}
        return found

    def _throughput(self, median: float | None, tokens: int) -> dict:
        per_token, peak, devices, source = (self.per_token, self.peak, self.devices,
                                            self.step_energy.source)
        return {
            "model_flops_per_token": per_token, "devices": len(devices),
            "device_kind": str(getattr(devices[0], "device_kind", devices[0].platform)),
            "peak_tflops_per_device": peak,
            "median_mfu": (None if per_token is None or peak is None or median is None
                           else per_token * tokens / median / len(devices) / 1e12 / peak),
            "energy_source": source,
            "power_model": None if source in ("nvml", "amdsmi") else dataclasses.asdict(
                self.step_energy.power)}
