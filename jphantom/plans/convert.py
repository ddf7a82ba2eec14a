"""The parallel layer each style makes of each kind of Flax layer (the table of
:mod:`jphantom.plans`): Megatron's column, row and vocabulary layers (Shoeybi et al.) and
sequence parallelism (Korthikanti et al.), Seal et al.'s phantom and T1 layers, AxoNN's 3D matmul
(Singh's thesis ch. 5), expert parallelism, TED and DTD (Singh's thesis ch. 7), context
parallelism, and the styles registered for your own layers; every dimension the axis must divide
checked by name."""

from __future__ import annotations

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.runtime.mesh import BATCH_AXES, EXPERT
from jphantom.nn import attention
from jphantom.nn import expert_parallel as expert_layers
from jphantom.nn import moe as experts_module
from jphantom.nn import phantom as phantom_layers
from jphantom.nn import pmm3d as pmm3d_layers
from jphantom.nn import tensor
from jphantom.nn.boundary import Boundary
from jphantom.nn.moe import SwitchMoE
from jphantom.plans.paths import holds_params
from jphantom.plans.styles import NORMS, REGISTERED, Style, build_registered


EXPERT_AXIS = EXPERT


def mesh_axis_size(mesh, axis: str) -> int:
    shape = dict(mesh.shape) if hasattr(mesh, "shape") else dict(mesh)
    if axis not in shape:
        raise ConfigError(f"the mesh {shape} has no {axis!r} axis for the plan's layers: add "
                          f"{axis}=1 (no tensor parallelism) or {axis}=N to the mesh")
    return int(shape[axis])


def _divides(path: str, what: str, value: int, p: int, axis: str) -> None:
    if value % p:
        raise ConfigError(f"{path}: {what}={value} is not divisible by the {axis!r} axis of size "
                          f"{p}: pick a mesh whose {axis} divides {value}, or style 'replicate'")


def convert(path: str, module, style: Style, *, axis: str, p: int, sequence_parallel: bool,
            ghost_width: int | None, fused: bool, shape: dict):
    """The parallel module for ``module`` under ``style`` (``None``: keep the module): a
    registered style's own, else what the conversion of the style (:data:`CONVERSIONS`) makes
    of it, or a ConfigError naming the layers the style fits (:data:`FITS`)."""
    name = style.name
    if name == "replicate":
        return None
    if name in REGISTERED:
        return build_registered(path, module, style, axis=axis, p=p,
                                sequence_parallel=sequence_parallel, shape=shape)
    built = CONVERSIONS[name](path, module, style, axis=axis, p=p,
                              sequence_parallel=sequence_parallel, ghost_width=ghost_width,
                              fused=fused, shape=shape)
    if built is None:
        raise ConfigError(f"{path}: style {name!r} does not fit {type(module).__name__}; it "
                          f"applies to {FITS[name]}")
    return built


def _context(path: str, module, style: Style, *, shape: dict, **_):
    """``context``: context parallelism, the sequence split over the ``context`` axis (ring or
    all-gather attention, each rank's positions)."""
    if not isinstance(module, (attention.CausalAttention, attention.Positions)):
        return None
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


def _t1(path: str, module, style: Style, *, axis: str, p: int, **_):
    """``t1``: Seal et al.'s T1 layer, a linear layer with both its feature dimensions split."""
    if not isinstance(module, nnx.Linear):
        return None
    _divides(path, "in_features", module.in_features, p, axis)
    _divides(path, "out_features", module.out_features, p, axis)
    return tensor.T1Linear.from_module(module, axis=axis)


def _boundary(path: str, module, style: Style, *, axis: str, **_):
    """``gather`` and ``scatter``: Megatron's FFN plan's entry and exit (a :class:`Boundary`)
    gather the feature-split input and scatter the replicated output back."""
    if not isinstance(module, Boundary):
        return None
    cls = tensor.GatherFeatures if style.name == "gather" else tensor.ScatterFeatures
    return cls.from_module(module, axis=axis)


def _megatron(path: str, module, style: Style, *, axis: str, p: int, sequence_parallel: bool,
              **_):
    """``column``, ``row`` and ``vocab``: Megatron's column and row layers (an ``nnx.Linear``, an
    ``nnx.Einsum``, an ``nnx.LinearGeneral`` split on its heads, key/value heads shared by
    several ranks) and its vocabulary-parallel embedding and head (Shoeybi et al.)."""
    name, linear = style.name, isinstance(module, nnx.Linear)
    if name in ("column", "row") and isinstance(module, nnx.Einsum):
        cls = tensor.ColumnParallelEinsum if name == "column" else tensor.RowParallelEinsum
        lhs, rhs, out = tensor.einsum_operands(module)
        split = tensor.einsum_split(lhs, rhs, out, column=name == "column")
        if split is not None:
            _divides(path, f"the Einsum's axis {split!r}", module.kernel_shape[rhs.index(split)],
                     p, axis)
        return cls.from_module(module, axis=axis, sequence_parallel=sequence_parallel)
    if name in ("column", "row") and isinstance(module, nnx.LinearGeneral):
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
    if name == "vocab" and isinstance(module, nnx.Embed):
        _divides(path, "num_embeddings", module.num_embeddings, p, axis)
        return tensor.VocabParallelEmbed.from_module(module, axis=axis,
                                                     sequence_parallel=sequence_parallel)
    return None


def _sequence(path: str, module, style: Style, *, axis: str, **_):
    """``input`` and ``sequence``: a norm that opens a tensor-parallel region (Megatron's f) or,
    under sequence parallelism, gathers the sequence (Korthikanti et al.); ``sequence`` also
    keeps a position table or another per-token layer with parameters on its sequence split."""
    embed, linear = isinstance(module, nnx.Embed), isinstance(module, nnx.Linear)
    if isinstance(module, NORMS):
        return tensor.InputNorm.from_module(module, axis=axis,
                                            sequence_parallel=style.name == "sequence",
                                            collective_matmul=style.collective_matmul)
    if style.name == "sequence" and not embed and not linear and holds_params(module):
        if style.collective_matmul:
            raise ConfigError(f"{path}: collective_matmul applies to nnx.LayerNorm and "
                              f"nnx.RMSNorm; {type(module).__name__} runs as "
                              "Style('sequence') without it")
        return tensor.PerTokenSequence.from_module(module, axis=axis)
    if style.name == "sequence" and embed:
        return tensor.SequenceParallelEmbed.from_module(module, axis=axis)
    return None


def _experts(path: str, module, style: Style, *, axis: str, p: int, sequence_parallel: bool,
             shape: dict, **options):
    """``experts``: a routed mixture of experts (:func:`_convert_moe`), or a bank of experts
    split over ``axis`` (TED) and, with an expert axis, over it (expert parallelism; Singh's
    thesis ch. 7)."""
    if isinstance(module, SwitchMoE):
        return _convert_moe(path, module, style, axis=axis, p=p,
                            sequence_parallel=sequence_parallel, shape=shape, **options)
    if not isinstance(module, experts_module.Experts):
        return None
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


def _pmm3d(path: str, module, style: Style, *, shape: dict, **_):
    """``pmm3d``: AxoNN's 3D matmul (Singh's thesis ch. 5): a linear layer as a normal or
    transposed layer of the x, y, z grid, the token table as a normal layer's weight, a position
    table and a norm with their features over y, a routed mixture of experts."""
    if isinstance(module, SwitchMoE):
        groups = shape.get(EXPERT_AXIS, 1)
        if module.config.experts % groups:
            raise ConfigError(f"{path}: experts={module.config.experts} is not divisible by the "
                              f"expert axis size {groups}: every rank holds E / G whole experts")
        _divides(path, "expert width", module.config.width, shape.get("x", 1), "x")
        return pmm3d_layers.Pmm3dMoE.from_module(
            module, expert_axis=EXPERT_AXIS if groups > 1 else None,
            batch_axes=tuple(a for a in BATCH_AXES if a in shape),
            tensor=shape.get("x", 1) > 1)
    if isinstance(module, experts_module.Experts):
        raise ConfigError(f"{path}: pmm3d has no expert layer: keep the experts off a pmm3d "
                          "mesh (or write their plan with 'experts' on a model axis)")
    if isinstance(module, nnx.Linear):
        role = style.role or "normal"
        contract, out = pmm3d_layers.ROLES[role]
        _divides(path, "in_features", module.in_features, shape.get(contract, 1), contract)
        _divides(path, "out_features", module.out_features,
                 shape.get(out, 1) * shape.get(pmm3d_layers.Z, 1), f"{out} x z")
        return pmm3d_layers.Pmm3dLinear.from_module(module, role=role,
                                                    vocab_output=style.vocab_output,
                                                    weights=style.weights or "kept")
    y = pmm3d_layers.Y
    if isinstance(module, nnx.Embed) and style.vocab_output:  # the token table: a normal weight
        _divides(path, "num_embeddings", module.num_embeddings,
                 shape.get("x", 1) * shape.get("z", 1), "x x z")
        _divides(path, "features", module.features, shape.get(y, 1), y)
        return pmm3d_layers.Pmm3dEmbed.from_module(module)
    if isinstance(module, nnx.Embed):  # a position table: features over y
        _divides(path, "features", module.features, shape.get(y, 1), y)
        return phantom_layers.FeatureParallelEmbed.from_module(module, axis=y)
    if isinstance(module, NORMS):
        _divides(path, "num_features", module.num_features, shape.get(y, 1), y)
        return phantom_layers.FeatureParallelNorm.from_module(module, axis=y)
    return None


def _phantom(path: str, module, style: Style, *, axis: str, p: int, ghost_width: int | None,
             fused: bool, **options):
    """``phantom``: Seal et al.'s phantom layer (k ghost neurons per rank), and the embeddings,
    norms, experts and routed mixtures of experts of a model whose features are split."""
    if isinstance(module, SwitchMoE):
        return _convert_moe(path, module, style, axis=axis, p=p, ghost_width=ghost_width,
                            fused=fused, **options)
    if isinstance(module, nnx.Linear):
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
    if isinstance(module, nnx.Embed):
        _divides(path, "features", module.features, p, axis)
        return phantom_layers.FeatureParallelEmbed.from_module(module, axis=axis)
    if isinstance(module, NORMS):
        _divides(path, "num_features", module.num_features, p, axis)
        return phantom_layers.FeatureParallelNorm.from_module(module, axis=axis)
    if isinstance(module, experts_module.Experts):
        _divides(path, "hidden", module.w_gate.shape[-2], p, axis)
        _divides(path, "expert width", module.w_gate.shape[-1], p, axis)
        return tensor.TensorParallelExperts.from_module(module, axis=axis, feature_split=True)
    return None


CONVERSIONS = {"context": _context, "t1": _t1, "gather": _boundary, "scatter": _boundary,
               "column": _megatron, "row": _megatron, "vocab": _megatron, "input": _sequence,
               "sequence": _sequence, "experts": _experts, "pmm3d": _pmm3d, "phantom": _phantom}
"""Each built-in style's conversion: ``conversion(path, module, style, **settings)`` -> the
parallel module, or ``None`` where the style does not fit the module."""

FITS = {"column": "nnx.Linear", "row": "nnx.Linear", "vocab": "nnx.Embed or an nnx.Linear head",
        "sequence": "nnx.LayerNorm, nnx.RMSNorm or a position nnx.Embed",
        "input": "nnx.LayerNorm or nnx.RMSNorm",
        "phantom": "nnx.Linear, nnx.Embed, nnx.LayerNorm, nnx.RMSNorm or Experts",
        "experts": "jphantom.nn.Experts or a SwitchMoE", "t1": "nnx.Linear",
        "gather": "jphantom.nn.Boundary", "scatter": "jphantom.nn.Boundary",
        "pmm3d": "nnx.Linear, nnx.Embed, nnx.LayerNorm, nnx.RMSNorm or a SwitchMoE",
        "context": "jphantom.nn.CausalAttention or jphantom.nn.Positions"}
"""What each built-in style fits, named in the error of a style given a module it does not."""


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
