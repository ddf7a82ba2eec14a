"""AxoNN's communication equations for the 4D algorithm (Singh's thesis ch. 5, Eqs. 5.1-5.6):
the grid G_x x G_y x G_z x G_data, a fully connected layer O = I W under Algorithm 3, its five
collectives per step and their ring volumes,

    (5.1)  t_AG,z   = (1/β_z) (G_z - 1) k n / (G_x G_y G_z)           all-gather of Ŵ, forward
    (5.2)  t_RS,z   = (1/β_z) ((G_z - 1)/G_z) k n / (G_x G_y)         reduce-scatter of dŴ, backward
    (5.3)  t_AR,y   = (2/β_y) ((G_y - 1)/G_y) m n / (G_z G_x)         all-reduce of O, forward
    (5.4)  t_AR,x   = (2/β_x) ((G_x - 1)/G_x) m k / (G_z G_y)         all-reduce of dI, backward
    (5.5)  t_AR,data= (2/β_d) ((G_data - 1)/G_data) k n / (G_x G_y G_z)  gradient all-reduce
    (5.6)  t_comm   = t_AG,z + t_RS,z + t_AR,y + t_AR,x + t_AR,data

priced with Eq. 5.7's bandwidths (:mod:`~jphantom.perf.axonn_model.network`) and, our addition, α
per ring step (Thakur et al.'s ring)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jphantom.errors import ConfigError
from jphantom.perf.axonn_model.network import Topology, hierarchy_bandwidths
from jphantom.perf.axonn_model.units import check_count, check_positive


AXES = ("x", "y", "z", "data")
"""The grid's axes, innermost first (Singh's thesis Sec. 5.1.2's hierarchy order)."""

# ring steps of one collective among p ranks (Thakur et al.): how many α it costs
_RING_STEPS = {"all-gather": lambda p: p - 1, "reduce-scatter": lambda p: p - 1,
               "all-reduce": lambda p: 2 * (p - 1), "all-to-all": lambda p: p - 1,
               "collective-permute": lambda p: 1}


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
class LayerShape:
    """One fully connected layer O [m, n] = I [m, k] x W [k, n] (Alg. 3's shapes; m tokens of one
    data group, k in-features, n out-features); ``transposed`` swaps the X and Y roles."""

    m: int
    k: int
    n: int
    transposed: bool = False
    name: str = ""

    def __post_init__(self):
        for field in ("m", "k", "n"):
            check_count(f"LayerShape.{field}", getattr(self, field), 1)
        if not isinstance(self.transposed, bool):
            raise ConfigError(f"LayerShape.transposed={self.transposed!r} must be True or False")


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


def layer_collectives(layer: LayerShape, grid: Grid, *,
                      microbatches: int = 1) -> list[Collective]:
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


def layer_seconds(layer: LayerShape, grid: Grid, topology: Topology, *,
                  bytes_per_element: float = 2, latency: bool = True,
                  microbatches: int = 1) -> dict[str, float]:
    """Eq. 5.6 for one layer: seconds of each of Eqs. 5.1-5.5 and their ``total``."""
    bandwidth = axis_bandwidths(grid, topology)
    alpha = topology.latency_us * 1e-6 if latency else 0.0
    names = ("5.1", "5.2", "5.3", "5.4", "5.5")
    out = {name: c.seconds(bandwidth[c.axis], bytes_per_element=bytes_per_element, latency_s=alpha)
           for name, c in zip(names, layer_collectives(layer, grid, microbatches=microbatches))}
    out["total"] = sum(out.values())
    return out


def predict(layers: Sequence[LayerShape], grid: Grid, topology: Topology, *,
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
