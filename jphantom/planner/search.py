"""The planner: every registry strategy prices its layouts of a GPT on G GPUs
(:meth:`jphantom.registry.strategies.Strategy.price`, :mod:`jphantom.planner.layouts`; Singh's Sec. 5.1.2:
the 4D grids priced with Eqs. 5.1-5.7; the other layouts jphantom trains with the same alpha-beta,
placement-aware network model; how each is priced: :mod:`jphantom.planner`), then they are
ranked."""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Sequence
from typing import Any

from jphantom.errors import ConfigError
from jphantom.perf import axonn_model as ax
from jphantom.perf.axonn_model import GIB, GPTShape, Topology
from jphantom.planner.layouts import Candidate, Pricing
from jphantom.planner.pricing import CollectivePricer
from jphantom.planner.result import PlanRow, Ranking
from jphantom.registry.strategies import STRATEGIES

LAYOUTS = tuple(layout.name for strategy in STRATEGIES.values() if strategy.declares("layouts")
                for layout in strategy.layouts)
"""Every layout the planner prices: the registry strategies' (:attr:`jphantom.registry.strategies.Strategy.
layouts`, :mod:`jphantom.planner.layouts`)."""
MAX_DEVICES = 1 << 20
"""The most GPUs :func:`plan` prices (1,048,576): its enumeration of every divisor and 4D grid
stays under seconds up to there; a larger count is refused by name rather than searched for
minutes."""
DEFAULT_DEVICE_TFLOPS = 280.0
"""Sustained bf16 TFLOP/s assumed per GPU to price a pipeline's bubble: the A100's empirical GEMM
peak (Singh's thesis §4.3: 280 of the advertised 312)."""


def _int(name: str, value: Any, minimum: int = 1, fix: str = "") -> int:
    return ax.check_count(name, value, minimum, fix)


def _number(name: str, value: Any, fix: str) -> float:
    return ax.check_positive(name, value, fix)


def plan(model: Any, devices: int, topology: Topology | None = None, *, batch: int,
         seq_len: int | None = None, memory_gib: float | None = None,
         precision: str = "bf16", ghost_width: int | None = None, accumulate: int = 1,
         latency: bool = True, device_tflops: float | None = None,
         flash_attention: bool = True, recompute: bool = True,
         layouts: Sequence[str] = LAYOUTS, as_compiled: bool = False,
         objective: str = "comm", device: Any = None,
         memory_source: str = "given") -> Ranking:
    """Price every layout of ``model`` (a :class:`GPTShape` or a transformer ``TransformerConfig``)
    on ``devices`` GPUs of ``topology`` (default :meth:`Topology.perlmutter`) for one training step
    of ``batch`` sequences, and rank them (module docstring).

    ``memory_gib``: the GPU's memory; layouts whose modelled memory exceeds it are marked
    ``fits=False`` and ranked last (``memory_source``: where that figure comes from, printed
    beside it). ``precision``: ``bf16`` (2-byte messages and activations, 16
    bytes of state per parameter) or ``float32``. ``ghost_width``: phantom's k (default hidden / 32,
    our choice; phantom rows above Seal et al.'s Eq. 8 bound are noted). ``accumulate``: gradient
    accumulation micro-batches A for every layout but the pipelines, whose micro-batches are one
    sequence each (M = batch / D, AxoNN ch. 3's micro-batch size 1). ``latency=False``: no α
    (pmm3d rows are then the paper's Eqs. 5.1-5.7, plus GPT-2's position-table gradient).
    ``device_tflops``: sustained TFLOP/s
    per GPU pricing the compute and the pipeline bubble (default: ``device``'s sustained GEMM
    rate, peak x GEMM efficiency, else :data:`DEFAULT_DEVICE_TFLOPS`).
    ``objective``: what to rank by (:data:`jphantom.planner.result.OBJECTIVES`): ``comm``
    (communication + bubble, the default), ``time`` (compute + communication + bubble), ``energy``
    (joules per token, Seal et al.'s Eq. 1 with ``device``'s busy and idle power, else Frontier's
    A = 560 W, B = 90 W) or ``memory``. ``device``: a :class:`jphantom.predict.DeviceModel`.
    ``flash_attention``: no S x S scores in activation memory.
    ``recompute``: FLOPs count the checkpointed forward again (Narayanan's 96 B S L h^2 form).
    ``layouts``: a subset of :data:`LAYOUTS`. ``as_compiled``: price what jphantom's compiled
    step moves (checked against the H100 compile, ``experiments/compile_at_scale.py``) instead of
    the papers' formulas alone: gradient reductions over ``data`` in float32 (the master
    gradients; 4 bytes per element under bf16), pmm3d's weight gathered over ``z`` again in the
    backward (as ZeRO-3's), and with ``recompute`` the checkpointed forward's activation
    collectives again, except those of each block's last layer, whose output the backward does not
    read (Megatron's attention all-reduce, or under SP the two all-gathers and the attention
    reduce-scatter; pmm3d's Eq. 5.3 all-reduces of the q/k/v, attention output and MLP up
    projections).
    """
    shape = GPTShape.of(model, seq_len)
    topology, memory_gib, k = _checked(shape, devices, topology, batch, accumulate, memory_gib,
                                       ghost_width, layouts, latency=latency,
                                       flash_attention=flash_attention, recompute=recompute,
                                       as_compiled=as_compiled)
    device_tflops, power = _device_pricing(objective, device, precision, device_tflops)
    p = ax.precision_of(precision)
    pricing = Pricing(shape, devices, batch, accumulate,
                      CollectivePricer(topology, p.element_bytes, latency), p, k, as_compiled,
                      recompute, flash_attention, device_tflops)
    priced = [c for strategy in STRATEGIES.values() for c in strategy.price(pricing, layouts)]
    if not priced:
        raise ConfigError(f"no layout of {len(layouts)} kinds can split this model over "
                          f"{devices} GPUs with batch={batch}: pick a batch divisible by the "
                          "device count (whole sequences per rank) or other sizes")
    rows = sorted((_row(c, pricing, memory_gib, power, objective) for c in priced),
                  key=lambda r: (r.fits is False, r.ranking_key, r.key_s, r.memory["total"],
                                 r.layout, r.mesh))
    rows = [dataclasses.replace(row, rank=i + 1) for i, row in enumerate(rows)]
    assumptions = _assumptions(
        shape, pricing.total_params, batch, devices, topology, p, memory_gib, k, ghost_width,
        accumulate, latency, device_tflops, flash_attention, recompute, as_compiled, objective,
        device, power)
    assumptions["memory_source"] = memory_source if memory_gib is not None else None
    return Ranking(tuple(rows), types.MappingProxyType(assumptions))


def _checked(shape: GPTShape, devices: Any, topology: Topology | None, batch: Any,
             accumulate: Any, memory_gib: Any, ghost_width: Any, layouts: Sequence[str],
             **flags: Any) -> tuple[Topology, float | None, int]:
    """:func:`plan`'s arguments checked, each refused by name: the topology (default
    :meth:`Topology.perlmutter`), the memory limit and phantom's k (default hidden / 32)."""
    _devices(devices)
    topology = Topology.perlmutter() if topology is None else topology
    if not isinstance(topology, Topology):
        raise ConfigError(f"topology={topology!r} must be a jphantom.perf.axonn_model.Topology, "
                          "e.g. Topology.perlmutter()")
    _int("batch", batch, 1, "give the sequences per training step, e.g. 512")
    _int("accumulate", accumulate, 1, "give the gradient-accumulation micro-batches, e.g. 1")
    if memory_gib is not None:
        memory_gib = _number("memory_gib", memory_gib, "give one GPU's memory in GiB, e.g. 40")
    k = max(1, shape.hidden // 32) if ghost_width is None else ghost_width
    _int("ghost_width", k, 1, "give phantom's k ghost neurons per rank and token, e.g. 64")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or not layouts:
        raise ConfigError(f"layouts={list(layouts)!r}: choose from {list(LAYOUTS)}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be True or False")
    return topology, memory_gib, k


def _row(c: Candidate, q: Pricing, memory_gib: float | None, power: Any, objective: str
         ) -> PlanRow:
    """A priced candidate as a row of the ranking: its memory totalled and checked against
    ``memory_gib``, its compute timed at the sustained rate, Eq. 1's power."""
    by_axis, volume = c.priced
    memory = dict(c.memory)
    memory["total"] = sum(v for key, v in memory.items() if key != "total")
    fits = None if memory_gib is None else memory["total"] <= memory_gib * GIB
    return PlanRow(c.layout, c.strategy, c.mesh, types.MappingProxyType(dict(c.options)),
                   sum(by_axis.values()), types.MappingProxyType(dict(by_axis)),
                   c.bubble_s, c.flops, types.MappingProxyType(memory), fits, tuple(c.notes),
                   same_model=STRATEGIES[c.strategy].same_model,
                   bytes_by_axis=types.MappingProxyType(dict(volume)),
                   compute_s=c.flops / (q.device_tflops * 1e12),
                   busy_watts=power.busy_watts, idle_watts=power.idle_watts,
                   devices=q.devices, tokens=q.batch * q.shape.seq_len, objective=objective)


def _devices(devices: Any) -> int:
    """``devices``, an integer in 1 .. :data:`MAX_DEVICES`."""
    _int("devices", devices, 1, "give the number of GPUs to plan for, e.g. 32")
    if devices > MAX_DEVICES:
        raise ConfigError(f"devices={devices} exceeds the planner's {MAX_DEVICES:,} GPUs: give "
                          "a machine's GPU count, e.g. 32")
    return devices


def _device_pricing(objective: str, device: Any, precision: str,
                    device_tflops: float | None) -> tuple[float, Any]:
    """The objective checked; the sustained TFLOP/s pricing compute (``device``'s peak x GEMM
    efficiency unless given, else :data:`DEFAULT_DEVICE_TFLOPS`) and Eq. 1's power (``device``'s
    busy and idle watts, else Frontier's)."""
    from jphantom.energy import PowerModel
    from jphantom.planner.result import OBJECTIVES

    if objective not in OBJECTIVES:
        raise ConfigError(f"objective={objective!r}: choose from {', '.join(OBJECTIVES)}")
    dtype = "bf16" if precision == "bf16" else "f32"
    if device_tflops is None:
        device_tflops = (device.peak_flops(dtype) * device[f"gemm_efficiency.{dtype}"] / 1e12
                         if device is not None else DEFAULT_DEVICE_TFLOPS)
    device_tflops = _number("device_tflops", device_tflops,
                            "give the sustained TFLOP/s of one GPU, e.g. 280")
    power = (PowerModel(device["power.busy_watts"], device["power.idle_watts"], device.name)
             if device is not None else PowerModel())
    return device_tflops, power


def _assumptions(shape, total_params, batch, devices, topology, p, memory_gib, k, ghost_width,
                 accumulate, latency, device_tflops, flash_attention, recompute, as_compiled,
                 objective, device, power) -> dict:
    """Everything a ranking assumed, with what it models and what it does not."""
    return {
        "nodes": math.ceil(devices / topology.gpus_per_node),
        "model": dataclasses.asdict(shape) | {"parameters": total_params},
        "batch_sequences": batch, "tokens_per_step": batch * shape.seq_len, "devices": devices,
        "topology": topology.as_dict(),
        "precision": {"name": p.name, "message_bytes": p.element_bytes,
                      "state_bytes_per_parameter": p.state_bytes, "source": p.source},
        "memory_gib": memory_gib, "ghost_width": k,
        "ghost_width_source": "given" if ghost_width is not None else "hidden / 32 (our default)",
        "accumulate": accumulate, "latency": latency, "device_tflops": device_tflops,
        "flash_attention": flash_attention, "recompute_flops": recompute,
        "as_compiled": as_compiled,
        "objective": objective,
        "ranking": {"comm": "modelled communication + pipeline bubble seconds per step",
                    "time": "modelled step seconds: compute at the sustained GEMM rate + "
                            "communication (none hidden) + pipeline bubble",
                    "energy": "joules per token, Seal et al.'s Eq. 1: A x compute + B x "
                              "(communication + bubble) on every GPU",
                    "memory": "modelled memory per GPU"}[objective] + ", layouts that fit first",
        "device": device.name if device is not None else None,
        "power_watts": {"busy": power.busy_watts, "idle": power.idle_watts,
                        "source": power.name},
        "modelled": "ring collectives priced count x (wire x bytes / beta + steps x alpha), beta "
                    "by Singh's thesis Eq. 5.7 per mesh level; pmm3d by Eqs. 5.1-5.6 over the GPT's "
                    "linear layers and the LM head; memory: state + checkpointed activations "
                    "(Korthikanti) + logits",
        "not_modelled": ("overlap, recompute collectives, compute and optimizer time (except the "
                         "pipeline bubble), LayerNorm collectives of pmm3d, kernel efficiency"
                         if objective in ("comm", "memory") else
                         "overlap of communication with compute (none hidden: an upper bound), "
                         "memory-bound kernels and the optimizer update, LayerNorm collectives "
                         "of pmm3d, per-shape kernel efficiency (--compile-top simulates the "
                         "compiled program for all of these)"),
    }
