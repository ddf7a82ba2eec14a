"""Plans: which parallel layer each of a model's layers becomes, applied by path.

    plan = jphantom.plans.megatron(model, sequence_parallel=True)   # or plans.phantom(model, 8)
    model = jphantom.parallelize(model, mesh, plan)                 # = plans.parallelize
    model = jphantom.parallelize(model, mesh, {"blocks.*.attn.q": "column", ...})  # by hand

A *plan* maps module paths (dotted, with ``fnmatch`` globs: ``*`` matches any run of characters,
dots included) to a *style*. The model is changed in place (and returned); its parameters keep
their values and gain the sharding metadata the training step reads. Styles and what they do to
each kind of Flax layer (p = the size of ``axis``):

=============  ==========================================================================
``column``     ``nnx.Linear`` -> :class:`~jphantom.nn.tensor.ColumnParallelLinear` (out / p);
               ``nnx.LinearGeneral`` (``nnx.MultiHeadAttention``'s query, key, value) ->
               :class:`~jphantom.nn.tensor.ColumnParallelGeneral` (heads / p);
               ``Style("column", kv_heads=K)`` (grouped-query attention's key and value
               projections) with more ranks than K heads ->
               :class:`~jphantom.nn.tensor.SharedHeadsLinear` (each rank the head its query
               heads share, the projection replicated)
``row``        ``nnx.Linear`` -> :class:`~jphantom.nn.tensor.RowParallelLinear` (in / p);
               ``nnx.LinearGeneral`` (its output projection) ->
               :class:`~jphantom.nn.tensor.RowParallelGeneral` (heads / p)
``vocab``      ``nnx.Embed`` -> :class:`~jphantom.nn.tensor.VocabParallelEmbed` (V / p);
               ``nnx.Linear`` (an LM head) -> :class:`~jphantom.nn.tensor.VocabParallelHead`
``input``      a norm whose output feeds column-parallel layers (q, k, v; up, gate; the head)
               -> :class:`~jphantom.nn.tensor.InputNorm`: Megatron's f once, here, instead of
               once per layer (three backward all-reduces for q, k, v would be two too many)
``sequence``   Megatron-SP: a norm -> :class:`~jphantom.nn.tensor.InputNorm` on S/p tokens
               whose output is all-gathered over the sequence once for the layers it feeds;
               a position ``nnx.Embed`` -> :class:`~jphantom.nn.tensor.SequenceParallelEmbed`.
               Any ``sequence`` entry turns sequence parallelism on for every column, row, vocab
               and experts layer of the plan, which then take their input from such a norm.
``phantom``    Seal et al.: ``nnx.Linear`` -> :class:`~jphantom.nn.phantom_layers.PhantomLinear`
               (``Style("phantom", ghost_width=k, vocab_output=True)`` for the LM head);
               ``nnx.Embed`` -> :class:`~jphantom.nn.phantom_layers.FeatureParallelEmbed`; norms ->
               :class:`~jphantom.nn.phantom_layers.FeatureParallelNorm`; ``Experts`` ->
               :class:`~jphantom.nn.tensor.TensorParallelExperts` on feature-split streams;
               ``SwitchMoE`` -> :class:`~jphantom.nn.expert.PhantomMoE` (phantom experts)
``experts``    :class:`~jphantom.nn.experts.Experts` ->
               :class:`~jphantom.nn.tensor.TensorParallelExperts` (FFN width / p); on a mesh
               with an ``expert`` axis :class:`~jphantom.nn.expert.ExpertParallelExperts`
               (E / G experts per rank, all-to-all dispatch; TED: width / p over ``axis``);
               a routed :class:`~jphantom.nn.experts.SwitchMoE` ->
               :class:`~jphantom.nn.expert.ExpertParallelMoE` (E / G experts per rank over
               ``expert``, TED over ``axis``; ``Style("experts", dtd=True)``: duplicate token
               dropping), its load-balancing statistics summed over the batch axes
               (E / G experts per rank, all-to-all dispatch; TED: width / p over ``axis``)
``t1``         Seal et al.'s T1 tensor parallelism: ``nnx.Linear`` ->
               :class:`~jphantom.nn.tensor.T1Linear` (out / p; its feature-split input
               all-gathered in every layer, output feature-split)
``gather``     a :class:`~jphantom.nn.boundary.Boundary` ->
               :class:`~jphantom.nn.tensor.GatherFeatures` (feature-split -> replicated)
``scatter``    a :class:`~jphantom.nn.boundary.Boundary` ->
               :class:`~jphantom.nn.tensor.ScatterFeatures` (replicated -> feature-split)
``pmm3d``      AxoNN's 3D matmul on ``x``, ``y``, ``z``: ``nnx.Linear`` ->
               :class:`~jphantom.nn.pmm3d.Pmm3dLinear` (``Style("pmm3d", role="normal" |
               "transposed", weights="kept" | "regather" | "deferred")``); the token
               ``nnx.Embed`` (``vocab_output=True``) -> :class:`~jphantom.nn.pmm3d.Pmm3dEmbed`;
               other embeddings and norms split their features over ``y``; a routed
               ``SwitchMoE`` -> :class:`~jphantom.nn.pmm3d.Pmm3dMoE` (experts over
               ``expert``, their width over ``x``)
(yours)        a style registered for your own layer class with :func:`register_style`
``context``    context parallelism over the ``context`` axis (:mod:`jphantom.nn.attention`):
               a :class:`~jphantom.nn.attention.CausalAttention` core ->
               :class:`~jphantom.nn.attention.RingAttention` (``Style("context",
               algorithm="all-gather")``: :class:`~jphantom.nn.attention.GatheredAttention`;
               ``balanced=False``: the contiguous layout), a
               :class:`~jphantom.nn.attention.Positions` ->
               :class:`~jphantom.nn.attention.ContextPositions`
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
from collections.abc import Callable, Mapping

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn import attention
from jphantom.nn import experts as experts_module
from jphantom.nn.boundary import Boundary
from jphantom.nn.experts import Experts, SwitchMoE
from jphantom.nn import expert as expert_layers
from jphantom.nn import phantom as phantom_layers
from jphantom.nn import pmm3d as pmm3d_layers
from jphantom.mesh import BATCH_AXES
from jphantom.nn import tensor

EXPERT_AXIS = "expert"
STYLES = ("column", "row", "vocab", "input", "sequence", "phantom", "experts", "t1", "gather",
          "scatter", "pmm3d", "context", "replicate")
AXIS_STYLES = ("column", "row", "vocab", "input", "sequence", "phantom", "experts", "t1",
               "gather", "scatter")
NORMS = (nnx.LayerNorm, nnx.RMSNorm)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a registered style's layer goes (:func:`register_style`): its ``path`` in the model,
    the mesh ``axis`` the plan splits (of ``size`` ranks), whether the plan is sequence-parallel,
    the mesh's axis sizes and the plan entry's :class:`Style`."""

    path: str
    axis: str
    size: int
    sequence_parallel: bool
    mesh_shape: Mapping[str, int]
    style: "Style"


# name -> (the layer classes it applies to, build(module, placement), whether it splits ``axis``)
_REGISTERED: dict[str, tuple[tuple[type, ...], Callable, bool]] = {}


def register_style(name: str, layers, build: Callable, *, uses_axis: bool = True) -> None:
    """Teach plans a style for your own layer classes: ``plan[path] = name`` on a module that is
    an instance of ``layers`` (a class or a tuple of them) becomes ``build(module, placement)``
    (:class:`Placement`), the parallel module: an ``nnx.Module`` that runs on one rank inside the
    step's ``shard_map`` (its collectives on ``placement.axis``), whose parameters carry their
    mesh axes (:func:`jphantom.nn.metadata.param`), and whose ``dense_equivalent()`` gives the
    plain layer it equals (the one-device oracle, :func:`jphantom.verify`). ``uses_axis``: the
    style needs ``axis`` in the mesh. Built-in styles cannot be replaced; registering a name again
    replaces your earlier registration."""
    if name in STYLES:
        raise ConfigError(f"style {name!r} is built in: register yours under another name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a style's name is a non-empty string, not {name!r}")
    classes = tuple(layers) if isinstance(layers, (tuple, list)) else (layers,)
    if not classes or not all(isinstance(c, type) for c in classes):
        raise ConfigError(f"register_style({name!r}, ...): give the layer class (or a tuple of "
                          "them) the style applies to")
    if not callable(build):
        raise ConfigError(f"register_style({name!r}, ...): build must be a function "
                          "build(module, placement) -> the parallel module")
    _REGISTERED[name] = (classes, build, bool(uses_axis))


def unregister_style(name: str) -> None:
    """Forget a style registered with :func:`register_style`."""
    _REGISTERED.pop(name, None)


def _registered(path: str, module, style, *, axis: str, p: int, sequence_parallel: bool,
                shape: dict):
    classes, build, _ = _REGISTERED[style.name]
    if not isinstance(module, classes):
        raise ConfigError(f"{path}: style {style.name!r} applies to "
                          f"{', '.join(c.__name__ for c in classes)}, not "
                          f"{type(module).__name__}")
    new = build(module, Placement(path, axis, p, sequence_parallel, dict(shape), style))
    if not isinstance(new, nnx.Module) or not callable(getattr(new, "dense_equivalent", None)):
        raise ConfigError(f"{path}: style {style.name!r} built {type(new).__name__}, which is not "
                          "an nnx.Module with dense_equivalent() (the plain layer it equals: the "
                          "one-device oracle)")
    return new


@dataclasses.dataclass(frozen=True)
class Style:
    """A plan entry. ``ghost_width``: k of a ``phantom`` layer (default: ``parallelize``'s);
    ``vocab_output``: a ``phantom`` linear that is the LM head (vocabulary-split outputs)."""

    name: str
    ghost_width: int | None = None
    vocab_output: bool = False
    role: str | None = None  # pmm3d: "normal" (in over y, out over x) or "transposed"
    dtd: bool = False  # experts (a SwitchMoE): duplicate token dropping
    weights: str | None = None  # pmm3d: "kept" (default), "regather" or "deferred"
    algorithm: str | None = None  # context: "ring" (default) or "all-gather"
    balanced: bool = True  # context: the load-balanced causal layout
    collective_matmul: bool = False  # sequence (a norm) and row: the SP collectives as rings
    kv_heads: int | None = None  # column: the layer's outputs are this many (key/value) heads

    def __post_init__(self):
        if self.kv_heads is not None and (self.name != "column" or isinstance(self.kv_heads, bool)
                                          or not isinstance(self.kv_heads, int)
                                          or self.kv_heads < 1):
            raise ConfigError(f"kv_heads={self.kv_heads!r} belongs to the 'column' style, a whole "
                              "number of heads >= 1")
        if self.collective_matmul and self.name not in ("sequence", "row"):
            raise ConfigError(f"collective_matmul belongs to the 'sequence' (a norm before "
                              f"column layers) and 'row' styles, not {self.name!r}")
        if self.algorithm is not None:
            if self.name != "context":
                raise ConfigError(f"algorithm belongs to the 'context' style, not {self.name!r}")
            attention.check_algorithm(self.algorithm)
        if not self.balanced and self.name != "context":
            raise ConfigError(f"balanced belongs to the 'context' style, not {self.name!r}")
        if self.dtd and self.name != "experts":
            raise ConfigError(f"dtd (duplicate token dropping) belongs to the 'experts' style, "
                              f"not {self.name!r}")
        if self.name not in STYLES and self.name not in _REGISTERED:
            raise ConfigError(f"style {self.name!r}: use one of {', '.join(STYLES)}"
                              + (f" or a registered one ({', '.join(_REGISTERED)})"
                                 if _REGISTERED else "") + " (jphantom.plans.register_style "
                              "adds a style for your own layer)")
        if self.name not in ("phantom", "pmm3d") and (self.ghost_width is not None
                                                      or self.vocab_output):
            raise ConfigError(f"ghost_width and vocab_output belong to the 'phantom' (and "
                              f"vocab_output to 'pmm3d') style, not {self.name!r}")
        if self.name == "pmm3d" and self.ghost_width is not None:
            raise ConfigError("ghost_width belongs to the 'phantom' style, not 'pmm3d'")
        if self.role is not None and (self.name != "pmm3d"
                                      or self.role not in ("normal", "transposed")):
            raise ConfigError(f"role={self.role!r}: 'normal' or 'transposed', for 'pmm3d' only")
        if self.weights is not None and (self.name != "pmm3d"
                                         or self.weights not in pmm3d_layers.WEIGHTS):
            raise ConfigError(f"weights={self.weights!r}: one of "
                              f"{', '.join(pmm3d_layers.WEIGHTS)}, for 'pmm3d' only")
        if self.ghost_width is not None:
            phantom_layers.check_ghost_width(self.ghost_width, "Style")

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
             ghost_width: int | None, fused: bool, shape: dict):
    """The parallel module for ``module`` under ``style`` (``None``: keep the module)."""
    kind = type(module).__name__
    name = style.name
    if name == "replicate":
        return None
    if name in _REGISTERED:
        return _registered(path, module, style, axis=axis, p=p,
                           sequence_parallel=sequence_parallel, shape=shape)
    if name == "context" and isinstance(module, (attention.CausalAttention,
                                                  attention.Positions)):
        size = shape.get(attention.AXIS, 1)
        if size < 2:
            raise ConfigError(f"{path}: style 'context' splits the sequence over the 'context' "
                              "axis, which the mesh lacks (or has size 1): add context=2 or more")
        if isinstance(module, attention.Positions):
            return attention.ContextPositions(size=size, balanced=style.balanced)
        cls = (attention.GatheredAttention if style.algorithm == "all-gather"
               else attention.RingAttention)
        return cls(size=size, balanced=style.balanced, window=module.window,
                   implementation=module.implementation)
    linear = isinstance(module, nnx.Linear)
    embed = isinstance(module, nnx.Embed)
    norm = isinstance(module, NORMS)
    experts = isinstance(module, experts_module.Experts)
    if isinstance(module, SwitchMoE) and name == "pmm3d":
        groups = shape.get(EXPERT_AXIS, 1)
        if module.config.experts % groups:
            raise ConfigError(f"{path}: experts={module.config.experts} is not divisible by the "
                              f"expert axis size {groups}: every rank holds E / G whole experts")
        _divides(path, "expert width", module.config.width, shape.get("x", 1), "x")
        return pmm3d_layers.Pmm3dMoE.from_module(
            module, expert_axis=EXPERT_AXIS if groups > 1 else None,
            batch_axes=tuple(a for a in BATCH_AXES if a in shape),
            tensor=shape.get("x", 1) > 1)
    if isinstance(module, SwitchMoE) and name in ("experts", "phantom"):
        return _convert_moe(path, module, style, axis=axis, p=p,
                            sequence_parallel=sequence_parallel, ghost_width=ghost_width,
                            fused=fused, shape=shape)
    boundary = isinstance(module, Boundary)
    if name == "t1" and linear:
        _divides(path, "in_features", module.in_features, p, axis)
        _divides(path, "out_features", module.out_features, p, axis)
        return tensor.T1Linear.from_module(module, axis=axis)
    if name in ("gather", "scatter") and boundary:
        cls = tensor.GatherFeatures if name == "gather" else tensor.ScatterFeatures
        return cls.from_module(module, axis=axis)
    if name in ("column", "row") and isinstance(module, nnx.Einsum):
        cls = tensor.ColumnParallelEinsum if name == "column" else tensor.RowParallelEinsum
        lhs, rhs, out = tensor.einsum_operands(module)
        split = tensor.einsum_split(lhs, rhs, out, column=name == "column")
        if split is not None:
            _divides(path, f"the Einsum's axis {split!r}", module.kernel_shape[rhs.index(split)],
                     p, axis)
        return cls.from_module(module, axis=axis, sequence_parallel=sequence_parallel)
    general = isinstance(module, nnx.LinearGeneral)
    if name in ("column", "row") and general:
        split = module.out_features[0] if name == "column" else module.in_features[0]
        _divides(path, "heads (the first " + ("output" if name == "column" else "input")
                 + " axis)", split, p, axis)
        cls = tensor.ColumnParallelGeneral if name == "column" else tensor.RowParallelGeneral
        return cls.from_module(module, axis=axis, sequence_parallel=sequence_parallel)
    if name == "column" and linear and style.kv_heads is not None and p > style.kv_heads:
        if p % style.kv_heads:
            raise ConfigError(f"{path}: {style.kv_heads} key/value heads on {p} ranks of "
                              f"{axis!r}: the ranks must be a multiple of the heads (each head "
                              "shared by the same number of ranks), or divide them")
        _divides(path, "out_features", module.out_features, style.kv_heads, "heads")
        return tensor.SharedHeadsLinear.from_module(module, heads=style.kv_heads, axis=axis,
                                                    sequence_parallel=sequence_parallel)
    if name in ("column", "vocab") and linear:
        _divides(path, "out_features", module.out_features, p, axis)
        cls = tensor.ColumnParallelLinear if name == "column" else tensor.VocabParallelHead
        return cls.from_module(module, axis=axis, sequence_parallel=sequence_parallel)
    if name == "row" and linear:
        _divides(path, "in_features", module.in_features, p, axis)
        return tensor.RowParallelLinear.from_module(module, axis=axis,
                                                    sequence_parallel=sequence_parallel,
                                                    collective_matmul=style.collective_matmul)
    if name == "vocab" and embed:
        _divides(path, "num_embeddings", module.num_embeddings, p, axis)
        return tensor.VocabParallelEmbed.from_module(module, axis=axis,
                                                     sequence_parallel=sequence_parallel)
    if name in ("input", "sequence") and norm:
        return tensor.InputNorm.from_module(module, axis=axis,
                                            sequence_parallel=name == "sequence",
                                            collective_matmul=style.collective_matmul)
    if name == "sequence" and not embed and not linear and _holds_params(module):
        if style.collective_matmul:
            raise ConfigError(f"{path}: collective_matmul applies to nnx.LayerNorm and "
                              f"nnx.RMSNorm; {kind} runs as Style('sequence') without it")
        return tensor.PerTokenSequence.from_module(module, axis=axis)
    if name == "sequence" and embed:
        return tensor.SequenceParallelEmbed.from_module(module, axis=axis)
    if name == "experts" and experts:
        if p > 1:
            _divides(path, "expert width", module.w_gate.shape[-1], p, axis)
        groups = shape.get(EXPERT_AXIS, 1)
        if groups > 1:  # expert parallelism over the expert axis, TED over ``axis``
            _divides(path, "experts", module.w_gate.shape[-3], groups, EXPERT_AXIS)
            if module.top_k is None:
                raise ConfigError(f"{path}: expert parallelism dispatches each token to its top-k "
                                  "experts: build Experts(..., top_k=k)")
            return expert_layers.ExpertParallelExperts.from_module(
                module, top_k=module.top_k, expert_axis=EXPERT_AXIS,
                model_axis=axis if p > 1 else None, sequence_parallel=sequence_parallel)
        return tensor.TensorParallelExperts.from_module(module, axis=axis,
                                                        sequence_parallel=sequence_parallel)
    if name == "pmm3d":
        if experts:
            raise ConfigError(f"{path}: pmm3d has no expert layer: keep the experts off a pmm3d "
                              "mesh (or write their plan with 'experts' on a model axis)")
        if linear:
            role = style.role or "normal"
            contract, out = pmm3d_layers.ROLES[role]
            _divides(path, "in_features", module.in_features, shape.get(contract, 1), contract)
            _divides(path, "out_features", module.out_features,
                     shape.get(out, 1) * shape.get(pmm3d_layers.Z, 1), f"{out} x z")
            return pmm3d_layers.Pmm3dLinear.from_module(module, role=role,
                                                        vocab_output=style.vocab_output,
                                                        weights=style.weights or "kept")
        y = pmm3d_layers.Y
        if embed and style.vocab_output:  # the token table: a normal layer's weight
            _divides(path, "num_embeddings", module.num_embeddings,
                     shape.get("x", 1) * shape.get("z", 1), "x x z")
            _divides(path, "features", module.features, shape.get(y, 1), y)
            return pmm3d_layers.Pmm3dEmbed.from_module(module)
        if embed:  # a position table: features over y
            _divides(path, "features", module.features, shape.get(y, 1), y)
            return phantom_layers.FeatureParallelEmbed.from_module(module, axis=y)
        if norm:
            _divides(path, "num_features", module.num_features, shape.get(y, 1), y)
            return phantom_layers.FeatureParallelNorm.from_module(module, axis=y)
    if name == "phantom":
        if linear:
            k = style.ghost_width if style.ghost_width is not None else ghost_width
            if k is None:
                raise ConfigError(f"{path}: style 'phantom' needs a ghost width: "
                                  "Style('phantom', ghost_width=8) or parallelize(..., "
                                  "ghost_width=8)")
            phantom_layers.check_ghost_width(k, path)
            _divides(path, "in_features", module.in_features, p, axis)
            _divides(path, "out_features", module.out_features, p, axis)
            return phantom_layers.PhantomLinear.from_module(module, ghost_width=k, num_shards=p,
                                                     axis=axis, fused=fused,
                                                     vocab_output=style.vocab_output)
        if embed:
            _divides(path, "features", module.features, p, axis)
            return phantom_layers.FeatureParallelEmbed.from_module(module, axis=axis)
        if norm:
            _divides(path, "num_features", module.num_features, p, axis)
            return phantom_layers.FeatureParallelNorm.from_module(module, axis=axis)
        if experts:
            _divides(path, "hidden", module.w_gate.shape[-2], p, axis)
            _divides(path, "expert width", module.w_gate.shape[-1], p, axis)
            return tensor.TensorParallelExperts.from_module(module, axis=axis, feature_split=True)
    fits = {"column": "nnx.Linear", "row": "nnx.Linear", "vocab": "nnx.Embed or an nnx.Linear head",
            "sequence": "nnx.LayerNorm, nnx.RMSNorm or a position nnx.Embed",
            "input": "nnx.LayerNorm or nnx.RMSNorm",
            "phantom": "nnx.Linear, nnx.Embed, nnx.LayerNorm, nnx.RMSNorm or Experts",
            "experts": "jphantom.nn.Experts or a SwitchMoE", "t1": "nnx.Linear",
            "gather": "jphantom.nn.Boundary", "scatter": "jphantom.nn.Boundary",
            "pmm3d": "nnx.Linear, nnx.Embed, nnx.LayerNorm, nnx.RMSNorm or a SwitchMoE",
            "context": "jphantom.nn.CausalAttention or jphantom.nn.Positions"}[name]
    raise ConfigError(f"{path}: style {name!r} does not fit {kind}; it applies to {fits}")


def _convert_moe(path: str, moe: SwitchMoE, style: Style, *, axis: str, p: int,
                 sequence_parallel: bool, ghost_width: int | None, fused: bool, shape: dict):
    """A routed mixture of experts under ``experts`` (expert parallelism, TED, DTD) or
    ``phantom`` (phantom-parallel experts)."""
    config = moe.config
    groups = shape.get(EXPERT_AXIS, 1)
    if config.experts % groups:
        raise ConfigError(f"{path}: experts={config.experts} is not divisible by the expert axis "
                          f"size {groups}: every rank holds E / G whole experts")
    expert_axis = EXPERT_AXIS if groups > 1 else None
    batch_axes = tuple(a for a in BATCH_AXES if a in shape)
    if style.name == "phantom":
        if sequence_parallel:
            raise ConfigError(f"{path}: phantom-parallel experts run on the feature-split stream "
                              "[B, S, h/p]; sequence parallelism splits the sequence instead: "
                              "drop the 'sequence' entries or use style 'experts'")
        k = style.ghost_width if style.ghost_width is not None else ghost_width
        if k is None:
            raise ConfigError(f"{path}: style 'phantom' needs a ghost width: "
                              "Style('phantom', ghost_width=8)")
        phantom_layers.check_ghost_width(k, path)
        _divides(path, "hidden", config.hidden, p, axis)
        _divides(path, "expert width", config.width, p, axis)
        return expert_layers.PhantomMoE.from_module(
            moe, ghost_width=k, num_shards=p, axis=axis, fused=fused, expert_axis=expert_axis,
            batch_axes=batch_axes)
    _divides(path, "expert width", config.width, p, axis)
    if style.dtd and p == 1:
        raise ConfigError(f"{path}: dtd (duplicate token dropping) splits the capacity buffers "
                          f"over the {axis!r} axis, which has size 1 here: add {axis}=2 or more, "
                          "or leave dtd out")
    return expert_layers.ExpertParallelMoE.from_module(
        moe, expert_axis=expert_axis, model_axis=axis if p > 1 else None, dtd=style.dtd,
        batch_axes=batch_axes, sequence_parallel=sequence_parallel)


def set_submodule(model, path: tuple, new) -> None:
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
    uses_axis = any(s.name in AXIS_STYLES or (s.name in _REGISTERED and _REGISTERED[s.name][2])
                    for s in styles.values())
    p = _mesh_axis_size(mesh, axis) if uses_axis else shape.get(axis, 1)
    if any(s.name == "pmm3d" for s in styles.values()):
        for needed in ("x", "y", "z"):
            _mesh_axis_size(mesh, needed)
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
            if _holds_params(module) and path not in named and not _inside(path, named):
                raise _unplaced(path, module, True, "parallelize (sequence parallelism)")
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
        new = _convert(path, module, style, axis=axis, p=p, sequence_parallel=sequence_parallel,
                       ghost_width=ghost_width, fused=fused, shape=shape)
        if new is not None:
            swaps.append((path_tuple, new))
    for path_tuple, new in swaps:
        set_submodule(model, path_tuple, new)
    return model


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
    _mesh_axis_size(mesh, axis)
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



# -------------------------------------------------------------------------------------------------
# Ready-made plans, built by walking a model's modules. The walk recognises layers by type and by
# the names common model families use: the token table by how the model uses it
# (vocabulary_table: the only nnx.Embed, the one as large as an untied head, or the one named like
# a token table beside position tables; else the caller names it), any other nnx.Embed a position
# table; the LM head an nnx.Linear with V outputs; column-parallel linears (COLUMN: q, k, v, up
# and gate projections) and row-parallel ones (ROW: attention output, down projections) by
# attribute name; routers (ROUTERS), norms and Experts by type. A linear the walk cannot place,
# or any other module holding parameters it does not know, is a ConfigError naming its path and
# class and how to name it: the plans are exhaustive, never silently partial.
# -------------------------------------------------------------------------------------------------

COLUMN = frozenset({"q", "k", "v", "qkv", "c_attn", "q_proj", "k_proj", "v_proj", "query",
                    "key", "value", "wq", "wk", "wv", "up", "up_proj", "gate_proj", "w1", "w3",
                    "fc1", "c_fc", "wi", "mlp_up", "fc_in", "in_proj"})
ROW = frozenset({"o", "o_proj", "out", "out_proj", "down", "down_proj", "w2", "fc2", "c_proj",
                 "wo", "attn_out", "mlp_down", "fc_out"})
HEAD_NORMS = frozenset({"q_norm", "k_norm"})  # Qwen3, OLMo 2: over each head's features
KV_COLUMNS = frozenset({"k", "v", "k_proj", "v_proj", "key", "value", "wk", "wv"})
ROUTERS = frozenset({"router", "gate"})
# the norm before a block's MLP: when that MLP is a routed mixture of experts (SwitchMoE) it stays
# replicated under Megatron, so that the router runs on the replicated stream and TED's f acts on
# the dispatched buffers (Singh's thesis ch. 7)
MLP_NORMS = frozenset({"ln_2", "post_attention_layernorm", "ffn_norm", "norm2"})


VOCAB_NAMES = frozenset({"wte", "tok", "tok_embeddings", "embed_tokens", "token_embedding",
                         "tokens", "word_embeddings", "embed", "embedding", "tok_emb"})
POSITION_NAMES = frozenset({"wpe", "pos", "pos_embedding", "position_embeddings", "positions",
                            "pos_emb", "position_embedding"})


def _walk(model: nnx.Module, vocab: str | None = None):
    """The model's modules (those inside a SwitchMoE left out: the MoE is one plan entry), its
    embeddings, and the token table's path and size (:func:`vocabulary_table`)."""
    modules = modules_by_path(model)
    moes = [path for path, (_, m) in modules.items() if isinstance(m, SwitchMoE)]
    modules = {path: entry for path, entry in modules.items()
               if not any(path.startswith(moe + ".") for moe in moes)}
    embeds = {path: m for path, (_, m) in modules.items() if isinstance(m, nnx.Embed)}
    table = vocabulary_table(model, vocab, modules=modules)
    return modules, embeds, table, (None if table is None else embeds[table].num_embeddings)


def vocabulary_table(model: nnx.Module, vocab: str | None = None, *, modules=None) -> str | None:
    """The path of ``model``'s token table, found by how the model uses its embeddings, never by
    their sizes: ``vocab`` when given; the only ``nnx.Embed``; the one as large as an untied LM
    head's outputs (an ``nnx.Linear`` not named like a projection); the one named like a token
    table (:data:`VOCAB_NAMES`) beside ones named like position tables
    (:data:`POSITION_NAMES`). Anything else is a :class:`ConfigError` asking for ``vocab``.
    ``None`` for a model without embeddings."""
    modules = modules_by_path(model) if modules is None else modules
    embeds = {path: m for path, (_, m) in modules.items() if isinstance(m, nnx.Embed)}
    if vocab is not None:
        if vocab not in embeds:
            raise ConfigError(f"vocab={vocab!r} is not an nnx.Embed of {type(model).__name__}; "
                              f"its embeddings: {', '.join(embeds) or 'none'}")
        return vocab
    if len(embeds) <= 1:
        return next(iter(embeds), None)
    heads = {m.out_features for path, (tup, m) in modules.items()
             if isinstance(m, nnx.Linear) and _name(tup) not in COLUMN | ROW | ROUTERS}
    by_head = [path for path, m in embeds.items() if m.num_embeddings in heads]
    if len(by_head) == 1:
        return by_head[0]
    names = {path: path.split(".")[-1] for path in embeds}
    tokens = [p for p, n in names.items() if n in VOCAB_NAMES]
    if len(tokens) == 1 and all(n in POSITION_NAMES for p, n in names.items() if p != tokens[0]):
        return tokens[0]
    raise ConfigError(f"cannot tell which of {type(model).__name__}'s embeddings "
                      f"({', '.join(embeds)}) is the token table (the vocabulary): pass "
                      "vocab='<its path>' to the plan (e.g. plans.megatron(model, vocab=...))")


def _holds_params(module) -> bool:
    """Whether ``module`` holds an ``nnx.Param`` as an attribute of its own (not through a
    submodule)."""
    return any(isinstance(value, nnx.Param) for value in vars(module).values())


def _unplaced(path: str, module, sequence_parallel: bool, walk: str) -> ConfigError:
    """The error for a module holding parameters that a ready-made plan cannot place."""
    kind = type(module).__name__
    names = ", ".join(n for n, v in vars(module).items() if isinstance(v, nnx.Param))
    fix = (f"named={{{path!r}: jphantom.Style('sequence')}} if it treats each token alone (a "
           "norm before column layers: it runs on the rank's S/p tokens, then the sequence is "
           "gathered), or register a style for its class (jphantom.register_style)"
           if sequence_parallel else
           f"named={{{path!r}: 'replicate'}} to keep it whole on every rank (right for a "
           "module that needs no split, such as a norm), or register a style for its class "
           "(jphantom.register_style)")
    return ConfigError(f"{walk} cannot place {path} ({kind}, holding {names}): name it, "
                       f"{fix} (in a plan of your own: the same entry)")


def _name(path_tuple) -> str:
    return str(path_tuple[-1])


def megatron(model: nnx.Module, *, sequence_parallel: bool = False, dtd: bool = False,
             collective_matmul: bool = False, kv_heads: int | None = None,
             vocab: str | None = None, named: Mapping | None = None) -> dict[str, str | Style]:
    """Megatron tensor parallelism (Brakel et al.): q/k/v and up/gate column-parallel, attention output
    and down row-parallel, embedding and head vocabulary-parallel, experts split over their width,
    routers replicated, norms ``input`` (f once for the layers they feed: pre-norm blocks);
    ``sequence_parallel`` (the Day 66 notes): norms and position tables ``sequence``. A routed mixture of
    experts (:class:`~jphantom.nn.experts.SwitchMoE`) is ``experts`` (over ``expert`` and TED;
    ``dtd``: duplicate token dropping) and the norm before it (:data:`MLP_NORMS`) ``replicate``.
    ``collective_matmul`` (with ``sequence_parallel``): the row layers and the norms inside the
    blocks that feed column layers only (not a block's MLP norm where its MLP is a mixture of
    experts, not the final norm before the head) run their collectives as rings under the GEMMs
    (:mod:`jphantom.nn.tensor`). ``kv_heads``: the key/value heads of grouped-query attention
    (the key and value projections then ``Style("column", kv_heads=...)``: with more ranks than
    heads each rank computes the head its query heads share,
    :class:`~jphantom.nn.tensor.SharedHeadsLinear`); default the model's ``config.kv_heads``
    where it has one. ``vocab``: the token table's path (:func:`vocabulary_table`). ``named``:
    path patterns -> styles for modules the walk does not know (taken as given, before the
    walk; a module holding parameters that neither names is an error naming it)."""
    if kv_heads is None:
        kv_heads = getattr(getattr(model, "config", None), "kv_heads", None)
    if collective_matmul and not sequence_parallel:
        raise ConfigError("collective_matmul overlaps sequence parallelism's all-gathers and "
                          "reduce-scatters with the GEMMs: pass sequence_parallel=True too "
                          "(--sequence-parallel)")
    modules, embeds, table, vocab = _walk(model, vocab)
    expert_blocks = {path_tuple[:i] for path_tuple, module in modules.values()
                     if isinstance(module, (SwitchMoE, Experts)) for i in range(len(path_tuple))}
    cm = lambda name: Style(name, collective_matmul=True) if collective_matmul else name
    moe_blocks = {path_tuple[:-1] for path_tuple, module in modules.values()
                  if isinstance(module, SwitchMoE)}
    if dtd and not moe_blocks:
        raise ConfigError("dtd (duplicate token dropping) applies to routed MoE layers "
                          "(SwitchMoE, e.g. GPT-2 with moe_every); the model has none: leave "
                          "dtd out")
    plan = _named(modules, named)
    for path, (path_tuple, module) in modules.items():
        name = _name(path_tuple)
        if path in plan or _inside(path, plan):
            continue
        if isinstance(module, SwitchMoE):
            plan[path] = Style("experts", dtd=dtd)
        elif isinstance(module, nnx.Embed):
            plan[path] = ("vocab" if path == table
                          else "sequence" if sequence_parallel else "replicate")
        elif isinstance(module, NORMS) and name in HEAD_NORMS:
            plan[path] = "replicate"  # Qwen3's per-head q/k norms: on this rank's heads
        elif isinstance(module, NORMS) and getattr(module, "residual_norm", False):
            plan[path] = "replicate"  # Gemma's norms of a block's outputs: on the residual
        elif isinstance(module, NORMS) and path_tuple[:-1] in moe_blocks and name in MLP_NORMS:
            plan[path] = "replicate"  # the MoE routes the stream as it is (SP: this rank's S/p)
        elif isinstance(module, NORMS):  # pre-norm blocks: every norm feeds column layers
            in_block = len(path_tuple) > 1
            feeds_columns = not (name in MLP_NORMS and path_tuple[:-1] in expert_blocks)
            plan[path] = ("input" if not sequence_parallel
                          else cm("sequence") if in_block and feeds_columns else "sequence")
        elif isinstance(module, Experts):
            plan[path] = "experts"
        elif isinstance(module, (nnx.LinearGeneral, nnx.Einsum)) and name in COLUMN | ROW:
            plan[path] = "row" if name in ROW else "column"  # nnx.MultiHeadAttention's
        elif isinstance(module, nnx.Linear):
            if name in ROUTERS:
                plan[path] = "replicate"
            elif name in COLUMN:
                plan[path] = (Style("column", kv_heads=kv_heads)
                              if kv_heads is not None and name in KV_COLUMNS else "column")
            elif name in ROW:
                plan[path] = cm("row")
            elif vocab is not None and module.out_features == vocab:
                plan[path] = "vocab"
            else:
                raise ConfigError(f"plans.megatron cannot tell whether {path} (nnx.Linear "
                                  f"{module.in_features}->{module.out_features}) is column- or "
                                  "row-parallel: build the plan by hand, e.g. "
                                  f"{{**plans.megatron(...), {path!r}: 'column'}} after renaming, "
                                  "or write it whole")
        elif _holds_params(module) and not _inside(path, plan):
            raise _unplaced(path, module, sequence_parallel, "plans.megatron")
    return plan


def _named(modules: dict, named: Mapping | None) -> dict:
    """The entries of ``named`` (path patterns -> styles) on ``modules``' paths: what a walk
    takes as given."""
    plan = {}
    for pattern, style in (named or {}).items():
        matched = [path for path in modules if fnmatch.fnmatchcase(path, pattern)]
        if not matched:
            raise ConfigError(f"named pattern {pattern!r} matches no module; the modules include: "
                              f"{', '.join(list(modules)[:12])}")
        for path in matched:
            plan[path] = style
    return plan


def _inside(path: str, plan: Mapping) -> bool:
    """Whether ``path`` lies inside a module the plan already names (a mixture of experts is
    one entry)."""
    return any(path.startswith(named + ".") for named in plan)


def phantom(model: nnx.Module, ghost_width: int = 8, *, vocab: str | None = None,
            named: Mapping | None = None) -> dict[str, Style]:
    """Phantom parallelism (Seal et al.) for a whole model: every linear a phantom layer of k =
    ``ghost_width`` ghost neurons (the LM head with vocabulary-split outputs), embeddings and norms
    split over features, routers row-parallel (their logits all-reduced), experts on the
    feature-split stream."""
    modules, embeds, _, vocab = _walk(model, vocab)
    layer = Style("phantom", ghost_width=ghost_width)
    plan = _named(modules, named)
    for path, (path_tuple, module) in modules.items():
        if path in plan or _inside(path, plan):
            continue
        if isinstance(module, NORMS) and _name(path_tuple) in HEAD_NORMS:
            plan[path] = "replicate"  # per-head norms: each rank normalises its whole heads
            continue
        if isinstance(module, (nnx.Embed, *NORMS, Experts, SwitchMoE)):
            plan[path] = layer
        elif isinstance(module, nnx.Linear):
            name = _name(path_tuple)
            if name in ROUTERS:
                plan[path] = Style("row")
            elif (vocab is not None and module.out_features == vocab
                  and name not in COLUMN | ROW):  # the LM head, not an MLP as wide as V
                plan[path] = Style("phantom", ghost_width=ghost_width, vocab_output=True)
            else:
                plan[path] = layer
        elif _holds_params(module) and not _inside(path, plan):
            raise _split_features(path, module, "plans.phantom")
    return plan


def _split_features(path: str, module, walk: str) -> ConfigError:
    """A module of the user's in a plan that splits every activation's features (phantom,
    pmm3d): it would see a slice of each token's features."""
    kind = type(module).__name__
    return ConfigError(f"{walk} cannot place {path} ({kind}): this plan splits every "
                       "activation's features, so the module would see a slice of each "
                       "token's; register a style for its class (jphantom.register_style) and "
                       f"name it in the plan, or use strategy 'tensor' (plans.megatron)")


def pmm3d(model: nnx.Module, *, weights: str = "kept", vocab: str | None = None,
          named: Mapping | None = None) -> dict[str, Style]:
    """AxoNN's 3D matmul (Singh's thesis ch. 5) for a whole model on ``x``, ``y``, ``z``: q/k/v and
    up/gate normal layers, attention output and down transposed, the token table (and an untied
    head) vocabulary over ``x``, norms and position tables over ``y``. ``weights``: the linears'
    gathered weights, ``"kept"``, ``"regather"`` or ``"deferred"``
    (:class:`~jphantom.nn.pmm3d.Pmm3dLinear`; the token table is always kept)."""
    modules, embeds, table, vocab = _walk(model, vocab)
    plan = _named(modules, named)
    for path, (path_tuple, module) in modules.items():
        name = _name(path_tuple)
        if path in plan or _inside(path, plan):
            continue
        if isinstance(module, nnx.Embed):
            plan[path] = Style("pmm3d", vocab_output=path == table)
        elif isinstance(module, NORMS) and name in HEAD_NORMS:
            raise ConfigError(f"plans.pmm3d: {path} normalises each attention head, whose "
                              "features pmm3d splits over y; use plans.megatron or "
                              "plans.phantom for a model with per-head q/k norms (Qwen3)")
        elif isinstance(module, NORMS):
            plan[path] = Style("pmm3d")
        elif isinstance(module, SwitchMoE):
            plan[path] = Style("pmm3d")
        elif isinstance(module, Experts) or name in ROUTERS:
            raise ConfigError(f"plans.pmm3d: {path} is part of a mixture of experts that is not "
                              "a routed SwitchMoE (GPT-2's MoE blocks), which pmm3d does not "
                              "split; use strategy 'tensor' (plans.megatron) with an expert axis")
        elif isinstance(module, nnx.Linear):
            if name in COLUMN:
                plan[path] = Style("pmm3d", role="normal", weights=weights)
            elif name in ROW:
                plan[path] = Style("pmm3d", role="transposed", weights=weights)
            elif vocab is not None and module.out_features == vocab:
                plan[path] = Style("pmm3d", role="normal", vocab_output=True, weights=weights)
            else:
                raise ConfigError(f"plans.pmm3d cannot tell whether {path} is a normal or a "
                                  "transposed layer: write the plan by hand")
        elif _holds_params(module) and not _inside(path, plan):
            raise _split_features(path, module, "plans.pmm3d")
    return plan


def context(model: nnx.Module, *, algorithm: str = "ring", balanced: bool = True
            ) -> dict[str, Style]:
    """Context parallelism (:mod:`jphantom.nn.attention`): every attention core
    (:class:`~jphantom.nn.attention.CausalAttention`) and positions module
    (:class:`~jphantom.nn.attention.Positions`) of ``model`` over the ``context`` axis, with
    ``algorithm`` ``ring`` or ``all-gather`` and the ``balanced`` causal layout. Merge it with
    another plan (``{**plans.megatron(model), **plans.context(model)}``) or apply it alone."""
    attention.check_algorithm(algorithm)
    plan = {}
    for path, (_, module) in modules_by_path(model).items():
        if isinstance(module, attention.CausalAttention):
            plan[path] = Style("context", algorithm=algorithm, balanced=balanced)
        elif isinstance(module, attention.Positions):
            plan[path] = Style("context", balanced=balanced)
    if not any(isinstance(m, attention.CausalAttention) for _, m in nnx.iter_modules(model)):
        raise ConfigError(f"{type(model).__name__} has no jphantom.nn.CausalAttention core: "
                          "context parallelism swaps it for ring attention; build the model's "
                          "attention with one (q, k, v -> output) and its positions with "
                          "jphantom.nn.Positions")
    return plan
