"""Seal et al.'s energy model (Eqs. 1-2) against Table I, the power meter's integration, and the NVML
energy meter against a fake NVML: counter preferred, PCI-bus-id mapping, fallback, per-process sums."""

import itertools
import sys
import threading
import time
import types

import numpy as np
import pytest

from jphantom.energy import (
    EnergyEstimate,
    NvmlPowerMeter,
    PowerMeasurement,
    PowerModel,
    energy_per_iteration,
    energy_to_target,
    estimate_energy,
    integrate_trapezoid,
    measured_energy,
)
from jphantom.errors import ConfigError

# Seal et al. Table I (n = 16384, L = 2, fixed MSE loss): p, k, then per model energy/epoch (J),
# epochs and total energy (J) as printed.
TABLE_I = [
    # p, k, TP J/epoch, TP epochs, TP total, PP J/epoch, PP epochs, PP total
    (8, 16, 181.2, 453, 82_084, 74.6, 157, 11_712),
    (16, 6, 333.6, 453, 151_121, 158.0, 175, 27_650),
    (32, 4, 658.4, 453, 298_255, 333.6, 267, 89_071),
    (64, 2, 1281.6, 453, 580_565, 779.2, 362, 282_070),
    (128, 2, 2611.2, 453, 1_182_874, 2131.2, 488, 1_040_026),
    (256, 4, 6873.6, 453, 3_113_741, 6950.4, 232, 1_612_493),
]
# Digest of Seal et al., Sec. 4.4: PP/TP total energy, to three decimals.
PP_OVER_TP = {8: 0.143, 16: 0.183, 32: 0.299, 64: 0.486, 128: 0.879, 256: 0.518}


@pytest.mark.parametrize("model", ["TP", "PP"])
@pytest.mark.parametrize("row", TABLE_I, ids=[f"p{row[0]}" for row in TABLE_I])
def test_eq2_reproduces_table_i_totals(row, model):
    tp_per_epoch, tp_epochs, tp_total, pp_per_epoch, pp_epochs, pp_total = row[2:]
    per_epoch, epochs, total = (
        (tp_per_epoch, tp_epochs, tp_total) if model == "TP" else (pp_per_epoch, pp_epochs, pp_total)
    )
    assert energy_to_target(per_epoch, epochs) == pytest.approx(total, abs=1.0)  # Table I rounds to 1 J


@pytest.mark.parametrize("row", TABLE_I, ids=[f"p{row[0]}" for row in TABLE_I])
def test_table_i_pp_over_tp_ratios(row):
    p, _, tp_per_epoch, tp_epochs, _, pp_per_epoch, pp_epochs, _ = row
    ratio = energy_to_target(pp_per_epoch, pp_epochs) / energy_to_target(tp_per_epoch, tp_epochs)
    assert ratio == pytest.approx(PP_OVER_TP[p], abs=5e-4)


def test_two_orders_of_magnitude_is_tp_at_256_over_phantom_at_8():
    tp_256 = energy_to_target(6873.6, 453)
    phantom_8 = energy_to_target(74.6, 157)
    assert tp_256 / phantom_8 == pytest.approx(265.9, rel=2e-3)
    assert tp_256 / phantom_8 > 100


def test_eq1_sums_busy_and_idle_power_over_devices():
    frontier = PowerModel()
    assert (frontier.busy_watts, frontier.idle_watts, frontier.name) == (560.0, 90.0, "frontier-mi250x")
    # 10 ms computing and 2 ms communicating on each of 8 GCDs: 8 * (560 * 0.01 + 90 * 0.002) J.
    assert energy_per_iteration(0.010, 0.002, frontier, devices=8) == pytest.approx(8 * (5.6 + 0.18))
    assert energy_per_iteration(1.0, 0.0) == 560.0
    assert energy_per_iteration(0.0, 1.0, PowerModel(300.0, 60.0, "h100-guess")) == 60.0


def test_estimate_energy_is_eq1_then_eq2():
    estimate = estimate_energy(0.010, 0.002, iterations=157, devices=8, note="phantom p=8")
    assert estimate.source == "modelled"
    assert (estimate.compute_seconds, estimate.comm_seconds) == (0.010, 0.002)
    assert estimate.joules_per_iteration == pytest.approx(46.24)
    assert estimate.total_joules == pytest.approx(46.24 * 157)
    assert "frontier-mi250x" in estimate.note and "phantom p=8" in estimate.note


def test_measured_energy_divides_total_by_iterations():
    estimate = measured_energy(11_712.0, 157, note="Table I, PP p=8")
    assert estimate.source == "measured"
    assert estimate.joules_per_iteration == pytest.approx(74.6, abs=0.01)
    assert estimate.compute_seconds is None and estimate.comm_seconds is None


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: PowerModel(busy_watts=-1.0), "busy_watts=-1.0"),
        (lambda: PowerModel(idle_watts=0.0), "idle_watts=0.0"),
        (lambda: PowerModel(busy_watts=80.0, idle_watts=90.0), "busy_watts=80.0 < idle_watts=90.0"),
        (lambda: PowerModel(busy_watts=float("inf")), "busy_watts=inf"),
        (lambda: energy_per_iteration(-0.1, 0.0), "alpha_s=-0.1"),
        (lambda: energy_per_iteration(0.1, "slow"), "beta_s='slow'"),
        (lambda: energy_per_iteration(0.1, 0.1, devices=0), "devices=0"),
        (lambda: energy_per_iteration(0.1, 0.1, power=560.0), "power=560.0"),
        (lambda: energy_to_target(74.6, -157), "iterations=-157"),
        (lambda: measured_energy(100.0, 0), "iterations=0"),
        (lambda: EnergyEstimate(None, None, 1.0, 2.0, 2.0, "guessed"), "source='guessed'"),
        (lambda: EnergyEstimate(None, None, 1.0, 2.0, 3.0, "measured"), "total_joules=3.0"),
        (lambda: NvmlPowerMeter(interval_s=0), "interval_s=0"),
        (lambda: NvmlPowerMeter(device_indices=[-1]), "device_indices=(-1,)"),
    ],
)
def test_bad_inputs_raise_config_error_naming_the_value(call, fragment):
    with pytest.raises(ConfigError) as error:
        call()
    assert fragment in str(error.value)


def test_trapezoid_is_exact_for_a_power_ramp():
    times = [0.0, 0.1, 0.25, 0.7, 1.0]
    watts = [100.0 + 50.0 * t for t in times]  # 100 W rising to 150 W over 1 s: 125 J
    assert integrate_trapezoid(times, watts) == pytest.approx(125.0)
    assert integrate_trapezoid([0.0], [100.0]) == 0.0


def test_meter_reports_unavailability_without_raising():
    ok, reason = NvmlPowerMeter.available()
    assert isinstance(ok, bool) and reason
    if not ok:  # this CPU-only machine: a clear error at start, none at import or construction
        meter = NvmlPowerMeter()
        with pytest.raises(ConfigError, match="cannot measure"):
            meter.start()


def test_meter_without_pynvml_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    ok, reason = NvmlPowerMeter.available()
    assert not ok and "pynvml" in reason and "install" in reason


def test_meter_integrates_an_injected_constant_power():
    meter = NvmlPowerMeter(interval_s=0.02, sampler=lambda: 100.0)
    with meter:
        time.sleep(0.2)
    measured = meter.measurement
    assert measured.samples >= 2
    assert measured.seconds >= 0.2
    assert measured.joules == pytest.approx(100.0 * measured.seconds, rel=1e-9)  # ~20 J
    assert measured.mean_watts == pytest.approx(100.0)
    assert measured.device_names == ("device0",)


def test_meter_sums_devices_and_keeps_their_names_with_a_fake_clock():
    ticks = itertools.count()
    meter = NvmlPowerMeter(
        interval_s=0.005,
        sampler=lambda: [100.0, 50.0],
        device_names=["gpu-a", "gpu-b"],
        clock=lambda: 0.05 * next(ticks),
    )
    meter.start()
    measured = meter.stop()
    assert measured.device_names == ("gpu-a", "gpu-b")
    assert measured.seconds == pytest.approx(0.05 * (measured.samples - 1))
    assert measured.joules_per_device == pytest.approx((100.0 * measured.seconds, 50.0 * measured.seconds))
    assert measured.joules == pytest.approx(150.0 * measured.seconds)


def test_meter_reports_a_failing_sampler_at_stop():
    failed = threading.Event()
    calls = itertools.count()

    def sampler():
        if next(calls) >= 1:
            failed.set()
            raise OSError("sensor gone")
        return [100.0]

    meter = NvmlPowerMeter(interval_s=0.001, sampler=sampler)
    meter.start()
    assert failed.wait(timeout=5.0)
    with pytest.raises(RuntimeError, match="sensor gone"):
        meter.stop()


def test_meter_start_and_stop_misuse():
    meter = NvmlPowerMeter(sampler=lambda: [1.0])
    with pytest.raises(ConfigError, match="without start"):
        meter.stop()
    meter.start()
    with pytest.raises(ConfigError, match="twice"):
        meter.start()
    meter.stop()
    with pytest.raises(ConfigError, match="device_names"):
        NvmlPowerMeter(sampler=lambda: [1.0, 2.0], device_names=["only-one"]).start()


def _fake_pynvml(powers_mw):
    """A stand-in for nvidia-ml-py with one GPU per entry of ``powers_mw``, counting init/shutdown."""
    state = {"open": 0}

    def init():
        state["open"] += 1

    def shutdown():
        state["open"] -= 1

    module = types.SimpleNamespace(
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: len(powers_mw),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda handle: f"Fake GPU {handle}".encode(),  # bytes, as older pynvml
        nvmlDeviceGetPowerUsage=lambda handle: powers_mw[handle],
    )
    return module, state


def test_meter_reads_nvml_power_in_milliwatts(monkeypatch):
    module, state = _fake_pynvml([250_000, 70_000])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert NvmlPowerMeter.available() == (True, "2 GPU(s): Fake GPU 0, Fake GPU 1")
    assert state["open"] == 0

    with NvmlPowerMeter(interval_s=0.005) as meter:
        pass
    measured = meter.measurement
    assert measured.device_names == ("0:Fake GPU 0", "1:Fake GPU 1")
    assert measured.joules_per_device == pytest.approx((250.0 * measured.seconds, 70.0 * measured.seconds))
    assert state["open"] == 0  # NVML shut down after the window

    with NvmlPowerMeter(device_indices=[1], interval_s=0.005) as meter:
        pass
    assert meter.measurement.device_names == ("1:Fake GPU 1",)
    assert meter.measurement.joules == pytest.approx(70.0 * meter.measurement.seconds)

    with pytest.raises(ConfigError, match=r"device_indices=\(5,\) but NVML sees 2 GPU"):
        NvmlPowerMeter(device_indices=[5]).start()
    assert state["open"] == 0


# --- NvmlEnergyMeter: NVML's energy counter, PCI-bus-id mapping, fallback, per-process sums ---


class FakeNvml:
    """nvidia-ml-py stand-in. ``gpus`` in NVML's own (PCI) order, each a dict with ``bus`` (as NVML
    prints it), ``name``, ``power_mw`` and ``energy_mj`` (None: NVMLError_NotSupported, a pre-Volta
    GPU). ``advance(joules)`` moves every counter on; reads and init/shutdown are counted."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, gpus):
        self.gpus = gpus
        self.open = 0
        self.power_reads = 0
        self.energy_reads = 0

    def nvmlInit(self):
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        return next(i for i, gpu in enumerate(self.gpus) if gpu["bus"] == bus_id)

    def nvmlDeviceGetPciInfo(self, handle):
        return types.SimpleNamespace(busId=self.gpus[handle]["bus"].encode())  # bytes, as pynvml

    def nvmlDeviceGetName(self, handle):
        return self.gpus[handle]["name"]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self.energy_reads += 1
        if self.gpus[handle]["energy_mj"] is None:
            raise self.NVMLError_NotSupported("Not Supported")
        return self.gpus[handle]["energy_mj"]

    def nvmlDeviceGetPowerUsage(self, handle):
        self.power_reads += 1
        return self.gpus[handle]["power_mw"]

    def advance(self, joules):
        for gpu, added in zip(self.gpus, joules):
            if gpu["energy_mj"] is not None:
                gpu["energy_mj"] += int(added * 1000)


def _gpu(bus, name, power_w=300.0, energy_mj=10**9):
    return {"bus": bus, "name": name, "power_mw": int(power_w * 1000), "energy_mj": energy_mj}


def _device(id, bus, process_index=0):
    """A jax GPU device as the meter sees it; ``bus`` in CUDA's spelling."""
    return types.SimpleNamespace(id=id, platform="gpu", process_index=process_index,
                                 local_hardware_id=id, pci_bus_id=bus)


def _fake_clock(step=0.05):
    ticks = itertools.count()
    return lambda: step * next(ticks)


# NVML lists GPUs in PCI order: 1a, 3b, 5e. jax's device 0 is on 5e and device 1 on 1a (e.g.
# CUDA_VISIBLE_DEVICES=2,0): by index the meter would read the wrong boards.
NVML_GPUS = [("00000000:1A:00.0", "GPU-A"), ("00000000:3B:00.0", "GPU-B"), ("00000000:5E:00.0", "GPU-C")]


def test_normalise_pci_bus_id_accepts_nvml_cuda_and_sysfs_spellings():
    from jphantom.energy import normalise_pci_bus_id

    for spelling in ("00000000:3B:00.0", "0000:3b:00.0", b"0000:3B:00.0\x00", " 3b:00.0 "):
        assert normalise_pci_bus_id(spelling) == "0000:3b:00.0"
    with pytest.raises(ConfigError, match=r"PCI bus id 'GPU-1234' is not domain:bus:device.function"):
        normalise_pci_bus_id("GPU-1234")


def test_counter_is_read_at_the_window_ends_and_preferred_to_power():
    from jphantom.energy import NvmlEnergyMeter

    nvml = FakeNvml([_gpu(bus, name) for bus, name in NVML_GPUS])
    meter = NvmlEnergyMeter([_device(0, "0000:1a:00.0")], nvml=nvml, clock=_fake_clock())
    meter.start()
    nvml.advance([123.456, 999.0, 999.0])
    measured = meter.stop()
    assert measured.method == "counter" and measured.device_methods == ("counter",)
    assert measured.joules == pytest.approx(123.456)  # not 300 W x seconds: the counter wins
    assert measured.joules_per_device == pytest.approx((123.456,))
    assert nvml.power_reads == 0 and nvml.energy_reads == 2  # one read at each end of the window
    assert measured.samples == 2 and measured.processes == 1
    assert measured.seconds == pytest.approx(0.05) and measured.mean_watts == pytest.approx(123.456 / 0.05)
    assert nvml.open == 0  # NVML shut down after the window


def test_jax_devices_are_matched_to_nvml_handles_by_pci_bus_id_not_index():
    from jphantom.energy import NvmlEnergyMeter

    nvml = FakeNvml([_gpu(bus, name) for bus, name in NVML_GPUS])
    devices = [_device(0, "0000:5E:00.0"), _device(1, "0000:1a:00.0")]
    with NvmlEnergyMeter(devices, nvml=nvml, clock=_fake_clock()) as meter:
        nvml.advance([100.0, 200.0, 300.0])  # GPU-A, GPU-B, GPU-C in NVML's order
    measured = meter.measurement
    assert measured.joules_per_device == pytest.approx((300.0, 100.0))  # jax 0 is GPU-C, jax 1 GPU-A
    assert measured.device_names == ("0:GPU-C@0000:5e:00.0", "1:GPU-A@0000:1a:00.0")
    assert measured.joules == pytest.approx(400.0)  # GPU-B is not this run's: not counted


def test_bus_id_of_is_injectable_and_unknown_or_shared_buses_are_refused():
    from jphantom.energy import NvmlEnergyMeter

    nvml = FakeNvml([_gpu(bus, name) for bus, name in NVML_GPUS])
    buses = {7: "0000:3b:00.0"}
    device = types.SimpleNamespace(id=7, platform="gpu", process_index=0, local_hardware_id=0)
    with NvmlEnergyMeter([device], nvml=nvml, bus_id_of=lambda d: buses[d.id]) as meter:
        nvml.advance([1.0, 2.0, 3.0])
    assert meter.measurement.joules == pytest.approx(2.0)

    with pytest.raises(ConfigError, match=r"on PCI bus 0000:af:00.0 but NVML lists \['0000:1a:00.0'"):
        NvmlEnergyMeter([_device(0, "0000:af:00.0")], nvml=nvml).start()
    with pytest.raises(ConfigError, match="both on PCI bus 0000:1a:00.0 .MIG"):
        NvmlEnergyMeter([_device(0, "0000:1a:00.0"), _device(1, "0000:1A:00.0")], nvml=nvml).start()
    assert nvml.open == 0  # shut down after a refused start too


def test_a_gpu_without_the_counter_falls_back_to_sampling_and_the_method_says_so():
    from jphantom.energy import NvmlEnergyMeter

    gpus = [_gpu(NVML_GPUS[0][0], "V100", energy_mj=5_000_000), _gpu(NVML_GPUS[1][0], "P100", 100.0, None)]
    nvml = FakeNvml(gpus)
    devices = [_device(0, "0000:1a:00.0"), _device(1, "0000:3b:00.0")]
    meter = NvmlEnergyMeter(devices, interval_s=0.002, nvml=nvml, clock=_fake_clock())
    meter.start()
    nvml.advance([50.0, 0.0])
    time.sleep(0.01)
    measured = meter.stop()
    assert measured.method == "mixed" and measured.device_methods == ("counter", "sampling")
    counted, sampled = measured.joules_per_device
    assert counted == pytest.approx(50.0)
    # 100 W integrated over whole ticks of the fake clock (0.05 s, shared with the counter reads)
    assert sampled >= 5.0 and sampled / 5.0 == pytest.approx(round(sampled / 5.0))
    assert measured.samples >= 2 and nvml.power_reads == measured.samples
    assert "NVMLError_NotSupported" in meter.fallback_reasons["1:P100@0000:3b:00.0"]
    assert nvml.open == 0

    sampled_only = NvmlEnergyMeter(devices[1:], interval_s=0.002, nvml=nvml, clock=_fake_clock())
    with sampled_only:
        pass
    assert sampled_only.measurement.method == "sampling"
    assert sampled_only.measurement.mean_watts == pytest.approx(100.0)


def test_an_nvml_binding_without_the_counter_function_samples():
    from jphantom.energy import NvmlEnergyMeter

    class OldNvml(FakeNvml):
        nvmlDeviceGetTotalEnergyConsumption = None  # nvidia-ml-py from before the counter

    nvml = OldNvml([_gpu(NVML_GPUS[0][0], "K80", 150.0)])
    meter = NvmlEnergyMeter([_device(0, "0000:1a:00.0")], interval_s=0.002, nvml=nvml, clock=_fake_clock())
    with meter:
        pass
    assert meter.measurement.method == "sampling"
    assert meter.measurement.joules == pytest.approx(150.0 * meter.measurement.seconds)
    assert "no nvmlDeviceGetTotalEnergyConsumption" in meter.fallback_reasons["0:K80@0000:1a:00.0"]


def test_energies_are_summed_across_processes_each_metering_its_own_gpus():
    from jphantom.energy import NvmlEnergyMeter, gather_across_processes, sum_across_processes

    assert sum_across_processes(3.5) == 3.5  # one process: identity
    assert gather_across_processes([1.0, 2.0]).tolist() == [[1.0, 2.0]]
    two_processes = lambda local: np.stack([local, 2 * local])  # process 1 saw twice as much
    assert sum_across_processes(3.5, gather=two_processes) == pytest.approx(10.5)
    with pytest.raises(ConfigError, match=r"gather returned shape \(2,\)"):
        gather_across_processes([1.0, 2.0], gather=lambda local: local)

    # This process (0) has GPU-A with the counter; process 1 reports 500 J from one sampled GPU.
    other = np.array([500.0, 0, 1, 0.08])  # [joules, counter GPUs, sampled GPUs, seconds]
    seen = []

    def gather(local):
        seen.append(local.copy())
        return np.stack([local, other])

    nvml = FakeNvml([_gpu(bus, name) for bus, name in NVML_GPUS])
    meter = NvmlEnergyMeter([_device(0, "0000:1a:00.0")], nvml=nvml, gather=gather, clock=_fake_clock())
    meter.start()
    nvml.advance([40.0, 0.0, 0.0])
    measured = meter.stop()
    assert seen[0].tolist() == pytest.approx([40.0, 1, 0, 0.05])  # what this process contributes
    assert measured.joules == pytest.approx(540.0) and measured.processes == 2
    assert measured.joules_per_device == pytest.approx((40.0,))  # this process's GPUs only
    assert measured.method == "mixed"  # counter here, sampling there
    assert measured.seconds == pytest.approx(0.08)


def test_a_process_meters_only_its_own_gpus():
    import jax

    from jphantom.energy import NvmlEnergyMeter, process_devices

    nvml = FakeNvml([_gpu(bus, name) for bus, name in NVML_GPUS])
    with pytest.raises(ConfigError, match="belongs to process 1, not to this one .0.: each process"):
        NvmlEnergyMeter([_device(4, "0000:1a:00.0", process_index=1)], nvml=nvml).start()
    with pytest.raises(ConfigError, match="'cpu' device, not an NVIDIA GPU"):
        NvmlEnergyMeter(jax.local_devices()[:1], nvml=nvml).start()
    with pytest.raises(ConfigError, match="lists a device twice"):
        NvmlEnergyMeter([_device(0, "0000:1a:00.0")] * 2, nvml=nvml).start()
    assert process_devices(1) == jax.devices()[:1]
    assert all(d.process_index == jax.process_index() for d in process_devices())
    # A process holding none of a run's GPUs still takes part in the sum, contributing nothing.
    empty = NvmlEnergyMeter([], gather=lambda local: np.stack([local, [7.0, 1, 0, 0.1]]))
    with empty:
        pass
    assert empty.measurement.joules == 7.0 and empty.measurement.method == "counter"
    assert nvml.open == 0


def test_energy_meter_misuse_and_a_counter_that_runs_backwards():
    from jphantom.energy import NvmlEnergyMeter

    nvml = FakeNvml([_gpu(NVML_GPUS[0][0], "GPU-A")])
    meter = NvmlEnergyMeter([_device(0, "0000:1a:00.0")], nvml=nvml)
    with pytest.raises(ConfigError, match="without start"):
        meter.stop()
    meter.start()
    with pytest.raises(ConfigError, match="twice"):
        meter.start()
    nvml.gpus[0]["energy_mj"] -= 1000  # the driver reloaded mid-window
    with pytest.raises(RuntimeError, match="went from 1e\\+09 to 9.99999e\\+08 mJ"):
        meter.stop()
    assert nvml.open == 0
    with pytest.raises(ConfigError, match="interval_s=0"):
        NvmlEnergyMeter(interval_s=0)
    with pytest.raises(ConfigError, match="metered no GPU in any process"):
        NvmlEnergyMeter([]).start().stop()
    with pytest.raises(ConfigError, match="method='guessed'"):
        PowerMeasurement(1.0, (1.0,), ("a",), 1.0, 2, method="guessed")


def test_energy_meter_availability_with_and_without_pynvml(monkeypatch):
    from jphantom.energy import NvmlEnergyMeter

    gpus = [_gpu(NVML_GPUS[0][0], "GPU-A"), _gpu(NVML_GPUS[1][0], "GPU-B", energy_mj=None)]
    nvml = FakeNvml(gpus)
    assert NvmlEnergyMeter.available(nvml) == (
        True, "2 GPU(s): GPU-A, GPU-B; energy counter on 1 of 2 (power sampling on the rest)")
    assert nvml.open == 0

    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    ok, reason = NvmlEnergyMeter.available()
    assert not ok and "pynvml" in reason and "pip install 'jphantom[gpu]'" in reason
    with pytest.raises(ConfigError, match=r"cannot measure: nvidia-ml-py \(pynvml\) is not installed"):
        NvmlEnergyMeter([_device(0, "0000:1a:00.0")]).start()


class FakeLibcuda:
    """The three CUDA driver calls cuda_pci_bus_id makes; ``buses`` by CUDA ordinal."""

    def __init__(self, buses):
        self.buses = buses

    def cuInit(self, flags):
        return 0

    def cuDeviceGet(self, pointer, ordinal):
        if ordinal >= len(self.buses):
            return 101  # CUDA_ERROR_INVALID_DEVICE
        pointer.contents.value = 1000 + ordinal
        return 0

    def cuDeviceGetPCIBusId(self, buffer, length, handle):
        buffer.value = self.buses[handle.value - 1000].encode()
        return 0


def test_cuda_pci_bus_id_asks_the_driver_for_the_devices_cuda_ordinal():
    from jphantom.energy import cuda_pci_bus_id

    libcuda = FakeLibcuda(["0000:5E:00.0", "0000:1A:00.0"])  # CUDA's order, after CUDA_VISIBLE_DEVICES
    device = types.SimpleNamespace(id=3, local_hardware_id=1)
    assert cuda_pci_bus_id(device, libcuda=libcuda) == "0000:1a:00.0"
    assert cuda_pci_bus_id(_device(0, "0000:3B:00.0"), libcuda=libcuda) == "0000:3b:00.0"  # given
    with pytest.raises(ConfigError, match="cuDeviceGet returned CUDA error 101 .* ordinal 5"):
        cuda_pci_bus_id(types.SimpleNamespace(id=0, local_hardware_id=5), libcuda=libcuda)
    with pytest.raises(ConfigError, match="has no local_hardware_id"):
        cuda_pci_bus_id(types.SimpleNamespace(id=0, local_hardware_id=None), libcuda=libcuda)


def test_compare_meters_this_processes_share_of_a_run_with_the_energy_meter(monkeypatch):
    import jax

    from jphantom.loop.compare import gpu_meter_factory
    from jphantom.energy import NvmlEnergyMeter, process_devices

    logged = []
    assert gpu_meter_factory(log=logged.append) is None  # this CPU machine: modelled
    assert "modelled" in logged[-1]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml([_gpu(NVML_GPUS[0][0], "GPU-A")]))
    factory = gpu_meter_factory(log=logged.append)
    assert "energy counter on 1 of 1" in logged[-1]
    meter = factory(1)
    assert isinstance(meter, NvmlEnergyMeter) and meter.devices == tuple(process_devices(1))
