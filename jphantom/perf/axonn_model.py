"""AxoNN's placement-aware communication model of the 4D algorithm (Singh's thesis ch. 5, Eqs. 5.1-5.7).

The G GPUs form a grid G_x x G_y x G_z x G_data, ranked innermost to outermost X, Y, Z, data (the
``x``, ``y``, ``z``, ``data`` axes of :mod:`jphantom.mesh`; ``str(grid)`` is the mesh text
``"data=2,z=2,y=2,x=2"``). A fully connected layer O = I W with I [m, k], W [k, n] runs Algorithm 3:
W is split rows over Y and columns over X and flat-sharded over Z (Ŵ, k n / (G_x G_y G_z) per GPU);
I is split rows (tokens) over Z and columns over Y. Per layer and per step (Singh's thesis §2, exact; the
"volume" is what each GPU puts on the wire under the ring algorithm, in elements):

    (5.1)  t_AG,z   = (1/β_z) (G_z - 1) k n / (G_x G_y G_z)           all-gather of Ŵ, forward
    (5.2)  t_RS,z   = (1/β_z) ((G_z - 1)/G_z) k n / (G_x G_y)         reduce-scatter of dŴ, backward
    (5.3)  t_AR,y   = (2/β_y) ((G_y - 1)/G_y) m n / (G_z G_x)         all-reduce of O, forward
    (5.4)  t_AR,x   = (2/β_x) ((G_x - 1)/G_x) m k / (G_z G_y)         all-reduce of dI, backward
    (5.5)  t_AR,data= (2/β_d) ((G_data - 1)/G_data) k n / (G_x G_y G_z)  gradient all-reduce
    (5.6)  t_comm   = t_AG,z + t_RS,z + t_AR,y + t_AR,x + t_AR,data

A *transposed* layer (every other layer, so that O's (Z, X) layout feeds the next layer) swaps the
roles of X and Y: G_x <-> G_y in the volumes, and, since its forward all-reduce then runs over the X
groups, β_x <-> β_y too (the digest's §6 item 7: "logically yes"). The whole network is the sum of
Eq. 5.6 over its layers; m is the tokens of one data group, batch x seq_len / G_data (§2's
implementer note).

Bandwidths (Eq. 5.7, placement-aware). Level i of the hierarchy has G_i ranks whose neighbours are
∏_{j<i} G_j apart. Case 1, the group lies inside a node (∏_{j<=i} G_j <= G_node): β_i is the
*database* entry keyed (G_0 = ∏_{j<i} G_j, G_1 = G_i) (Sec. 5.1.2 profiles G_0 simultaneous rings of
G_1 GPUs with 1 GB messages), or the topology's default intra-node bandwidth when the entry is
missing. Case 2, the group spans nodes:

    (5.7)  β_i = β_inter / min(G_node, ∏_{j<i} G_j)

(one ring over 8 GPUs of 2 nodes gets β_inter; two concurrent rings of 4 across the same nodes get
β_inter / 2 each; a node has at most G_node ring links leaving it). A group of one rank costs 0.

Latency (our addition, Seal et al. Eq. 26's idea in the ring's terms). The paper ignores startup
costs (§2 assumption 3: large messages). Here every collective also costs α per ring step, p - 1
steps for all-gather and reduce-scatter and 2 (p - 1) for all-reduce (Thakur et al.'s ring), one
per point-to-point message, so that many small messages are not free. ``latency=False`` gives the
paper's model exactly.

Units: volumes are elements (compare them with the HLO's bytes / element size); bandwidths are
bytes per second, GB/s = 1e9 bytes/s; times are seconds.

Also here, for the planner (:mod:`jphantom.plan`): the GPT layer list (Singh's thesis §1.4: QKV normal,
attention output transposed, MLP up normal, MLP down transposed), the enumeration of grids with
their divisibility and memory filters, and the per-device memory model (:func:`pmm3d_memory`,
modelled, see its docstring).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jphantom.errors import ConfigError

GB = 1e9
"""Bytes in one GB (bandwidths are GB/s = 1e9 bytes per second)."""
GIB = 2**30
AXES = ("x", "y", "z", "data")
"""The grid's axes, innermost first (Singh's thesis Sec. 5.1.2's hierarchy order)."""

# ring steps of one collective among p ranks (Thakur et al.): how many α it costs
_RING_STEPS = {"all-gather": lambda p: p - 1, "reduce-scatter": lambda p: p - 1,
               "all-reduce": lambda p: 2 * (p - 1), "all-to-all": lambda p: p - 1,
               "collective-permute": lambda p: 1}


def check_count(name: str, value: Any, minimum: int = 1, fix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}"
                          + (f": {fix}" if fix else ""))
    return value


def check_positive(name: str, value: Any, fix: str, *, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r} must be a number: {fix}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        raise ConfigError(f"{name}={value!r} must be finite and {'>= 0' if zero_ok else '> 0'}: "
                          f"{fix}")
    return number


# --------------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------------


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
    axes innermost first (``model``, then ``stage``, then ``data``: :mod:`jphantom.mesh` order)."""
    bandwidths, inner = {}, 1
    for name, size in levels:
        bandwidths[name] = placement_bandwidth(topology, inner, size)
        inner *= size
    return bandwidths


# --------------------------------------------------------------------------------------------------
# The grid, layers and collectives
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Grid:
    """(G_x, G_y, G_z, G_data), innermost first; ``str`` is the mesh text, outermost first."""

    x: int
    y: int
    z: int
    data: int

    def __post_init__(self):
        for axis in AXES:
            check_count(f"G_{axis}", getattr(self, axis), 1, "grid sizes are whole numbers of GPUs")

    @property
    def devices(self) -> int:
        return self.x * self.y * self.z * self.data

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.x, self.y, self.z, self.data)

    @property
    def levels(self) -> tuple[tuple[str, int], ...]:
        """(axis, size) innermost first: Eq. 5.7's hierarchy."""
        return tuple(zip(AXES, self.sizes))

    def transposed(self) -> Grid:
        """The grid a transposed layer sees: G_x and G_y swapped (Singh's thesis §1.3)."""
        return Grid(self.y, self.x, self.z, self.data)

    def __str__(self) -> str:
        return f"data={self.data},z={self.z},y={self.y},x={self.x}"


@dataclasses.dataclass(frozen=True)
class Layer:
    """One fully connected layer O [m, n] = I [m, k] x W [k, n] (Alg. 3's shapes; m tokens of one
    data group, k in-features, n out-features); ``transposed`` swaps the X and Y roles."""

    m: int
    k: int
    n: int
    transposed: bool = False
    name: str = ""

    def __post_init__(self):
        for field in ("m", "k", "n"):
            check_count(f"Layer.{field}", getattr(self, field), 1)
        if not isinstance(self.transposed, bool):
            raise ConfigError(f"Layer.transposed={self.transposed!r} must be True or False")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective each GPU of a ``group``-rank group on mesh axis ``axis`` runs ``count``
    times per step. ``buffer``: elements of the per-GPU *result* buffer of one execution (what the
    compiled HLO reports: an all-gather's gathered output, a reduce-scatter's shard, an
    all-reduce's whole buffer, a point-to-point message); ``equation``: where it comes from."""

    kind: str
    axis: str
    group: int
    buffer: float
    count: int = 1
    equation: str = ""
    element_bytes: float | None = None  # this collective's bytes per element, if not the default

    def __post_init__(self):
        if self.kind not in _RING_STEPS:
            raise ConfigError(f"collective kind {self.kind!r}: use one of {sorted(_RING_STEPS)}")
        check_count("Collective.group", self.group, 1)
        check_count("Collective.count", self.count, 0)
        check_positive("Collective.buffer", self.buffer, "elements of the result buffer", zero_ok=True)

    @property
    def wire(self) -> float:
        """Elements each GPU sends in one execution under the ring algorithm (the volume of Eqs.
        5.1-5.5): all-gather (p-1)/p of its result, reduce-scatter (p-1) x its shard, all-reduce
        2 (p-1)/p of the buffer, all-to-all (p-1)/p, a point-to-point message all of it."""
        p = self.group
        if p == 1:
            return 0.0
        return {"all-gather": (p - 1) / p * self.buffer,
                "reduce-scatter": (p - 1) * self.buffer,
                "all-reduce": 2 * (p - 1) / p * self.buffer,
                "all-to-all": (p - 1) / p * self.buffer,
                "collective-permute": self.buffer}[self.kind]

    @property
    def steps(self) -> int:
        """Ring steps (α's) of one execution: p - 1 (all-gather, reduce-scatter), 2 (p - 1)
        (all-reduce), 1 (point-to-point); 0 for one rank."""
        return 0 if self.group == 1 else _RING_STEPS[self.kind](self.group)

    def seconds(self, bandwidth: float, *, bytes_per_element: float,
                latency_s: float = 0.0) -> float:
        """count x (wire x bytes / β + steps x α); 0 for a one-rank group."""
        if self.group == 1 or self.count == 0:
            return 0.0
        if self.element_bytes is not None:
            bytes_per_element = self.element_bytes
        return self.count * (self.wire * bytes_per_element / bandwidth + self.steps * latency_s)


def all_gather_z(k: int, n: int, grid: Grid) -> float:
    """Eq. 5.1's volume: (G_z - 1) k n / (G_x G_y G_z) elements per GPU (Alg. 3 line 2)."""
    return (grid.z - 1) * k * n / (grid.x * grid.y * grid.z)


def reduce_scatter_z(k: int, n: int, grid: Grid) -> float:
    """Eq. 5.2's volume: ((G_z - 1)/G_z) k n / (G_x G_y) elements per GPU (Alg. 3 line 14)."""
    return (grid.z - 1) / grid.z * k * n / (grid.x * grid.y)


def all_reduce_y(m: int, n: int, grid: Grid) -> float:
    """Eq. 5.3's volume: 2 ((G_y - 1)/G_y) m n / (G_z G_x) elements per GPU (Alg. 3 line 4)."""
    return 2 * (grid.y - 1) / grid.y * m * n / (grid.z * grid.x)


def all_reduce_x(m: int, k: int, grid: Grid) -> float:
    """Eq. 5.4's volume: 2 ((G_x - 1)/G_x) m k / (G_z G_y) elements per GPU (Alg. 3 line 12)."""
    return 2 * (grid.x - 1) / grid.x * m * k / (grid.z * grid.y)


def all_reduce_data(k: int, n: int, grid: Grid) -> float:
    """Eq. 5.5's volume: 2 ((G_data - 1)/G_data) k n / (G_x G_y G_z) elements per GPU."""
    return 2 * (grid.data - 1) / grid.data * k * n / (grid.x * grid.y * grid.z)


def layer_collectives(layer: Layer, grid: Grid, *, microbatches: int = 1) -> list[Collective]:
    """The five collectives of Alg. 3 for one layer, per GPU and step (Singh's thesis §1.3's table).

    Normal layer: AG_z of Ŵ (result k n/(G_x G_y)), AR over Y of Ô (m n/(G_z G_x)), AR over X of
    dI (m k/(G_z G_y)), RS_z of dW (result k n/(G_x G_y G_z)), AR over data of dŴ. A transposed
    layer runs the forward all-reduce over X and the backward one over Y, with G_x <-> G_y in the
    buffers. Their ``wire`` equals Eqs. 5.1-5.5's volumes. ``microbatches`` A > 1 (gradient
    accumulation, our extension): per micro-batch of m/A tokens Ŵ is gathered, both all-reduces
    run and dW is reduce-scattered (A times each); the data all-reduce stays once per step.
    """
    check_count("microbatches", microbatches, 1)
    g = grid.transposed() if layer.transposed else grid
    forward_axis, backward_axis = ("x", "y") if layer.transposed else ("y", "x")
    m, k, n, A = layer.m / microbatches, layer.k, layer.n, microbatches
    weight = k * n / (g.x * g.y)
    return [
        Collective("all-gather", "z", g.z, weight, A, "Eq. 5.1 (Alg. 3 line 2)"),
        Collective("reduce-scatter", "z", g.z, weight / g.z, A, "Eq. 5.2 (Alg. 3 line 14)"),
        Collective("all-reduce", forward_axis, g.y, m * n / (g.z * g.x), A,
                   "Eq. 5.3 (Alg. 3 line 4)"),
        Collective("all-reduce", backward_axis, g.x, m * k / (g.z * g.y), A,
                   "Eq. 5.4 (Alg. 3 line 12)"),
        Collective("all-reduce", "data", g.data, weight / g.z, 1, "Eq. 5.5"),
    ]


def axis_bandwidths(grid: Grid, topology: Topology) -> dict[str, float]:
    """Eq. 5.7 for the four levels: {"x", "y", "z", "data": bytes/s} (inf for a level of 1)."""
    return hierarchy_bandwidths(grid.levels, topology)


def layer_seconds(layer: Layer, grid: Grid, topology: Topology, *, bytes_per_element: float = 2,
                  latency: bool = True, microbatches: int = 1) -> dict[str, float]:
    """Eq. 5.6 for one layer: seconds of each of Eqs. 5.1-5.5 and their ``total``."""
    bandwidth = axis_bandwidths(grid, topology)
    alpha = topology.latency_us * 1e-6 if latency else 0.0
    names = ("5.1", "5.2", "5.3", "5.4", "5.5")
    out = {name: c.seconds(bandwidth[c.axis], bytes_per_element=bytes_per_element, latency_s=alpha)
           for name, c in zip(names, layer_collectives(layer, grid, microbatches=microbatches))}
    out["total"] = sum(out.values())
    return out


def predict(layers: Sequence[Layer], grid: Grid, topology: Topology, *,
            bytes_per_element: float = 2, latency: bool = True, microbatches: int = 1) -> dict:
    """Σ over ``layers`` of Eq. 5.6: {"total": s, "by_equation": {"5.1": s, ...}, "by_axis":
    {"x": s, ...}, "bandwidths": {axis: bytes/s}} for ``grid`` on ``topology``."""
    bandwidth = axis_bandwidths(grid, topology)
    alpha = topology.latency_us * 1e-6 if latency else 0.0
    by_equation = dict.fromkeys(("5.1", "5.2", "5.3", "5.4", "5.5"), 0.0)
    by_axis = dict.fromkeys(AXES, 0.0)
    for layer in layers:
        for name, c in zip(by_equation, layer_collectives(layer, grid, microbatches=microbatches)):
            t = c.seconds(bandwidth[c.axis], bytes_per_element=bytes_per_element, latency_s=alpha)
            by_equation[name] += t
            by_axis[c.axis] += t
    return {"total": sum(by_equation.values()), "by_equation": by_equation, "by_axis": by_axis,
            "bandwidths": bandwidth}


# --------------------------------------------------------------------------------------------------
# The GPT shape
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """A decoder-only transformer's sizes for the planner (no arrays): ``layers`` L, ``hidden`` h,
    ``heads`` a, ``seq_len`` S, ``vocab_size`` V, and its ``family``:

    - ``gpt2`` (default): GPT-2 blocks (:mod:`jphantom.models.gpt2`): fused QKV h -> 3h,
      attention output h -> h, MLP h -> 4h -> h with GELU, biases and LayerNorms (13 h small
      parameters per block), learned positions (S h), tied embedding and head;
    - ``llama`` (:mod:`jphantom.models.llama`): grouped-query attention with ``kv_heads`` key/value
      heads (QKV h -> h + 2 h kv_heads / a), SwiGLU MLP of width ``intermediate`` I (gate and up
      h -> 2I, down I -> h), no biases, RMSNorms (2 h per block), rotary positions (no table), an
      untied head. ``intermediate`` defaults to jphantom's 8h/3 rounded up to 32, ``kv_heads`` to
      ``heads``.

    Defaults: S = 2048 and V = 51,200 (GPT-2's 50,257 BPE tokens padded to a multiple of 2048 so it
    divides every power-of-two split); Singh's Table 5.1 gives neither, so both are assumed.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int = 2048
    vocab_size: int = 51200
    family: str = "gpt2"
    intermediate: int | None = None
    kv_heads: int | None = None
    tied: bool | None = None  # a tied head (default: GPT-2's tied, Llama's untied)
    model: str | None = None  # the zoo family of these sizes (default: family)

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "seq_len", "vocab_size"):
            check_count(field, getattr(self, field), 1)
        if self.family not in FAMILIES:
            raise ConfigError(f"family={self.family!r}: the planner prices {FAMILIES}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}: each "
                              f"head has hidden/heads features; pick heads dividing {self.hidden}")
        if self.tied is None:
            object.__setattr__(self, "tied", self.family == "gpt2")
        if self.model is None:
            object.__setattr__(self, "model", self.family)
        if self.family == "gpt2":
            for field in ("intermediate", "kv_heads"):
                if getattr(self, field) is not None:
                    raise ConfigError(f"{field} applies to family='llama' (GPT-2's MLP is 4h "
                                      "wide and its attention has one key/value per head)")
            return
        if self.intermediate is None:
            object.__setattr__(self, "intermediate", -(-8 * self.hidden // 3 // 32) * 32)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        check_count("intermediate", self.intermediate, 1)
        check_count("kv_heads", self.kv_heads, 1)
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}: "
                              "each key/value head serves heads/kv_heads query heads")

    @classmethod
    def of(cls, model: Any, seq_len: int | None = None) -> GPTShape:
        """A GPTShape from itself, a :class:`jphantom.models.gpt2.TransformerConfig` or a
        :class:`jphantom.models.llama.LlamaConfig` (``seq_len`` overrides the model's)."""
        if isinstance(model, GPTShape):
            shape = model
        elif getattr(model, "model_name", None) in ("transformer", "llama"):
            if getattr(model, "moe_every", 0) or getattr(model, "experts", 0):
                raise ConfigError("the planner prices dense blocks; MoE blocks are not modelled: "
                                  "use a dense model")
            if model.model_name == "transformer":
                shape = cls(model.layers, model.hidden, model.heads, model.seq_len,
                            model.vocab_size)
            else:
                shape = cls(model.layers, model.hidden, model.heads,
                            seq_len or model.max_positions, model.vocab_size, "llama",
                            model.intermediate, model.kv_heads)
        else:
            raise ConfigError(f"model={model!r} must be a GPTShape, a TransformerConfig or a "
                              "LlamaConfig (the planner prices dense decoder-only transformers)")
        return shape if seq_len is None else dataclasses.replace(shape, seq_len=seq_len)

    def linears(self) -> tuple[tuple[str, int, int, bool], ...]:
        """One block's fully connected layers as (name, k, n, transposed): k inputs, n outputs,
        ``transposed`` for the second of each pair (Singh's thesis Alg. 3's layout)."""
        h = self.hidden
        if self.family == "gpt2":
            return (("qkv", h, 3 * h, False), ("attn_out", h, h, True),
                    ("mlp_up", h, 4 * h, False), ("mlp_down", 4 * h, h, True))
        kv = 2 * h * self.kv_heads // self.heads
        return (("qkv", h, h + kv, False), ("attn_out", h, h, True),
                ("mlp_up", h, 2 * self.intermediate, False),
                ("mlp_down", self.intermediate, h, True))

    @property
    def mlp_width(self) -> int:
        return 4 * self.hidden if self.family == "gpt2" else self.intermediate

    @property
    def block_matmul_params(self) -> int:
        """Σ k n over one block's linears (GPT-2: 12 h^2)."""
        return sum(k * n for _, k, n, _ in self.linears())

    @property
    def block_small_params(self) -> int:
        """One block's biases and norm weights: GPT-2 13 h (4 biases over 9 h, 2 LayerNorms
        4 h), Llama 2 h (2 RMSNorms)."""
        return 13 * self.hidden if self.family == "gpt2" else 2 * self.hidden

    @property
    def block_params(self) -> int:
        return self.block_matmul_params + self.block_small_params

    @property
    def tied_head(self) -> bool:
        return self.tied

    def param_count(self) -> int:
        """Weights and biases: GPT-2 (tied head, :meth:`TransformerConfig.param_count`)
        V h + S h + L (12 h^2 + 13 h) + 2 h; Llama (untied head) 2 V h + L (Σ k n + 2 h) + h."""
        h, L = self.hidden, self.layers
        if self.family == "gpt2":
            return self.vocab_size * h + self.seq_len * h + L * (12 * h * h + 13 * h) + 2 * h
        return (1 + (not self.tied)) * self.vocab_size * h + L * self.block_params + h

    def flops_per_step(self, batch: int, *, recompute: bool = True) -> int:
        """FLOPs of one step over ``batch`` sequences: Narayanan et al.'s count (Singh's thesis §4.3,
        [EXT]) F = 96 B S L h^2 (1 + S/(6h) + V/(16 L h)) = B S (r L (24 h^2 + 4 S h) + 6 h V)
        with r = 4 passes of each block under activation recompute (forward, recompute, 2 x
        backward), r = 3 without; 24 h^2 is 2 Σ k n of GPT-2's block (Llama: its own Σ k n).
        The attention term counts the full S x S square."""
        h, L, S, V = self.hidden, self.layers, self.seq_len, self.vocab_size
        r = 4 if recompute else 3
        return batch * S * (r * L * (2 * self.block_matmul_params + 4 * S * h) + 6 * h * V)


FAMILIES = ("gpt2", "llama")


GPT_20B = GPTShape(layers=32, hidden=7168, heads=56)
"""Singh's thesis Table 5.1's GPT-20B (S = 2048 and V = 51,200 assumed)."""
GPT_40B = GPTShape(layers=38, hidden=9216, heads=72)
"""Singh's thesis Table 5.1's GPT-40B (S = 2048 and V = 51,200 assumed)."""


def gpt_layers(shape: GPTShape, tokens: int, *, lm_head: bool = False) -> tuple[Layer, ...]:
    """The fully connected layers of a GPT under Alg. 3 (Singh's thesis §1.4), m = ``tokens`` of one
    data group (batch x S / G_data): per block QKV (k = h, n = 3h, normal: heads over X), attention
    output (h, h, transposed), MLP up (h, 4h, normal), MLP down (4h, h, transposed); L blocks
    (:meth:`GPTShape.linears`: a Llama's GQA and SwiGLU widths).
    ``lm_head``: also the (tied) LM head h -> V as one normal layer (vocabulary over X)."""
    shape = GPTShape.of(shape)
    check_count("tokens", tokens, 1)
    h = shape.hidden
    block = tuple(Layer(tokens, k, n, transposed, name)
                  for name, k, n, transposed in shape.linears())
    head = (Layer(tokens, h, shape.vocab_size, False, "lm_head"),) if lm_head else ()
    return block * shape.layers + head


# --------------------------------------------------------------------------------------------------
# Precision and memory
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Precision:
    """``element_bytes`` of messages and activations; ``state_bytes`` per parameter for
    parameters + gradients + Adam's two moments."""

    name: str
    element_bytes: int
    state_bytes: int
    source: str


PRECISIONS = {
    "bf16": Precision("bf16", 2, 16, "bf16 weights and gradients + fp32 master weights and Adam "
                      "moments: 2 + 2 + 12 = 16 bytes per parameter (Cheng et al. §1.1; jphantom's "
                      "bf16 policy keeps fp32 weights and gradients: 4 + 4 + 8, also 16)"),
    "float32": Precision("float32", 4, 16, "fp32 weights, gradients, Adam moments: 4 + 4 + 8"),
}


def precision_of(name: str | Precision) -> Precision:
    if isinstance(name, Precision):
        return name
    try:
        return PRECISIONS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"precision={name!r}: use one of {list(PRECISIONS)}") from None


def checkpointed_activations(shape: GPTShape, tokens: float, *, stream_split: int,
                             inner_split: int, stored_layers: float, element_bytes: int,
                             flash_attention: bool = True) -> dict[str, float]:
    """Activation bytes per device under per-layer activation checkpointing (Singh's thesis §4.3: the
    Ch. 5 runs checkpoint activations), modelled with Korthikanti et al.'s per-layer count (seed
    003 digest: s b h (34 + 5 a s / h) bytes at 2-byte activations, of which 10 s b h are the
    LayerNorm/dropout/residual parts a tensor split replicates and 24 s b h + 5 a s^2 b the
    attention/MLP internals it splits):

    - ``checkpoints``: each of ``stored_layers`` layers keeps its input, ``tokens`` x h /
      ``stream_split`` elements (the residual stream as this layout shards it);
    - ``working``: one layer recomputed for its backward, tokens x h x (10 / stream_split + (24 +
      5 a S / h) / inner_split) x element_bytes / 2 bytes; ``flash_attention`` (default) drops the
      5 a S / h attention-score term (a fused attention kernel keeps no S x S scores).

    ``tokens``: the tokens this device holds in one forward (its data group's share of the
    micro-batch, divided by any token split)."""
    h = shape.hidden
    scores = 0.0 if flash_attention else 5 * shape.heads * shape.seq_len / h
    checkpoints = stored_layers * tokens * h / stream_split * element_bytes
    working = tokens * h * (10 / stream_split + (24 + scores) / inner_split) * element_bytes / 2
    return {"checkpoints": checkpoints, "working": working}


def logits_bytes(tokens: float, vocab_split: int, shape: GPTShape) -> float:
    """The LM head's float32 logits of ``tokens`` tokens, vocabulary split ``vocab_split`` ways."""
    return tokens * shape.vocab_size / vocab_split * 4


def grid_problems(grid: Grid, shape: GPTShape, batch: int, *, accumulate: int = 1,
                  lm_head: bool = True) -> list[str]:
    """Why ``grid`` cannot run the GPT (empty: it can). The filters (our choices; the paper states
    none, §2's implementer notes):

    - heads % G_x: QKV's outputs split over X by whole heads (attention stays local), and the
      transposed attention output splits its rows the same way;
    - hidden % G_y: LayerNorm and the residual stream split features over Y (§1.4); QKV's and MLP
      up's rows (k = h) over Y;
    - (4 h) % G_x: the MLP's 4h features over X (implied by heads % G_x; checked anyway);
    - each layer's k n / (G_x G_y) % G_z: Ŵ is a flat 1/G_z slice of the (y, x) block (§7.1);
    - vocab % G_x with ``lm_head``: the head's vocabulary over X;
    - batch % (G_data G_z accumulate): tokens split over data and Z must be whole sequences
      (attention needs all of a sequence's tokens: the digest's §6 item 5).
    """
    h, problems = shape.hidden, []
    if shape.heads % grid.x:
        problems.append(f"heads={shape.heads} not divisible by G_x={grid.x}")
    if h % grid.y:
        problems.append(f"hidden={h} not divisible by G_y={grid.y}")
    if shape.mlp_width % grid.x:
        problems.append(f"MLP width {shape.mlp_width} not divisible by G_x={grid.x}")
    if shape.family == "llama" and shape.kv_heads % grid.x:
        problems.append(f"kv_heads={shape.kv_heads} not divisible by G_x={grid.x}")
    if lm_head and shape.vocab_size % grid.x:
        problems.append(f"vocab={shape.vocab_size} not divisible by G_x={grid.x}")
    if not problems:
        for layer in gpt_layers(shape, 1, lm_head=lm_head)[-5:]:
            g = grid.transposed() if layer.transposed else grid
            if layer.k % g.y or layer.n % g.x or (layer.k // g.y * layer.n // g.x) % g.z:
                problems.append(f"{layer.name} weight {layer.k}x{layer.n} not divisible into "
                                f"(G_y, G_x, G_z) = ({g.y}, {g.x}, {g.z}) shards")
    if batch % (grid.data * grid.z * accumulate):
        problems.append(f"batch={batch} not divisible by G_data x G_z x accumulate = "
                        f"{grid.data * grid.z * accumulate} (whole sequences per rank)")
    return problems


def pmm3d_memory(grid: Grid, shape: GPTShape, batch: int, *, precision: str | Precision = "bf16",
                 accumulate: int = 1, flash_attention: bool = True, lm_head: bool = True) -> dict:
    """Bytes per device of the 4D layout (modelled; the paper has no memory model for Ch. 5):

    - ``state``: state_bytes (16 for bf16 + Adam) x (the matmul weights, Σ k n over the layers,
      with the tied embedding as the LM head, / (G_x G_y G_z): Ŵ is sharded over X, Y and Z and
      replicated over data) + state_bytes x the small parameters (biases, LayerNorms, positions:
      13 L h + 2 h + S h), counted replicated (an upper bound; < 2% of the state here);
    - ``checkpoints`` and ``working``: :func:`checkpointed_activations` with the residual stream
      [B S / (G_data G_z A), h / G_y] (§1.4) and the layer internals split over X;
    - ``transient``: one layer's gathered weight W (k n / (G_x G_y)) and its unreduced gradient, the
      largest layer's, at element_bytes;
    - ``logits``: float32 [B S / (G_data G_z A), V / G_x].
    """
    p = precision_of(precision)
    layers = gpt_layers(shape, 1, lm_head=lm_head)
    h, L, S = shape.hidden, shape.layers, shape.seq_len
    tables = shape.vocab_size * h * (1 if shape.tied_head else 2)  # embedding (+ untied head)
    matmul = L * shape.block_matmul_params + (tables if lm_head else 0)
    small = shape.param_count() - L * shape.block_matmul_params - tables
    tensor_group = grid.x * grid.y * grid.z
    tokens = batch * S / (grid.data * grid.z * accumulate)
    acts = checkpointed_activations(shape, tokens, stream_split=grid.y, inner_split=grid.x,
                                    stored_layers=L, element_bytes=p.element_bytes,
                                    flash_attention=flash_attention)
    biggest = max(layer.k * layer.n for layer in layers)
    memory = {
        "state": p.state_bytes * (matmul / tensor_group + small),
        **acts,
        "transient": 2 * biggest / (grid.x * grid.y) * p.element_bytes,
        "logits": logits_bytes(tokens, grid.x, shape) if lm_head else 0.0,
    }
    memory["total"] = sum(memory.values())
    return memory


# --------------------------------------------------------------------------------------------------
# Enumeration and ranking (Sec. 5.1.2's use of the model)
# --------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(devices: int, shape: GPTShape | None = None, *, batch: int | None = None,
                   memory_gib: float | None = None, precision: str | Precision = "bf16",
                   accumulate: int = 1, flash_attention: bool = True,
                   lm_head: bool = True) -> list[Grid]:
    """Every ordered factorisation devices = G_x G_y G_z G_data (20 for 8 GPUs, 35 for 16, 56 for
    32, 84 for 64: C(a+3, 3) for 2^a), sorted by (G_data, G_z, G_y, G_x). With a ``shape`` and
    ``batch``, only the grids that pass :func:`grid_problems`; with ``memory_gib`` also, only those
    whose :func:`pmm3d_memory` total fits in that many GiB."""
    check_count("devices", devices, 1, "give the number of GPUs, e.g. 32")
    grids = [Grid(x, y, z, devices // (x * y * z))
             for x in _divisors(devices) for y in _divisors(devices // x)
             for z in _divisors(devices // (x * y))]
    grids.sort(key=lambda g: (g.data, g.z, g.y, g.x))
    if shape is None:
        if batch is not None or memory_gib is not None:
            raise ConfigError("batch and memory_gib filter grids against a model: pass shape too")
        return grids
    shape = GPTShape.of(shape)
    if batch is None:
        raise ConfigError("filtering grids against a model needs batch (sequences per step)")
    check_count("batch", batch, 1)
    check_count("accumulate", accumulate, 1)
    grids = [g for g in grids if not grid_problems(g, shape, batch, accumulate=accumulate,
                                                   lm_head=lm_head)]
    if memory_gib is not None:
        limit = check_positive("memory_gib", memory_gib, "give the GiB of one GPU, e.g. 40") * GIB
        grids = [g for g in grids if pmm3d_memory(
            g, shape, batch, precision=precision, accumulate=accumulate,
            flash_attention=flash_attention, lm_head=lm_head)["total"] <= limit]
    return grids


def rank(shape: GPTShape, devices: int, topology: Topology, *, batch: int,
         memory_gib: float | None = None, precision: str | Precision = "bf16",
         latency: bool = True, accumulate: int = 1, lm_head: bool = False,
         flash_attention: bool = True) -> list[tuple[Grid, float]]:
    """Sec. 5.1.2's use of the model: every admissible grid with its Σ Eq. 5.6 seconds, fastest
    first (ties by mesh text). ``lm_head=False`` (default) prices the transformer blocks only, as
    the paper's GPT layers; ``latency=False`` is the paper's model exactly."""
    shape = GPTShape.of(shape)
    p = precision_of(precision)
    grids = configurations(devices, shape, batch=batch, memory_gib=memory_gib, precision=p,
                           accumulate=accumulate, flash_attention=flash_attention, lm_head=lm_head)
    out = []
    for grid in grids:
        layers = gpt_layers(shape, batch * shape.seq_len // grid.data, lm_head=lm_head)
        seconds = predict(layers, grid, topology, bytes_per_element=p.element_bytes,
                          latency=latency, microbatches=accumulate)["total"]
        out.append((grid, seconds))
    out.sort(key=lambda item: (item[1], str(item[0])))
    return out
