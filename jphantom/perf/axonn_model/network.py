"""The network AxoNN's model prices (Singh's thesis Eq. 5.7, placement-aware): a
:class:`Topology` of nodes, and the bandwidth of a group of G_i ranks whose members are
∏_{j<i} G_j apart: inside a node Sec. 5.1.2's database entry (G_0, G_1), across nodes

    (5.7)  β_i = β_inter / min(G_node, ∏_{j<i} G_j)

and a point-to-point message's bandwidth (one GPU pair's link; our extension)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jphantom.errors import ConfigError
from jphantom.perf.axonn_model.units import GB, check_count, check_positive


@dataclasses.dataclass(frozen=True)
class Topology:
    """The network Eq. 5.7 prices, validated on construction.

    ``gpus_per_node`` G_node; ``inter_node_gbps`` β_inter, GB/s per direction between a pair of
    nodes with all their NICs together (§2 assumption 5: "the same peer-to-peer bidirectional
    bandwidth β_inter between every pair of nodes"; a ring over one node boundary gets all of it);
    ``intra_node_gbps`` the bandwidth of a collective inside a node when ``intra_node_table`` has
    no entry for it; ``intra_node_table`` Sec. 5.1.2's database, {(G_0, G_1): GB/s} for G_0
    concurrent groups of G_1 GPUs, G_0 G_1 <= G_node (bus bandwidth: t = volume / β); ``latency_us``
    α, microseconds per ring step (0 for none); ``name`` for reports.
    """

    gpus_per_node: int
    inter_node_gbps: float
    intra_node_gbps: float = 300.0
    intra_node_table: Any = ()
    latency_us: float = 5.0
    name: str = "custom"
    source: str = ""

    def __post_init__(self):
        check_count("gpus_per_node", self.gpus_per_node, 1,
                    "give G_node, the GPUs of one node, e.g. 4")
        object.__setattr__(self, "inter_node_gbps", check_positive(
            "inter_node_gbps", self.inter_node_gbps,
            "give β_inter in GB/s between two nodes (all NICs), e.g. 100 for 4 x 25 GB/s"))
        object.__setattr__(self, "intra_node_gbps", check_positive(
            "intra_node_gbps", self.intra_node_gbps,
            "give the intra-node collective bandwidth in GB/s, e.g. 300 for NVLink3"))
        object.__setattr__(self, "latency_us", check_positive(
            "latency_us", self.latency_us, "give α in microseconds per ring step, e.g. 5 (0: none)",
            zero_ok=True))
        table = self.intra_node_table
        items = table.items() if isinstance(table, Mapping) else table
        try:
            items = list(items)
        except TypeError:
            raise ConfigError(f"intra_node_table={table!r} must map (G0, G1) -> GB/s, e.g. "
                              "{(1, 4): 300.0}") from None
        entries = {}
        for item in items:
            try:
                key, gbps = item
                g0, g1 = key
            except (TypeError, ValueError):
                raise ConfigError(f"intra_node_table entry {item!r} must be ((G0, G1), GB/s), e.g. "
                                  "((1, 4), 300.0)") from None
            check_count(f"intra_node_table key {key!r}: G0", g0, 1)
            check_count(f"intra_node_table key {key!r}: G1", g1, 1)
            if g0 * g1 > self.gpus_per_node:
                raise ConfigError(
                    f"intra_node_table key {key!r} has G0 x G1 = {g0 * g1} > gpus_per_node="
                    f"{self.gpus_per_node}: the database covers groups inside one node (Eq. 5.7 "
                    "prices the others); drop the entry or raise gpus_per_node")
            entries[(g0, g1)] = check_positive(f"intra_node_table[{key!r}]", gbps,
                                               "give GB/s > 0")
        object.__setattr__(self, "intra_node_table", tuple(sorted(entries.items())))
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"Topology.name={self.name!r} must be a non-empty string")

    @classmethod
    def perlmutter(cls) -> Topology:
        """Perlmutter's GPU nodes (Singh's thesis §4.3): 4 A100-40GB and 4 Slingshot-11 NICs per node.

        β_inter = 4 NICs x 25 GB/s = 100 GB/s per direction per node pair (Slingshot-11 is
        200 Gb/s = 25 GB/s each way; the digest's "25 GB/s bidirectional each" read as per
        direction). Intra-node (assumed, nominal, not profiled): NVLink3 with 4 links of 25 GB/s per
        direction between every pair of the 4 GPUs, so a pair (or two concurrent pairs) gets
        100 GB/s, a ring of 3 200 GB/s, a ring of all 4 (3 edge-disjoint directed rings) 300 GB/s.
        α = 5 μs per ring step (assumed). Replace the table with measured bus bandwidths (Sec.
        5.1.2's database) when you have them.
        """
        return cls(gpus_per_node=4, inter_node_gbps=4 * 25.0, intra_node_gbps=300.0,
                   intra_node_table={(1, 2): 100.0, (2, 2): 100.0, (1, 3): 200.0, (1, 4): 300.0},
                   latency_us=5.0, name="perlmutter",
                   source="Singh's thesis §4.3: 4 A100 + 4 Slingshot-11 NICs x 25 GB/s per node "
                          "(β_inter = 100 GB/s); NVLink3 table and α = 5 μs assumed (nominal)")

    @property
    def table(self) -> dict[tuple[int, int], float]:
        """The intra-node database, {(G0, G1): GB/s}."""
        return dict(self.intra_node_table)

    def intra_node(self, g0: int, g1: int) -> float:
        """Case 1 of Eq. 5.7: bytes/s of G0 concurrent groups of G1 GPUs inside a node."""
        return self.table.get((g0, g1), self.intra_node_gbps) * GB

    def as_dict(self) -> dict:
        return {"name": self.name, "gpus_per_node": self.gpus_per_node,
                "inter_node_gbps": self.inter_node_gbps, "intra_node_gbps": self.intra_node_gbps,
                "intra_node_table": {f"{g0},{g1}": v for (g0, g1), v in self.intra_node_table},
                "latency_us": self.latency_us, "source": self.source}


def placement_bandwidth(topology: Topology, inner: int, size: int) -> float:
    """Eq. 5.7: bytes/s of a group of ``size`` ranks whose members are ``inner`` ranks apart
    (``inner`` = ∏_{j<i} G_j, the product of the levels inside it); ``math.inf`` for one rank.

    Case 1 (``inner * size <= G_node``): the database entry (inner, size), else the default
    intra-node bandwidth. Case 2: β_inter / min(G_node, inner).
    """
    check_count("inner", inner, 1)
    check_count("size", size, 1)
    if size == 1:
        return math.inf
    if inner * size <= topology.gpus_per_node:
        return topology.intra_node(inner, size)
    return topology.inter_node_gbps * GB / min(topology.gpus_per_node, inner)


def point_to_point_bandwidth(topology: Topology, inner: int, size: int) -> float:
    """Bytes/s of one message between neighbours of a ``size``-rank chain whose members are
    ``inner`` ranks apart (a pipeline's stage axis; our extension of Eq. 5.7): inside a node, the
    database entry of ``inner`` concurrent *pairs* (inner, 2), since a message uses one GPU pair's
    link; across nodes, Eq. 5.7's β_inter / min(G_node, inner) (the chain's node-boundary link,
    shared by the ``inner`` chains beside it); ``math.inf`` for one rank."""
    check_count("inner", inner, 1)
    check_count("size", size, 1)
    if size == 1:
        return math.inf
    if inner * size <= topology.gpus_per_node:
        return topology.intra_node(inner, 2)
    return topology.inter_node_gbps * GB / min(topology.gpus_per_node, inner)


def hierarchy_bandwidths(levels: Sequence[tuple[str, int]], topology: Topology) -> dict[str, float]:
    """Eq. 5.7 for every level of a hierarchy given innermost first as (axis name, size) pairs:
    {axis: bytes/s}. For the 4D grid the levels are x, y, z, data; for other layouts the mesh's
    axes innermost first (``model``, then ``stage``, then ``data``: :mod:`jphantom.runtime.mesh` order)."""
    bandwidths, inner = {}, 1
    for name, size in levels:
        bandwidths[name] = placement_bandwidth(topology, inner, size)
        inner *= size
    return bandwidths
