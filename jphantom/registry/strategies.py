"""The parallel strategies: one registry of objects, each declaring what it is, and the rules that
join a strategy to the other options, each stated once with one message.

A strategy (:class:`Strategy`) declares its mesh axes, whether it is the one-device oracle, the
plan its layers take and applies it (:meth:`Strategy.plan`; the plans are
:mod:`jphantom.registry.layer_plans`' objects: Megatron's column/row pairs, Seal et al.'s T1 or phantom
layers, AxoNN's 3D matmul, or GSPMD's annotations of Megatron's plan), which model families it runs
(:meth:`Strategy.runs`: those its plan splits), the program it runs as (``shard_map`` or
``gspmd``), which options apply to it (sequence parallelism, duplicate token dropping, a ghost
width, ZeRO, a context axis), and the layouts the planner prices it as (:meth:`Strategy.price`).
The names are the one vocabulary of the CLI, the API, ``results.json``, the cost models and the
docs.

The cross-option rules (:func:`check_sequence_parallel`, :func:`check_collective_matmul`,
:func:`check_dtd`, :func:`check_ghost_width`, :func:`check_stage`) are called by the run
configuration, the program builder and the plans alike, so a rule has one message wherever it is
broken. This module imports no jax: a configuration reads it as it validates.
"""

from __future__ import annotations

import dataclasses

from jphantom.errors import ConfigError
from jphantom.registry.lazy import Lazy, resolved
from jphantom.runtime.mesh import CONTEXT, DATA, EXPERT, MODEL, STAGE, X, Y, Z

SHARED_AXES = (DATA, STAGE, EXPERT, CONTEXT)
"""The axes every strategy of a language model may add (batch, pipeline, experts, sequence)."""

GRID_AXES = (Z, Y, X)
"""AxoNN's 3D matmul grid (pmm3d's own axes)."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A row of :data:`STRATEGIES` (module docstring).

    - ``family``: ``dense`` (dense-shaped weights, any degree) or ``phantom`` (the ghost width k
      and the degree p are part of the model).
    - ``layers``: the plan its layers take (``None``: the plain model), one of
      :mod:`jphantom.registry.layer_plans`' ``MEGATRON``, ``T1``, ``PHANTOM``, ``PMM3D`` or ``ANNOTATE``;
      ``fused`` (phantom: one decompressor GEMM) and ``weights`` (pmm3d: when the weights are
      gathered) select within it.
    - ``axes``: the mesh axes its layers split (``model``; pmm3d's ``z``, ``y``, ``x``); none
      for the one-device oracle (``one_device``).
    - ``spmd``: ``shard_map`` (the layers' own collectives) or ``gspmd`` (annotations, jit's).
    - What applies to it: ``zero`` (ZeRO over ``data``; pmm3d shards its weights over ``z``
      already), ``sequence_parallel`` and ``dtd`` (Megatron-SP, TED's duplicate token dropping),
      ``context`` (a context axis), ``pairs`` (an FFN's layers alternate column and row).
    - ``layouts``: the layouts the planner prices it as (:mod:`jphantom.planner.layouts`; none:
      the planner does not price it, e.g. a variant priced as its base strategy)."""

    name: str
    description: str
    family: str = "dense"
    layers: Lazy | None = None
    axes: tuple[str, ...] = (MODEL,)
    spmd: str = "shard_map"
    one_device: bool = False
    fused: bool = True
    weights: str | None = None
    zero: bool = True
    sequence_parallel: bool = False
    dtd: bool = False
    context: bool = True
    pairs: bool = False
    collectives: Lazy | None = None
    step_model: Lazy | None = None
    layouts: Lazy | None = None

    def __getattribute__(self, name):
        return resolved(self, name)  # a Lazy field imported once, then kept as its value

    def declares(self, field: str) -> bool:
        """Whether the row gives ``field`` (not ``None``), without importing a
        :class:`~jphantom.registry.lazy.Lazy` one."""
        return object.__getattribute__(self, field) is not None

    @property
    def needs_ghost_width(self) -> bool:
        """Phantom parallelism's k is part of its model."""
        return self.family == "phantom"

    @property
    def same_model(self) -> bool:
        """Whether it trains the dense model (dense-shaped weights, the one-device oracle's
        function); phantom's ghosts make another model (Seal et al.)."""
        return self.family == "dense"

    def plan(self, model, mesh, family, **options):
        """Split ``model`` (the plain model of ``family``, a :class:`jphantom.registry.families.Family`) in
        place over ``mesh`` (a :class:`jphantom.runtime.mesh.MeshConfig`) by its layers' plan (the
        family's program's builder; ``options``: ``sequence_parallel``, ``ghost_width``, ``dtd``,
        ``collective_matmul`` where they apply); the one-device oracle leaves it plain."""
        if self.layers is None:
            return model
        if not self.layers.builds(family):
            raise ConfigError(f"strategy {self.name!r} does not run the model family "
                              f"{family.name!r}: its layers' plan does not split that model")
        getattr(self.layers, family.program)(model, self, mesh, family=family, **options)
        return model

    def runs(self, family) -> bool:
        """Whether the model family ``family`` (a :class:`jphantom.registry.families.Family`) runs it: its
        layers' plan splits the family's model (:meth:`jphantom.registry.layer_plans.LayerPlan.builds`)."""
        return self.layers is None or self.layers.builds(family)

    def price(self, pricing, names=None):
        """The priced candidates of its planner layouts (:attr:`layouts`) named in ``names``
        (default all) for ``pricing`` (a :class:`jphantom.planner.layouts.Pricing`: the model's
        shape on the devices, the batch, the network and the device's rate)."""
        for layout in self.layouts or ():
            if names is None or layout.name in names:
                yield from layout.price(pricing)

    def check_mesh(self, mesh):
        """The mesh (a :class:`jphantom.runtime.mesh.MeshConfig`) a language model runs on under this
        strategy: one device for the oracle; pmm3d's ``x``, ``y``, ``z`` added with size 1 where
        absent; ``model=1`` added where absent otherwise. A ConfigError names an axis it cannot
        use."""
        from jphantom.runtime.mesh import MeshConfig

        if self.one_device:
            if mesh.device_count != 1:
                raise ConfigError(f"strategy {self.name!r} runs on one device, not on mesh {mesh}: "
                                  "use 'model=1', or 'gspmd' / 'tensor' / 'phantom' for several "
                                  "devices")
            return mesh
        allowed = SHARED_AXES + self.axes
        if self.axes == GRID_AXES:
            extra = [a for a, s in mesh.axes if a not in allowed and s > 1]
            if extra:
                raise ConfigError(f"strategy {self.name!r} runs on the axes data, stage, expert, "
                                  f"z, y, x, not {extra}: drop them from the mesh ({mesh})")
            return MeshConfig.of({**dict(mesh.axes), **{a: mesh.size(a) for a in GRID_AXES}})
        grid = [a for a in (X, Y, Z) if mesh.size(a) > 1]
        if grid:
            raise ConfigError(f"the mesh axes {grid} are pmm3d's (AxoNN's 3D matrix multiply): use "
                              f"--strategy pmm3d, or put those devices on data or model ({mesh})")
        if MODEL not in mesh.shape:
            return MeshConfig.of({**dict(mesh.axes), MODEL: 1})
        return mesh


_INVENTORY, _STEP_MODEL = "jphantom.costs.inventory", "jphantom.perf.step_model"
_LAYOUTS, _PLANS = "jphantom.planner.layouts", "jphantom.registry.layer_plans"
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("dense", "the unsharded model on one device (the single-device oracle)", axes=(),
             one_device=True),
    Strategy("gspmd", "the plain model with NamedSharding annotations of Megatron's plan; jax.jit "
             "chooses the collectives (what a JAX user writes without jphantom)",
             layers=Lazy(_PLANS, "ANNOTATE"), spmd="gspmd", context=False),
    Strategy("tensor", "Megatron tensor parallelism: column/row pairs with f and g (Brakel et al.); "
             "sequence parallelism as an option (Korthikanti et al. 2022)",
             layers=Lazy(_PLANS, "MEGATRON"), sequence_parallel=True, dtd=True, pairs=True,
             collectives=Lazy(_INVENTORY, "MEGATRON"), layouts=Lazy(_LAYOUTS, "TENSOR")),
    Strategy("tensor-t1", "Seal et al.'s TP: row-sharded weights, all-gather forward / "
             "reduce-scatter backward", layers=Lazy(_PLANS, "T1"),
             collectives=Lazy(_INVENTORY, "T1"), step_model=Lazy(_STEP_MODEL, "T1")),
    Strategy("phantom", "phantom parallelism (Seal et al.), one fused decompressor GEMM",
             family="phantom", layers=Lazy(_PLANS, "PHANTOM"),
             collectives=Lazy(_INVENTORY, "PHANTOM"), step_model=Lazy(_STEP_MODEL, "PHANTOM"),
             layouts=Lazy(_LAYOUTS, "PHANTOM")),
    Strategy("phantom-unfused", "phantom parallelism with the paper's p-1 decompressor GEMMs",
             family="phantom", layers=Lazy(_PLANS, "PHANTOM"), fused=False,
             collectives=Lazy(_INVENTORY, "PHANTOM"), step_model=Lazy(_STEP_MODEL, "PHANTOM")),
    Strategy("pmm3d", "AxoNN's 3D parallel matrix multiply on x, y, z (and data), Singh's thesis "
             "ch. 5: weights all-gathered over z, all-reduces over y forward and x backward, "
             "reduce-scatters over z", layers=Lazy(_PLANS, "PMM3D"), weights="kept",
             axes=GRID_AXES, zero=False, context=False, pairs=True,
             layouts=Lazy(_LAYOUTS, "PMM3D")),
    Strategy("pmm3d-regather", "pmm3d whose backward all-gathers the weights again instead of "
             "keeping them (AxoNN's default)", layers=Lazy(_PLANS, "PMM3D"), weights="regather",
             axes=GRID_AXES, zero=False, context=False, pairs=True),
    Strategy("pmm3d-deferred", "pmm3d with every weight gathered before the layers and one "
             "reduce-scatter after the backward", layers=Lazy(_PLANS, "PMM3D"),
             weights="deferred", axes=GRID_AXES, zero=False, context=False, pairs=True),
)}
NAMES = tuple(STRATEGIES)


def get(name: str) -> Strategy:
    """A strategy by name, with the valid names in the error."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown strategy {name!r}; choose one of {list(STRATEGIES)}") from None


# -- the cross-option rules, each stated once ------------------------------------------------------


def check_sequence_parallel(strategy: str, on: bool, *, has_sequence: bool = True) -> None:
    """Megatron-SP splits a transformer's sequence over ``model`` between its tensor-parallel
    regions (Korthikanti et al. 2022): ``tensor`` only, and a model with a sequence."""
    if on and not (get(strategy).sequence_parallel and has_sequence):
        what = "a model without a sequence (the FFN)" if not has_sequence else repr(strategy)
        raise ConfigError("sequence_parallel (--sequence-parallel) applies to the transformer "
                          f"under strategy 'tensor' (Megatron-SP), not to {what}")


def check_collective_matmul(on: bool, sequence_parallel: bool) -> None:
    """The collective matmul overlaps sequence parallelism's collectives (Wang et al. 2023)."""
    if on and not sequence_parallel:
        raise ConfigError("collective_matmul (--collective-matmul) overlaps sequence "
                          "parallelism's all-gathers and reduce-scatters with the GEMMs: add "
                          "sequence_parallel (--sequence-parallel)")


def check_dtd(strategy: str, on: bool, *, routed_experts: bool) -> None:
    """TED's duplicate token dropping (Singh's thesis ch. 7) splits the routed experts' capacity
    buffers over ``model``: GPT-2's routed MoE blocks under ``tensor``."""
    if on and not (routed_experts and get(strategy).dtd):
        raise ConfigError("dtd (--dtd, duplicate token dropping) applies to routed MoE blocks "
                          "(GPT-2's moe_every, --moe-every N) under strategy 'tensor' (TED): set "
                          "them and use 'tensor', or leave dtd out")


def check_ghost_width(strategy: str, ghost_width) -> None:
    """Phantom parallelism's k (ghost neurons per rank and token, Seal et al.) is part of its
    model: it must be given."""
    if get(strategy).needs_ghost_width and ghost_width is None:
        raise ConfigError(f"strategy {strategy!r} needs ghost_width (--ghost-width K: k ghost "
                          "neurons per rank and token, Seal et al.), e.g. 8")


def check_stage(strategy: str, staged: bool) -> None:
    """The one-device oracle has no stages to cut."""
    if staged and get(strategy).one_device:
        raise ConfigError(f"strategy {strategy!r} does not run inside pipeline stages: use "
                          "'tensor' or 'phantom' (with model=1 for no tensor parallelism), or "
                          "'gspmd'")
