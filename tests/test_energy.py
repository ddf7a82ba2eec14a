"""Seed 000's energy model (Eqs. 1-2) against Table I, and the power meter's integration."""

import itertools
import sys
import threading
import time
import types

import pytest

from jphantom.energy import (
    EnergyEstimate,
    NvmlPowerMeter,
    PowerModel,
    energy_per_iteration,
    energy_to_target,
    estimate_energy,
    integrate_trapezoid,
    measured_energy,
)
from jphantom.errors import ConfigError

# Seed 000 Table I (n = 16384, L = 2, fixed MSE loss): p, k, then per model energy/epoch (J),
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
# Digest of seed 000, Sec. 4.4: PP/TP total energy, to three decimals.
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
