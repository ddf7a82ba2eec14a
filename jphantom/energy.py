"""Energy of training: Seal et al.'s model (Eqs. 1-2) and GPU energy meters like its measurement.

    (1)  e = A · α + B · β        joules per iteration
    (2)  E_λ = ν_λ · e            joules to reach loss λ in ν_λ iterations

A is the dynamic power of a busy (computing) GPU and B its static power while it waits on
communication, A > B; on Frontier's MI250X the paper takes A ≈ 560 W and B ≈ 90 W. α and β are the
seconds one iteration (forward + backward) spends computing and communicating.

``PowerModel`` holds A and B, ``energy_per_iteration`` is Eq. 1 summed over devices,
``energy_to_target`` is Eq. 2, and ``EnergyEstimate`` records either a modelled or a measured result.
Where NVIDIA GPUs are present, a meter measures instead (Seal et al. measured with ROCm-SMI; digest of
Seal et al., Sec. 4.5). Only GPU energy is counted, as in the paper: no CPU, memory or network.

- ``NvmlEnergyMeter`` (what ``jphantom compare --energy auto`` uses) reads NVML's cumulative energy
  counter (``nvmlDeviceGetTotalEnergyConsumption``, millijoules, Volta and newer) of each of this
  process's GPUs at the two ends of the window and takes the difference; a GPU without the counter
  falls back to power sampling, and the result's ``method`` says which ("counter", "sampling" or
  "mixed"). jax devices are matched to NVML handles by PCI bus id (``cuda_pci_bus_id``), never by
  index, and with several processes each meters only its own GPUs before the totals are summed
  (``gather_across_processes``), so no GPU is counted twice.
- ``NvmlPowerMeter`` samples ``nvmlDeviceGetPowerUsage`` in a background thread and integrates it
  (trapezoid rule). It is the fallback above, and the meter for injected samplers (tests).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jphantom.errors import ConfigError, check_real

SOURCES = ("measured", "modelled")
METHODS = ("counter", "sampling", "mixed")  # how a PowerMeasurement's joules were obtained
INSTALL_HINT = "nvidia-ml-py (pynvml) is not installed: pip install 'jphantom[gpu]'"


@dataclasses.dataclass(frozen=True)
class PowerModel:
    """Per-device power of Eq. 1: A = ``busy_watts`` computing, B = ``idle_watts`` communicating.

    Defaults are Seal et al.'s Frontier values (Sec. II-A): A ≈ 560 W, B ≈ 90 W per MI250X GCD.
    """

    busy_watts: float = 560.0
    idle_watts: float = 90.0
    name: str = "frontier-mi250x"

    def __post_init__(self):
        busy = check_real("PowerModel.busy_watts", self.busy_watts, low_inclusive=False)
        idle = check_real("PowerModel.idle_watts", self.idle_watts, low_inclusive=False)
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
    alpha = check_real("alpha_s", alpha_s)
    beta = check_real("beta_s", beta_s)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"devices={devices!r} must be a whole number >= 1 (the GPUs Eq. 1 sums over)")
    if not isinstance(power, PowerModel):
        raise ConfigError(f"power={power!r} must be a PowerModel")
    return devices * (power.busy_watts * alpha + power.idle_watts * beta)


def energy_to_target(per_iteration_j: float, iterations: float) -> float:
    """Eq. 2, joules to reach the target loss: E_λ = ν_λ · e (``iterations`` ν_λ, often epochs)."""
    return check_real("per_iteration_j", per_iteration_j) * check_real("iterations", iterations)


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
                object.__setattr__(self, name, check_real(f"EnergyEstimate.{name}", getattr(self, name)))
        for name in ("joules_per_iteration", "iterations", "total_joules"):
            object.__setattr__(self, name, check_real(f"EnergyEstimate.{name}", getattr(self, name)))
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
    total = check_real("total_joules", total_joules)
    count = check_real("iterations", iterations, low_inclusive=False)
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
        return _nvml_status(pynvml)

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
            method="sampling",
            device_methods=("sampling",) * len(per_device),
        )
        return self.measurement

    def __enter__(self) -> NvmlPowerMeter:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _nvml_status(nvml, probe_counter: bool = False) -> tuple[bool, str]:
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
        names = [_decode(nvml.nvmlDeviceGetName(handle)) for handle in handles]
        reason = f"{count} GPU(s): {', '.join(names)}"
        if probe_counter:
            with_counter = sum(_read_counter(nvml, handle)[0] is not None for handle in handles)
            reason += f"; energy counter on {with_counter} of {count} (power sampling on the rest)"
        return True, reason
    except Exception as error:
        return False, f"NVML could not list GPUs: {error}"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _read_counter(nvml, handle) -> tuple[float | None, str]:
    """(millijoules since the driver loaded, "") from NVML's energy counter, or (None, why not)."""
    read = getattr(nvml, "nvmlDeviceGetTotalEnergyConsumption", None)
    if read is None:
        return None, "this nvidia-ml-py has no nvmlDeviceGetTotalEnergyConsumption"
    try:
        return float(read(handle)), ""
    except getattr(nvml, "NVMLError", Exception) as error:  # NVMLError_NotSupported before Volta
        return None, f"{type(error).__name__}: {error}"


_BUS_ID = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])")


def normalise_pci_bus_id(bus_id: str | bytes) -> str:
    """``bus_id`` as ``dddd:bb:dd.f`` in lower case: NVML's ``'00000000:3B:00.0'``, CUDA's
    ``'0000:3B:00.0'`` and sysfs' ``'0000:3b:00.0'`` all become ``'0000:3b:00.0'``."""
    text = _decode(bus_id).strip().strip("\x00").lower() if isinstance(bus_id, (str, bytes)) else ""
    match = _BUS_ID.fullmatch(text)
    if match is None:
        raise ConfigError(f"PCI bus id {bus_id!r} is not domain:bus:device.function "
                          "(e.g. '0000:3b:00.0'): pass a bus id as NVML or CUDA prints it")
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def _load_libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        raise ConfigError(
            f"the CUDA driver library libcuda.so.1 cannot be loaded ({error}), so a jax device cannot "
            "be matched to its NVML handle by PCI bus id. Fix: run on an NVIDIA GPU with its driver, "
            "pass bus_id_of=..., or model the energy with estimate_energy (Eq. 1)") from None


def cuda_pci_bus_id(device, *, libcuda=None) -> str:
    """The PCI bus id (normalised, ``'0000:3b:00.0'``) of the GPU behind the jax ``device``.

    jax 0.10's CUDA devices do not carry a bus id (their attributes are the vendor, compute
    capability, core count, slice and NUMA node), but ``device.local_hardware_id`` is the CUDA
    device ordinal in this process, the one DLPack uses. The CUDA driver (``libcuda``, loaded with
    ctypes) turns that ordinal into a bus id with ``cuDeviceGetPCIBusId``, applying this process's
    own CUDA_VISIBLE_DEVICES (indices, UUIDs) and CUDA_DEVICE_ORDER exactly as it did for jax, so
    the answer is the GPU jax runs on; parsing CUDA_VISIBLE_DEVICES instead would misplace GPUs
    under CUDA's default fastest-first order or with UUIDs. A ``pci_bus_id`` attribute on the
    device, should a jax version provide one, is used as it is.
    """
    given = getattr(device, "pci_bus_id", None)
    if given:
        return normalise_pci_bus_id(given)
    ordinal = getattr(device, "local_hardware_id", None)
    if ordinal is None:
        raise ConfigError(f"jax device {device} has no local_hardware_id (CUDA ordinal), so its PCI "
                          "bus id is unknown: pass bus_id_of=... to the meter")
    libcuda = _load_libcuda() if libcuda is None else libcuda
    handle = ctypes.c_int()
    buffer = ctypes.create_string_buffer(64)
    calls = (("cuInit", (0,)), ("cuDeviceGet", (ctypes.pointer(handle), int(ordinal))),
             ("cuDeviceGetPCIBusId", (buffer, len(buffer), handle)))
    for name, args in calls:
        status = getattr(libcuda, name)(*args)
        if status != 0:
            raise ConfigError(f"{name} returned CUDA error {status} for jax device {device} "
                              f"(CUDA ordinal {ordinal}): is the NVIDIA driver working?")
    return normalise_pci_bus_id(buffer.value)


def process_devices(count: int | None = None) -> list:
    """This process's devices among the first ``count`` of ``jax.devices()`` (all when None).

    A mesh over ``jax.devices()[:count]`` may span several processes; each meters the part it
    addresses, and :func:`gather_across_processes` adds the parts up."""
    pool = jax.devices() if count is None else jax.devices()[:count]
    return [device for device in pool if device.process_index == jax.process_index()]


def gather_across_processes(values: Sequence[float], gather: Callable | None = None) -> np.ndarray:
    """[P, k]: row i is process i's ``values`` (k numbers; every process must call this, in step).

    ``gather`` maps this process's [k] vector to the stacked [P, k] (tests pass a fake). By default a
    single process returns its own row, and several use
    ``jax.experimental.multihost_utils.process_allgather`` of the values as float32 (jax without
    x64 would cast them anyway; a relative rounding of 6e-8, far below any meter's accuracy)."""
    local = np.asarray(values, dtype=np.float64).reshape(-1)
    if gather is not None:
        rows = gather(local)
    elif jax.process_count() == 1:
        rows = local[None]
    else:
        from jax.experimental import multihost_utils

        rows = multihost_utils.process_allgather(local.astype(np.float32))
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != local.size or rows.shape[0] < 1:
        raise ConfigError(f"gather returned shape {rows.shape} for {local.size} values: it must stack "
                          f"one row per process, shape (processes, {local.size}), as process_allgather")
    return rows


def sum_across_processes(joules: float, gather: Callable | None = None) -> float:
    """Total of every process's ``joules`` (identity with one process); see gather_across_processes.

    Each process meters only its own GPUs, so the sum counts every GPU once."""
    return float(gather_across_processes([joules], gather)[:, 0].sum())


class NvmlEnergyMeter:
    """Energy of this process's NVIDIA GPUs over a window, from NVML's energy counter where it exists.

        meter = NvmlEnergyMeter()            # devices: jax.local_devices(), this process's GPUs
        jax.block_until_ready(state)
        meter.start()
        state = train(state)
        jax.block_until_ready(state)
        meter.stop().joules                  # summed over every process's GPUs

    ``start()`` opens NVML, lists its GPUs by PCI bus id (``nvmlDeviceGetPciInfo``) and pairs each
    jax device with the GPU on the same bus (``bus_id_of``, default :func:`cuda_pci_bus_id`), never
    by index: NVML numbers GPUs in PCI order and ignores CUDA_VISIBLE_DEVICES, jax does neither. It
    then reads ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules since the driver loaded, Volta
    and newer); ``stop()`` reads it again and the window's energy is the difference. The caller
    brackets the window with ``jax.block_until_ready``, so both reads see finished work. A GPU whose
    counter is missing (older GPU or nvidia-ml-py) or raises an NVMLError falls back to sampling its
    power every ``interval_s`` (:class:`NvmlPowerMeter`); the result's ``method`` is ``"counter"``,
    ``"sampling"`` or ``"mixed"`` and ``device_methods`` says which GPU used which.

    With several processes each meters only its own GPUs (``devices`` must be addressable by this
    process) and ``stop()`` sums the processes' totals with ``gather`` (default
    ``process_allgather``, a collective: every process must call ``stop()``), so every GPU is counted
    exactly once, unless processes share one GPU (MIG slices, several processes on one board): the
    counter is the whole board's. ``nvml`` is the pynvml module (default: imported at ``start()``;
    nvidia-ml-py is the optional extra ``jphantom[gpu]``) or a stand-in. Only GPU energy is counted.
    """

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        interval_s: float = 0.05,
        *,
        nvml: Any = None,
        bus_id_of: Callable[[Any], str | bytes] | None = None,
        gather: Callable[[np.ndarray], np.ndarray] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.interval_s = check_real("interval_s", interval_s, low_inclusive=False)
        self.devices = None if devices is None else tuple(devices)  # None: jax.local_devices()
        self._nvml_given = nvml
        self._bus_id_of = cuda_pci_bus_id if bus_id_of is None else bus_id_of
        self._gather = gather
        self._clock = clock
        self._running = False
        self._nvml = None  # the NVML module while this meter holds it open
        self._sampler: NvmlPowerMeter | None = None
        self.measurement: PowerMeasurement | None = None

    @staticmethod
    def available(nvml: Any = None) -> tuple[bool, str]:
        """(True, which GPUs, how many have the energy counter) when NVML works, else (False, why).
        ``nvml``: the module to ask (default pynvml). Never raises."""
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                return False, INSTALL_HINT
        return _nvml_status(nvml, probe_counter=True)

    def _module(self):
        if self._nvml_given is not None:
            return self._nvml_given
        try:
            import pynvml
        except ImportError:
            raise ConfigError(f"NvmlEnergyMeter cannot measure: {INSTALL_HINT}. Fix: install it, or "
                              "model the energy with jphantom.energy.estimate_energy (Eq. 1)") from None
        return pynvml

    def _check_devices(self, devices: tuple) -> None:
        me = jax.process_index()
        for device in devices:
            if device.platform not in ("gpu", "cuda"):
                raise ConfigError(f"device {device} is a {device.platform!r} device, not an NVIDIA GPU: "
                                  "NvmlEnergyMeter reads NVML; model the energy with estimate_energy")
            if device.process_index != me:
                raise ConfigError(
                    f"device {device} belongs to process {device.process_index}, not to this one ({me}): "
                    "each process meters only its own GPUs (jphantom.energy.process_devices), and "
                    "stop() sums the processes")
        ids = [device.id for device in devices]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"devices={ids!r} lists a device twice: it would be metered twice")

    def _handles(self, nvml, devices: tuple) -> tuple[list, list[str]]:
        """(NVML handle, normalised PCI bus id) of each jax device, matched by bus id."""
        by_bus = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                by_bus[normalise_pci_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)] = handle
            except getattr(nvml, "NVMLError", Exception):  # a GPU NVML lists but may not open
                continue
        handles, buses, owner = [], [], {}
        for device in devices:
            bus = normalise_pci_bus_id(self._bus_id_of(device))
            if bus in owner:
                raise ConfigError(f"jax devices {owner[bus]} and {device} are both on PCI bus {bus} "
                                  "(MIG slices of one GPU?): its energy counter is the whole GPU's; "
                                  "meter one of them")
            if bus not in by_bus:
                raise ConfigError(f"jax device {device} is on PCI bus {bus} but NVML lists "
                                  f"{sorted(by_bus)}: jax and NVML must see the same GPUs")
            owner[bus] = device
            handles.append(by_bus[bus])
            buses.append(bus)
        return handles, buses

    def start(self) -> NvmlEnergyMeter:
        """Map this process's devices to NVML, read their energy counters, start sampling the rest."""
        if self._running:
            raise ConfigError("NvmlEnergyMeter.start() called twice: stop() the running window first")
        devices = tuple(jax.local_devices()) if self.devices is None else self.devices
        self._check_devices(devices)
        self.measurement = None
        self._names, self._counter_slots, self._sampled_slots = [], [], []
        self._counter_start, self._counter_handles, self._fallback = [], [], {}
        self._sampler = None
        if devices:
            nvml = self._module()
            try:
                nvml.nvmlInit()
            except Exception as error:
                raise ConfigError(f"NvmlEnergyMeter cannot measure: NVML could not start ({error}). "
                                  "Fix: run on an NVIDIA GPU, or model the energy with "
                                  "estimate_energy (Eq. 1)") from error
            self._nvml = nvml
            try:
                self._open(nvml, devices)
            except BaseException:
                self._close()
                raise
        self._t0 = self._clock()
        self._running = True
        return self

    def _open(self, nvml, devices: tuple) -> None:
        handles, buses = self._handles(nvml, devices)
        for slot, (device, handle, bus) in enumerate(zip(devices, handles, buses)):
            self._names.append(f"{device.id}:{_decode(nvml.nvmlDeviceGetName(handle))}@{bus}")
            millijoules, why_not = _read_counter(nvml, handle)
            if millijoules is None:
                self._sampled_slots.append(slot)
                self._fallback[slot] = why_not
            else:
                self._counter_slots.append(slot)
                self._counter_handles.append(handle)
                self._counter_start.append(millijoules)
        if self._sampled_slots:
            sampled = [handles[slot] for slot in self._sampled_slots]
            self._sampler = NvmlPowerMeter(
                interval_s=self.interval_s,
                sampler=lambda: [nvml.nvmlDeviceGetPowerUsage(h) / 1000.0 for h in sampled],  # mW -> W
                device_names=[self._names[slot] for slot in self._sampled_slots],
                clock=self._clock,
            ).start()

    def _close(self) -> None:
        if self._nvml is not None:
            nvml, self._nvml = self._nvml, None
            nvml.nvmlShutdown()

    def stop(self) -> PowerMeasurement:
        """Read the counters again, stop sampling, and return the energy summed over all processes."""
        if not self._running:
            raise ConfigError("NvmlEnergyMeter.stop() without start()")
        self._running = False
        sampled = None
        try:
            counter_end = [float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
                           for handle in self._counter_handles] if self._counter_slots else []
            t1 = self._clock()
        finally:
            try:
                if self._sampler is not None:
                    sampled = self._sampler.stop()
            finally:
                self._close()
        per_device = [0.0] * len(self._names)
        methods = [""] * len(self._names)
        for slot, begin, end in zip(self._counter_slots, self._counter_start, counter_end):
            if end < begin:
                raise RuntimeError(f"NVML energy counter of {self._names[slot]} went from {begin:g} to "
                                   f"{end:g} mJ (driver reloaded during the window?): measure again")
            per_device[slot], methods[slot] = (end - begin) / 1000.0, "counter"  # mJ -> J
        for k, slot in enumerate(self._sampled_slots):
            per_device[slot], methods[slot] = sampled.joules_per_device[k], "sampling"
        seconds = t1 - self._t0 if self._counter_slots or sampled is None else sampled.seconds
        local = [sum(per_device), len(self._counter_slots), len(self._sampled_slots), seconds]
        rows = gather_across_processes(local, self._gather)  # [processes, 4]
        counters, samplings = rows[:, 1].sum(), rows[:, 2].sum()
        if counters + samplings == 0:
            raise ConfigError("NvmlEnergyMeter metered no GPU in any process: pass devices=... "
                              "(e.g. jphantom.energy.process_devices(p)) that include GPUs")
        method = "counter" if samplings == 0 else "sampling" if counters == 0 else "mixed"
        self.measurement = PowerMeasurement(
            joules=float(rows[:, 0].sum()),
            joules_per_device=tuple(per_device),
            device_names=tuple(self._names),
            seconds=float(rows[:, 3].max()),
            samples=sampled.samples if sampled is not None else 2 * bool(self._counter_slots),
            method=method,
            processes=int(rows.shape[0]),
            device_methods=tuple(methods),
        )
        return self.measurement

    def read(self) -> float | None:
        """Joules of this process's GPUs since ``start()``, read from their energy counters now
        (the window stays open): the difference of two reads, each after
        ``jax.block_until_ready``, is the energy between them (a training step's). ``None`` when
        some GPU has no counter (it is being sampled). No collective: this process only."""
        if not self._running:
            raise ConfigError("NvmlEnergyMeter.read() without start()")
        if self._sampled_slots:
            return None
        now = [float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
               for handle in self._counter_handles]
        return sum(end - begin for end, begin in zip(now, self._counter_start)) / 1000.0  # mJ

    @property
    def fallback_reasons(self) -> dict[str, str]:
        """Why each sampled GPU of the last window has no counter reading (device name -> reason)."""
        return {self._names[slot]: why for slot, why in getattr(self, "_fallback", {}).items()}

    def __enter__(self) -> NvmlEnergyMeter:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _decode(name: str | bytes) -> str:
    """nvmlDeviceGetName returns bytes in older nvidia-ml-py, str in newer."""
    return name.decode() if isinstance(name, bytes) else name
