"""``jphantom.parallelize``: swap a model's plain Flax layers for parallel ones, by path.

    plan = {"blocks.*.attn.q": "column", "blocks.*.attn.out": "row", "wte": "vocab"}
    model = jphantom.parallelize(model, mesh, plan)

A *plan* maps module paths (dotted, with ``fnmatch`` globs: ``*`` matches any run of characters,
dots included) to a *style*. The model is changed in place (and returned); its parameters keep
their values and gain the sharding metadata the training step reads. Styles and what they do to
each kind of Flax layer (p = the size of ``axis``):

=============  ==========================================================================
``column``     ``nnx.Linear`` -> :class:`~jphantom.nn.tensor.ColumnParallelLinear` (out / p)
``row``        ``nnx.Linear`` -> :class:`~jphantom.nn.tensor.RowParallelLinear` (in / p)
``vocab``      ``nnx.Embed`` -> :class:`~jphantom.nn.tensor.VocabParallelEmbed` (V / p);
               ``nnx.Linear`` (an LM head) -> :class:`~jphantom.nn.tensor.VocabParallelHead`
``sequence``   Megatron-SP: ``nnx.LayerNorm`` / ``nnx.RMSNorm`` keep their module and get their
               gradients summed over ``axis``; a position ``nnx.Embed`` ->
               :class:`~jphantom.nn.tensor.SequenceParallelEmbed`. Any ``sequence`` entry turns
               sequence parallelism on for every column, row and vocab layer of the plan.
``phantom``    seed 000: ``nnx.Linear`` -> :class:`~jphantom.nn.phantom.PhantomLinear`
               (``Style("phantom", ghost_width=k, vocab_output=True)`` for the LM head);
               ``nnx.Embed`` -> :class:`~jphantom.nn.phantom.FeatureParallelEmbed`; norms ->
               :class:`~jphantom.nn.phantom.FeatureParallelNorm`; ``Experts`` ->
               :class:`~jphantom.nn.tensor.TensorParallelExperts` on feature-split streams
``experts``    :class:`~jphantom.nn.experts.Experts` ->
               :class:`~jphantom.nn.tensor.TensorParallelExperts` (FFN width / p)
``replicate``  unchanged: every rank holds the whole layer
=============  ==========================================================================

Everything is checked before anything is changed: a pattern that matches no module, a style that
does not fit the module it matches (``row`` on an ``nnx.Embed``), two patterns giving one module
two styles, or a dimension the axis does not divide is a :class:`~jphantom.errors.ConfigError`
naming the path. A model may define ``check_shards(num_shards)`` to refuse what paths cannot show
(attention heads that do not divide).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn import experts as experts_module
from jphantom.nn import metadata, phantom, tensor

STYLES = ("column", "row", "vocab", "sequence", "phantom", "experts", "replicate")
NORMS = (nnx.LayerNorm, nnx.RMSNorm)


@dataclasses.dataclass(frozen=True)
class Style:
    """A plan entry. ``ghost_width``: k of a ``phantom`` layer (default: ``parallelize``'s);
    ``vocab_output``: a ``phantom`` linear that is the LM head (vocabulary-split outputs)."""

    name: str
    ghost_width: int | None = None
    vocab_output: bool = False

    def __post_init__(self):
        if self.name not in STYLES:
            raise ConfigError(f"style {self.name!r}: use one of {', '.join(STYLES)}")
        if self.name != "phantom" and (self.ghost_width is not None or self.vocab_output):
            raise ConfigError(f"ghost_width and vocab_output belong to the 'phantom' style, not "
                              f"{self.name!r}")
        if self.ghost_width is not None:
            phantom.check_ghost_width(self.ghost_width, "Style")

    @classmethod
    def of(cls, value) -> "Style":
        if isinstance(value, Style):
            return value
        if isinstance(value, str):
            return cls(value)
        raise ConfigError(f"plan value {value!r}: give a style name ({', '.join(STYLES)}) or a "
                          "jphantom.Style")


def _path(path) -> str:
    return ".".join(str(part) for part in path)


def modules_by_path(model: nnx.Module) -> dict[str, tuple]:
    """Every submodule of ``model``: dotted path -> (path tuple, module)."""
    return {_path(path): (tuple(path), module) for path, module in nnx.iter_modules(model)
            if path}


def _mesh_axis_size(mesh, axis: str) -> int:
    shape = dict(mesh.shape) if hasattr(mesh, "shape") else dict(mesh)
    if axis not in shape:
        raise ConfigError(f"the mesh {shape} has no {axis!r} axis for the plan's layers: add "
                          f"{axis}=1 (no tensor parallelism) or {axis}=N to the mesh")
    return int(shape[axis])


def _divides(path: str, what: str, value: int, p: int, axis: str) -> None:
    if value % p:
        raise ConfigError(f"{path}: {what}={value} is not divisible by the {axis!r} axis of size "
                          f"{p}: pick a mesh whose {axis} divides {value}, or style 'replicate'")


def _convert(path: str, module, style: Style, *, axis: str, p: int, sequence_parallel: bool,
             ghost_width: int | None, fused: bool):
    """The parallel module for ``module`` under ``style`` (``None``: keep the module)."""
    kind = type(module).__name__
    name = style.name
    if name == "replicate":
        return None
    linear = isinstance(module, nnx.Linear)
    embed = isinstance(module, nnx.Embed)
    norm = isinstance(module, NORMS)
    experts = isinstance(module, experts_module.Experts)
    if name in ("column", "vocab") and linear:
        _divides(path, "out_features", module.out_features, p, axis)
        cls = tensor.ColumnParallelLinear if name == "column" else tensor.VocabParallelHead
        return cls.from_module(module, axis=axis, sequence_parallel=sequence_parallel)
    if name == "row" and linear:
        _divides(path, "in_features", module.in_features, p, axis)
        return tensor.RowParallelLinear.from_module(module, axis=axis,
                                                    sequence_parallel=sequence_parallel)
    if name == "vocab" and embed:
        _divides(path, "num_embeddings", module.num_embeddings, p, axis)
        return tensor.VocabParallelEmbed.from_module(module, axis=axis,
                                                     sequence_parallel=sequence_parallel)
    if name == "sequence" and norm:  # marked once every entry is validated
        return lambda: metadata.mark(module, reduce_axes=(axis,))
    if name == "sequence" and embed:
        return tensor.SequenceParallelEmbed.from_module(module, axis=axis)
    if name == "experts" and experts:
        _divides(path, "expert width", module.w_gate.shape[-1], p, axis)
        return tensor.TensorParallelExperts.from_module(module, axis=axis,
                                                        sequence_parallel=sequence_parallel)
    if name == "phantom":
        if linear:
            k = style.ghost_width if style.ghost_width is not None else ghost_width
            if k is None:
                raise ConfigError(f"{path}: style 'phantom' needs a ghost width: "
                                  "Style('phantom', ghost_width=8) or parallelize(..., "
                                  "ghost_width=8)")
            phantom.check_ghost_width(k, path)
            _divides(path, "in_features", module.in_features, p, axis)
            _divides(path, "out_features", module.out_features, p, axis)
            return phantom.PhantomLinear.from_module(module, ghost_width=k, num_shards=p,
                                                     axis=axis, fused=fused,
                                                     vocab_output=style.vocab_output)
        if embed:
            _divides(path, "features", module.features, p, axis)
            return phantom.FeatureParallelEmbed.from_module(module, axis=axis)
        if norm:
            _divides(path, "num_features", module.num_features, p, axis)
            return phantom.FeatureParallelNorm.from_module(module, axis=axis)
        if experts:
            _divides(path, "hidden", module.w_gate.shape[-2], p, axis)
            _divides(path, "expert width", module.w_gate.shape[-1], p, axis)
            return tensor.TensorParallelExperts.from_module(module, axis=axis, feature_split=True)
    fits = {"column": "nnx.Linear", "row": "nnx.Linear", "vocab": "nnx.Embed or an nnx.Linear head",
            "sequence": "nnx.LayerNorm, nnx.RMSNorm or a position nnx.Embed",
            "phantom": "nnx.Linear, nnx.Embed, nnx.LayerNorm, nnx.RMSNorm or Experts",
            "experts": "jphantom.nn.Experts"}[name]
    raise ConfigError(f"{path}: style {name!r} does not fit {kind}; it applies to {fits}")


def _set(model, path: tuple, new) -> None:
    parent = model
    for part in path[:-1]:
        parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    last = path[-1]
    if isinstance(last, int):
        parent[last] = new
    else:
        setattr(parent, last, new)


def parallelize(model: nnx.Module, mesh, plan: Mapping[str, str | Style], *,
                axis: str = "model", ghost_width: int | None = None,
                fused: bool = True) -> nnx.Module:
    """Swap ``model``'s layers for the parallel layers ``plan`` names, in place; returns ``model``.

    ``mesh``: a ``jax.sharding.Mesh`` (or a mapping of axis sizes) with an ``axis`` axis (p ranks).
    ``plan``: dotted module path pattern -> style (module docstring). ``ghost_width``: the default
    k of ``phantom`` entries. ``fused``: phantom's fused decompressor GEMM (seed 000 uses p-1).
    Call it outside ``jax.jit``; it needs no mesh context (parameters are placed by the step).
    """
    if not isinstance(model, nnx.Module):
        raise ConfigError(f"parallelize takes an nnx.Module, not {type(model).__name__}")
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError("plan must be a non-empty mapping of module path patterns to styles, "
                          "e.g. {'blocks.*.attn.q': 'column'} (or jphantom.plans.megatron(model))")
    p = _mesh_axis_size(mesh, axis)
    styles = {pattern: Style.of(value) for pattern, value in plan.items()}
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
    check = getattr(model, "check_shards", None)
    if callable(check) and any(s.name != "replicate" for s in styles.values()):
        check(p)
    swaps = []
    for path, (_, style) in chosen.items():  # validate every entry before changing anything
        path_tuple, module = modules[path]
        new = _convert(path, module, style, axis=axis, p=p, sequence_parallel=sequence_parallel,
                       ghost_width=ghost_width, fused=fused)
        if new is not None:
            swaps.append((path_tuple, new))
    for path_tuple, new in swaps:
        if callable(new) and not isinstance(new, nnx.Module):
            new()
        else:
            _set(model, path_tuple, new)
    return model
