"""The styles a plan entry may name: the built-in ones (:data:`STYLES`), the plan entry itself
(:class:`Style`, with each style's options checked where it is written), and the registry of
styles for your own layer classes (:func:`register_style`, :class:`Placement`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn import attention
from jphantom.nn import phantom as phantom_layers
from jphantom.nn import pmm3d as pmm3d_layers


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
REGISTERED: dict[str, tuple[tuple[type, ...], Callable, bool]] = {}


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
    REGISTERED[name] = (classes, build, bool(uses_axis))


def unregister_style(name: str) -> None:
    """Forget a style registered with :func:`register_style`."""
    REGISTERED.pop(name, None)


def build_registered(path: str, module, style, *, axis: str, p: int, sequence_parallel: bool,
                shape: dict):
    classes, build, _ = REGISTERED[style.name]
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
        if self.name not in STYLES and self.name not in REGISTERED:
            raise ConfigError(f"style {self.name!r}: use one of {', '.join(STYLES)}"
                              + (f" or a registered one ({', '.join(REGISTERED)})"
                                 if REGISTERED else "") + " (jphantom.plans.register_style "
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
