"""Seal et al.'s FFN as a program (:class:`jphantom.registry.program.Program`): the family's
``build`` (:attr:`jphantom.registry.families.Family.build`), which checks the configuration
against the mesh and the strategy, creates the plain :class:`~jphantom.models.ffn.FFN` (``pairs``
as the strategy declares) and parallelises it with the strategy's layers' plan.

This module sits in the program layer, above the rest of its package (``tests/test_layering.py``
places it apart, as ``models.gpt2.plan`` sits with the plans): it builds a
:class:`~jphantom.registry.program.Program`, and the family names it by a
:class:`~jphantom.registry.lazy.Lazy` reference, imported when a program is built, so the
family's registration imports no jax and nothing above the models.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from jphantom.errors import ConfigError, JPhantomWarning
from jphantom.registry import strategies
from jphantom.registry.program import Program
from jphantom.registry.strategies import get
from jphantom.runtime.mesh import DATA, EXPERT, MODEL, STAGE, MeshConfig

if TYPE_CHECKING:
    from flax import nnx
    from jax.sharding import PartitionSpec as P


FEATURE_AXIS, DATA_AXIS, STAGE_AXIS, EXPERT_AXIS = MODEL, DATA, STAGE, EXPERT
PMM3D_AXES = (DATA, *strategies.GRID_AXES)


def _only_axes(mesh: MeshConfig, allowed: tuple[str, ...], strategy: str) -> None:
    extra = [name for name, size in mesh.axes if name not in allowed and size > 1]
    if extra:
        raise ConfigError(f"strategy {strategy!r} runs on mesh axes {allowed}, not {extra}: "
                          f"drop them from the mesh ({mesh})")


def _pmm3d_divides(what: str, value: int, axes: tuple[str, ...], mesh: MeshConfig) -> None:
    size = math.prod(mesh.size(a) for a in axes)
    if value % size:
        raise ConfigError(f"{what}={value} is not divisible by {' x '.join(axes)} = {size} of mesh "
                          f"{mesh}: pmm3d splits it over those axes; pick a multiple or another "
                          "grid")


def check_mesh(config, strategy: str, mesh: MeshConfig) -> MeshConfig:
    """The mesh the FFN runs on under ``strategy`` (pmm3d's grid: ``x``, ``y``, ``z`` added with
    size 1 where absent; a staged mesh or ``gspmd`` without ``model``: ``model=1``), or a
    ConfigError naming the value and the fix. The FFN has no experts, no sequence to split over
    ``context``, and pmm3d's grid no pipeline."""
    if EXPERT_AXIS in mesh.shape:
        raise ConfigError(f"an {EXPERT_AXIS!r} mesh axis splits the experts of MoE blocks: give "
                          "the transformer MoE blocks (--moe-every 2 --experts 8) or drop the axis")
    row = get(strategy)
    staged = STAGE_AXIS in mesh.shape
    if row.axes == strategies.GRID_AXES:
        if staged:
            raise ConfigError("pmm3d does not run inside pipeline stages: drop the 'stage' axis")
        _only_axes(mesh, PMM3D_AXES, strategy)
        mesh = row.check_mesh(mesh)
        for axes in (("x", "z"), ("y", "z")):
            _pmm3d_divides("width", config.width, axes, mesh)
        return mesh
    strategies.check_stage(strategy, staged)
    if row.one_device:
        return row.check_mesh(mesh)
    _only_axes(mesh, (DATA_AXIS, STAGE_AXIS, FEATURE_AXIS), strategy)
    if FEATURE_AXIS not in mesh.shape:
        if not staged and row.spmd != "gspmd":
            import jax

            raise ConfigError(f"strategy {strategy!r} shards features over the 'model' axis: add "
                              f"it to the mesh (e.g. 'model={jax.device_count()}'), got {mesh}")
        mesh = MeshConfig.of({**dict(mesh.axes), FEATURE_AXIS: 1})
    from jphantom.nn.shapes import check_width

    check_width(config.width, mesh.size(FEATURE_AXIS))
    return mesh


def plan(model: nnx.Module, strategy: str, mesh: MeshConfig, *, ghost_width=None):
    """Parallelise the FFN ``model`` (:class:`jphantom.models.ffn.FFN`, ``pairs`` as its
    strategy declares) in place under ``strategy`` (:meth:`jphantom.registry.strategies.Strategy.plan`:
    the FFN builder of its layers' plan, :mod:`jphantom.registry.layer_plans`)."""
    from jphantom.registry import families

    return get(strategy).plan(model, mesh, families.get("ffn"), ghost_width=ghost_width)


def batch_specs(strategy: str, config, mesh: MeshConfig) -> tuple[P, P]:
    """The input's and the target's specs: rows over ``data``, features over ``model``
    (phantom's layout, every strategy but pmm3d); pmm3d: rows over (``data``, ``z``), input
    features over ``y``, output features over the last layer's output axis (x after a normal
    last layer, odd depth; y after a transposed one)."""
    from jax.sharding import PartitionSpec as P

    if get(strategy).axes == strategies.GRID_AXES:
        rows = tuple(a for a in (DATA_AXIS, "z") if a in mesh.shape)
        rows = rows[0] if len(rows) == 1 else rows
        return P(rows, "y"), P(rows, "x" if config.depth % 2 else "y")
    spec = P(DATA_AXIS if DATA_AXIS in mesh.shape else None,
             FEATURE_AXIS if FEATURE_AXIS in mesh.shape else None)
    return spec, spec


def build(config, strategy: str, mesh: MeshConfig, *, ghost_width: int | None = None,
              seed: int = 0, model: nnx.Module | None = None, sequence_parallel: bool = False,
              dtd: bool = False, **options) -> Program:
    """Seal et al.'s FFN (:class:`jphantom.models.ffn.FFN`) under ``strategy`` on ``mesh``: the plain
    model (``pairs`` where the strategy declares them), parallelised by :func:`plan`.
    ``ghost_width``: phantom's k (default the configuration's); ``model``: a concrete plain
    :class:`~jphantom.models.ffn.FFN` to parallelise instead of creating one."""
    import warnings

    import jax
    from flax import nnx

    from jphantom.models.ffn import FFN, ffn_loss

    if {"context_attention", "load_balance"} & set(options):
        raise ConfigError("a context mesh axis does not apply to the ffn model: it has no "
                          "sequence to split; drop context from the mesh")
    if options:
        raise ConfigError(f"options {sorted(options)} do not apply to the ffn model")
    strategies.check_dtd(strategy, dtd, routed_experts=False)
    strategies.check_sequence_parallel(strategy, sequence_parallel, has_sequence=False)
    mesh = check_mesh(config, strategy, mesh)
    pairs = get(strategy).pairs
    if STAGE_AXIS in mesh.shape:  # whole units per stage (virtual stages: the step checks)
        from jphantom.pipeline.config import PipelineConfig

        units, name = ((config.depth // 2, "layer pairs (depth / 2)") if pairs
                       else (config.depth, "depth"))
        if units == 0:
            raise ConfigError(f"depth={config.depth}: a pipeline cuts the FFN's {name}; give it "
                              "at least one per stage")
        PipelineConfig().check(mesh.size(STAGE_AXIS), units, name)

    k = ghost_width if ghost_width is not None else config.ghost_width
    strategies.check_ghost_width(strategy, k)
    if get(strategy).needs_ghost_width:
        from jphantom.nn.phantom.ops import PhantomConfig

        PhantomConfig(config.width, k, mesh.size(FEATURE_AXIS), config.depth)  # Eq. 8 warning

    def planned(m):
        with warnings.catch_warnings():  # Eq. 8 warned about above, once
            warnings.simplefilter("ignore", JPhantomWarning)
            return plan(m, strategy, mesh, ghost_width=k)

    if model is not None:
        if not isinstance(model, FFN) or model.pairs != pairs or model.config != config:
            raise ConfigError(f"model must be FFN({config}, pairs={pairs}) for strategy "
                              f"{strategy!r}")
        create, built = None, planned(model)
    else:
        create = lambda key: planned(FFN(config, pairs=pairs, rngs=nnx.Rngs(key)))
        built = nnx.eval_shape(lambda: create(jax.random.PRNGKey(seed)))
    return Program(strategy, "ffn", config, mesh, create, built, ffn_loss,
                   batch_specs=batch_specs(strategy, config, mesh),
                   spmd=get(strategy).spmd, options={"ghost_width": k, "pairs": pairs})
