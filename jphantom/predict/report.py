"""A prediction of one training step: seconds split into compute, exposed and hidden
communication, MFU, tokens per second per GPU, the compiled peak memory, and joules per step and
per token by Seal et al.'s Eq. 1 (:func:`jphantom.energy.energy_per_iteration`: busy power A
while the compute stream runs, idle power B while it waits on a collective). Every figure here is
modelled; ``measured`` fields are filled only by a script that ran the step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jphantom.predict.device import DeviceModel
from jphantom.predict.network import Network
from jphantom.predict.timeline import Timeline, simulate


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One step of an SPMD program on ``devices`` GPUs of kind ``device`` (per-device seconds;
    every device runs the same program)."""

    device: str
    devices: int
    gpus_per_node: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    hidden_comm_s: float
    simulated_flops: float  # per device: GEMMs and fused attention as compiled (recompute included)
    hbm_bytes: float
    collective_bytes: float
    kernels: float
    by_kind_s: dict
    top_ops: list
    tokens_per_step: int | None = None  # global
    model_flops_per_step: float | None = None  # per device, the model's count (for MFU)
    peak_memory_bytes: float | None = None  # compiled, per device
    device_memory_bytes: float | None = None
    peak_bf16_flops: float = 0.0
    busy_watts: float = 0.0
    idle_watts: float = 0.0
    gemm_rates: str = ""  # whose GEMM rates priced it (the description's gemm_rates)
    measured_error: str = ""  # the device's error band on record (jphantom.predict.validation)

    @property
    def joules_per_step(self) -> float:
        """Seal et al.'s Eq. 1 over every device: devices x (A x compute + B x exposed)."""
        from jphantom.energy import PowerModel, energy_per_iteration

        power = PowerModel(self.busy_watts, self.idle_watts, self.device)
        return energy_per_iteration(self.compute_s, self.exposed_comm_s, power, self.devices)

    @property
    def joules_per_token(self) -> float | None:
        return self.joules_per_step / self.tokens_per_step if self.tokens_per_step else None

    @property
    def tokens_per_second_per_gpu(self) -> float | None:
        if not self.tokens_per_step:
            return None
        return self.tokens_per_step / self.step_s / self.devices

    @property
    def mfu(self) -> float | None:
        """Model FLOPs per device per second over the device's dense bf16 peak."""
        if not self.model_flops_per_step or not self.peak_bf16_flops:
            return None
        return self.model_flops_per_step / self.step_s / self.peak_bf16_flops

    @property
    def fits(self) -> bool | None:
        if self.peak_memory_bytes is None or self.device_memory_bytes is None:
            return None
        return self.peak_memory_bytes <= self.device_memory_bytes

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(label="modelled", joules_per_step=self.joules_per_step,
                   joules_per_token=self.joules_per_token,
                   tokens_per_second_per_gpu=self.tokens_per_second_per_gpu, mfu=self.mfu,
                   fits=self.fits)
        return out


def predict(hlo_text: str, device: DeviceModel, *, devices: int = 1,
            gpus_per_node: int | None = None, node_of: Callable[[int], int] | None = None,
            tokens_per_step: int | None = None, model_flops_per_step: float | None = None,
            peak_memory_bytes: float | None = None, memory_limit_bytes: float | None = None,
            top: int = 10) -> Prediction:
    """Simulate the compiled program ``hlo_text`` (per device, as XLA compiled it for
    ``devices`` devices, ``gpus_per_node`` to a node) on ``device``
    (:func:`jphantom.predict.timeline.simulate`) and report it. ``tokens_per_step`` (global)
    and ``model_flops_per_step`` (per device, the model's count) give tokens/s and MFU;
    ``peak_memory_bytes`` (XLA's memory analysis) whether it fits: within ``memory_limit_bytes``
    (the run's allocator limit, :mod:`jphantom.costs.budget`), else the device's memory."""
    network = Network.of(device, gpus_per_node)
    timeline: Timeline = simulate(hlo_text, device, network, devices=devices, node_of=node_of)
    return Prediction(
        device=device.name, devices=devices, gpus_per_node=network.gpus_per_node,
        step_s=timeline.step, compute_s=timeline.compute, exposed_comm_s=timeline.exposed,
        hidden_comm_s=timeline.hidden, simulated_flops=timeline.flops,
        hbm_bytes=timeline.nbytes, collective_bytes=timeline.collective_bytes,
        kernels=timeline.kernels, by_kind_s=timeline.by_kind(), top_ops=timeline.top(top),
        tokens_per_step=tokens_per_step, model_flops_per_step=model_flops_per_step,
        peak_memory_bytes=peak_memory_bytes,
        device_memory_bytes=device.memory_bytes if memory_limit_bytes is None else
        memory_limit_bytes,
        peak_bf16_flops=device.peak_flops("bf16"), busy_watts=device["power.busy_watts"],
        idle_watts=device["power.idle_watts"], gemm_rates=device.gemm_rates)


def joules_text(joules: float) -> str:
    """``joules`` with at least three significant figures in J, mJ, \u00b5J or nJ, the unit that
    puts it at 1 or more (J from 1 up): never ``0.000 J`` for a small, non-zero energy."""
    if joules == 0:
        return "0 J"
    for unit, factor in (("J", 1.0), ("mJ", 1e-3), ("\u00b5J", 1e-6), ("nJ", 1e-9)):
        if abs(joules) >= factor or unit == "nJ":
            value = joules / factor
            return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    raise AssertionError("unreachable")


def format_prediction(p: Prediction, title: str = "") -> str:
    """The prediction as text: the step's split, throughput, memory, energy and top ops."""
    ms = 1e3
    lines = [title] if title else []
    lines.append(
        f"predicted step {p.step_s * ms:.1f} ms on {p.devices} x {p.device} (modelled): "
        f"compute {p.compute_s * ms:.1f} ms, communication exposed {p.exposed_comm_s * ms:.1f} "
        f"ms, hidden under compute {p.hidden_comm_s * ms:.1f} ms")
    parts = []
    if p.tokens_per_second_per_gpu is not None:
        parts.append(f"{p.tokens_per_second_per_gpu:,.0f} tokens/s per GPU")
    if p.mfu is not None:
        parts.append(f"MFU {p.mfu:.1%}")
    parts.append(f"{p.simulated_flops / p.step_s / 1e12:.0f} TFLOP/s per GPU as compiled")
    lines.append("; ".join(parts))
    if p.peak_memory_bytes is not None:
        lines.append(f"memory (compiled): peak {p.peak_memory_bytes / 2**30:.1f} GiB of "
                     f"{p.device_memory_bytes / 2**30:.1f} GiB: "
                     + ("fits" if p.fits else "does NOT fit"))
    energy = f"energy (Seal et al. Eq. 1, A = {p.busy_watts:g} W busy, B = {p.idle_watts:g} W " \
             f"idle): {joules_text(p.joules_per_step)} per step"
    if p.joules_per_token is not None:
        energy += f", {joules_text(p.joules_per_token)} per token"
    lines.append(energy)
    if p.gemm_rates:
        lines.append(f"GEMM rates: {p.gemm_rates}")
    if p.measured_error:
        lines.append(p.measured_error)
    kinds = ", ".join(f"{k} {v * ms:.1f} ms" for k, v in sorted(p.by_kind_s.items(),
                                                                key=lambda kv: -kv[1]))
    lines.append(f"time by kind (summed, overlap not removed): {kinds}")
    lines.append(f"top ops by predicted time ({len(p.top_ops)}):")
    for row in p.top_ops:
        lines.append(f"  {row['seconds'] * ms:8.2f} ms  x{row['count']:<5g} {row['kind']:<26} "
                     f"{row['op'][:40]:<40} {row['source'][-48:]}")
    return "\n".join(lines)
