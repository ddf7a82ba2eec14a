"""Clusters as data: the nodes ``jphantom plan --cluster NAME`` prices, each number with where it
came from (``source``: datasheet or assumed, and a ``cite``), as the device descriptions of
:mod:`jphantom.predict.device` carry theirs.

A node is ``gpus_per_node`` GPUs in packages of ``gpus_per_package`` (Frontier: an MI250X holds
2 GCDs), joined inside a package by ``in_package_gbps`` and between packages by
``between_packages_gbps``, and ``nics_per_node`` NICs of ``nic_gbps`` to the other nodes (GB/s
per direction, nominal, as :meth:`Topology.perlmutter` is). :meth:`Cluster.topology` turns that
into the planner's :class:`~jphantom.perf.axonn_model.Topology` (Singh's Eq. 5.7 with its
intra-node database): a group inside one package gets the package's links, a group spanning
packages the slowest hop of its ring, and a fully connected node (``fully_connected``: MI300X, a
direct link to every peer) ``(size - 1)`` links per GPU. :attr:`Cluster.domains` says the same
to :func:`jphantom.runtime.mesh.axis_domains`, which names where each mesh axis's groups sit.

``perlmutter`` is the planner's default machine exactly (:meth:`Topology.perlmutter`); ``plan``
without ``--cluster`` is unchanged."""

from __future__ import annotations

import dataclasses

from jphantom.errors import ConfigError
from jphantom.perf.axonn_model import Topology
from jphantom.predict.device import Quantity

OLCF = ("OLCF Frontier User Guide, System Overview / Frontier Compute Nodes, "
        "https://docs.olcf.ornl.gov/systems/frontier_user_guide.html")
MI300X = ("AMD Instinct MI300X specifications, "
          "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html")


def _q(value: float, source: str, cite: str) -> Quantity:
    return Quantity(value, source, cite)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster's node (module docstring). ``numbers[key]`` is a :class:`Quantity`; ``device``
    the :mod:`jphantom.predict` description of one GPU (prices compute, memory and power); an
    optional ``memory_gib`` number overrides the device's HBM (Perlmutter's A100s are the 40 GB
    part)."""

    name: str
    description: str
    device: str
    numbers: dict
    fully_connected: bool = False

    def __getitem__(self, key: str) -> float:
        return self.numbers[key].value

    @property
    def gpus_per_node(self) -> int:
        return int(self["gpus_per_node"])

    @property
    def gpus_per_package(self) -> int:
        return int(self["gpus_per_package"])

    @property
    def domains(self) -> tuple[tuple[str, int], ...]:
        """The nested domains of devices, innermost first: ``(("package", 2), ("node", 8))``."""
        inner = (("package", self.gpus_per_package),) if self.gpus_per_package > 1 else ()
        return (*inner, ("node", self.gpus_per_node))

    def memory_gib(self, device) -> float:
        """GiB per GPU: the node's own figure where it has one, else ``device``'s HBM."""
        if "memory_gib" in self.numbers:
            return self["memory_gib"]
        return device["memory.hbm_bytes"] / 2**30

    def topology(self) -> Topology:
        """The planner's network (module docstring)."""
        if self.name == "perlmutter":
            return Topology.perlmutter()
        node, package = self.gpus_per_node, self.gpus_per_package
        between, inside = self["between_packages_gbps"], self["in_package_gbps"]
        table = {}
        for inner in range(1, node + 1):
            for size in range(2, node // inner + 1):
                if self.fully_connected:  # a direct link to each of the size - 1 peers
                    table[(inner, size)] = (size - 1) * between
                elif inner * size <= package:  # the whole group inside one package
                    table[(inner, size)] = inside
        inter = self["nics_per_node"] * self["nic_gbps"]
        cites = "; ".join(f"{k} {q.value:g} ({q.source}: {q.cite})"
                          for k, q in self.numbers.items())
        return Topology(gpus_per_node=node, inter_node_gbps=inter,
                        intra_node_gbps=(node - 1) * between if self.fully_connected else between,
                        intra_node_table=table, latency_us=self["latency_us"], name=self.name,
                        source=f"{self.description}: {cites}")

    def as_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "device": self.device,
                "fully_connected": self.fully_connected,
                "numbers": {k: q.as_dict() for k, q in self.numbers.items()}}


CLUSTERS = {
    "perlmutter": Cluster(
        "perlmutter", "Perlmutter GPU node: 4 A100-40GB on NVLink3, 4 Slingshot-11 NICs",
        "a100-sxm", {
            "gpus_per_node": _q(4, "datasheet", "Singh's thesis Sec. 4.3 (Topology.perlmutter)"),
            "gpus_per_package": _q(1, "datasheet", "one A100 per package"),
            "nics_per_node": _q(4, "datasheet", "Singh's thesis Sec. 4.3: 4 Slingshot-11 NICs"),
            "nic_gbps": _q(25, "datasheet", "Slingshot-11 200 Gb/s = 25 GB/s per direction"),
            "latency_us": _q(5, "assumed", "Topology.perlmutter's alpha (assumed)"),
            "memory_gib": _q(40, "datasheet", "Perlmutter's GPU nodes hold A100-SXM4 40 GB "
                             "(NERSC, Perlmutter architecture, https://docs.nersc.gov/systems/"
                             "perlmutter/architecture/; 256 nodes have 80 GB); the planner's "
                             "documented --memory-gib 40 (a100-sxm describes the 80 GB part)")}),
    "frontier": Cluster(
        "frontier", "Frontier node: 4 MI250X = 8 GCDs in 4 packages of 2, 4 Slingshot-11 NICs",
        "mi250x-gcd", {
            "gpus_per_node": _q(8, "datasheet", f"{OLCF}: [4x] AMD MI250X, each with 2 GCDs, "
                                "for a total of 8 GCDs per node, seen as 8 separate GPUs"),
            "gpus_per_package": _q(2, "datasheet", f"{OLCF}: each MI250X holds 2 GCDs"),
            "in_package_gbps": _q(200, "datasheet", f"{OLCF}: the 2 GCDs on the same MI250X are "
                                  "connected with Infinity Fabric GPU-GPU with a peak bandwidth "
                                  "of 200 GB/s (taken per direction: 4 links of 50 GB/s, ROCm "
                                  "'AMD Instinct MI250 microarchitecture', https://rocm.docs.amd."
                                  "com/en/latest/reference/gpu-arch/mi250.html: a 16-wide link at "
                                  "25 GT/s is 50 GB/s)"),
            "between_packages_gbps": _q(50, "datasheet", f"{OLCF}: GCDs on different MI250X are "
                                        "connected with a peak bandwidth of 50-100 GB/s by the "
                                        "number of Infinity Fabric links between them; a ring "
                                        "over packages runs at its slowest hop, one 50 GB/s link "
                                        "(the low end taken; the device description's "
                                        "intra_node_gbps is the same)"),
            "nics_per_node": _q(4, "datasheet", f"{OLCF}: 4 HPE Slingshot 200 Gb/s NICs per node "
                                "(as mi250x-gcd.toml cites it)"),
            "nic_gbps": _q(25, "datasheet", "Slingshot-11 200 Gb/s = 25 GB/s per direction "
                           f"({OLCF})"),
            "latency_us": _q(10, "assumed", "mi250x-gcd.toml's inter_latency_us (assumed: the "
                             "Frontier-like alpha of jphantom.runtime.collectives)")}),
    "mi300x": Cluster(
        "mi300x", "MI300X node: 8 MI300X fully connected by Infinity Fabric, 8 NICs of 400 Gb/s",
        "mi300x", {
            "gpus_per_node": _q(8, "datasheet", f"{MI300X} / AMD Instinct MI300X Platform: 8 OAMs "
                                "per node, fully connected by Infinity Fabric"),
            "gpus_per_package": _q(1, "datasheet", "one MI300X per OAM package"),
            "in_package_gbps": _q(64, "datasheet", "one GPU per package: unused"),
            "between_packages_gbps": _q(64, "datasheet", f"{MI300X}: 7 Infinity Fabric links of "
                                        "128 GB/s bidirectional, 896 GB/s aggregate => 64 GB/s "
                                        "per direction to each peer"),
            "nics_per_node": _q(8, "datasheet", "Azure ND MI300X v5: 8x 400 Gb/s InfiniBand, one "
                                "per GPU (Microsoft Learn, 'ND MI300X v5 sizes series'; "
                                "platform-specific, as mi300x.toml cites it)"),
            "nic_gbps": _q(50, "datasheet", "400 Gb/s = 50 GB/s per direction"),
            "latency_us": _q(5.1, "assumed", "mi300x.toml's inter_latency_us (RCCL's NET Ring LL "
                             "hwLat, ROCm/rccl src/graph/tuning.cc)")},
        fully_connected=True),
}


def names() -> tuple[str, ...]:
    return tuple(CLUSTERS)


def get(name: str) -> Cluster:
    """The cluster called ``name``; a :class:`ConfigError` naming the choices otherwise."""
    try:
        return CLUSTERS[str(name).strip().lower()]
    except KeyError:
        raise ConfigError(f"--cluster {name!r} is not a known cluster: choose one of "
                          f"{', '.join(CLUSTERS)}") from None
