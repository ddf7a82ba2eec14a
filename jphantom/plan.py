"""``jphantom plan``: rank every parallel layout of a GPT on G GPUs by modelled communication.

Singh's Sec. 5.1.2 enumerates the 4D grids (G_x, G_y, G_z, G_data), prices each with Eqs.
5.1-5.7 and runs the top few. This module does that (:mod:`jphantom.perf.axonn_model`) and prices
the other layouts jphantom trains with the same alpha-beta, placement-aware network model, so that
one table compares them. Every row is a layout you could run: its registry strategy, its mesh (the
:mod:`jphantom.mesh` text; axes outermost first) and its options.

==============  ==========  ===============================================================
layout          strategy    communication per step (per GPU)
==============  ==========  ===============================================================
pmm3d           pmm3d       Σ over the GPT's linear layers of Eq. 5.6 (Eqs. 5.1-5.5), the
                            tied LM head as one more normal layer (§1.4's layout)
tensor          tensor      ``program.collective_inventory(..., "tensor")`` on
                            data=D,model=T (Megatron's f/g all-reduces; seeds 002/003),
                            then the data all-reduce of the rank's parameters
tensor + SP     tensor      the same with ``sequence_parallel=True`` (all-reduces become
                            reduce-scatter + all-gather pairs; the Day 66 notes)
data            tensor      model=1: only the data all-reduce of all parameters
phantom         phantom     ``program.collective_inventory(..., "phantom")`` (k ghosts per
                            token all-gathered, reduced backward; Seal et al.) + data all-reduce
pipeline 1F1B   tensor      stage=P,data=D (model=1): one point-to-point message of one
                            micro-batch's activations [S, h] per micro-batch forward and one
                            gradient backward; the data all-reduce of the stage's parameters
pipeline ZB-H1  tensor      the same messages and memory; the bubble of the zero-bubble
                            schedule's lock-step table (:mod:`jphantom.pipeline.split`)
pipeline ZB-V   tensor      twice the messages (two chunks per device, the V placement); the
                            same memory; its lock-step bubble
zero-3          tensor      data=G,model=1 with ``--zero 3``: per micro-batch every block is
                            all-gathered forward and again backward (jphantom re-gathers under
                            remat) and its gradient reduce-scattered (Cheng et al. §1.2: 6P bytes)
context         tensor      data=D,context=C (model=1), ring attention: per layer (C-1) K/V
                            chunks [B S/C Hk d] forward, again backward (and in the recompute
                            forward), (C-1) dK/dV chunks backward (:mod:`jphantom.nn.attention`);
                            the gradient all-reduce over data x context
==============  ==========  ===============================================================

Each collective costs count x (wire elements x bytes / β + ring steps x α) (``Collective``), β
from Eq. 5.7 for the group's level in the mesh's hierarchy, innermost first (``model``/``x``,
``y``, ``z``, ``stage``, ``data``: the device order :meth:`jphantom.mesh.MeshConfig.build` uses);
a pipeline's point-to-point messages use one GPU pair's link
(:func:`jphantom.perf.axonn_model.point_to_point_bandwidth`).

The ranking key is ``comm_s + bubble_s``: the paper ranks by communication alone; a pipeline's
cost is mostly its bubble, idle time (P - 1)/M of its compute (1F1B with M micro-batches), so the
bubble is priced too, at the assumed sustained FLOP/s. Compute is not in the key: every dense
layout does the same FLOPs per device (Narayanan's count / G); phantom does fewer, but trains a
different, smaller model (Seal et al.), so its FLOPs are shown, not credited.

Memory per device (modelled; 16 bytes of state per parameter for bf16 + Adam, per-layer activation
checkpointing as the Ch. 5 runs, Korthikanti's per-layer activation count:
:func:`jphantom.perf.axonn_model.checkpointed_activations`) decides ``fits`` when a limit is given;
layouts that do not fit rank after those that do.

Not modelled: overlap of communication with compute (the paper's OAR/ORS/OAG), activation-recompute
collectives (AG_z and AR_y again in the recompute forward), AxoNN's backward re-gather of W,
non-linear layers' collectives under pmm3d (LayerNorm's psum over Y), the tied embedding's gradient
exchange between the first and last pipeline stage, optimizer and kernel time, MoE blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

from jphantom.errors import ConfigError
from jphantom.perf import axonn_model as ax
from jphantom.perf.axonn_model import GIB, Collective, GPTShape, Topology

LAYOUTS = ("pmm3d", "tensor", "tensor + SP", "data", "phantom", "pipeline 1F1B", "pipeline ZB-H1",
           "pipeline ZB-V", "zero-3", "context")
PIPELINES = {"pipeline 1F1B": "1f1b", "pipeline ZB-H1": "zb-h1", "pipeline ZB-V": "zb-v"}
DEFAULT_DEVICE_TFLOPS = 280.0
"""Sustained bf16 TFLOP/s assumed per GPU to price a pipeline's bubble: the A100's empirical GEMM
peak (Singh's thesis §4.3: 280 of the advertised 312)."""


def _int(name: str, value: Any, minimum: int = 1, fix: str = "") -> int:
    return ax.check_count(name, value, minimum, fix)


def _number(name: str, value: Any, fix: str) -> float:
    return ax.check_positive(name, value, fix)


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One layout, priced. ``strategy`` is the registry name (``pmm3d``, ``tensor``,
    ``phantom``), ``layout`` the display name (:data:`LAYOUTS`), ``mesh`` the mesh text,
    ``options`` the strategy's options (``sequence_parallel``, ``zero``, ``schedule`` and
    ``microbatches``, ``ghost_width``). Seconds and bytes per step and per device: ``comm_s``
    (Σ of ``comm_by_axis``), ``bubble_s`` (pipelines), ``flops_per_device``, ``memory`` (modelled
    breakdown, ``total``), ``fits`` (None without a memory limit), ``notes``, ``rank`` (1 =
    best), and ``bytes_by_axis`` (the modelled collectives' per-device result bytes per step, the
    compiled HLO's convention)."""

    layout: str
    strategy: str
    mesh: str
    options: Mapping[str, Any]
    comm_s: float
    comm_by_axis: Mapping[str, float]
    bubble_s: float
    flops_per_device: float
    memory: Mapping[str, float]
    fits: bool | None
    notes: tuple[str, ...] = ()
    rank: int = 0
    same_model: bool = True
    bytes_by_axis: Mapping[str, float] = dataclasses.field(default_factory=dict)

    @property
    def variant(self) -> str:
        """A short label: pmm3d's special cases (Singh's thesis §1.3), phantom's k, the pipeline's M."""
        o = self.options
        if "microbatches" in o:
            return f"M={o['microbatches']}"
        if "ghost_width" in o:
            return f"k={o['ghost_width']} *"
        if self.layout == "pmm3d":
            g = dict(item.split("=") for item in self.mesh.split(","))
            x, y, z, data = (int(g[a]) for a in ("x", "y", "z", "data"))
            if x == y == 1 and z > 1:
                return "FSDP" if data == 1 else "HSDP"
            if y == z == 1 and x > 1:
                return "1D (Megatron)"
            if x == y == z == 1 and data > 1:
                return "data parallel"
        return ""

    @property
    def key_s(self) -> float:
        """The ranking key: modelled communication + pipeline bubble seconds per step."""
        return self.comm_s + self.bubble_s

    @property
    def memory_gib(self) -> float:
        return self.memory["total"] / GIB

    def as_dict(self) -> dict:
        return {"rank": self.rank, "layout": self.layout, "strategy": self.strategy,
                "mesh": self.mesh, "options": dict(self.options), "comm_s": self.comm_s,
                "comm_by_axis_s": dict(self.comm_by_axis),
                "collective_bytes_by_axis": dict(self.bytes_by_axis), "bubble_s": self.bubble_s,
                "ranking_key_s": self.key_s, "flops_per_device": self.flops_per_device,
                "memory_bytes": dict(self.memory), "memory_gib": self.memory_gib,
                "fits": self.fits, "same_model": self.same_model, "variant": self.variant,
                "notes": list(self.notes)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The ranked rows (best first; iterate, index or ``len`` it like a list) and the inputs
    assumed (``assumptions``)."""

    rows: tuple[PlanRow, ...]
    assumptions: Mapping[str, Any]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]

    @property
    def top(self) -> PlanRow:
        """The top choice: the best-ranked layout that trains the given model (not phantom, whose
        model is smaller) and fits; if none fits, the best-ranked one that trains the model."""
        same = [row for row in self.rows if row.same_model]
        return next((row for row in same if row.fits is not False), same[0] if same else
                    self.rows[0])

    def as_dict(self, top: int | None = None) -> dict:
        rows = self.rows if top is None else self.rows[:top]
        return {"assumptions": dict(self.assumptions), "considered": len(self.rows),
                "fitting": sum(r.fits is not False for r in self.rows),
                "top_choice": self.top.as_dict(), "rows": [r.as_dict() for r in rows]}


# --------------------------------------------------------------------------------------------------
# Pricing helpers
# --------------------------------------------------------------------------------------------------


class _Pricer:
    """Collectives -> seconds on a topology, per mesh axis, with one precision and α switch."""

    def __init__(self, topology: Topology, element_bytes: int, latency: bool):
        self.topology, self.element_bytes = topology, element_bytes
        self.alpha = topology.latency_us * 1e-6 if latency else 0.0

    def price(self, collectives: Sequence[Collective],
              levels: Sequence[tuple[str, int]]) -> tuple[dict[str, float], dict[str, float]]:
        """({axis: seconds}, {axis: result bytes}) for ``collectives`` on a mesh whose ``levels``
        are innermost first. Bytes are the per-device result buffers times executions (what the
        compiled HLO reports, :class:`jphantom.perf.axonn_model.Collective`'s ``buffer``), at
        the precision's message bytes."""
        bandwidth = ax.hierarchy_bandwidths(levels, self.topology)
        inner = {name: math.prod(size for _, size in levels[:i])
                 for i, (name, _) in enumerate(levels)}
        by_axis = {name: 0.0 for name, size in levels if size > 1}
        volume = dict(by_axis)
        for c in collectives:
            if c.group > 1:  # a group over "a+b" spans both levels: priced at the outer
                # level's beta, the outermost of its axes with more than one rank (data=1,
                # context=C: context's, not data's, which has no link of its own)
                sizes = dict(levels)
                parts = [a for a in c.axis.split("+") if sizes.get(a, 1) > 1]
                outer = max(parts or c.axis.split("+")[:1],
                            key=lambda a: [name for name, _ in levels].index(a)
                            if a in sizes else -1)
                beta = (ax.point_to_point_bandwidth(self.topology, inner[c.axis], c.group)
                        if c.kind == "collective-permute" else bandwidth[outer])
                by_axis[c.axis] = by_axis.get(c.axis, 0.0) + c.seconds(
                    beta, latency_s=self.alpha, bytes_per_element=self.element_bytes)
                volume[c.axis] = volume.get(c.axis, 0.0) + c.count * c.buffer * (
                    c.element_bytes or self.element_bytes)
        return by_axis, volume


def _inventory(name: str, shape: GPTShape, data: int, model: int, batch_per_rank: int,
               ghost_width: int | None, sequence_parallel: bool, repeats: int) -> list[Collective]:
    """A registry strategy's per-step collectives over ``model`` (each list entry one execution of
    one per-device result buffer of that many elements), ``repeats`` times (micro-batches)."""
    from jphantom import program
    from jphantom.mesh import MeshConfig
    from jphantom.models.llama import LlamaConfig
    from jphantom.models.gpt2 import TransformerConfig

    if shape.family == "llama":
        config = LlamaConfig(vocab_size=shape.vocab_size, hidden=shape.hidden,
                             intermediate=shape.intermediate, layers=shape.layers,
                             heads=shape.heads, kv_heads=shape.kv_heads,
                             max_positions=shape.seq_len)
    else:
        config = TransformerConfig(vocab_size=shape.vocab_size, seq_len=shape.seq_len,
                                   hidden=shape.hidden, heads=shape.heads, layers=shape.layers,
                                   ghost_width=ghost_width)
    options = {"sequence_parallel": True} if sequence_parallel else {}
    inventory = program.collective_inventory(
        config, name, MeshConfig.of({"data": data, "model": model}), batch_per_rank, **options)
    out = []
    for kind, sizes in inventory.items():
        for size in sorted(set(sizes)):
            out.append(Collective(kind, "model", model, size, repeats * sizes.count(size),
                                  f"jphantom.program.collective_inventory({name!r})"))
    return out


def _data_all_reduce(params: float, data: int, buckets: int,
                     element_bytes: float | None = None) -> Collective:
    """The once-per-step gradient all-reduce over ``data`` of a rank's ``params``, in ``buckets``
    equal collectives (one per layer and one for the rest: each costs its ring steps of α);
    ``element_bytes``: 4 for float32 master gradients (``as_compiled``), else the precision's."""
    return Collective("all-reduce", "data", data, params / buckets, buckets,
                      "gradient all-reduce over data (Eq. 5.5's role)", element_bytes)


def _pmm3d_collectives(layer, grid, accumulate: int, as_compiled: bool,
                       recomputed: bool) -> list[Collective]:
    """Alg. 3's collectives of one layer (:func:`jphantom.perf.axonn_model.layer_collectives`);
    ``as_compiled``: plus the backward's re-gather of the weight over ``z``, the forward
    all-reduce again when the layer is ``recomputed``, the data all-reduce in float32."""
    out = ax.layer_collectives(layer, grid, microbatches=accumulate)
    if not as_compiled:
        return out
    gather, forward = out[0], out[2]
    extra = [dataclasses.replace(gather, equation="jphantom: W gathered again for the backward")]
    if recomputed:
        extra.append(dataclasses.replace(forward, equation="jphantom: recompute forward"))
    return ([dataclasses.replace(c, element_bytes=4) if c.axis == "data" else c for c in out]
            + extra)


def _phantom_linear(i: int, o: int, p: int, k: int) -> int:
    """Per-rank parameters of a phantom linear i -> o (``phantom.init_linear``): local (o/p)(i/p),
    compressor k i/p, decompressors p (o/p) k (own slot included), bias o/p."""
    return (o // p) * (i // p) + k * (i // p) + p * (o // p) * k + o // p


def _phantom_linear_flops(i: int, o: int, p: int, k: int) -> int:
    """Forward FLOPs per token and rank of a fused phantom linear: 2 (o/p)(i/p) + 2 k (i/p) +
    2 p k (o/p) (:mod:`jphantom.perf.step_model`'s count; the decompressor GEMM spans all p
    slots)."""
    return 2 * (o // p) * (i // p) + 2 * k * (i // p) + 2 * p * k * (o // p)


def _phantom_eq8_bound(hidden: int, p: int) -> float:
    """Seal et al. Eq. 8: phantom is smaller than the dense layer while k < (n/p)(1 - 1/p)."""
    return hidden / p * (1 - 1 / p)


# --------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _lockstep_idle(schedule: str, stages: int, microbatches: int) -> float:
    """Idle time of a schedule's lock-step table, in forwards of a whole stage (t_b = 2 t_f):
    1F1B (P - 1) x 3; the zero-bubble tables' idle time is the same for every M >= 2P, so it is
    measured at min(M, 2P) (their list scheduling grows with M)."""
    from jphantom.pipeline import schedule as schedules

    if schedule == "1f1b":
        return 3.0 * (stages - 1)
    m = min(microbatches, 2 * stages)
    return schedules.lockstep_split(schedule, stages, m).cost() - 3.0 * m


def plan(model: Any, devices: int, topology: Topology | None = None, *, batch: int,
         seq_len: int | None = None, memory_gib: float | None = None,
         precision: str = "bf16", ghost_width: int | None = None, accumulate: int = 1,
         latency: bool = True, device_tflops: float = DEFAULT_DEVICE_TFLOPS,
         flash_attention: bool = True, recompute: bool = True,
         layouts: Sequence[str] = LAYOUTS, as_compiled: bool = False) -> Plan:
    """Price every layout of ``model`` (a :class:`GPTShape` or a transformer ``TransformerConfig``)
    on ``devices`` GPUs of ``topology`` (default :meth:`Topology.perlmutter`) for one training step
    of ``batch`` sequences, and rank them (module docstring).

    ``memory_gib``: the GPU's memory; layouts whose modelled memory exceeds it are marked
    ``fits=False`` and ranked last. ``precision``: ``bf16`` (2-byte messages and activations, 16
    bytes of state per parameter) or ``float32``. ``ghost_width``: phantom's k (default hidden / 32,
    our choice; phantom rows above Seal et al.'s Eq. 8 bound are noted). ``accumulate``: gradient
    accumulation micro-batches A for every layout but the pipelines, whose micro-batches are one
    sequence each (M = batch / D, AxoNN ch. 3's micro-batch size 1). ``latency=False``: no α
    (pmm3d rows are then the paper's Eqs. 5.1-5.7 exactly). ``device_tflops``: sustained TFLOP/s
    per GPU pricing the pipeline bubble. ``flash_attention``: no S x S scores in activation memory.
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
    _int("devices", devices, 1, "give the number of GPUs to plan for, e.g. 32")
    topology = Topology.perlmutter() if topology is None else topology
    if not isinstance(topology, Topology):
        raise ConfigError(f"topology={topology!r} must be a jphantom.perf.axonn_model.Topology, "
                          "e.g. Topology.perlmutter()")
    _int("batch", batch, 1, "give the sequences per training step, e.g. 512")
    _int("accumulate", accumulate, 1, "give the gradient-accumulation micro-batches, e.g. 1")
    if memory_gib is not None:
        memory_gib = _number("memory_gib", memory_gib, "give one GPU's memory in GiB, e.g. 40")
    device_tflops = _number("device_tflops", device_tflops,
                            "give the sustained TFLOP/s of one GPU, e.g. 280")
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

    pricer = _Pricer(topology, p.element_bytes, latency)
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
                            same_model=strategy != "phantom",
                            bytes_by_axis=types.MappingProxyType(dict(volume))))

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
                                    _pmm3d_collectives(layer, grid, accumulate, as_compiled,
                                                       recompute and i < len(part) - 1
                                                       and layer.name != "lm_head")],
                                   grid.levels)
                      for part in (block_and_head[:-1], block_and_head[-1:])]
            if not shape.tied_head:  # the untied embedding's gradient over data (Eq. 5.5)
                table = [Collective("all-reduce", "data", grid.data,
                                    V * h / (grid.x * grid.y * grid.z), 1,
                                    "Eq. 5.5: the untied embedding's gradient", grad_bytes)]
                priced.append(pricer.price(table, grid.levels))
            else:
                priced.append(({}, {}))
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
            collectives = _inventory("tensor", shape, d, t, per_rank, None, sp, accumulate)
            if as_compiled and recompute and t > 1:  # the recomputed forward, last layer aside
                tokens_h = per_rank * S * h
                collectives += ([Collective("all-gather", "model", t, tokens_h, 2 * L * accumulate,
                                            "SP recompute: both inputs gathered again"),
                                 Collective("reduce-scatter", "model", t, tokens_h / t,
                                            L * accumulate, "SP recompute: attention output")]
                                if sp else
                                [Collective("all-reduce", "model", t, tokens_h, L * accumulate,
                                            "recompute: attention output all-reduce again")])
            # column-parallel weights and biases (GPT-2's 7 h), the vocabulary tables
            sharded = (L * (shape.block_matmul_params + (0 if llama else 7 * h))
                       + V * h * (1 if shape.tied_head else 2))
            params = sharded / t + (total_params - sharded)
            collectives.append(_data_all_reduce(params, d, L + 1, grad_bytes))
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
            collectives = _inventory("phantom", shape, d, t, per_rank, k, False, accumulate)
            linears = [(h, 3 * h), (h, h), (h, 4 * h), (4 * h, h)]
            params = (L * (sum(_phantom_linear(i, o, t, k) for i, o in linears) + 4 * h // t)
                      + (V + S) * h // t + 2 * h // t + _phantom_linear(h, V, t, k))
            collectives.append(_data_all_reduce(params, d, L + 1, grad_bytes))
            tokens = per_rank * S
            ghosts = 4 * tokens * t * k * p.element_bytes  # one block's received ghosts [T, p k]
            memory = {"state": p.state_bytes * params,
                      **ax.checkpointed_activations(shape, tokens, stream_split=t, inner_split=t,
                                                    stored_layers=L, **acts),
                      "ghosts": ghosts, "logits": ax.logits_bytes(tokens, t, shape)}
            r = 4 if recompute else 3
            block = sum(_phantom_linear_flops(i, o, t, k) for i, o in linears) + 4 * S * h // t
            flops = batch * S / d * (r * L * block + 3 * _phantom_linear_flops(h, V, t, k))
            notes = ["a different model: k ghosts per rank replace the off-diagonal blocks of "
                     "every projection (Seal et al.), so it is never the top choice"]
            bound = _phantom_eq8_bound(h, t)
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
            collectives.append(_data_all_reduce(L // stages * block_params, d, L // stages,
                                                grad_bytes))
            collectives.append(Collective("all-reduce", "data+stage", d * stages, rest, 1,
                                          "gradients of what every stage holds", grad_bytes))
            bubble = _lockstep_idle(schedule, stages, M) / (3 * M)  # idle / busy time
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
    rows.sort(key=lambda r: (r.fits is False, r.key_s, r.memory["total"], r.layout, r.mesh))
    rows = [dataclasses.replace(row, rank=i + 1) for i, row in enumerate(rows)]
    nodes = math.ceil(devices / topology.gpus_per_node)
    assumptions = {
        "model": dataclasses.asdict(shape) | {"parameters": total_params},
        "batch_sequences": batch, "tokens_per_step": batch * S, "devices": devices,
        "nodes": nodes, "topology": topology.as_dict(),
        "precision": {"name": p.name, "message_bytes": p.element_bytes,
                      "state_bytes_per_parameter": p.state_bytes, "source": p.source},
        "memory_gib": memory_gib, "ghost_width": k,
        "ghost_width_source": "given" if ghost_width is not None else "hidden / 32 (our default)",
        "accumulate": accumulate, "latency": latency, "device_tflops": device_tflops,
        "flash_attention": flash_attention, "recompute_flops": recompute,
        "as_compiled": as_compiled,
        "ranking": "modelled communication + pipeline bubble seconds per step, layouts that fit "
                   "first",
        "modelled": "ring collectives priced count x (wire x bytes / beta + steps x alpha), beta "
                    "by Singh's thesis Eq. 5.7 per mesh level; pmm3d by Eqs. 5.1-5.6 over the GPT's "
                    "linear layers and the LM head; memory: state + checkpointed activations "
                    "(Korthikanti) + logits",
        "not_modelled": "overlap, recompute collectives, compute and optimizer time (except the "
                        "pipeline bubble), LayerNorm collectives of pmm3d, kernel efficiency",
    }
    return Plan(tuple(rows), types.MappingProxyType(assumptions))


# --------------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------------


def format_plan(result: Plan, top: int = 10) -> str:
    """The ranking as a text table, the top choice and the assumptions."""
    a = result.assumptions
    m, t = a["model"], a["topology"]
    table = t["intra_node_table"]
    intra = (", ".join(f"({key}) {v:g}" for key, v in table.items())
             + f", else {t['intra_node_gbps']:g}") if table else f"{t['intra_node_gbps']:g}"
    fitting = sum(r.fits is not False for r in result.rows)
    limit = (f"{fitting} of {len(result.rows)} fit in {a['memory_gib']:g} GiB"
             if a["memory_gib"] is not None else f"{len(result.rows)} priced, no memory limit")
    lines = [
        (f"{ {'llama': 'Llama'}.get(m.get('model'), m.get('model'))} L={m['layers']}, h={m['hidden']}, heads={m['heads']} ({m['kv_heads']} key/"
         f"value), SwiGLU {m['intermediate']}, " if m.get("family") == "llama" else
         f"GPT L={m['layers']}, h={m['hidden']}, heads={m['heads']}, ")
        + f"S={m['seq_len']}, V={m['vocab_size']} ({m['parameters'] / 1e9:.2f}B parameters); batch "
        f"{a['batch_sequences']} sequences ({a['tokens_per_step']:,} tokens) per step"
        + (f", {a['accumulate']} accumulation micro-batches" if a["accumulate"] > 1 else "")
        + f"; {a['devices']} GPUs = {a['nodes']} node(s) x {t['gpus_per_node']}.",
        f"Network ({t['name']}): beta_inter {t['inter_node_gbps']:g} GB/s between nodes; intra-node"
        f" GB/s by (G0,G1): {intra}; alpha {t['latency_us']:g} us per ring step"
        + ("" if a["latency"] else " (off: Singh's model exactly)") + ".",
        f"{a['precision']['name']}: {a['precision']['message_bytes']}-byte messages, "
        f"{a['precision']['state_bytes_per_parameter']} bytes of state per parameter; "
        + ("no phantom layouts (GPT-2 blocks only)" if m.get("family") == "llama" else
           f"phantom k={a['ghost_width']}")
        + f"; pipeline bubble priced at {a['device_tflops']:g} TFLOP/s. "
        f"Layouts: {limit}.",
        "Ranked by modelled communication + pipeline bubble per step (Singh's thesis Eqs. 5.1-5.7, "
        "ring alpha-beta); memory modelled.",
        "",
        f"{'rank':>4}  {'strategy':<14} {'mesh':<24} {'variant':<14} {'comm s':>8} "
        f"{'bubble s':>8} {'TFLOP/dev':>9} {'mem GiB':>7}  fits",
    ]
    shown = result.rows[:top]
    for row in shown:
        fits = "-" if row.fits is None else ("yes" if row.fits else "no")
        bubble = f"{row.bubble_s:8.3f}" if row.bubble_s else f"{'-':>8}"
        lines.append(f"{row.rank:>4}  {row.layout:<14} {row.mesh:<24} {row.variant:<14} "
                     f"{row.comm_s:8.3f} {bubble} {row.flops_per_device / 1e12:9.1f} "
                     f"{row.memory_gib:7.1f}  {fits}")
    if any(not row.same_model for row in shown):
        lines.append("   * phantom trains a different, smaller model (Seal et al.): listed, never "
                     "the top choice")
    best = result.top
    axes = ", ".join(f"{axis} {s:.3f} s" for axis, s in best.comm_by_axis.items())
    verdict = ("" if best.fits is not False
               else " (nothing fits: the least communication among those that do not)")
    variant = f" ({best.variant})" if best.variant else ""
    lines += ["", f"Top choice{verdict}: rank {best.rank}, {best.layout} on {best.mesh}{variant}, "
              f"{best.key_s:.3f} s modelled per step ({axes or 'no communication'}), "
              f"{best.memory_gib:.1f} GiB per GPU."]
    lines.append("Not modelled: " + a["not_modelled"] + ".")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _parse_int(flag: str, text: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {text!r} is not a whole number: give e.g. {flag} "
                          f"{max(minimum, 32)}") from None
    if value < minimum:
        raise ConfigError(f"{flag} {value} must be >= {minimum}")
    return value


def _parse_float(flag: str, text: str, *, zero_ok: bool = False) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{flag} {text} must be a finite number {'>= 0' if zero_ok else '> 0'}")
    return value


def _shape_of_flags(args) -> GPTShape:
    """The planner's shape of ``--model`` (a registered family that declares a ``plan_shape``)
    at the flags' sizes."""
    from jphantom.config import ModelConfig
    from jphantom import families

    found = families.get(args.model)
    if found.plan_shape is None:
        priced = [f.name for f in families.families().values() if f.plan_shape is not None]
        raise ConfigError(f"--model {found.name}: the planner prices dense decoder blocks "
                          f"({', '.join(priced)}); {found.name} declares no plan_shape")
    sizes = {name: _parse_int(f"--{name.replace('_', '-')}", getattr(args, name))
             for name in ("layers", "hidden", "heads", "seq_len", "vocab")}
    for name in ("intermediate", "kv_heads"):
        value = getattr(args, name)
        if value is not None:
            sizes[name] = _parse_int(f"--{name.replace('_', '-')}", value)
    section = ModelConfig(name=found.name, **{k: v for k, v in sizes.items()
                                              if k in found.accepted})
    return GPTShape.of(found.plan_shape(found.from_flags(section, False)))


def _run(args) -> int:
    import json
    import sys

    shape = _shape_of_flags(args)
    gpus_per_node = _parse_int("--gpus-per-node", args.gpus_per_node)
    inter = _parse_float("--inter-node-gbps", args.inter_node_gbps)
    latency_us = _parse_float("--latency-us", args.latency_us, zero_ok=True)
    if args.intra_node_gbps is None and gpus_per_node == 4:
        base = Topology.perlmutter()
        topology = dataclasses.replace(
            base, inter_node_gbps=inter, latency_us=latency_us,
            name="perlmutter" if (inter, latency_us) == (base.inter_node_gbps, base.latency_us)
            else "perlmutter NVLink table, custom inter-node/latency")
    else:
        intra = 300.0 if args.intra_node_gbps is None else _parse_float("--intra-node-gbps",
                                                                        args.intra_node_gbps)
        topology = Topology(gpus_per_node=gpus_per_node, inter_node_gbps=inter,
                            intra_node_gbps=intra, latency_us=latency_us, name="custom")
    result = plan(
        shape, _parse_int("--devices", args.devices), topology,
        batch=_parse_int("--batch", args.batch),
        memory_gib=None if args.memory_gib is None else _parse_float("--memory-gib",
                                                                     args.memory_gib),
        precision=args.precision,
        ghost_width=None if args.ghost_width is None else _parse_int("--ghost-width",
                                                                    args.ghost_width),
        accumulate=_parse_int("--accumulate", args.accumulate), latency=not args.no_latency,
        device_tflops=_parse_float("--device-tflops", args.device_tflops),
        flash_attention=not args.attention_scores,
        as_compiled=args.as_compiled or args.compile_top is not None)
    top = _parse_int("--top", args.top)
    if args.compile_top is not None:
        return _compile_top(args, result, _parse_int("--compile-top", args.compile_top),
                            gpus_per_node)
    if args.json:
        json.dump(result.as_dict(top), sys.stdout, indent=2)
        print()
    else:
        print(format_plan(result, top))
    return 0


def _compile_top(args, result: Plan, k: int, gpus_per_node: int) -> int:
    """``--compile-top K``: compile the K best layouts for the target and re-rank them."""
    import json
    import os
    import sys

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from jphantom import aot

    devices = result.assumptions["devices"]
    if devices % gpus_per_node:
        raise ConfigError(f"--devices {devices} is not a whole number of nodes of "
                          f"--gpus-per-node {gpus_per_node}")
    target = aot.Target.parse(args.target, nodes=devices // gpus_per_node,
                              gpus_per_node=gpus_per_node)
    aot.require_plugin(target.platform)
    entries = aot.compile_plan(result, k, target)
    if args.json:
        json.dump({"plan": result.as_dict(k), "target": target.as_dict(),
                   "compiled": entries}, sys.stdout, indent=2)
        print()
        return 0
    print(format_plan(result, k))
    print(f"\nThe top {k} layouts that train this model, compiled for {target.name} and "
          "re-ranked (compiled peak fits first, then fewer collective bytes across nodes, then "
          "fewer in all):\n")
    print(aot.format_compiled_plan(entries))
    return 0


def add_parser(subparsers) -> None:
    """Register ``jphantom plan`` on the CLI's subparsers. Numbers are read as text and checked by
    the handler, so a bad value is one ``jphantom: error:`` line (exit status 2)."""
    parser = subparsers.add_parser(
        "plan", help="rank parallel layouts of a GPT on N GPUs by modelled communication "
                     "(Singh's Eqs. 5.1-5.7); nothing runs",
        description="Enumerate every 4D grid (pmm3d: data x z x y x x) and the other layouts "
                    "(Megatron tensor parallelism with and without sequence parallelism, plain "
                    "data parallelism, phantom parallelism, 1F1B pipelines, ZeRO-3) of a GPT on "
                    "--devices GPUs; price each step's collectives with the ring alpha-beta model "
                    "and AxoNN's placement-aware bandwidths (Singh's thesis Eq. 5.7: groups inside a "
                    "node use the intra-node table, groups across nodes share beta_inter); model "
                    "the memory per GPU; print them ranked, best first, with the top choice and "
                    "every assumption. Pure arithmetic: no devices, nothing compiled. Defaults: "
                    "GPT-20B of Singh's thesis Table 5.1 on 32 Perlmutter GPUs.",
        epilog="Examples: jphantom plan --devices 32 --memory-gib 40  (GPT-20B on 8 Perlmutter "
               "nodes) | jphantom plan --layers 38 --hidden 9216 --heads 72 --devices 64 "
               "--memory-gib 40 --top 5  (GPT-40B) | jphantom plan --devices 64 --gpus-per-node 8 "
               "--inter-node-gbps 200 --intra-node-gbps 450 --json  (another machine, as JSON) | "
               "jphantom plan --no-latency  (Singh's model exactly)")
    parser.add_argument("--model", default="transformer",
                        help="the model family to plan: transformer (alias gpt2: GPT-2 blocks), "
                             "llama (grouped-query attention, SwiGLU, untied head), mistral, "
                             "qwen2, qwen3, gemma3 (their Llama blocks; qwen3 and gemma3 with "
                             "tied embeddings), or a registered family with a plan_shape "
                             "(default transformer)")
    parser.add_argument("--intermediate", default=None, metavar="N",
                        help="llama: the SwiGLU width (default 8h/3 rounded up to 32)")
    parser.add_argument("--kv-heads", default=None, metavar="N",
                        help="llama: key/value heads (default --heads)")
    for flag, default, text in (
            ("--layers", "32", "transformer blocks L"), ("--hidden", "7168", "width h"),
            ("--heads", "56", "attention heads"), ("--seq-len", "2048", "sequence length S"),
            ("--vocab", "51200", "vocabulary V (GPT-2's 50257 padded)")):
        parser.add_argument(flag, default=default, metavar="N", help=f"{text} (default {default})")
    parser.add_argument("--batch", default="512", metavar="N",
                        help="sequences per training step (default 512, our choice: Singh's thesis does "
                             "not give its batch)")
    parser.add_argument("--devices", default="32", metavar="N",
                        help="GPUs to plan for (default 32)")
    parser.add_argument("--gpus-per-node", default="4", metavar="N",
                        help="GPUs per node, G_node (default 4, Perlmutter)")
    parser.add_argument("--inter-node-gbps", default="100", metavar="GB/S",
                        help="beta_inter: GB/s per direction between two nodes, all NICs together "
                             "(default 100 = Perlmutter's 4 Slingshot-11 NICs x 25 GB/s)")
    parser.add_argument("--intra-node-gbps", default=None, metavar="GB/S",
                        help="one bandwidth for every collective inside a node (default: with 4 "
                             "GPUs per node Perlmutter's NVLink3 table, 100 GB/s for a pair, 200 "
                             "for 3, 300 for all 4; else 300)")
    parser.add_argument("--latency-us", default="5", metavar="US",
                        help="alpha, microseconds per ring step (default 5, assumed)")
    parser.add_argument("--no-latency", action="store_true",
                        help="no alpha terms: Singh's bandwidth-only model exactly")
    parser.add_argument("--memory-gib", default=None, metavar="GIB",
                        help="GPU memory: layouts whose modelled memory exceeds it rank last, "
                             "marked fits=no (Perlmutter: 40)")
    parser.add_argument("--precision", default="bf16",
                        help="bf16 (2-byte messages, 16 bytes of state per parameter; default) or "
                             "float32")
    parser.add_argument("--ghost-width", default=None, metavar="K",
                        help="phantom's ghost neurons per rank and token (default hidden / 32)")
    parser.add_argument("--accumulate", default="1", metavar="A",
                        help="gradient-accumulation micro-batches (not pipelines; default 1)")
    parser.add_argument("--device-tflops", default=str(DEFAULT_DEVICE_TFLOPS), metavar="TF",
                        help="sustained TFLOP/s per GPU, to price a pipeline's bubble (default "
                             "280, the A100's empirical bf16 GEMM peak)")
    parser.add_argument("--attention-scores", action="store_true",
                        help="count the S x S attention scores in activation memory (no fused "
                             "attention kernel)")
    parser.add_argument("--top", default="10", metavar="N", help="rows to print (default 10)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON: assumptions, top choice and the top rows")
    parser.add_argument("--as-compiled", action="store_true",
                        help="price what jphantom's compiled step moves (float32 gradient "
                             "reductions, pmm3d's backward weight re-gather, the recompute "
                             "forward's collectives) instead of the papers' formulas alone; "
                             "implied by --compile-top")
    parser.add_argument("--compile-top", default=None, metavar="K",
                        help="compile the K best layouts for --target (GPT-2 blocks of this "
                             "shape, float32 master weights with bf16 compute, per-layer "
                             "checkpointing) and re-rank them by compiled memory fit and "
                             "compiled communication (needs pip install 'jphantom[aot]')")
    parser.add_argument("--target", default="gpu:h100",
                        help="the GPU --compile-top compiles for (default gpu:h100)")
    parser.set_defaults(handler=_run)
