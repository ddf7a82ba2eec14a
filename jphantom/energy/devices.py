"""Which GPUs a meter reads: a jax device's PCI bus id (through the CUDA driver), NVML's and
CUDA's bus ids normalised to match, this process's share of a mesh's devices, and the sum of every
process's reading (each meters only its own GPUs, so none is counted twice)."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Sequence

import jax
import numpy as np

from jphantom.energy.sampling import decode_name
from jphantom.errors import ConfigError


_BUS_ID = re.compile(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])")


def normalise_pci_bus_id(bus_id: str | bytes) -> str:
    """``bus_id`` as ``dddd:bb:dd.f`` in lower case: NVML's ``'00000000:3B:00.0'``, CUDA's
    ``'0000:3B:00.0'`` and sysfs' ``'0000:3b:00.0'`` all become ``'0000:3b:00.0'``."""
    text = decode_name(bus_id).strip().strip("\x00").lower() if isinstance(bus_id, (str, bytes)) else ""
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
