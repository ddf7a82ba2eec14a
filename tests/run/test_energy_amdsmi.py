"""The amdsmi energy counter (jphantom.energy.AmdsmiEnergyMeter) on recorded readings: a fake
amdsmi module, no AMD GPU, no jax compiles."""

from __future__ import annotations

import sys
import types

import pytest

from jphantom.costs import metrics
from jphantom.energy import AmdsmiEnergyMeter, amdsmi_microjoules
from jphantom.errors import ConfigError


class _Amdsmi:
    """amdsmi's calls the meter makes; ``counts[i]`` is GPU i's accumulator (None: not supported)."""

    def __init__(self, counts, field="energy_accumulator", resolution=15.3):
        self.counts, self.field, self.resolution = list(counts), field, resolution
        self.open = 0

    def amdsmi_init(self):
        self.open += 1

    def amdsmi_shut_down(self):
        self.open -= 1

    def amdsmi_get_processor_handles(self):
        return list(range(len(self.counts)))

    def amdsmi_get_gpu_device_bdf(self, handle):
        return f"0000:{handle + 0xc1:02x}:00.0"

    def amdsmi_get_energy_count(self, handle):
        if self.counts[handle] is None:
            raise RuntimeError("AMDSMI_STATUS_NOT_SUPPORTED")
        return {self.field: self.counts[handle], "counter_resolution": self.resolution,
                "timestamp": 0}


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _devices(n, platform="rocm"):
    return [types.SimpleNamespace(id=i, platform=platform, process_index=0) for i in range(n)]


def _meter(amdsmi, n, clock=None):
    return AmdsmiEnergyMeter(_devices(n), amdsmi=amdsmi, gather=lambda row: row[None],
                             bus_id_of=lambda d: f"0000:{d.id + 0xc1:02x}:00.0",
                             clock=clock or _Clock())


@pytest.mark.parametrize("field", ["energy_accumulator", "power"])  # ROCm >= 6.4, and before
def test_energy_is_accumulator_times_resolution_under_either_field_name(field):
    amdsmi = _Amdsmi([1_000_000], field=field, resolution=15.259)
    assert amdsmi_microjoules(amdsmi, 0) == (pytest.approx(15_259_000.0), "")
    clock = _Clock()
    meter = _meter(amdsmi, 1, clock).start()
    amdsmi.counts[0] += 2_000_000  # 2e6 counts x 15.259 µJ = 30.518 J
    clock.t = 1.0
    assert meter.read() == pytest.approx(30.518)
    measurement = meter.stop()
    assert measurement.joules == pytest.approx(30.518) and measurement.method == "counter"
    assert amdsmi.open == 0


def test_mi250x_counts_each_package_once_from_its_reporting_gcd():
    # 4 GCDs, 2 packages: GCDs 1 and 3 are silent (one reads 0, one is not supported)
    amdsmi = _Amdsmi([1000, 0, 5000, None], resolution=1.0)
    clock = _Clock()
    meter = _meter(amdsmi, 4, clock).start()
    assert meter.silent == [False, True, False, True]
    amdsmi.counts[0] += 3_000_000
    amdsmi.counts[2] += 1_000_000
    clock.t = 1.0
    measurement = meter.stop()
    assert measurement.joules == pytest.approx(4.0)  # 3 J + 1 J, each package once
    assert measurement.joules_per_device == pytest.approx((3.0, 0.0, 1.0, 0.0))


def test_a_process_with_only_silent_gcds_is_refused():
    amdsmi = _Amdsmi([0, None])
    with pytest.raises(ConfigError, match="one\nGCD|only one"):
        _meter(amdsmi, 2).start()
    assert amdsmi.open == 0


def test_a_counter_stepping_backwards_is_reported_not_recorded():
    amdsmi = _Amdsmi([10_000_000], resolution=1.0)
    clock = _Clock()
    meter = _meter(amdsmi, 1, clock).start()
    clock.t, amdsmi.counts[0] = 0.5, 12_000_000
    assert meter.read() == pytest.approx(2.0)
    clock.t, amdsmi.counts[0] = 1.0, 9_000_000
    with pytest.warns(RuntimeWarning, match="stepped backwards"):
        assert meter.read() is None
    assert "stepped backwards" in meter.unreliable
    with pytest.raises(RuntimeError, match="stepped backwards"):
        meter.stop()


def test_a_stuck_counter_is_reported_but_back_to_back_reads_are_not():
    amdsmi = _Amdsmi([10_000_000], resolution=1.0)
    clock = _Clock()
    meter = _meter(amdsmi, 1, clock).start()
    clock.t = 0.001  # an immediate second read: unchanged is fine
    assert meter.read() == 0.0 and meter.unreliable is None
    clock.t = 2.0  # two seconds of work and no energy: stuck
    with pytest.warns(RuntimeWarning, match="stuck"):
        assert meter.read() is None


def test_step_energy_records_amdsmi_and_marks_an_unreliable_counter():
    amdsmi = _Amdsmi([1_000_000, 0], resolution=1.0)
    clock = _Clock()
    devices = _devices(2)
    energy = metrics.StepEnergy(devices, _meter(amdsmi, 2, clock).start())
    assert energy.source == "amdsmi"
    energy.begin()
    clock.t, amdsmi.counts[0] = 1.0, 1_000_000 + 500_000_000
    joules = energy.end(seconds=1.0)
    assert joules == pytest.approx(500.0) and energy.joules_per_token(joules, 100) == 5.0
    energy.begin()
    clock.t, amdsmi.counts[0] = 2.0, 1_000  # backwards
    with pytest.warns(RuntimeWarning):
        assert energy.end(seconds=1.0) is None
    assert energy.source == "amdsmi-unreliable" and energy.joules_per_token(None, 100) is None
    energy.close()


def test_source_is_amdsmi_on_rocm_devices_and_unavailable_without_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi raises ImportError
    ok, why = AmdsmiEnergyMeter.available()
    assert not ok and "amdsmi" in why
    assert metrics.StepEnergy.for_devices(_devices(1)).source == "modelled"
    with pytest.raises(ConfigError, match="amdsmi"):
        AmdsmiEnergyMeter(_devices(1)).start()
    fake = _Amdsmi([1000])
    monkeypatch.setitem(sys.modules, "amdsmi", fake)
    monkeypatch.setattr("jphantom.energy.amd.hip_pci_bus_id",
                        lambda d, **_: f"0000:{d.id + 0xc1:02x}:00.0")
    energy = metrics.StepEnergy.for_devices(_devices(1))
    assert energy.source == "amdsmi" and isinstance(energy.meter, AmdsmiEnergyMeter)
    energy.close()
    assert fake.open == 0
    assert AmdsmiEnergyMeter.available(_Amdsmi([0, None]))[0] is False
    assert metrics.StepEnergy.for_devices(_devices(1, platform="cpu")).source == "modelled"
