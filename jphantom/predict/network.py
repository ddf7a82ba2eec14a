"""The network of a GPU cluster priced as NCCL prices it: a collective over a group of GPUs by
the ring and the tree algorithms, whichever is faster for its size, with the group placed on
nodes as the compiled program places it.

A group of ``n`` GPUs with ``g`` of them on each of ``N`` nodes (``n = g N``) moves per GPU, for
a result of ``b`` bytes per GPU (the compiled HLO's convention; Thakur, Rabenseifner and Gropp,
*Optimization of Collective Communication Operations in MPICH*, 2005, for the ring counts):

=====================  =========================  ===============
kind                   bytes on the busiest link  ring steps
=====================  =========================  ===============
all-gather             (n-1)/n x b                n - 1
reduce-scatter         (n-1) x b  (input n b)     n - 1
all-reduce             2 (n-1)/n x b              2 (n - 1)
all-to-all             (n-1)/n x b                n - 1
collective-permute     b                          1
=====================  =========================  ===============

The link's bandwidth ``B`` is NVLink/NVSwitch's (``intra_node_gbps x intra_node_efficiency``)
inside one node, or the package's (``in_package_gbps x intra_node_efficiency``) for a group
inside one package of a device that has them (an MI250X: 2 GCDs joined by 4 Infinity Fabric
links, 200 GB/s, against one 50 GB/s link between packages). A group spanning nodes runs one ring per NIC (NCCL's channels), so the node's
NICs carry it together; every group of the collective runs at once (SPMD), and the
``gpus_per_node / g`` groups that share a node share its NICs:
``B = min(intra, nics x nic_gbps x inter_node_efficiency x g / gpus_per_node)``. Each ring step
costs the latency of the slowest hop (``intra_latency_us`` or ``inter_latency_us``).

An all-reduce across nodes may also take NCCL's tree (a double binary tree between the nodes, a
chain inside each): ``2 log2(N)`` inter-node and ``2 (g - 1)`` intra-node latencies, and
``2 b`` per GPU over the slower of the two levels; the faster of ring and tree is taken, as
NCCL's tuner does. Every collective also pays one kernel launch. Modelled, not measured: contention
with compute (an overlapped collective slows the kernels under it) is not modelled.
"""

from __future__ import annotations

import dataclasses
import math

from jphantom.predict.device import DeviceModel

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all",
         "collective-permute")


@dataclasses.dataclass(frozen=True)
class GroupPlacement:
    """Where a collective's groups sit: ``size`` GPUs per group, ``per_node`` of them on each of
    ``nodes`` nodes (``size = per_node x nodes``), spanning ``packages`` packages (0: not
    known, as if each GPU were its own)."""

    size: int
    nodes: int = 1
    packages: int = 0

    @property
    def per_node(self) -> int:
        return max(1, self.size // max(1, self.nodes))


Placement = GroupPlacement
"""Deprecated: :class:`GroupPlacement`'s old name (which :class:`jphantom.plans.Placement`, a
layer's place in a plan, also was); it goes in the next release."""


def placement(groups: list[list[int]], node_of, package_of=None) -> GroupPlacement:
    """The placement of the largest group (``node_of(id)``: the node of a device id;
    ``package_of(id)``: its package, when the device has packages)."""
    if not groups:
        return GroupPlacement(1, 1)
    group = max(groups, key=len)
    packages = len({package_of(i) for i in group}) if package_of is not None else 0
    return GroupPlacement(len(group), len({node_of(i) for i in group}), packages)


@dataclasses.dataclass(frozen=True)
class Network:
    """The cluster's network (module docstring), from a :class:`DeviceModel`'s ``[network]``."""

    device: DeviceModel
    gpus_per_node: int

    @classmethod
    def of(cls, device: DeviceModel, gpus_per_node: int | None = None) -> Network:
        return cls(device, int(gpus_per_node or device["network.gpus_per_node"]))

    @property
    def gpus_per_package(self) -> int:
        return int(self.device.get("network.gpus_per_package", 1))

    def bandwidth(self, where: GroupPlacement) -> float:
        """Bytes per second of the group's busiest link."""
        d = self.device
        intra = d["network.intra_node_gbps"] * d["network.intra_node_efficiency"] * 1e9
        if where.nodes <= 1 and where.packages == 1 and d.get("network.in_package_gbps"):
            return d["network.in_package_gbps"] * d["network.intra_node_efficiency"] * 1e9
        if where.nodes <= 1:
            return intra
        nics = (d["network.nics_per_node"] * d["network.nic_gbps"]
                * d["network.inter_node_efficiency"] * 1e9)
        return min(intra, nics * where.per_node / self.gpus_per_node)

    def latency(self, where: GroupPlacement) -> float:
        key = "inter_latency_us" if where.nodes > 1 else "intra_latency_us"
        return self.device[f"network.{key}"] * 1e-6

    def seconds(self, kind: str, nbytes: float, where: GroupPlacement) -> float:
        """One collective's seconds (module docstring); 0 for a group of one GPU."""
        n = where.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        if kind not in KINDS:
            raise ValueError(f"unknown collective kind {kind!r}")
        launch = self.device.launch_seconds
        bw, alpha = self.bandwidth(where), self.latency(where)
        if kind == "collective-permute":
            return launch + alpha + nbytes / bw
        if kind == "reduce-scatter":
            wire, steps = (n - 1) * nbytes, n - 1
        elif kind == "all-reduce":
            wire, steps = 2 * (n - 1) / n * nbytes, 2 * (n - 1)
        else:  # all-gather, all-to-all
            wire, steps = (n - 1) / n * nbytes, n - 1
        ring = wire / bw + steps * alpha
        if kind == "all-reduce" and where.nodes > 1:
            return launch + min(ring, self.tree_seconds(nbytes, where))
        return launch + ring

    def tree_seconds(self, nbytes: float, where: GroupPlacement) -> float:
        """NCCL's tree all-reduce across nodes (module docstring)."""
        d = self.device
        intra_bw = d["network.intra_node_gbps"] * d["network.intra_node_efficiency"] * 1e9
        inter_bw = self.bandwidth(where)
        alpha = (2 * math.log2(where.nodes) * d["network.inter_latency_us"]
                 + 2 * (where.per_node - 1) * d["network.intra_latency_us"]) * 1e-6
        return alpha + 2 * nbytes / min(intra_bw, inter_bw)
