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
- ``AmdsmiEnergyMeter`` is the same for AMD GPUs: amdsmi's energy counter
  (``amdsmi_get_energy_count``, accumulator x resolution in µJ), each MI250X package counted once,
  and a counter that sticks or steps backwards reported, not recorded (:mod:`~jphantom.energy.amd`).
- ``NvmlPowerMeter`` samples ``nvmlDeviceGetPowerUsage`` in a background thread and integrates it
  (trapezoid rule). It is the fallback above, and the meter for injected samplers (tests).

The modules: :mod:`~jphantom.energy.model` (Eqs. 1-2), :mod:`~jphantom.energy.sampling`
(``NvmlPowerMeter``, ``PowerMeasurement``, the NVML helpers), :mod:`~jphantom.energy.counter`
(``NvmlEnergyMeter``) and :mod:`~jphantom.energy.devices` (PCI bus ids, this process's devices,
the sum over processes).
"""

from jphantom.energy.amd import AmdsmiEnergyMeter, amdsmi_microjoules
from jphantom.energy.counter import NvmlEnergyMeter
from jphantom.energy.devices import (cuda_pci_bus_id, gather_across_processes,
                                     normalise_pci_bus_id, process_devices, sum_across_processes)
from jphantom.energy.model import (SOURCES, EnergyEstimate, PowerModel, energy_per_iteration,
                                   energy_to_target, estimate_energy, measured_energy)
from jphantom.energy.sampling import (INSTALL_HINT, METHODS, NvmlPowerMeter, PowerMeasurement,
                                      integrate_trapezoid)

__all__ = ["AmdsmiEnergyMeter", "INSTALL_HINT", "METHODS", "SOURCES", "EnergyEstimate",
           "NvmlEnergyMeter", "NvmlPowerMeter", "PowerMeasurement", "PowerModel",
           "amdsmi_microjoules", "cuda_pci_bus_id", "energy_per_iteration", "energy_to_target",
           "estimate_energy", "gather_across_processes", "integrate_trapezoid", "measured_energy",
           "normalise_pci_bus_id", "process_devices", "sum_across_processes"]
