"""GPU energy from NVML's energy counter: :class:`NvmlEnergyMeter` reads each of this process's
GPUs (matched to its jax device by PCI bus id) at the two ends of a window, samples the power of a
GPU without the counter, and sums the processes."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jphantom.energy.devices import (cuda_pci_bus_id, gather_across_processes,
                                     normalise_pci_bus_id)
from jphantom.energy.sampling import (INSTALL_HINT, NvmlPowerMeter, PowerMeasurement, decode_name,
                                      nvml_status, read_counter)
from jphantom.errors import ConfigError, check_real


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
        return nvml_status(nvml, probe_counter=True)

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
            self._names.append(f"{device.id}:{decode_name(nvml.nvmlDeviceGetName(handle))}@{bus}")
            millijoules, why_not = read_counter(nvml, handle)
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
