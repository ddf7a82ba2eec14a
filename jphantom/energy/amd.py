"""GPU energy from amdsmi's energy counter on AMD Instinct GPUs: :class:`AmdsmiEnergyMeter`, the
counterpart of :class:`~jphantom.energy.NvmlEnergyMeter`, and :func:`amdsmi_microjoules`, one
reading. Untested on AMD hardware: every test feeds it recorded readings."""

from __future__ import annotations

import ctypes
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jphantom.energy.devices import gather_across_processes, normalise_pci_bus_id
from jphantom.energy.sampling import PowerMeasurement
from jphantom.errors import ConfigError, check_real

AMDSMI_INSTALL_HINT = ("amdsmi (AMD SMI's Python library) is not installed: it ships with ROCm, "
                       "pip install /opt/rocm/share/amd_smi")
_ACCUMULATORS = ("energy_accumulator", "power")  # the field's name from ROCm 6.4, and before it


def amdsmi_microjoules(amdsmi, handle) -> tuple[float | None, str]:
    """(µJ since the driver loaded, "") from ``amdsmi_get_energy_count``: the accumulator
    (``energy_accumulator`` from ROCm 6.4, ``power`` before) times ``counter_resolution`` (µJ per
    count); (None, why) where the GPU does not report it. A reading of 0 is returned as 0.0: the
    silent GCD of an MI250X package reads 0 or is not supported (:class:`AmdsmiEnergyMeter`)."""
    read = getattr(amdsmi, "amdsmi_get_energy_count", None)
    if read is None:
        return None, "this amdsmi has no amdsmi_get_energy_count"
    try:
        count = read(handle)
    except Exception as error:  # AmdSmiLibraryException: not supported on this GCD
        return None, f"amdsmi_get_energy_count failed: {error}"
    found = [count[name] for name in _ACCUMULATORS if isinstance(count, dict) and name in count]
    resolution = count.get("counter_resolution") if isinstance(count, dict) else None
    if not found or not isinstance(found[0], (int, float)) or not isinstance(resolution, (int, float)):
        return None, f"amdsmi_get_energy_count gave no accumulator and resolution: {count!r}"
    return float(found[0]) * float(resolution), ""


def hip_pci_bus_id(device, *, libhip=None) -> str:
    """The PCI bus id of the GPU behind a jax ROCm ``device``: HIP's ``hipDeviceGetPCIBusId`` of
    its ordinal (``local_hardware_id``), which applies HIP_VISIBLE_DEVICES as jax did."""
    given = getattr(device, "pci_bus_id", None)
    if given:
        return normalise_pci_bus_id(given)
    ordinal = getattr(device, "local_hardware_id", None)
    if ordinal is None:
        raise ConfigError(f"jax device {device} has no local_hardware_id: pass bus_id_of=...")
    if libhip is None:
        try:
            libhip = ctypes.CDLL("libamdhip64.so")
        except OSError as error:
            raise ConfigError(f"libamdhip64.so cannot be loaded ({error}): pass bus_id_of=...") from None
    buffer = ctypes.create_string_buffer(64)
    status = libhip.hipDeviceGetPCIBusId(buffer, len(buffer), int(ordinal))
    if status != 0:
        raise ConfigError(f"hipDeviceGetPCIBusId returned HIP error {status} for jax device {device}")
    return normalise_pci_bus_id(buffer.value)


class AmdsmiEnergyMeter:
    """Energy of this process's AMD GPUs over a window, from amdsmi's energy counter.

    The same shape as :class:`~jphantom.energy.NvmlEnergyMeter`: ``start()``, ``read()`` (joules
    since ``start()``, or None), ``stop()`` (a :class:`~jphantom.energy.PowerMeasurement` summed
    over processes), ``available()``. jax devices are matched to amdsmi's GPUs by PCI bus id
    (``amdsmi_get_gpu_device_bdf``; ``bus_id_of``, default :func:`hip_pci_bus_id`). The counter is
    µJ = accumulator x ``counter_resolution`` (:func:`amdsmi_microjoules`).

    Quirks handled:

    - MI250X: of the two GCDs of a package only one reports, for both dies; the other reads 0 or
      is not supported. Such a silent GCD adds nothing (its die is in its sibling's reading) when
      another metered GCD reports, so each package is counted once. Where no GCD of this process
      reports, ``start()`` refuses: there is nothing of this process's to read.
    - Counters that stick or step backwards: a reading below the previous one, or one unchanged
      after ``stuck_after_s`` seconds (a powered GPU always draws energy), marks the meter
      ``unreliable`` (the reason), warns once, and from then on ``read()`` returns None and
      ``stop()`` raises rather than return a wrong number.

    ``amdsmi`` is the module (default: imported at ``start()``) or a stand-in.
    """

    source = "amdsmi"

    def __init__(self, devices: Sequence[Any] | None = None, *, amdsmi: Any = None,
                 bus_id_of: Callable[[Any], str | bytes] | None = None,
                 gather: Callable[[np.ndarray], np.ndarray] | None = None,
                 clock: Callable[[], float] = time.perf_counter, stuck_after_s: float = 0.05):
        self.devices = None if devices is None else tuple(devices)
        self._amdsmi_given = amdsmi
        self._bus_id_of = hip_pci_bus_id if bus_id_of is None else bus_id_of
        self._gather = gather
        self._clock = clock
        self.stuck_after_s = check_real("stuck_after_s", stuck_after_s, low_inclusive=False)
        self._running = False
        self._amdsmi = None
        self.unreliable: str | None = None
        self.measurement: PowerMeasurement | None = None

    @staticmethod
    def available(amdsmi: Any = None) -> tuple[bool, str]:
        """(True, how many GPUs report energy) when amdsmi works, else (False, why). Never raises."""
        if amdsmi is None:
            try:
                import amdsmi
            except ImportError:
                return False, AMDSMI_INSTALL_HINT
        try:
            amdsmi.amdsmi_init()
        except Exception as error:
            return False, f"amdsmi could not start: {error}"
        try:
            handles = list(amdsmi.amdsmi_get_processor_handles())
            reporting = sum(bool(amdsmi_microjoules(amdsmi, h)[0]) for h in handles)
        except Exception as error:
            return False, f"amdsmi could not list GPUs: {error}"
        finally:
            amdsmi.amdsmi_shut_down()
        if not reporting:
            return False, f"none of amdsmi's {len(handles)} GPUs reports an energy counter"
        return True, f"{len(handles)} AMD GPU(s), {reporting} reporting energy"

    def _module(self):
        if self._amdsmi_given is not None:
            return self._amdsmi_given
        try:
            import amdsmi
        except ImportError:
            raise ConfigError(f"AmdsmiEnergyMeter cannot measure: {AMDSMI_INSTALL_HINT}") from None
        return amdsmi

    def _handles(self, amdsmi, devices: tuple) -> list:
        by_bus = {normalise_pci_bus_id(amdsmi.amdsmi_get_gpu_device_bdf(h)): h
                  for h in amdsmi.amdsmi_get_processor_handles()}
        handles = []
        for device in devices:
            if getattr(device, "process_index", 0) != jax.process_index():
                raise ConfigError(f"device {device} belongs to another process: each process "
                                  "meters only its own GPUs")
            bus = normalise_pci_bus_id(self._bus_id_of(device))
            if bus not in by_bus:
                raise ConfigError(f"jax device {device} is on PCI bus {bus} but amdsmi lists "
                                  f"{sorted(by_bus)}: jax and amdsmi must see the same GPUs")
            handles.append(by_bus[bus])
        return handles

    def start(self) -> AmdsmiEnergyMeter:
        """Map this process's devices to amdsmi and read their counters (µJ)."""
        if self._running:
            raise ConfigError("AmdsmiEnergyMeter.start() called twice: stop() the window first")
        devices = tuple(jax.local_devices()) if self.devices is None else self.devices
        amdsmi = self._module()
        amdsmi.amdsmi_init()
        self._amdsmi = amdsmi
        try:
            handles = self._handles(amdsmi, devices)
            readings = [amdsmi_microjoules(amdsmi, h) for h in handles]
        except BaseException:
            self._close()
            raise
        self.names = [f"{d.id}:amdsmi" for d in devices]
        self.silent = [not uj for uj, _ in readings]  # 0 or not supported: a sibling reports
        if all(self.silent):
            self._close()
            raise ConfigError("no GPU of this process reports amdsmi energy (on MI250X only one "
                              "GCD of a package does): meter a reporting GCD, or model the energy")
        self._handles_reporting = [h for h, quiet in zip(handles, self.silent) if not quiet]
        self._start_uj = [uj for uj, _ in readings if uj]
        self._t0, self.unreliable, self.measurement = self._clock(), None, None
        self._last_uj, self._last_t = list(self._start_uj), [self._t0] * len(self._start_uj)
        self._running = True
        return self

    def _close(self) -> None:
        if self._amdsmi is not None:
            amdsmi, self._amdsmi = self._amdsmi, None
            amdsmi.amdsmi_shut_down()

    def _read_uj(self) -> list[float] | None:
        """The reporting GPUs' µJ now, or None once a counter stuck or stepped backwards."""
        now_t = self._clock()
        now = [amdsmi_microjoules(self._amdsmi, h)[0] for h in self._handles_reporting]
        if self.unreliable is None:
            for k, (before, after) in enumerate(zip(self._last_uj, now)):
                if after is None or after < before:
                    self.unreliable = f"went from {before:g} to {after} µJ (stepped backwards)"
                elif after == before and now_t - self._last_t[k] >= self.stuck_after_s:
                    self.unreliable = (f"stayed at {after:g} µJ for {now_t - self._last_t[k]:.3g} "
                                       "s (stuck)")
                elif after != before:
                    self._last_uj[k], self._last_t[k] = after, now_t
                if self.unreliable is not None:
                    self.unreliable = f"amdsmi energy counter of GPU {k} {self.unreliable}"
                    warnings.warn(f"{self.unreliable}: its energy is not recorded "
                                  "(energy_joules None)", RuntimeWarning, stacklevel=3)
                    break
        return None if self.unreliable is not None else now

    def read(self) -> float | None:
        """Joules of this process's GPUs since ``start()`` (no collective), or None once a counter
        is unreliable."""
        if not self._running:
            raise ConfigError("AmdsmiEnergyMeter.read() without start()")
        now = self._read_uj()
        return None if now is None else sum(a - b for a, b in zip(now, self._start_uj)) / 1e6

    def stop(self) -> PowerMeasurement:
        """Read again and return the window's energy summed over all processes; raises
        RuntimeError when a counter stuck or stepped backwards during the window."""
        if not self._running:
            raise ConfigError("AmdsmiEnergyMeter.stop() without start()")
        self._running = False
        try:
            now, t1 = self._read_uj(), self._clock()
        finally:
            self._close()
        if now is None:
            raise RuntimeError(f"{self.unreliable}: measure again")
        per_device, reporting = [0.0] * len(self.names), iter(zip(now, self._start_uj))
        for slot, quiet in enumerate(self.silent):
            if not quiet:
                end, begin = next(reporting)
                per_device[slot] = (end - begin) / 1e6
        rows = gather_across_processes([sum(per_device), t1 - self._t0], self._gather)
        self.measurement = PowerMeasurement(
            joules=float(rows[:, 0].sum()), joules_per_device=tuple(per_device),
            device_names=tuple(self.names), seconds=float(rows[:, 1].max()), samples=2,
            method="counter", processes=int(rows.shape[0]),
            device_methods=tuple("counter" for _ in self.names))
        return self.measurement

    def __enter__(self) -> AmdsmiEnergyMeter:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
