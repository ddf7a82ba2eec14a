"""Per-step metrics: metrics.jsonl's fields for a tiny run (sane values, MFU and memory null on
CPU, modelled energy labelled), the gradient norm against the gradients themselves, the learning
rate against the schedule, the FLOPs formulas and peak table, NVML energy per step from its
counters, and TensorBoard off by default."""

import json
import types

import jax
import numpy as np
import pytest

from jphantom import cli
from jphantom.costs import metrics
from jphantom.config import RunConfig, TrainConfig
from jphantom.energy import PowerModel
from jphantom.errors import ConfigError

SETTINGS = dict(layers=1, hidden=16, heads=2, seq_len=8, batch=4, steps=3, eval_every=3,
                eval_batches=1, warmup_steps=0, lr_schedule="cosine", optimizer="sgd",
                learning_rate=0.1)
TINY = [a for key, value in SETTINGS.items()
        for a in (f"--{key.replace('_', '-')}", str(value))] + ["--no-progress"]
FIELDS = {"step", "train_loss", "learning_rate", "grad_norm", "step_seconds",
          "tokens_per_second", "model_tflops_per_device", "mfu", "peak_memory_bytes",
          "energy_joules", "joules_per_token", "energy_source"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    text = folder / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 60)
    out = folder / "out"
    assert cli.main(["train", *TINY, "--data", str(text), "--out", str(out)]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, text, lines


def test_every_step_writes_the_metrics_a_user_reads(tiny_run):
    out, _, lines = tiny_run
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert FIELDS <= set(line)
        assert line["step_seconds"] > 0 and line["tokens_per_second"] == pytest.approx(
            4 * 8 / line["step_seconds"])
        assert np.isfinite(line["grad_norm"]) and line["grad_norm"] > 0
        assert line["model_tflops_per_device"] > 0
        assert line["mfu"] is None and line["peak_memory_bytes"] is None  # CPU: nothing to claim
        assert line["energy_source"] == "modelled"  # Eq. 1, the whole step at A, one device
        assert line["energy_joules"] == pytest.approx(PowerModel().busy_watts
                                                      * line["step_seconds"])
        assert line["joules_per_token"] == pytest.approx(line["energy_joules"] / 32)
    assert [line.get("compiled", False) for line in lines] == [True, False, False]
    rates = [line["learning_rate"] for line in lines]
    assert rates[0] == 0.1 and rates[0] > rates[1] > rates[2] > 0.01  # cosine from the peak
    assert rates == pytest.approx([TrainConfig(**{k: v for k, v in SETTINGS.items() if k in (
        "steps", "warmup_steps", "lr_schedule", "learning_rate")}).learning_rate_at(i)
        for i in range(3)])
    assert "validation_loss" in lines[-1]
    results = json.loads((out / "results.json").read_text())
    throughput = results["throughput"]
    assert throughput["peak_tflops_per_device"] is None and throughput["median_mfu"] is None
    assert throughput["energy_source"] == "modelled" and throughput["power_model"]["busy_watts"]
    assert not (out / "tensorboard").exists()  # TensorBoard is off by default


def test_the_recorded_gradient_norm_is_the_first_steps_gradients_norm(tiny_run):
    """SGD moves the parameters by -lr x gradient: the first update's norm over the learning
    rate is the norm of the gradients, over every parameter (the run's compiled step, reused)."""
    out, text, lines = tiny_run
    from jphantom.loop.sources import TextSource

    config = RunConfig.from_flags(**SETTINGS, data=str(text), out=str(out), progress=False,
                                  grad_norm=True)
    b = config.build()
    state = b.program.init(b.step, seed=0)
    before = jax.device_get(state.params)  # the step donates its state
    batch = [jax.device_put(a, s) for a, s in zip(TextSource(config, 8).train(0), b.shardings)]
    after, _ = b.step(state, *batch)
    moved = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                         before, jax.device_get(after.params))
    norm = np.sqrt(sum(float(np.sum(m * m)) for m in jax.tree.leaves(moved)))
    assert lines[0]["grad_norm"] == pytest.approx(norm / 0.1, rel=1e-4)
    assert float(metrics.grad_norm_of(after.opt_state)) == lines[0]["grad_norm"]
    assert TrainConfig().grad_norm is False  # off for the library (inspect's step unchanged)


def test_model_flops_per_token_follow_the_models_formulas():
    from jphantom.models.gpt2 import TransformerConfig
    from jphantom.models.llama import LlamaConfig

    gpt2 = TransformerConfig(vocab_size=256, seq_len=64, hidden=32, heads=2, layers=2)
    assert metrics.flops_per_token(gpt2, "tensor", 64) == gpt2.flops_per_token()
    assert metrics.flops_per_token(gpt2, "tensor", 32) < gpt2.flops_per_token()  # attention 6LSh
    assert metrics.flops_per_token(gpt2, "phantom", 64) is None  # not the dense model
    llama = LlamaConfig(vocab_size=256, hidden=64, intermediate=128, layers=2, heads=4,
                        kv_heads=2)
    weights = llama.param_count() - 256 * 64 - 2 * (2 * 64) - 64  # minus embedding and norms
    assert metrics.flops_per_token(llama, "tensor", 16) == 6 * weights + 6 * 2 * 16 * 64
    from jphantom.models.ffn import FFNConfig

    assert metrics.flops_per_token(FFNConfig(32, 3), "dense", 1) == 6 * 3 * 32 * 32


@pytest.mark.parametrize("platform, kind, peak", [
    ("gpu", "NVIDIA H100 80GB HBM3", 989.4), ("gpu", "NVIDIA H100 PCIe", 756.0),
    ("gpu", "NVIDIA H200", 989.4), ("gpu", "NVIDIA GH200 480GB", 989.4),
    ("gpu", "NVIDIA A100-SXM4-80GB", 312.0), ("gpu", "NVIDIA A100 80GB PCIe", 312.0),
    ("gpu", "NVIDIA L40S", 362.0), ("gpu", "Some Future GPU", None), ("cpu", "cpu", None),
])
def test_peak_flops_come_from_the_table_and_never_for_cpu(platform, kind, peak):
    device = types.SimpleNamespace(platform=platform, device_kind=kind)
    assert metrics.peak_tflops(device) == peak


def test_a_described_device_has_its_peak_written_once():
    """A device with a description in jphantom/predict/devices/ takes its peak from there: the
    table names the description instead of repeating the number (H100: 989.4, not 989.0)."""
    from jphantom.predict import device

    for name in device.names():
        described = device.load(name)
        for kind in described.device_kinds:
            assert metrics.peak_of_kind(kind) == described["peak_tflops.bf16"], (name, kind)
    numbers = [peak for _, peak in metrics.PEAK_TFLOPS if not isinstance(peak, str)]
    described = {device.load(n)["peak_tflops.bf16"] for n in device.names()}
    assert not described & set(numbers), "a described peak written again in PEAK_TFLOPS"
    assert all(peak in device.names() for _, peak in metrics.PEAK_TFLOPS if isinstance(peak, str))


class _Counters:
    """NVML's energy counters for ``count`` GPUs (millijoules), advanced by hand."""

    NVMLError = RuntimeError

    def __init__(self, count):
        self.energy = [10**9] * count

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.energy)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetPciInfo(self, handle):
        return types.SimpleNamespace(busId=f"0000:{handle:02x}:00.0".encode())

    def nvmlDeviceGetName(self, handle):
        return "Fake H100"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        return self.energy[handle]


def test_step_energy_reads_nvml_counters_around_each_step():
    from jphantom.energy import NvmlEnergyMeter

    nvml = _Counters(2)
    devices = [types.SimpleNamespace(id=i, platform="gpu", process_index=0) for i in range(2)]
    meter = NvmlEnergyMeter(devices, nvml=nvml, bus_id_of=lambda d: f"0000:{d.id:02x}:00.0",
                            gather=lambda row: row[None]).start()
    energy = metrics.StepEnergy(devices, meter)
    nvml.energy = [e + 5000 for e in nvml.energy]  # between steps: not counted
    energy.begin()
    nvml.energy = [nvml.energy[0] + 250_000, nvml.energy[1] + 150_000]
    joules = energy.end(seconds=1.0)
    assert energy.source == "nvml" and joules == pytest.approx(400.0)
    assert energy.joules_per_token(joules, 100) == pytest.approx(4.0)
    energy.close()


def test_tensorboard_is_opt_in_and_its_absence_is_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboardX")
    board = metrics.TensorBoard(tmp_path / "tb")
    board.write({"step": 1, "train_loss": 2.0, "mfu": None, "energy_source": "nvml",
                 "compiled": True})
    board.close()
    assert any((tmp_path / "tb").iterdir())
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboardX" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install tensorboardX"):
        TrainConfig(tensorboard=True)
    assert cli.main(["train", "--tensorboard", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "pip install tensorboardX" in err and len(err.strip().splitlines()) == 1
