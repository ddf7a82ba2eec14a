"""Applying a plan: :func:`parallelize` swaps a model's layers for the parallel layers its plan
names, in place, after checking every entry; :func:`dense_equivalent` swaps them back for the
plain Flax layers they equal (the one-device oracle)."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.plans.convert import convert, mesh_axis_size
from jphantom.plans.paths import holds_params, inside, modules_by_path, set_submodule, unplaced
from jphantom.plans.styles import AXIS_STYLES, REGISTERED, Style


def parallelize(model: nnx.Module, mesh, plan: Mapping[str, str | Style], *,
                axis: str = "model", ghost_width: int | None = None,
                fused: bool = True) -> nnx.Module:
    """Swap ``model``'s layers for the parallel layers ``plan`` names, in place; returns ``model``.

    ``mesh``: a ``jax.sharding.Mesh`` (or a mapping of axis sizes) with an ``axis`` axis (p ranks).
    ``plan``: dotted module path pattern -> style (module docstring). ``ghost_width``: the default
    k of ``phantom`` entries. ``fused``: phantom's fused decompressor GEMM (Seal et al. use p-1).
    Call it outside ``jax.jit``; it needs no mesh context (parameters are placed by the step).
    """
    if not isinstance(model, nnx.Module):
        raise ConfigError(f"parallelize takes an nnx.Module, not {type(model).__name__}")
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError("plan must be a non-empty mapping of module path patterns to styles, "
                          "e.g. {'blocks.*.attn.q': 'column'} (or jphantom.plans.megatron(model))")
    shape = {str(k): int(v) for k, v in (dict(mesh.shape) if hasattr(mesh, "shape")
                                         else dict(mesh)).items()}
    styles = {pattern: Style.of(value) for pattern, value in plan.items()}
    uses_axis = any(s.name in AXIS_STYLES or (s.name in REGISTERED and REGISTERED[s.name][2])
                    for s in styles.values())
    p = mesh_axis_size(mesh, axis) if uses_axis else shape.get(axis, 1)
    if any(s.name == "pmm3d" for s in styles.values()):
        for needed in ("x", "y", "z"):
            mesh_axis_size(mesh, needed)
    sequence_parallel = any(s.name == "sequence" for s in styles.values())
    modules = modules_by_path(model)
    chosen: dict[str, tuple[str, Style]] = {}
    for pattern, style in styles.items():
        matched = [path for path in modules if fnmatch.fnmatchcase(path, pattern)]
        if not matched:
            close = ", ".join(list(modules)[:12])
            raise ConfigError(f"plan pattern {pattern!r} matches no module of "
                              f"{type(model).__name__}; its modules include: {close}")
        for path in matched:
            if path in chosen and chosen[path][1] != style:
                raise ConfigError(f"{path}: patterns {chosen[path][0]!r} and {pattern!r} give it "
                                  f"two styles ({chosen[path][1].name}, {style.name}): make them "
                                  "exclusive")
            chosen[path] = (pattern, style)
    if sequence_parallel:  # every module then sees S/p tokens: each must be named
        named = {path for path in chosen}
        for path, (_, module) in modules.items():
            if holds_params(module) and path not in named and not inside(path, named):
                raise unplaced(path, module, True, "parallelize (sequence parallelism)")
    check = getattr(model, "check_shards", None)
    if callable(check) and any(s.name != "replicate" for s in styles.values()):
        # the axis splitting attention heads: pmm3d's output axis x, else the model axis; with
        # 'column' entries of kv_heads the key/value heads may be fewer than the ranks
        shared = {s.kv_heads for s in styles.values() if s.kv_heads is not None}
        check(shape["x"] if any(s.name == "pmm3d" for s in styles.values()) else p,
              **({"shared_kv_heads": True} if shared else {}))
    swaps = []
    for path, (_, style) in chosen.items():  # validate every entry before changing anything
        path_tuple, module = modules[path]
        new = convert(path, module, style, axis=axis, p=p, sequence_parallel=sequence_parallel,
                       ghost_width=ghost_width, fused=fused, shape=shape)
        if new is not None:
            swaps.append((path_tuple, new))
    for path_tuple, new in swaps:
        set_submodule(model, path_tuple, new)
    return model


def dense_equivalent(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` with every parallel layer replaced by the plain Flax layer it equals
    (``dense_equivalent()``): the single-device oracle of a parallelised model. Differentiable in
    the parallel layers' parameters (phantom's dense matrix is computed with jax operations)."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    swaps = [(path_tuple, module.dense_equivalent())
             for path_tuple, module in modules_by_path(copy).values()
             if callable(getattr(module, "dense_equivalent", None))]
    for path_tuple, new in sorted(swaps, key=lambda s: len(s[0])):
        set_submodule(copy, path_tuple, new)
    return copy
