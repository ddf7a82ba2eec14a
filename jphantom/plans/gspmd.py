"""GSPMD's annotations (:func:`annotate`): the same plan as sharding metadata on the plain Flax
layers, what a JAX user writes without jphantom; ``jax.jit`` then chooses the collectives."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn import tensor
from jphantom.plans.convert import mesh_axis_size
from jphantom.plans.paths import modules_by_path
from jphantom.plans.styles import Style


# What each style splits, for GSPMD's annotations: parameter name -> mesh axis per dimension.
_ANNOTATIONS = {
    ("column", "Linear"): {"kernel": (None, "{axis}"), "bias": ("{axis}",)},
    ("vocab", "Linear"): {"kernel": (None, "{axis}"), "bias": ("{axis}",)},
    ("row", "Linear"): {"kernel": ("{axis}", None)},
    # nnx.MultiHeadAttention's LinearGeneral: kernel [in, heads, d] / [heads, d, out]
    ("column", "LinearGeneral"): {"kernel": (None, "{axis}", None), "bias": ("{axis}", None)},
    ("row", "LinearGeneral"): {"kernel": ("{axis}", None, None)},
    ("vocab", "Embed"): {"embedding": ("{axis}", None)},
    ("experts", "Experts"): {"w_gate": (None, None, "{axis}"), "w_up": (None, None, "{axis}"),
                             "w_down": (None, "{axis}", None)},
}


def annotate(model: nnx.Module, mesh, plan: Mapping[str, str | Style], *,
             axis: str = "model") -> nnx.Module:
    """GSPMD, what a JAX user writes without jphantom: the same plan, but the layers stay plain
    Flax layers and only their parameters' sharding metadata changes (column: kernel split on its
    outputs, row: on its inputs, vocab: the vocabulary); ``jax.jit`` then chooses the
    collectives. Train it with ``make_train_step(..., spmd="gspmd")``. Norms, ``input`` and
    ``sequence`` entries stay replicated; ``phantom`` has no annotation (it is another model)."""
    mesh_axis_size(mesh, axis)
    modules = modules_by_path(model)
    chosen = {}
    for pattern, value in plan.items():
        style = Style.of(value)
        matched = [path for path in modules if fnmatch.fnmatchcase(path, pattern)]
        if not matched:
            raise ConfigError(f"plan pattern {pattern!r} matches no module of "
                              f"{type(model).__name__}")
        if style.name == "phantom":
            raise ConfigError(f"{pattern}: phantom layers are another model, not an annotation "
                              "of this one: use parallelize")
        for path in matched:
            chosen[path] = style
    for path, style in chosen.items():
        module = modules[path][1]
        kind = "Linear" if isinstance(module, nnx.Linear) else type(module).__name__
        table = _ANNOTATIONS.get((style.name, kind), {})
        if isinstance(module, nnx.Einsum) and style.name in ("column", "row"):
            table = _einsum_annotation(module, style.name)
        for name, axes in table.items():
            variable = getattr(module, name, None)
            if isinstance(variable, nnx.Param):
                axes = tuple(a and a.format(axis=axis) for a in axes)
                lead = variable.get_value().ndim - len(axes)
                variable.set_metadata("out_sharding", (None,) * lead + axes)
    return model


def _einsum_annotation(module: nnx.Einsum, name: str) -> dict:
    """An ``nnx.Einsum``'s annotation: the kernel axis its column or row layer splits (column:
    the bias along it too)."""
    lhs, rhs, out = tensor.einsum_operands(module)
    split = tensor.einsum_split(lhs, rhs, out, column=name == "column")
    if split is None:
        return {}
    table = {"kernel": tuple("{axis}" if c == split else None for c in rhs)}
    if name == "column":
        table["bias"] = tuple("{axis}" if c == split else None for c in out if c in rhs)
    return table
