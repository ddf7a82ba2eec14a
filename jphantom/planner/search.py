"""The planner: every layout of a GPT on G GPUs enumerated and priced, then ranked (Singh's
Sec. 5.1.2: the 4D grids priced with Eqs. 5.1-5.7; the other layouts jphantom trains with the
same alpha-beta, placement-aware network model; how each is priced: :mod:`jphantom.planner`)."""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Sequence
from typing import Any

from jphantom.errors import ConfigError
from jphantom.perf import axonn_model as ax
from jphantom.perf.axonn_model import GIB, Collective, GPTShape, Topology
from jphantom.planner.pricing import (CollectivePricer, data_all_reduce, inventory,
                                      lockstep_idle, phantom_eq8_bound, phantom_linear,
                                      phantom_linear_flops, pmm3d_collectives)
from jphantom.planner.result import PlanRow, Ranking
from jphantom.strategies import get as get_strategy


LAYOUTS = ("pmm3d", "tensor", "tensor + SP", "data", "phantom", "pipeline 1F1B", "pipeline ZB-H1",
           "pipeline ZB-V", "zero-3", "context")
PIPELINES = {"pipeline 1F1B": "1f1b", "pipeline ZB-H1": "zb-h1", "pipeline ZB-V": "zb-v"}
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
    _devices(devices)
    topology = Topology.perlmutter() if topology is None else topology
    if not isinstance(topology, Topology):
        raise ConfigError(f"topology={topology!r} must be a jphantom.perf.axonn_model.Topology, "
                          "e.g. Topology.perlmutter()")
    _int("batch", batch, 1, "give the sequences per training step, e.g. 512")
    _int("accumulate", accumulate, 1, "give the gradient-accumulation micro-batches, e.g. 1")
    if memory_gib is not None:
        memory_gib = _number("memory_gib", memory_gib, "give one GPU's memory in GiB, e.g. 40")
    device_tflops, power = _device_pricing(objective, device, precision, device_tflops)
    p = ax.precision_of(precision)
    k = max(1, shape.hidden // 32) if ghost_width is None else ghost_width
    _int("ghost_width", k, 1, "give phantom's k ghost neurons per rank and token, e.g. 64")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or not layouts:
        raise ConfigError(f"layouts={list(layouts)!r}: choose from {list(LAYOUTS)}")
    for name, value in (("latency", latency), ("flash_attention", flash_attention),
                        ("recompute", recompute), ("as_compiled", as_compiled)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be True or False")

    pricer = CollectivePricer(topology, p.element_bytes, latency)
    grad_bytes = 4 if as_compiled else None  # float32 master gradients reduce in float32
    h, L, S, V = shape.hidden, shape.layers, shape.seq_len, shape.vocab_size
    total_params = shape.param_count()
    dense_flops = shape.flops_per_step(batch, recompute=recompute) / devices
    acts = dict(element_bytes=p.element_bytes, flash_attention=flash_attention)
    rows: list[PlanRow] = []

    def add(layout, strategy, mesh, options, priced, memory, flops, bubble_s=0.0, notes=()):
        by_axis, volume = priced
        memory = dict(memory)
        memory["total"] = sum(v for key, v in memory.items() if key != "total")
        fits = None if memory_gib is None else memory["total"] <= memory_gib * GIB
        rows.append(PlanRow(layout, strategy, mesh, types.MappingProxyType(dict(options)),
                            sum(by_axis.values()), types.MappingProxyType(dict(by_axis)),
                            bubble_s, flops, types.MappingProxyType(memory), fits, tuple(notes),
                            same_model=get_strategy(strategy).same_model,
                            bytes_by_axis=types.MappingProxyType(dict(volume)),
                            compute_s=flops / (device_tflops * 1e12),
                            busy_watts=power.busy_watts, idle_watts=power.idle_watts,
                            devices=devices, tokens=batch * S, objective=objective))

    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    block_params = shape.block_params
    llama = shape.family == "llama"

    if "pmm3d" in layouts:  # Singh's thesis ch. 5: Eqs. 5.1-5.7
        for grid in ax.configurations(devices):
            if ax.grid_problems(grid, shape, batch, accumulate=accumulate):
                continue
            # one block priced and counted L times (the blocks are alike: work bounded in L)
            block_and_head = ax.gpt_layers(dataclasses.replace(ax.GPTShape.of(shape), layers=1),
                                           batch * S // grid.data, lm_head=True)
            priced = [pricer.price([c for i, layer in enumerate(part) for c in
                                    pmm3d_collectives(layer, grid, accumulate, as_compiled,
                                                       recompute and i < len(part) - 1
                                                       and layer.name != "lm_head")],
                                   grid.levels)
                      for part in (block_and_head[:-1], block_and_head[-1:])]
            tables = _pmm3d_tables(shape, grid, grad_bytes)
            priced.append(pricer.price(tables, grid.levels) if tables else ({}, {}))
            by_axis, volume = ({axis: L * block.get(axis, 0.0) + head.get(axis, 0.0)
                                + table.get(axis, 0.0)
                                for axis in dict.fromkeys([*block, *head, *table])}
                               for block, head, table in zip(*priced))
            memory = ax.pmm3d_memory(grid, shape, batch, precision=p, accumulate=accumulate,
                                     flash_attention=flash_attention, lm_head=True)
            memory.pop("total")
            add("pmm3d", "pmm3d", str(grid), {}, (by_axis, volume), memory, dense_flops)

    for t in divisors:  # Megatron tensor (+ SP) x data; t = 1 is plain data parallelism
        d = devices // t
        variants = [("data", False)] if t == 1 else [("tensor", False), ("tensor + SP", True)]
        for layout, sp in variants:
            if layout not in layouts:
                continue
            if shape.heads % t or V % t or batch % (d * accumulate) or (sp and S % t) or (
                    llama and shape.kv_heads % t):
                continue
            per_rank = batch // (d * accumulate)
            collectives = inventory("tensor", shape, d, t, per_rank, None, sp, accumulate)
            if as_compiled and recompute and t > 1:  # the recomputed forward, last layer aside
                tokens_h = per_rank * S * h
                # SP: the inventory's backward already gathers both inputs again (from their
                # kept shards); the recomputed forward's gathers take their place
                collectives += ([Collective("reduce-scatter", "model", t, tokens_h / t,
                                            L * accumulate, "SP recompute: attention output")]
                                if sp else
                                [Collective("all-reduce", "model", t, tokens_h, L * accumulate,
                                            "recompute: attention output all-reduce again")])
            # column-parallel weights and biases (GPT-2's 7 h), the vocabulary tables
            sharded = (L * (shape.block_matmul_params + (0 if llama else 7 * h))
                       + V * h * (1 if shape.tied_head else 2))
            params = sharded / t + (total_params - sharded)
            collectives.append(data_all_reduce(params, d, L + 1, grad_bytes))
            tokens = per_rank * S
            memory = {"state": p.state_bytes * params,
                      **ax.checkpointed_activations(shape, tokens, stream_split=t if sp else 1,
                                                    inner_split=t, stored_layers=L, **acts),
                      "logits": ax.logits_bytes(tokens, t, shape)}
            options = {"sequence_parallel": True} if sp else {}
            add(layout, "tensor", f"data={d},model={t}", options,
                pricer.price(collectives, (("model", t), ("data", d))), memory, dense_flops)

    if "phantom" in layouts and not llama:  # Seal et al.'s phantom parallelism x data
        for t in divisors[1:]:
            d = devices // t
            if shape.heads % t or V % t or batch % (d * accumulate):
                continue
            per_rank = batch // (d * accumulate)
            collectives = inventory("phantom", shape, d, t, per_rank, k, False, accumulate)
            linears = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]
            params = (L * (sum(phantom_linear(i, o, t, k) for i, o in linears) + 4 * h // t)
                      + (V + S) * h // t + 2 * h // t + phantom_linear(h, V, t, k))
            collectives.append(data_all_reduce(params, d, L + 1, grad_bytes))
            tokens = per_rank * S
            ghosts = 4 * tokens * t * k * p.element_bytes  # one block's received ghosts [T, p k]
            memory = {"state": p.state_bytes * params,
                      **ax.checkpointed_activations(shape, tokens, stream_split=t, inner_split=t,
                                                    stored_layers=L, **acts),
                      "ghosts": ghosts, "logits": ax.logits_bytes(tokens, t, shape)}
            r = 4 if recompute else 3
            block = sum(phantom_linear_flops(i, o, t, k) for i, o in linears) + 4 * S * h // t
            flops = batch * S / d * (r * L * block + 3 * phantom_linear_flops(h, V, t, k))
            notes = ["a different model: k ghosts per rank replace the off-diagonal blocks of "
                     "every projection (Seal et al.), so it is never the top choice"]
            bound = phantom_eq8_bound(h, t)
            if k >= bound:
                notes.append(f"k={k} >= Eq. 8 bound {bound:.0f}: larger than the dense layer")
            add("phantom", "phantom", f"data={d},model={t}", {"ghost_width": k},
                pricer.price(collectives, (("model", t), ("data", d))), memory, flops,
                notes=notes)

    for layout, schedule in PIPELINES.items():  # stage x data, micro-batches of one sequence
        if layout not in layouts:
            continue
        for stages in divisors[1:]:
            d = devices // stages
            if L % (stages * (2 if schedule == "zb-v" else 1)) or batch % d:
                continue
            M = batch // d
            message = S * h  # one micro-batch's activations (and, backward, their gradient)
            sends = 4 * M if schedule == "zb-v" else 2 * M  # zb-v: both chunks' boundaries
            collectives = [Collective("collective-permute", "stage", stages, message, sends,
                                      f"{schedule} point-to-point: each micro-batch's "
                                      "activations forward, their gradient backward")]
            # a stage's blocks, and what is not a block (embedding, final norm, untied head):
            # jphantom keeps those on every stage, their gradients reduced over data x stage
            rest = total_params - L * block_params
            params = L // stages * block_params + rest
            collectives.append(data_all_reduce(L // stages * block_params, d, L // stages,
                                                grad_bytes))
            collectives.append(Collective("all-reduce", "data+stage", d * stages, rest, 1,
                                          "gradients of what every stage holds", grad_bytes))
            bubble = lockstep_idle(schedule, stages, M) / (3 * M)  # idle / busy time
            compute_s = dense_flops / (device_tflops * 1e12)
            in_flight = min(stages, M)  # the zero-bubble schedules keep 1F1B's peak
            memory = {"state": p.state_bytes * params,
                      **ax.checkpointed_activations(shape, S, stream_split=1, inner_split=1,
                                                    stored_layers=in_flight * L // stages, **acts),
                      "logits": ax.logits_bytes(S, 1, shape)}
            fraction = bubble / (1 + bubble)
            add(layout, "tensor", f"data={d},stage={stages}",
                {"schedule": schedule, "microbatches": M},
                pricer.price(collectives, (("stage", stages), ("data", d))), memory, dense_flops,
                bubble_s=compute_s * bubble,
                notes=[f"lock-step bubble {fraction:.1%} of the step (t_b = 2 t_f, B = W), "
                       f"priced at {device_tflops:g} TFLOP/s"])

    if "zero-3" in layouts and devices > 1 and batch % (devices * accumulate) == 0:
        G, A = devices, accumulate
        rest = total_params - L * block_params
        collectives = [
            Collective("all-gather", "data", G, block_params, 2 * A * L,
                       "ZeRO-3: each block gathered forward and again backward"),
            Collective("reduce-scatter", "data", G, block_params / G, A * L,
                       "ZeRO-3: each block's gradient reduce-scattered"),
            Collective("all-gather", "data", G, rest, A, "ZeRO-3: embeddings, final norm"),
            Collective("reduce-scatter", "data", G, rest / G, A, "ZeRO-3: their gradients"),
        ]
        tokens = batch // (G * A) * S
        memory = {"state": p.state_bytes * total_params / G,
                  **ax.checkpointed_activations(shape, tokens, stream_split=1, inner_split=1,
                                                stored_layers=L, **acts),
                  "transient": 2 * (block_params + rest) * p.element_bytes,
                  "logits": ax.logits_bytes(tokens, 1, shape)}
        add("zero-3", "tensor", f"data={G},model=1", {"zero": 3},
            pricer.price(collectives, (("model", 1), ("data", G))), memory, dense_flops)

    if "context" in layouts:  # ring attention over context x data (jphantom.nn.attention)
        for c in divisors[1:]:
            d = devices // c
            if S % (2 * c) or batch % (d * accumulate):
                continue
            per_rank = batch // (d * accumulate)
            chunk = per_rank * (S // c) * (shape.kv_heads or shape.heads) * (h // shape.heads)  # K or V
            passes = 3 if recompute else 2  # forward, backward (and the recompute forward)
            collectives = [
                Collective("collective-permute", "context", c, chunk,
                           2 * passes * (c - 1) * L * accumulate,
                           "ring attention: K and V chunks passed C-1 times per pass"),
                Collective("collective-permute", "context", c, chunk,
                           2 * (c - 1) * L * accumulate,
                           "ring attention: dK and dV carried home, float32", 4),
                Collective("all-reduce", "data+context", d * c, total_params / (L + 1), L + 1,
                           "gradient all-reduce over data x context", grad_bytes)]
            tokens = per_rank * S // c
            memory = {"state": p.state_bytes * total_params,
                      **ax.checkpointed_activations(dataclasses.replace(shape, seq_len=S // c),
                                                    tokens, stream_split=1, inner_split=1,
                                                    stored_layers=L, **acts),
                      "logits": ax.logits_bytes(tokens, 1, shape)}
            add("context", "tensor", f"data={d},context={c},model=1",
                {"context_attention": "ring"},
                pricer.price(collectives, (("context", c), ("data", d))), memory, dense_flops)
            if d > 1:  # with ZeRO-3 over data (the state sharded; context keeps it whole)
                rest = total_params - L * block_params
                sharded = collectives[:2] + [
                    Collective("all-gather", "data", d, block_params, 2 * accumulate * L,
                               "ZeRO-3: each block gathered forward and again backward"),
                    Collective("reduce-scatter", "data", d, block_params / d, accumulate * L,
                               "ZeRO-3: each block's gradient reduce-scattered"),
                    Collective("all-gather", "data", d, rest, accumulate, "ZeRO-3: the rest"),
                    Collective("reduce-scatter", "data", d, rest / d, accumulate,
                               "ZeRO-3: its gradient"),
                    Collective("all-reduce", "context", c, total_params / d / (L + 1), L + 1,
                               "gradient shards all-reduced over context", grad_bytes)]
                memory = {**memory, "state": p.state_bytes * total_params / d,
                          "transient": 2 * (block_params + rest) * p.element_bytes}
                add("context", "tensor", f"data={d},context={c},model=1",
                    {"context_attention": "ring", "zero": 3},
                    pricer.price(sharded, (("context", c), ("data", d))), memory, dense_flops)

    if not rows:
        raise ConfigError(f"no layout of {len(layouts)} kinds can split this model over "
                          f"{devices} GPUs with batch={batch}: pick a batch divisible by the "
                          "device count (whole sequences per rank) or other sizes")
    rows.sort(key=lambda r: (r.fits is False, r.ranking_key, r.key_s, r.memory["total"],
                             r.layout, r.mesh))
    rows = [dataclasses.replace(row, rank=i + 1) for i, row in enumerate(rows)]
    assumptions = _assumptions(
        shape, total_params, batch, devices, topology, p, memory_gib, k, ghost_width,
        accumulate, latency, device_tflops, flash_attention, recompute, as_compiled, objective,
        device, power)
    assumptions["memory_source"] = memory_source if memory_gib is not None else None
    return Ranking(tuple(rows), types.MappingProxyType(assumptions))


def _devices(devices: Any) -> int:
    """``devices``, an integer in 1 .. :data:`MAX_DEVICES`."""
    _int("devices", devices, 1, "give the number of GPUs to plan for, e.g. 32")
    if devices > MAX_DEVICES:
        raise ConfigError(f"devices={devices} exceeds the planner's {MAX_DEVICES:,} GPUs: give "
                          "a machine's GPU count, e.g. 32")
    return devices


def _pmm3d_tables(shape: GPTShape, grid: Any, grad_bytes: int | None) -> list[Collective]:
    """The gradients of pmm3d's tables outside the blocks and the tied head: an untied
    embedding's (vocabulary over x, z and features over y: all-reduced over data, Eq. 5.5) and
    GPT-2's learned position table's [S, h/G_y] (replicated over x, z and data; the batch splits
    over data x z, so its gradient all-reduces over them)."""
    V, h = shape.vocab_size, shape.hidden
    tables = []
    if not shape.tied_head:
        tables.append(Collective("all-reduce", "data", grid.data,
                                 V * h / (grid.x * grid.y * grid.z), 1,
                                 "Eq. 5.5: the untied embedding's gradient", grad_bytes))
    if shape.family == "gpt2":
        tables.append(Collective("all-reduce", "data+z", grid.z * grid.data,
                                 shape.seq_len * h / grid.y, 1,
                                 "the position table's gradient", grad_bytes))
    return tables


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
