"""Energy of training: seed 000's model (Eqs. 1-2) and a GPU power meter like its measurement.

    (1)  e = A · α + B · β        joules per iteration
    (2)  E_λ = ν_λ · e            joules to reach loss λ in ν_λ iterations

A is the dynamic power of a busy (computing) GPU and B its static power while it waits on
communication, A > B; on Frontier's MI250X the paper takes A ≈ 560 W and B ≈ 90 W. α and β are the
seconds one iteration (forward + backward) spends computing and communicating.

``PowerModel`` holds A and B, ``energy_per_iteration`` is Eq. 1 summed over devices,
``energy_to_target`` is Eq. 2, and ``EnergyEstimate`` records either a modelled or a measured result.
Where a GPU is present, ``NvmlPowerMeter`` measures instead: it samples NVML power in a background
thread and integrates it over the training window (trapezoid rule), as the paper does with ROCm-SMI
(digest of seed 000, Sec. 4.5).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jphantom.errors import ConfigError

SOURCES = ("measured", "modelled")


def _check_real(name: str, value: Any, *, positive: bool = False) -> float:
    """``value`` as a float, finite and >= 0 (> 0 when ``positive``); ConfigError naming it otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be a number, not a bool")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not a number") from None
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{name}={value!r} must be finite and {bound}")
    return number


@dataclasses.dataclass(frozen=True)
class PowerModel:
    """Per-device power of Eq. 1: A = ``busy_watts`` computing, B = ``idle_watts`` communicating.

    Defaults are seed 000's Frontier values (Sec. II-A): A ≈ 560 W, B ≈ 90 W per MI250X GCD.
    """

    busy_watts: float = 560.0
    idle_watts: float = 90.0
    name: str = "frontier-mi250x"

    def __post_init__(self):
        busy = _check_real("PowerModel.busy_watts", self.busy_watts, positive=True)
        idle = _check_real("PowerModel.idle_watts", self.idle_watts, positive=True)
        if busy < idle:
            raise ConfigError(
                f"PowerModel.busy_watts={self.busy_watts!r} < idle_watts={self.idle_watts!r}: Eq. 1 needs "
                "A (computing) >= B (waiting on communication); swap them"
            )
        object.__setattr__(self, "busy_watts", busy)
        object.__setattr__(self, "idle_watts", idle)


def energy_per_iteration(
    alpha_s: float, beta_s: float, power: PowerModel = PowerModel(), devices: int = 1
) -> float:
    """Eq. 1, joules of one iteration on ``devices`` devices: devices · (A · α + B · β).

    ``alpha_s`` (α) and ``beta_s`` (β) are *per-device* seconds of one iteration, spent computing and
    spent communicating; in an SPMD step every device has the same α and β, and the paper's energy
    sums over the GPUs, hence the factor ``devices``. Eq. 1 treats the two as disjoint: time in which
    communication overlaps compute belongs in α only.
    """
    alpha = _check_real("alpha_s", alpha_s)
    beta = _check_real("beta_s", beta_s)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"devices={devices!r} must be a whole number >= 1 (the GPUs Eq. 1 sums over)")
    if not isinstance(power, PowerModel):
        raise ConfigError(f"power={power!r} must be a PowerModel")
    return devices * (power.busy_watts * alpha + power.idle_watts * beta)


def energy_to_target(per_iteration_j: float, iterations: float) -> float:
    """Eq. 2, joules to reach the target loss: E_λ = ν_λ · e (``iterations`` ν_λ, often epochs)."""
    return _check_real("per_iteration_j", per_iteration_j) * _check_real("iterations", iterations)


@dataclasses.dataclass(frozen=True)
class EnergyEstimate:
    """Energy of a training run to a target, Eqs. 1-2, either ``"modelled"`` or ``"measured"``.

    ``compute_seconds`` (α) and ``comm_seconds`` (β) are per device per iteration, None where a
    measurement did not split them. ``total_joules`` = ``joules_per_iteration`` · ``iterations``.
    """

    compute_seconds: float | None
    comm_seconds: float | None
    joules_per_iteration: float
    iterations: float
    total_joules: float
    source: str
    note: str = ""

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ConfigError(f"EnergyEstimate.source={self.source!r} must be one of {SOURCES}")
        for name in ("compute_seconds", "comm_seconds"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _check_real(f"EnergyEstimate.{name}", getattr(self, name)))
        for name in ("joules_per_iteration", "iterations", "total_joules"):
            object.__setattr__(self, name, _check_real(f"EnergyEstimate.{name}", getattr(self, name)))
        eq2 = self.joules_per_iteration * self.iterations
        if not math.isclose(self.total_joules, eq2, rel_tol=1e-9, abs_tol=1e-9):
            raise ConfigError(
                f"EnergyEstimate.total_joules={self.total_joules!r} differs from joules_per_iteration x "
                f"iterations = {eq2!r} (Eq. 2); build it with estimate_energy or measured_energy"
            )


def estimate_energy(
    alpha_s: float,
    beta_s: float,
    iterations: float,
    power: PowerModel = PowerModel(),
    devices: int = 1,
    note: str = "",
) -> EnergyEstimate:
    """A modelled ``EnergyEstimate``: Eq. 1 per iteration on ``devices`` devices, then Eq. 2."""
    per_iteration = energy_per_iteration(alpha_s, beta_s, power, devices)
    detail = f"Eq. 1, {power.name}: A={power.busy_watts:g} W, B={power.idle_watts:g} W, x {devices} devices"
    return EnergyEstimate(
        compute_seconds=float(alpha_s),
        comm_seconds=float(beta_s),
        joules_per_iteration=per_iteration,
        iterations=float(iterations),
        total_joules=energy_to_target(per_iteration, iterations),
        source="modelled",
        note=f"{detail}; {note}" if note else detail,
    )


def measured_energy(
    total_joules: float,
    iterations: float,
    compute_seconds: float | None = None,
    comm_seconds: float | None = None,
    note: str = "",
) -> EnergyEstimate:
    """A measured ``EnergyEstimate``: metered joules (e.g. an ``NvmlPowerMeter``) over ``iterations`` > 0."""
    total = _check_real("total_joules", total_joules)
    count = _check_real("iterations", iterations, positive=True)
    return EnergyEstimate(compute_seconds, comm_seconds, total / count, count, total, "measured", note)


def integrate_trapezoid(times_s: Sequence[float], watts: Sequence[float]) -> float:
    """Joules under a power curve: trapezoid rule over (time in s, power in W) samples."""
    if len(times_s) != len(watts):
        raise ConfigError(f"{len(times_s)} times but {len(watts)} power samples: they must pair up")
    joules = 0.0
    for i in range(1, len(times_s)):
        joules += 0.5 * (watts[i] + watts[i - 1]) * (times_s[i] - times_s[i - 1])
    return joules


@dataclasses.dataclass(frozen=True)
class PowerMeasurement:
    """What an ``NvmlPowerMeter`` saw between ``start()`` and ``stop()``."""

    joules: float  # summed over devices
    joules_per_device: tuple[float, ...]
    device_names: tuple[str, ...]
    seconds: float
    samples: int

    @property
    def mean_watts(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else 0.0


class NvmlPowerMeter:
    """Integrated GPU energy over a window: samples power at a fixed interval, integrates (trapezoid).

    With no ``sampler`` it reads ``nvmlDeviceGetPowerUsage`` (milliwatts) of every NVIDIA GPU, or of
    ``device_indices``, through nvidia-ml-py (``pynvml``, imported only when needed). ``sampler`` may
    instead be any callable returning one power in watts per device, or one number for one device
    (tests, other meters); ``clock`` gives the sample times in seconds.

        meter = NvmlPowerMeter(interval_s=0.05)
        with meter:
            train()
        meter.measurement.joules

    A sample is taken at ``start()`` and at ``stop()``, so the integral spans exactly the window, and
    every ``interval_s`` in between. Only GPU power is counted, as in seed 000's measurement: no CPU,
    memory or network. Some drivers report power averaged over the last second; keep windows long
    next to that, or use a longer interval.
    """

    def __init__(
        self,
        device_indices: Sequence[int] | None = None,
        interval_s: float = 0.05,
        *,
        sampler: Callable[[], Sequence[float]] | None = None,
        device_names: Sequence[str] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.interval_s = _check_real("interval_s", interval_s, positive=True)
        if device_indices is not None:
            device_indices = tuple(device_indices)
            valid = all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in device_indices)
            if not device_indices or not valid:
                raise ConfigError(
                    f"device_indices={device_indices!r} must be a non-empty list of GPU indices >= 0"
                )
        self.device_indices = device_indices
        self._sampler = sampler
        self._reads_nvml = sampler is None
        self._device_names = tuple(device_names) if device_names is not None else None
        self._clock = clock
        self._times: list[float] = []
        self._watts: list[tuple[float, ...]] = []
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._nvml = None  # the pynvml module while this meter holds NVML open
        self.measurement: PowerMeasurement | None = None

    @staticmethod
    def available() -> tuple[bool, str]:
        """(True, which GPUs) when NVML power can be read, else (False, why). Never raises."""
        try:
            import pynvml
        except ImportError:
            return False, "nvidia-ml-py (pynvml) is not installed: pip install 'jphantom[gpu]'"
        try:
            pynvml.nvmlInit()
        except Exception as error:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            return False, f"NVML could not start (no NVIDIA driver or GPU?): {error}"
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                return False, "NVML found no NVIDIA GPU"
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            names = [_decode(pynvml.nvmlDeviceGetName(handle)) for handle in handles]
            return True, f"{count} GPU(s): {', '.join(names)}"
        except Exception as error:
            return False, f"NVML could not list GPUs: {error}"
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass

    def _open_nvml(self) -> None:
        ok, reason = self.available()
        if not ok:
            raise ConfigError(
                f"NvmlPowerMeter cannot measure: {reason}. Fix: run on an NVIDIA GPU, pass sampler=..., "
                "or model the energy with jphantom.energy.estimate_energy (Eq. 1)"
            )
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        indices = self.device_indices if self.device_indices is not None else tuple(range(count))
        if any(i >= count for i in indices):
            pynvml.nvmlShutdown()
            raise ConfigError(
                f"device_indices={indices!r} but NVML sees {count} GPU(s): use indices 0..{count - 1}"
            )
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        self._nvml = pynvml
        self._device_names = tuple(
            f"{i}:{_decode(pynvml.nvmlDeviceGetName(handle))}" for i, handle in zip(indices, handles)
        )
        self._sampler = lambda: [pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0 for h in handles]  # mW -> W

    def _close_nvml(self) -> None:
        if self._nvml is not None:
            self._nvml.nvmlShutdown()
            self._nvml, self._sampler = None, None

    def _take_sample(self) -> None:
        reading = self._sampler()
        watts = (float(reading),) if isinstance(reading, (int, float)) else tuple(float(w) for w in reading)
        now = self._clock()
        with self._lock:
            if self._watts and len(watts) != len(self._watts[0]):
                raise ConfigError(
                    f"power sampler returned {len(watts)} devices, earlier {len(self._watts[0])}"
                )
            self._times.append(now)
            self._watts.append(watts)

    def _run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            try:
                self._take_sample()
            except BaseException as error:  # reported by stop()
                self._thread_error = error
                return

    def start(self) -> NvmlPowerMeter:
        """Open NVML (unless a sampler was given), take the first sample and start sampling."""
        if self._thread is not None:
            raise ConfigError("NvmlPowerMeter.start() called twice: stop() the running window first")
        if self._reads_nvml:
            self._open_nvml()
        self._times, self._watts, self._thread_error = [], [], None
        self.measurement = None
        self._stop_event.clear()
        try:
            self._take_sample()
            if self._device_names is not None and len(self._device_names) != len(self._watts[0]):
                raise ConfigError(
                    f"device_names={self._device_names!r} name {len(self._device_names)} devices, "
                    f"the sampler gave {len(self._watts[0])} powers"
                )
        except BaseException:
            self._close_nvml()
            raise
        self._thread = threading.Thread(target=self._run, name="jphantom-power-meter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> PowerMeasurement:
        """Take the last sample, stop sampling and return the integrated energy of the window."""
        if self._thread is None:
            raise ConfigError("NvmlPowerMeter.stop() without start()")
        self._stop_event.set()
        self._thread.join()
        self._thread = None
        try:
            if self._thread_error is not None:
                raise RuntimeError(f"power sampler failed: {self._thread_error}") from self._thread_error
            self._take_sample()
        finally:
            self._close_nvml()
        devices = range(len(self._watts[0]))
        per_device = tuple(integrate_trapezoid(self._times, [w[d] for w in self._watts]) for d in devices)
        self.measurement = PowerMeasurement(
            joules=sum(per_device),
            joules_per_device=per_device,
            device_names=self._device_names or tuple(f"device{d}" for d in devices),
            seconds=self._times[-1] - self._times[0],
            samples=len(self._times),
        )
        return self.measurement

    def __enter__(self) -> NvmlPowerMeter:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _decode(name: str | bytes) -> str:
    """nvmlDeviceGetName returns bytes in older nvidia-ml-py, str in newer."""
    return name.decode() if isinstance(name, bytes) else name
