"""The layouts a strategy prices: each enumerates its meshes for a GPT on G GPUs and prices one
step of each (the table of :mod:`jphantom.planner`; Singh's Sec. 5.1.2 for pmm3d's 4D grids,
Eqs. 5.1-5.7; the others with the same alpha-beta, placement-aware network model).

A registry strategy names its layouts (:attr:`jphantom.registry.strategies.Strategy.layouts`: ``pmm3d``'s
grids, ``phantom``, and under ``tensor`` Megatron's, plain data parallelism, the pipelines, ZeRO-3
and ring attention), and :meth:`jphantom.registry.strategies.Strategy.price` yields their
:class:`Candidate`\\ s; :func:`jphantom.planner.search.plan` turns them into ranked rows. What every
layout reads is one :class:`Pricing`: the model's shape, the devices, the batch and how the step is
counted."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from jphantom.perf import axonn_model as ax
from jphantom.perf.axonn_model import Collective, GPTShape
from jphantom.planner.pricing import (CollectivePricer, data_all_reduce, inventory,
                                      lockstep_idle, phantom_eq8_bound, phantom_linear,
                                      phantom_linear_flops, pmm3d_collectives)


@dataclasses.dataclass(frozen=True)
class Pricing:
    """What every layout is priced from: the model's ``shape`` on ``devices`` GPUs, ``batch``
    sequences in ``accumulate`` micro-batches, the ``pricer`` of collectives (the topology and the
    message bytes), the precision ``p``, phantom's ghost width ``k``, the counting choices of
    :func:`jphantom.planner.search.plan` (``as_compiled``, ``recompute``, ``flash_attention``) and
    the sustained ``device_tflops`` pricing a pipeline's bubble."""

    shape: GPTShape
    devices: int
    batch: int
    accumulate: int
    pricer: CollectivePricer
    p: Any
    k: int
    as_compiled: bool
    recompute: bool
    flash_attention: bool
    device_tflops: float

    @property
    def grad_bytes(self) -> int | None:
        """Float32 master gradients reduce in float32 (``as_compiled``)."""
        return 4 if self.as_compiled else None

    @property
    def divisors(self) -> list[int]:
        return [d for d in range(1, self.devices + 1) if self.devices % d == 0]

    @property
    def dense_flops(self) -> float:
        """Narayanan's FLOPs of a step per device, every dense layout's."""
        return self.shape.flops_per_step(self.batch, recompute=self.recompute) / self.devices

    @property
    def total_params(self) -> int:
        return self.shape.param_count()

    def activations(self, shape: GPTShape | None = None, tokens: int = 0, **split) -> dict:
        """The checkpointed activations of ``tokens`` per rank
        (:func:`jphantom.perf.axonn_model.checkpointed_activations`)."""
        return ax.checkpointed_activations(self.shape if shape is None else shape, tokens,
                                           element_bytes=self.p.element_bytes,
                                           flash_attention=self.flash_attention, **split)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout on one mesh, priced: ``priced`` is the pricer's (seconds, bytes) by axis."""

    layout: str
    strategy: str
    mesh: str
    options: dict
    priced: tuple[dict, dict]
    memory: dict
    flops: float
    bubble_s: float = 0.0
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Layout:
    """A named layout of a strategy: ``enumerate(pricing, layout)`` yields its candidates."""

    name: str
    enumerate: Any
    strategy: str = "tensor"

    def price(self, pricing: Pricing) -> Iterator[Candidate]:
        return self.enumerate(pricing, self)


# -- pmm3d: Singh's thesis ch. 5, Eqs. 5.1-5.7 -----------------------------------------------------


def _pmm3d(q: Pricing, layout: Layout) -> Iterator[Candidate]:
    shape, pricer, L = q.shape, q.pricer, q.shape.layers
    for grid in ax.configurations(q.devices):
        if ax.grid_problems(grid, shape, q.batch, accumulate=q.accumulate):
            continue
        # one block priced and counted L times (the blocks are alike: work bounded in L)
        block_and_head = ax.gpt_layers(dataclasses.replace(ax.GPTShape.of(shape), layers=1),
                                       q.batch * shape.seq_len // grid.data, lm_head=True)
        priced = [pricer.price([c for i, layer in enumerate(part) for c in
                                pmm3d_collectives(layer, grid, q.accumulate, q.as_compiled,
                                                  q.recompute and i < len(part) - 1
                                                  and layer.name != "lm_head")],
                               grid.levels)
                  for part in (block_and_head[:-1], block_and_head[-1:])]
        tables = _pmm3d_tables(shape, grid, q.grad_bytes)
        priced.append(pricer.price(tables, grid.levels) if tables else ({}, {}))
        by_axis, volume = ({axis: L * block.get(axis, 0.0) + head.get(axis, 0.0)
                            + table.get(axis, 0.0)
                            for axis in dict.fromkeys([*block, *head, *table])}
                           for block, head, table in zip(*priced))
        memory = ax.pmm3d_memory(grid, shape, q.batch, precision=q.p, accumulate=q.accumulate,
                                 flash_attention=q.flash_attention, lm_head=True)
        memory.pop("total")
        yield Candidate(layout.name, layout.strategy, str(grid), {}, (by_axis, volume), memory,
                        q.dense_flops)


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
    if shape.kind.positions:  # the learned position table's gradient
        tables.append(Collective("all-reduce", "data+z", grid.z * grid.data,
                                 shape.seq_len * h / grid.y, 1,
                                 "the position table's gradient", grad_bytes))
    return tables


# -- Megatron's tensor parallelism (+ SP) x data; model=1 is plain data parallelism ---------------


def _megatron(sequence_parallel: bool, tensor: bool):
    """The layout of Megatron's ``model`` axis (``tensor``: T > 1; else T = 1, data parallelism),
    with or without ``sequence_parallel``."""

    def enumerate_meshes(q: Pricing, layout: Layout) -> Iterator[Candidate]:
        for t in q.divisors[1:] if tensor else q.divisors[:1]:
            d = q.devices // t
            shape, S = q.shape, q.shape.seq_len
            if shape.heads % t or (shape.kv_heads or shape.heads) % t or shape.vocab_size % t or (
                    q.batch % (d * q.accumulate)) or (sequence_parallel and S % t):
                continue
            per_rank = q.batch // (d * q.accumulate)
            collectives = inventory("tensor", shape, d, t, per_rank, None, sequence_parallel,
                                    q.accumulate)
            collectives += _recomputed(q, t, per_rank, sequence_parallel)
            params = _tensor_params(shape, t, q.total_params)
            collectives.append(data_all_reduce(params, d, shape.layers + 1, q.grad_bytes))
            tokens = per_rank * S
            memory = {"state": q.p.state_bytes * params,
                      **q.activations(tokens=tokens, stream_split=t if sequence_parallel else 1,
                                      inner_split=t, stored_layers=shape.layers),
                      "logits": ax.logits_bytes(tokens, t, shape)}
            options = {"sequence_parallel": True} if sequence_parallel else {}
            yield Candidate(layout.name, layout.strategy, f"data={d},model={t}", options,
                            q.pricer.price(collectives, (("model", t), ("data", d))), memory,
                            q.dense_flops)

    return enumerate_meshes


def _recomputed(q: Pricing, t: int, per_rank: int, sequence_parallel: bool) -> list[Collective]:
    """``as_compiled`` with ``recompute``: the recomputed forward's collectives, the last layer's
    aside (SP: the inventory's backward already gathers both inputs again from their kept shards;
    the recomputed forward's gathers take their place)."""
    if not (q.as_compiled and q.recompute and t > 1):
        return []
    tokens_h, L = per_rank * q.shape.seq_len * q.shape.hidden, q.shape.layers
    if sequence_parallel:
        return [Collective("reduce-scatter", "model", t, tokens_h / t, L * q.accumulate,
                           "SP recompute: attention output")]
    return [Collective("all-reduce", "model", t, tokens_h, L * q.accumulate,
                       "recompute: attention output all-reduce again")]


def _tensor_params(shape: GPTShape, t: int, total_params: int) -> float:
    """A rank's parameters under Megatron's split over ``t``: the column-parallel weights and
    biases (GPT-2's 7 h) and the vocabulary tables split, the rest whole."""
    L, h, V = shape.layers, shape.hidden, shape.vocab_size
    sharded = (L * (shape.block_matmul_params + shape.kind.split_biases * h)
               + V * h * (1 if shape.tied_head else 2))
    return sharded / t + (total_params - sharded)


# -- Seal et al.'s phantom parallelism x data ------------------------------------------------------


def _phantom(q: Pricing, layout: Layout) -> Iterator[Candidate]:
    shape, k = q.shape, q.k
    if not shape.kind.phantom:
        return
    h, L, S, V = shape.hidden, shape.layers, shape.seq_len, shape.vocab_size
    linears = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]
    for t in q.divisors[1:]:
        d = q.devices // t
        if shape.heads % t or V % t or q.batch % (d * q.accumulate):
            continue
        per_rank = q.batch // (d * q.accumulate)
        collectives = inventory("phantom", shape, d, t, per_rank, k, False, q.accumulate)
        params = (L * (sum(phantom_linear(i, o, t, k) for i, o in linears) + 4 * h // t)
                  + (V + S) * h // t + 2 * h // t + phantom_linear(h, V, t, k))
        collectives.append(data_all_reduce(params, d, L + 1, q.grad_bytes))
        tokens = per_rank * S
        ghosts = 4 * tokens * t * k * q.p.element_bytes  # one block's received ghosts [T, p k]
        memory = {"state": q.p.state_bytes * params,
                  **q.activations(tokens=tokens, stream_split=t, inner_split=t, stored_layers=L),
                  "ghosts": ghosts, "logits": ax.logits_bytes(tokens, t, shape)}
        r = 4 if q.recompute else 3
        block = sum(phantom_linear_flops(i, o, t, k) for i, o in linears) + 4 * S * h // t
        flops = q.batch * S / d * (r * L * block + 3 * phantom_linear_flops(h, V, t, k))
        notes = ["a different model: k ghosts per rank replace the off-diagonal blocks of "
                 "every projection (Seal et al.), so it is never the top choice"]
        bound = phantom_eq8_bound(h, t)
        if k >= bound:
            notes.append(f"k={k} >= Eq. 8 bound {bound:.0f}: larger than the dense layer")
        yield Candidate(layout.name, layout.strategy, f"data={d},model={t}", {"ghost_width": k},
                        q.pricer.price(collectives, (("model", t), ("data", d))), memory, flops,
                        notes=tuple(notes))


# -- pipelines: stage x data, micro-batches of one sequence ----------------------------------------


def _pipeline(schedule: str):
    """The layout of a pipeline ``schedule`` (``1f1b``, ``zb-h1``, ``zb-v``)."""

    def enumerate_meshes(q: Pricing, layout: Layout) -> Iterator[Candidate]:
        shape, L = q.shape, q.shape.layers
        for stages in q.divisors[1:]:
            d = q.devices // stages
            if L % (stages * (2 if schedule == "zb-v" else 1)) or q.batch % d:
                continue
            M = q.batch // d
            bubble = lockstep_idle(schedule, stages, M) / (3 * M)  # idle / busy time
            compute_s = q.dense_flops / (q.device_tflops * 1e12)
            in_flight = min(stages, M)  # the zero-bubble schedules keep 1F1B's peak
            memory = {"state": q.p.state_bytes * (L // stages * shape.block_params
                                                  + _unblocked(q)),
                      **q.activations(tokens=shape.seq_len, stream_split=1, inner_split=1,
                                      stored_layers=in_flight * L // stages),
                      "logits": ax.logits_bytes(shape.seq_len, 1, shape)}
            fraction = bubble / (1 + bubble)
            yield Candidate(
                layout.name, layout.strategy, f"data={d},stage={stages}",
                {"schedule": schedule, "microbatches": M},
                q.pricer.price(_pipeline_collectives(q, schedule, stages, d, M),
                               (("stage", stages), ("data", d))),
                memory, q.dense_flops, bubble_s=compute_s * bubble,
                notes=(f"lock-step bubble {fraction:.1%} of the step (t_b = 2 t_f, B = W), "
                       f"priced at {q.device_tflops:g} TFLOP/s",))

    return enumerate_meshes


def _unblocked(q: Pricing) -> int:
    """What is not a block (embedding, final norm, untied head)."""
    return q.total_params - q.shape.layers * q.shape.block_params


def _pipeline_collectives(q: Pricing, schedule: str, stages: int, d: int, M: int
                          ) -> list[Collective]:
    """A pipeline step's messages (each micro-batch's activations [S, h] forward, their gradient
    backward; zb-v: both chunks' boundaries) and its gradient reductions: a stage's blocks over
    data, and what every stage holds (embedding, final norm, untied head) over data x stage."""
    shape, L = q.shape, q.shape.layers
    sends = 4 * M if schedule == "zb-v" else 2 * M
    return [Collective("collective-permute", "stage", stages, shape.seq_len * shape.hidden,
                       sends, f"{schedule} point-to-point: each micro-batch's "
                       "activations forward, their gradient backward"),
            data_all_reduce(L // stages * shape.block_params, d, L // stages, q.grad_bytes),
            Collective("all-reduce", "data+stage", d * stages, _unblocked(q), 1,
                       "gradients of what every stage holds", q.grad_bytes)]


# -- ZeRO-3 over data ------------------------------------------------------------------------------


def _zero3_collectives(group: int, accumulate: int, layers: int, block_params: int, rest: int,
                       rest_notes: tuple[str, str], axis: str = "data") -> list[Collective]:
    """ZeRO-3 over ``axis`` (``data``; ``data+context`` beside ring attention) of ``group``
    ranks, per micro-batch: each block gathered forward and again backward and its gradient
    reduce-scattered; the rest (``rest_notes``) likewise once."""
    return [Collective("all-gather", axis, group, block_params, 2 * accumulate * layers,
                       "ZeRO-3: each block gathered forward and again backward"),
            Collective("reduce-scatter", axis, group, block_params / group, accumulate * layers,
                       "ZeRO-3: each block's gradient reduce-scattered"),
            Collective("all-gather", axis, group, rest, accumulate, rest_notes[0]),
            Collective("reduce-scatter", axis, group, rest / group, accumulate, rest_notes[1])]


def _zero3(q: Pricing, layout: Layout) -> Iterator[Candidate]:
    G, A, shape = q.devices, q.accumulate, q.shape
    if G == 1 or q.batch % (G * A):
        return
    L, block_params, rest = shape.layers, shape.block_params, _unblocked(q)
    collectives = _zero3_collectives(G, A, L, block_params, rest,
                                     ("ZeRO-3: embeddings, final norm", "ZeRO-3: their gradients"))
    tokens = q.batch // (G * A) * shape.seq_len
    memory = {"state": q.p.state_bytes * q.total_params / G,
              **q.activations(tokens=tokens, stream_split=1, inner_split=1, stored_layers=L),
              "transient": 2 * (block_params + rest) * q.p.element_bytes,
              "logits": ax.logits_bytes(tokens, 1, shape)}
    yield Candidate(layout.name, layout.strategy, f"data={G},model=1", {"zero": 3},
                    q.pricer.price(collectives, (("model", 1), ("data", G))), memory,
                    q.dense_flops)


# -- ring attention over context x data (jphantom.nn.attention) ------------------------------------


def _context(q: Pricing, layout: Layout) -> Iterator[Candidate]:
    shape, A = q.shape, q.accumulate
    S, L, h = shape.seq_len, shape.layers, shape.hidden
    for c in q.divisors[1:]:
        d = q.devices // c
        if S % (2 * c) or q.batch % (d * A):
            continue
        per_rank = q.batch // (d * A)
        chunk = per_rank * (S // c) * (shape.kv_heads or shape.heads) * (h // shape.heads)
        passes = 3 if q.recompute else 2  # forward, backward (and the recompute forward)
        collectives = [
            Collective("collective-permute", "context", c, chunk, 2 * passes * (c - 1) * L * A,
                       "ring attention: K and V chunks passed C-1 times per pass"),
            Collective("collective-permute", "context", c, chunk, 2 * (c - 1) * L * A,
                       "ring attention: dK and dV carried home, float32", 4),
            Collective("all-reduce", "data+context", d * c, q.total_params / (L + 1), L + 1,
                       "gradient all-reduce over data x context", q.grad_bytes)]
        tokens = per_rank * S // c
        memory = {"state": q.p.state_bytes * q.total_params,
                  **q.activations(dataclasses.replace(shape, seq_len=S // c), tokens,
                                  stream_split=1, inner_split=1, stored_layers=L),
                  "logits": ax.logits_bytes(tokens, 1, shape)}
        mesh = f"data={d},context={c},model=1"
        yield Candidate(layout.name, layout.strategy, mesh, {"context_attention": "ring"},
                        q.pricer.price(collectives, (("context", c), ("data", d))), memory,
                        q.dense_flops)
        if d > 1:  # with ZeRO-3 over data x context (the state sharded over both)
            yield _context_zero3(q, layout, mesh, collectives[:2], memory, c, d)


def _context_zero3(q: Pricing, layout: Layout, mesh: str, ring: list[Collective],
                   memory: dict, c: int, d: int) -> Candidate:
    """Ring attention with ZeRO-3 over the ranks holding the same weights, ``data`` x
    ``context`` (:data:`jphantom.step.zero.SHARDING_AXES`): the state sharded over both, the
    blocks gathered over both."""
    A, L, total = q.accumulate, q.shape.layers, q.total_params
    block_params, rest = q.shape.block_params, _unblocked(q)
    sharded = ring + _zero3_collectives(d * c, A, L, block_params, rest,
                                        ("ZeRO-3: the rest", "ZeRO-3: its gradient"),
                                        axis="data+context")
    memory = {**memory, "state": q.p.state_bytes * total / (d * c),
              "transient": 2 * (block_params + rest) * q.p.element_bytes}
    return Candidate(layout.name, layout.strategy, mesh, {"context_attention": "ring", "zero": 3},
                     q.pricer.price(sharded, (("context", c), ("data", d))), memory,
                     q.dense_flops)


PIPELINES = {"pipeline 1F1B": "1f1b", "pipeline ZB-H1": "zb-h1", "pipeline ZB-V": "zb-v"}
"""The pipeline layouts by name, and their schedules (:mod:`jphantom.pipeline.schedule`)."""

PMM3D = (Layout("pmm3d", _pmm3d, "pmm3d"),)
PHANTOM = (Layout("phantom", _phantom, "phantom"),)
TENSOR = (Layout("tensor", _megatron(False, True)), Layout("tensor + SP", _megatron(True, True)),
          Layout("data", _megatron(False, False)),
          *(Layout(name, _pipeline(schedule)) for name, schedule in PIPELINES.items()),
          Layout("zero-3", _zero3), Layout("context", _context))
"""The layouts of the registry's ``pmm3d``, ``phantom`` and ``tensor``
(:attr:`jphantom.registry.strategies.Strategy.layouts`)."""
