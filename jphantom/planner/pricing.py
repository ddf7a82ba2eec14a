"""What the planner prices a layout with: its collectives turned into seconds on a topology,
per mesh axis, by the ring alpha-beta model with Singh's Eq. 5.7 bandwidths
(:class:`CollectivePricer`); a registry strategy's collectives (:func:`inventory`); the data
all-reduce; pmm3d's per-layer collectives (Singh's Alg. 3, Eqs. 5.1-5.6); phantom's parameters
and FLOPs per rank and Seal et al.'s Eq. 8 bound; a pipeline schedule's lock-step idle time."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from jphantom.perf import axonn_model as ax
from jphantom.perf.axonn_model import Collective, GPTShape, Topology


class CollectivePricer:
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


def inventory(name: str, shape: GPTShape, data: int, model: int, batch_per_rank: int,
               ghost_width: int | None, sequence_parallel: bool, repeats: int) -> list[Collective]:
    """A registry strategy's per-step collectives over ``model`` (each list entry one execution of
    one per-device result buffer of that many elements), ``repeats`` times (micro-batches)."""
    from jphantom.costs.inventory import collective_inventory
    from jphantom.runtime.mesh import MeshConfig
    from jphantom.models.llama import LlamaConfig
    from jphantom.models.gpt2 import TransformerConfig

    if shape.kind.sized:  # grouped-query attention and a gated MLP: a Llama
        config = LlamaConfig(vocab_size=shape.vocab_size, hidden=shape.hidden,
                             intermediate=shape.intermediate, layers=shape.layers,
                             heads=shape.heads, kv_heads=shape.kv_heads,
                             max_positions=shape.seq_len)
    else:
        config = TransformerConfig(vocab_size=shape.vocab_size, seq_len=shape.seq_len,
                                   hidden=shape.hidden, heads=shape.heads, layers=shape.layers,
                                   ghost_width=ghost_width)
    options = {"sequence_parallel": True} if sequence_parallel else {}
    inventory = collective_inventory(
        config, name, MeshConfig.of({"data": data, "model": model}), batch_per_rank, **options)
    out = []
    for kind, sizes in inventory.items():
        for size in sorted(set(sizes)):
            out.append(Collective(kind, "model", model, size, repeats * sizes.count(size),
                                  f"jphantom.costs.inventory.collective_inventory({name!r})"))
    return out


def data_all_reduce(params: float, data: int, buckets: int,
                     element_bytes: float | None = None) -> Collective:
    """The once-per-step gradient all-reduce over ``data`` of a rank's ``params``, in ``buckets``
    equal collectives (one per layer and one for the rest: each costs its ring steps of α);
    ``element_bytes``: 4 for float32 master gradients (``as_compiled``), else the precision's."""
    return Collective("all-reduce", "data", data, params / buckets, buckets,
                      "gradient all-reduce over data (Eq. 5.5's role)", element_bytes)


def pmm3d_collectives(layer, grid, accumulate: int, as_compiled: bool,
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


def phantom_linear(i: int, o: int, p: int, k: int) -> int:
    """Per-rank parameters of a phantom linear i -> o (``phantom.init_linear``): local (o/p)(i/p),
    compressor k i/p, decompressors p (o/p) k (own slot included), bias o/p."""
    return (o // p) * (i // p) + k * (i // p) + p * (o // p) * k + o // p


def phantom_linear_flops(i: int, o: int, p: int, k: int) -> int:
    """Forward FLOPs per token and rank of a fused phantom linear: 2 (o/p)(i/p) + 2 k (i/p) +
    2 p k (o/p) (:mod:`jphantom.perf.step_model`'s count; the decompressor GEMM spans all p
    slots)."""
    return 2 * (o // p) * (i // p) + 2 * k * (i // p) + 2 * p * k * (o // p)


def phantom_eq8_bound(hidden: int, p: int) -> float:
    """Seal et al. Eq. 8: phantom is smaller than the dense layer while k < (n/p)(1 - 1/p)."""
    return hidden / p * (1 - 1 / p)


@functools.lru_cache(maxsize=None)
def lockstep_idle(schedule: str, stages: int, microbatches: int) -> float:
    """Idle time of a schedule's lock-step table, in forwards of a whole stage (t_b = 2 t_f):
    1F1B (P - 1) x 3; the zero-bubble tables' idle time is the same for every M >= 2P, so it is
    measured at min(M, 2P) (their list scheduling grows with M)."""
    from jphantom.pipeline import schedule as schedules

    if schedule == "1f1b":
        return 3.0 * (stages - 1)
    m = min(microbatches, 2 * stages)
    return schedules.lockstep(schedule, stages, m).cost() - 3.0 * m
