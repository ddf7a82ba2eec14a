"""What a training run reports every step: throughput, model FLOP/s and MFU, memory, energy.

Per step :func:`jphantom.loop.trainer.run` writes one line of ``metrics.jsonl`` (flushed at once), shows
the main figures on its progress bar and, with ``--tensorboard``, logs the same scalars
(:class:`TensorBoard`). The figures and where they come from:

- ``learning_rate``: the optimizer's schedule at this update
  (:meth:`jphantom.config.TrainConfig.learning_rate_at`);
- ``grad_norm``: the global L2 norm of the step's gradients, over every shard, as the optimizer
  saw them (:func:`record_grad_norm`, the first transformation of the run's optimizer:
  after ``--clip-norm``'s clipping where that comes first); ``None`` when not recorded;
- ``step_seconds`` and ``tokens_per_second``: wall time of the step alone, from a batch on the
  devices to its state finished (``jax.block_until_ready`` on both ends), evaluation and
  checkpointing outside it; the first step of a run includes compiling (``"compiled": true``);
- ``model_tflops_per_device`` and ``mfu``: the model's FLOPs per step (:func:`flops_per_token` x
  tokens: 6 x the weights of its matmuls plus causal attention, 6 L S h, per token -- PaLM's
  model FLOPs, recomputation not counted) over the step time and the mesh's devices; MFU against
  the device's dense bf16 peak (its description in ``jphantom/predict/devices/``, else
  :data:`PEAK_TFLOPS`, the vendors' datasheets). ``None`` on CPU (no peak to compare with) and on
  devices neither lists;
- ``peak_memory_bytes``: the largest ``peak_bytes_in_use`` of the mesh's devices on this process
  (``device.memory_stats()``; ``None`` where the backend reports none, as on CPU);
- ``energy_joules`` and ``joules_per_token``, with ``energy_source``: ``"nvml"`` on NVIDIA GPUs
  (the difference of NVML's energy counters around the step, :meth:`NvmlEnergyMeter.read`, this
  process's GPUs; joules per token divide by the tokens those GPUs processed), ``"amdsmi"`` on
  AMD GPUs (amdsmi's counters the same way; ``"amdsmi-unreliable"`` with ``None`` joules once a
  counter sticks or steps backwards), else
  ``"modelled"``: Seal et al.'s Eq. 1 with the whole step at the busy power A
  (:class:`jphantom.energy.PowerModel`, Frontier's MI250X by default) on every device of the mesh:
  a model, not a measurement.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jphantom.errors import ConfigError

# The devices' dense (no sparsity) bf16 tensor-core TFLOP/s. A device with a description in
# jphantom/predict/devices/ (its ``device_kinds``, jphantom.predict.device.for_kind) takes the
# description's ``peak_tflops.bf16``, the one place each of those peaks is written; the rows below
# cover the kinds none describes, matched against the lower-cased ``device.device_kind`` in order
# (the first substring found wins), each a TFLOP/s from the vendor's datasheet or the name of a
# description whose peak it shares (the same die and clocks).
PEAK_TFLOPS: tuple[tuple[str, float | str], ...] = (
    ("h100 pcie", 756.0), ("h100 nvl", 835.0), ("gh200", "h200"), ("h200", "h200"),
    ("h100", "h100-sxm"), ("h800", "h100-sxm"), ("b200", "b200"), ("a100", "a100-sxm"),
    ("a800", "a100-sxm"), ("l40s", 362.0), ("l40", 181.0), ("l4", 121.0), ("a10", 125.0),
    ("tpu v4", 275.0), ("tpu v5 lite", 197.0), ("tpu v5e", 197.0), ("tpu v5p", 459.0),
    ("tpu v6", 918.0),
    # AMD's Instinct pages: MI250 362.1 per package = 181.05 per GCD (one jax device); MI325X is
    # MI300X's compute; MI350X 4.6 PFLOPS with sparsity = 2300 dense
    ("mi250x", "mi250x-gcd"), ("mi250", 181.05), ("mi300x", "mi300x"), ("mi325x", "mi300x"),
    ("mi350x", 2300.0),
)
TENSORBOARD_INSTALL = "pip install tensorboardX"


@functools.lru_cache(maxsize=None)
def peak_of_kind(kind: str) -> float | None:
    """The dense bf16 peak TFLOP/s of a device kind (``"NVIDIA H100 80GB HBM3"``, ``"tpu v5p"``):
    its device description's (:func:`jphantom.predict.device.for_kind`), else the first
    :data:`PEAK_TFLOPS` name it contains (a description's peak where the row names one);
    ``None`` when none."""
    from jphantom.predict import device

    described = device.for_kind(kind)
    if described is None:
        kind = kind.lower()
        peak = next((peak for name, peak in PEAK_TFLOPS if name in kind), None)
        described = device.load(peak) if isinstance(peak, str) else None
        if described is None:
            return peak
    return float(described["peak_tflops.bf16"])


def peak_tflops(device) -> float | None:
    """The device's dense bf16 peak TFLOP/s (:data:`PEAK_TFLOPS`); ``None`` on CPU or for a
    device the table does not list."""
    if device.platform == "cpu":
        return None
    return peak_of_kind(str(getattr(device, "device_kind", "")))


def flops_per_token(model_config, strategy: str, seq_len: int) -> int | None:
    """Forward + backward model FLOPs per token (per row for the FFN) of the dense model at
    ``seq_len``: the model family's count (:attr:`jphantom.registry.families.Family.flops_per_token`:
    GPT-2's :meth:`~jphantom.models.gpt2.TransformerConfig.flops_per_token`, the Llama family's
    :func:`~jphantom.models.llama.flops_per_token`, 6 L n^2 for the FFN). ``None`` under phantom
    strategies, whose model is not the dense one (Seal et al.), or for a family that declares none."""
    from jphantom.registry import families
    from jphantom.registry.strategies import get

    if not get(strategy).same_model:
        return None
    try:
        count = families.of_config(model_config).flops_per_token
    except ConfigError:
        return None
    return None if count is None else int(count(model_config, seq_len))


def peak_memory_bytes(devices) -> int | None:
    """The largest ``peak_bytes_in_use`` of this process's ``devices``; ``None`` when the
    backend keeps no statistics (CPU)."""
    peaks = []
    for device in devices:
        if device.process_index != jax.process_index():
            continue
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 (backends without statistics raise various errors)
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


# ------------------------------------------------------------------------------------------------
# The gradient norm, recorded by the optimizer
# ------------------------------------------------------------------------------------------------


_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


class GradNormState(NamedTuple):
    """The global norm of the last gradients the optimizer was given (float32 scalar)."""

    grad_norm: jax.Array


def record_grad_norm() -> optax.GradientTransformation:
    """An identity transformation that keeps the global L2 norm (``optax.tree.norm``, formerly
    ``optax.global_norm``) of the updates it passes in
    its state: chained first, it records the step's gradient norm. The step's optimizer update
    sees the global gradient arrays, so the norm is over every shard (a cross-shard reduction
    jit adds, as ``optax.clip_by_global_norm`` does)."""

    def init(params):
        del params
        return GradNormState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None):
        del state, params
        return updates, GradNormState(_tree_norm(updates).astype(jnp.float32))

    return optax.GradientTransformation(init, update)


def grad_norm_of(opt_state) -> jax.Array | None:
    """The recorded gradient norm in ``opt_state`` (None without :func:`record_grad_norm`)."""
    found = [leaf for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
        x, GradNormState)) if isinstance(leaf, GradNormState)]
    return found[0].grad_norm if found else None


# ------------------------------------------------------------------------------------------------
# Energy of each step
# ------------------------------------------------------------------------------------------------


class StepEnergy:
    """Energy of each training step: the GPUs' energy counters where jax runs on GPUs and a
    counter works (NVML's, :class:`jphantom.energy.NvmlEnergyMeter`, source ``"nvml"``; amdsmi's
    on AMD GPUs, :class:`jphantom.energy.AmdsmiEnergyMeter`, source ``"amdsmi"``), else Eq. 1
    (module docstring). Call :meth:`begin` after the batch is on the devices and :meth:`end` once
    the step's state is ready; what happens between steps (evaluation, checkpoints) is outside
    every window. A counter that sticks or steps backwards gives ``None`` joules and the source
    ``"<source>-unreliable"`` from then on."""

    def __init__(self, devices, meter=None, power=None):
        from jphantom.energy import PowerModel

        self.devices = list(devices)
        self.meter = meter
        self.power = power or PowerModel()
        self.source = getattr(meter, "source", "nvml") if meter is not None else "modelled"
        self.metered_devices = (sum(d.process_index == jax.process_index() for d in self.devices)
                                if meter is not None else len(self.devices))
        self._start = None

    @classmethod
    def for_devices(cls, devices, nvml=None, amdsmi=None) -> "StepEnergy":
        """NVML (NVIDIA) or amdsmi (AMD) on this process's GPUs among ``devices`` when it can,
        else the model."""
        from jphantom.energy import AmdsmiEnergyMeter, NvmlEnergyMeter

        local = [d for d in devices if d.process_index == jax.process_index()]
        if not local or not all(d.platform in ("gpu", "cuda", "rocm") for d in local):
            return cls(devices)
        rocm = any(d.platform == "rocm" for d in local)
        for kind, module in ((AmdsmiEnergyMeter, amdsmi),) if rocm else (
                (NvmlEnergyMeter, nvml), (AmdsmiEnergyMeter, amdsmi)):
            ok, _ = kind.available(module)
            if not ok:
                continue
            meter = (kind(local, nvml=module, gather=lambda row: row[None]) if kind is
                     NvmlEnergyMeter else kind(local, amdsmi=module, gather=lambda row: row[None]))
            try:
                meter.start()
            except ConfigError:
                continue
            if meter.read() is not None:
                return cls(devices, meter)
            meter.stop()
        return cls(devices)

    def begin(self) -> None:
        self._start = self.meter.read() if self.meter is not None else None

    def end(self, seconds: float) -> float | None:
        """Joules of the step that began at :meth:`begin` and took ``seconds`` (None where the
        counter turned unreliable)."""
        if self.meter is not None:
            now = self.meter.read()
            if now is None or self._start is None:
                if not self.source.endswith("-unreliable"):
                    self.source += "-unreliable"
                return None
            return now - self._start
        from jphantom.energy import energy_per_iteration

        return energy_per_iteration(seconds, 0.0, self.power, devices=len(self.devices))

    def joules_per_token(self, joules: float | None, tokens: int) -> float | None:
        """``joules`` over the tokens the metered devices processed (their share of ``tokens``)."""
        if joules is None:
            return None
        share = tokens * self.metered_devices / len(self.devices)
        return joules / share if share else float("nan")

    def close(self) -> None:
        if self.meter is not None:
            meter, self.meter = self.meter, None
            try:
                meter.stop()
            except RuntimeError:  # an unreliable counter: already reported (source, warning)
                if not self.source.endswith("-unreliable"):
                    raise


# ------------------------------------------------------------------------------------------------
# TensorBoard
# ------------------------------------------------------------------------------------------------


def require_tensorboard() -> None:
    """ConfigError unless tensorboardX is installed (``--tensorboard`` needs it)."""
    import importlib.util

    if importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError(f"tensorboard=True needs tensorboardX: {TENSORBOARD_INSTALL} "
                          "(or pip install 'jphantom[tensorboard]'), or leave --tensorboard out")


class TensorBoard:
    """The per-step scalars as TensorBoard events in ``folder`` (tensorboardX), tagged
    ``train/<name>`` (``validation/loss`` for evaluations)."""

    def __init__(self, folder):
        require_tensorboard()
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(folder))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for name, value in record.items():
            if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            tag = "validation/loss" if name == "validation_loss" else f"train/{name}"
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
