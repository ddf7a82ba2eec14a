"""GPU energy by power sampling: NVML's power read at a fixed interval in a background thread
and integrated (trapezoid rule) over a window (:class:`NvmlPowerMeter`), what a meter saw
(:class:`PowerMeasurement`), and the NVML helpers the meters share (is NVML there, a GPU's energy
counter, its name)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from jphantom.errors import ConfigError, check_real

METHODS = ("counter", "sampling", "mixed")  # how a PowerMeasurement's joules were obtained
INSTALL_HINT = "nvidia-ml-py (pynvml) is not installed: pip install 'jphantom[gpu]'"


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
    """What a meter saw between ``start()`` and ``stop()``.

    ``joules`` is the total over every metered GPU of every process (a single process: the sum of
    ``joules_per_device``); ``joules_per_device``, ``device_names`` and ``device_methods`` describe
    this process's GPUs only. ``method`` is ``"counter"`` (NVML's energy counter on every GPU),
    ``"sampling"`` (integrated power samples on every GPU) or ``"mixed"``, over all processes.
    ``samples`` counts this process's power samples (2 for a counter-only window: its two reads).
    """

    joules: float
    joules_per_device: tuple[float, ...]
    device_names: tuple[str, ...]
    seconds: float
    samples: int
    method: str = "sampling"
    processes: int = 1  # processes whose GPUs ``joules`` sums
    device_methods: tuple[str, ...] = ()  # per local GPU: "counter" or "sampling"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"PowerMeasurement.method={self.method!r} must be one of {METHODS}")

    @property
    def mean_watts(self) -> float:
        return self.joules / self.seconds if self.seconds > 0 else 0.0


class NvmlPowerMeter:
    """Integrated GPU energy over a window: samples power at a fixed interval, integrates (trapezoid).

    With no ``sampler`` it reads ``nvmlDeviceGetPowerUsage`` (milliwatts) of every NVIDIA GPU, or of
    ``device_indices`` (NVML's indices, which are PCI-bus order and need not be jax's device ids),
    through nvidia-ml-py (``pynvml``, imported only when needed). ``sampler`` may instead be any
    callable returning one power in watts per device, or one number for one device (tests, the
    fallback of ``NvmlEnergyMeter``); ``clock`` gives the sample times in seconds. Prefer
    ``NvmlEnergyMeter`` on real GPUs: it reads the energy counter and maps devices by PCI bus id.

        meter = NvmlPowerMeter(interval_s=0.05)
        with meter:
            train()
        meter.measurement.joules

    A sample is taken at ``start()`` and at ``stop()``, so the integral spans exactly the window, and
    every ``interval_s`` in between. Only GPU power is counted, as in Seal et al.'s measurement: no CPU,
    memory or network. Recent drivers report power averaged over the last second, so the integral
    lags the window by up to a second; keep windows long next to that. The result's ``method`` is
    ``"sampling"``.
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
        self.interval_s = check_real("interval_s", interval_s, low_inclusive=False)
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
            return False, INSTALL_HINT
        return nvml_status(pynvml)

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
            f"{i}:{decode_name(pynvml.nvmlDeviceGetName(handle))}" for i, handle in zip(indices, handles)
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
            method="sampling",
            device_methods=("sampling",) * len(per_device),
        )
        return self.measurement

    def __enter__(self) -> NvmlPowerMeter:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def nvml_status(nvml, probe_counter: bool = False) -> tuple[bool, str]:
    """(True, which GPUs) when ``nvml`` (the pynvml module or a stand-in) starts and lists at least
    one GPU, else (False, why); with ``probe_counter`` the answer says how many GPUs have the energy
    counter. Never raises; leaves NVML shut down."""
    try:
        nvml.nvmlInit()
    except Exception as error:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return False, f"NVML could not start (no NVIDIA driver or GPU?): {error}"
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            return False, "NVML found no NVIDIA GPU"
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        names = [decode_name(nvml.nvmlDeviceGetName(handle)) for handle in handles]
        reason = f"{count} GPU(s): {', '.join(names)}"
        if probe_counter:
            with_counter = sum(read_counter(nvml, handle)[0] is not None for handle in handles)
            reason += f"; energy counter on {with_counter} of {count} (power sampling on the rest)"
        return True, reason
    except Exception as error:
        return False, f"NVML could not list GPUs: {error}"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def read_counter(nvml, handle) -> tuple[float | None, str]:
    """(millijoules since the driver loaded, "") from NVML's energy counter, or (None, why not)."""
    read = getattr(nvml, "nvmlDeviceGetTotalEnergyConsumption", None)
    if read is None:
        return None, "this nvidia-ml-py has no nvmlDeviceGetTotalEnergyConsumption"
    try:
        return float(read(handle)), ""
    except getattr(nvml, "NVMLError", Exception) as error:  # NVMLError_NotSupported before Volta
        return None, f"{type(error).__name__}: {error}"


def decode_name(name: str | bytes) -> str:
    """nvmlDeviceGetName returns bytes in older nvidia-ml-py, str in newer."""
    return name.decode() if isinstance(name, bytes) else name
