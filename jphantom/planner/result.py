"""The planner's result: every layout priced (:class:`PlanRow`) and their ranking with the
inputs assumed (:class:`Ranking`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jphantom.perf.axonn_model import GIB

OBJECTIVES = ("comm", "time", "energy", "memory")
"""What a plan ranks by: modelled communication + bubble (Singh's model, the default), the
modelled step time, joules per token (Seal et al.'s Eq. 1), or memory per GPU."""


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
    compute_s: float = 0.0  # FLOPs at the device's sustained GEMM rate
    busy_watts: float = 0.0  # Seal et al.'s Eq. 1: A while computing, B while waiting
    idle_watts: float = 0.0
    devices: int = 1
    tokens: int = 0  # per step, all devices
    objective: str = "comm"

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
        """Modelled communication + pipeline bubble seconds per step (the ``comm`` objective)."""
        return self.comm_s + self.bubble_s

    @property
    def step_s(self) -> float:
        """Modelled step seconds: compute + communication (none hidden: an upper bound; the
        compiled schedule's overlap is what ``--compile-top`` simulates) + bubble."""
        return self.compute_s + self.comm_s + self.bubble_s

    @property
    def joules_per_token(self) -> float:
        """Seal et al.'s Eq. 1 over every device, per token: A x compute + B x (communication
        + bubble), the GPUs busy while computing and idle while waiting."""
        joules = self.devices * (self.busy_watts * self.compute_s
                                 + self.idle_watts * (self.comm_s + self.bubble_s))
        return joules / self.tokens if self.tokens else 0.0

    @property
    def ranking_key(self) -> float:
        """The value the plan ranks by under its objective (:data:`OBJECTIVES`)."""
        return {"comm": self.key_s, "time": self.step_s, "energy": self.joules_per_token,
                "memory": self.memory["total"]}[self.objective]

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
                "compute_s": self.compute_s, "step_s": self.step_s,
                "joules_per_token": self.joules_per_token, "notes": list(self.notes)}


@dataclasses.dataclass(frozen=True)
class Ranking:
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

    def pareto(self) -> list[PlanRow]:
        """The time/energy Pareto front: the same-model rows that fit (all of them when none
        fits) that no other such row beats on both step seconds and joules per token, fastest
        first."""
        pool = [r for r in self.rows if r.same_model and r.fits is not False] or [
            r for r in self.rows if r.same_model]
        front = [r for r in pool if not any(
            (o.step_s <= r.step_s and o.joules_per_token <= r.joules_per_token)
            and (o.step_s < r.step_s or o.joules_per_token < r.joules_per_token) for o in pool)]
        return sorted(front, key=lambda r: r.step_s)

    def as_dict(self, top: int | None = None) -> dict:
        rows = self.rows if top is None else self.rows[:top]
        out = {"assumptions": dict(self.assumptions), "considered": len(self.rows),
               "fitting": sum(r.fits is not False for r in self.rows),
               "top_choice": self.top.as_dict(), "rows": [r.as_dict() for r in rows]}
        if self.assumptions.get("objective") in ("time", "energy"):
            out["pareto_front"] = [r.as_dict() for r in self.pareto()]
        return out
