"""A model under a strategy on a mesh: the one object ``train``, ``inspect``, ``compare`` and
``plan`` build, and what :func:`jphantom.make_train_step` trains.

    program = jphantom.program.build(GPT2 config, "tensor", MeshConfig.parse("data=2,model=4"),
                                     sequence_parallel=True)
    step = program.train_step(mesh, optax.adamw(3e-4), zero=1)     # a jphantom.TrainStep
    state = step.init(create=program.create)                         # parameters in their shards

A :class:`Program` is small: the parallelised NNX model (abstract: ``nnx.eval_shape``), how to
create it (``create()``, run by ``step.init`` under ``jax.jit`` so each parameter is born in its
shards), its ``loss_fn(model, *batch)`` (and ``metrics_fn``), the batch arrays' specs when they
are not the default (seed 000's FFN takes its features split over ``model``), and whether the
step is ``shard_map`` (the layers' own collectives) or ``gspmd`` (annotations, ``jax.jit``'s
collectives, the baseline). Everything about *how* the step runs (ZeRO, pipelines, precision,
remat, accumulation) is a step option, composed in one order by :class:`jphantom.TrainStep`.

A strategy is a row of :data:`STRATEGIES` (the one vocabulary of names of the CLI, the API,
``results.json``, the cost model and the docs) and a model family a row of :data:`FAMILIES`: the
family builds its NNX model from a configuration and applies the strategy's plan to it
(:mod:`jphantom.plans`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig

BATCH_AXES = ("data", "expert", "z")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A row of the strategy vocabulary. ``family``: ``dense`` (dense-shaped weights, any degree)
    or ``phantom`` (the ghost width k and the degree p are part of the model); ``models``: the
    model families it runs."""

    name: str
    description: str
    family: str
    models: tuple[str, ...]


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("dense", "the unsharded model on one device (the single-device oracle)", "dense",
             ("ffn", "gpt2", "llama")),
    Strategy("gspmd", "the plain model with NamedSharding annotations of Megatron's plan; jax.jit "
             "chooses the collectives (what a JAX user writes without jphantom)", "dense",
             ("ffn", "gpt2", "llama")),
    Strategy("tensor", "Megatron tensor parallelism: column/row pairs with f and g (seed 002); "
             "sequence parallelism as an option (seed 003)", "dense", ("ffn", "gpt2", "llama")),
    Strategy("tensor-t1", "seed 000's TP: row-sharded weights, all-gather forward / "
             "reduce-scatter backward", "dense", ("ffn",)),
    Strategy("phantom", "phantom parallelism (seed 000), one fused decompressor GEMM", "phantom",
             ("ffn", "gpt2", "llama")),
    Strategy("phantom-unfused", "phantom parallelism with the paper's p-1 decompressor GEMMs",
             "phantom", ("ffn", "gpt2", "llama")),
    Strategy("pmm3d", "AxoNN's 3D parallel matrix multiply on x, y, z (and data), seed 004 ch. 5: "
             "weights all-gathered over z, all-reduces over y forward and x backward, "
             "reduce-scatters over z", "dense", ("ffn", "gpt2", "llama")),
    Strategy("pmm3d-regather", "pmm3d whose backward all-gathers the weights again instead of "
             "keeping them (AxoNN's default)", "dense", ("ffn",)),
    Strategy("pmm3d-deferred", "pmm3d with every weight gathered before the layers and one "
             "reduce-scatter after the backward", "dense", ("ffn",)),
)}
NAMES = tuple(STRATEGIES)


def get(name: str) -> Strategy:
    """A strategy by name, with the valid names in the error."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; choose one of {list(STRATEGIES)}") from None


def strategies_for(model: str) -> list[str]:
    return [name for name, s in STRATEGIES.items() if model in s.models]


@dataclasses.dataclass(frozen=True)
class Program:
    """A model under a strategy on a mesh (module docstring)."""

    strategy: str
    model_name: str
    config: Any
    mesh: MeshConfig
    create: Callable[[jax.Array], nnx.Module] | None  # key -> model; None: ``model`` is concrete
    model: nnx.Module
    loss_fn: Callable
    metrics_fn: Callable | None = None
    batch_specs: tuple[P, ...] | None = None
    spmd: str = "shard_map"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def param_count(self) -> int:
        _, state, _ = nnx.split(self.model, nnx.Param, ...)
        return sum(math.prod(a.shape) for a in jax.tree.leaves(state))

    def train_step(self, mesh, optimizer, **options):
        """The :class:`jphantom.TrainStep` of this program on ``mesh`` (a ``jax.sharding.Mesh``
        built from :attr:`mesh`); ``options`` are the step's (zero, accumulate, precision,
        remat, pipeline, donate)."""
        from jphantom.train_step import make_train_step

        return make_train_step(self.model, mesh, optimizer, self.loss_fn,
                               batch_specs=self.batch_specs, spmd=self.spmd, **options)

    def init(self, step, seed: int = 0):
        """``step.init`` with this program's parameters created in their shards from ``seed``
        (one compilation for every seed), or the concrete model's parameters."""
        if self.create is None:
            return step.init()
        return step.init(create=self.create, key=jax.random.PRNGKey(seed))


def family_of(config) -> tuple[str, Callable[..., Program]]:
    """The model family of a configuration: its name and its ``build(config, strategy, mesh,
    **options) -> Program``."""
    from jphantom.models.ffn import FFNConfig
    from jphantom.models.llama import Llama, LlamaConfig
    from jphantom.models.transformer import TransformerConfig

    if isinstance(config, TransformerConfig):
        from jphantom.models.gpt2_nnx import GPT2

        return "gpt2", lm_build(GPT2, "gpt2")
    if isinstance(config, LlamaConfig):
        return "llama", lm_build(Llama, "llama")
    if isinstance(config, FFNConfig):
        return "ffn", build_ffn
    raise ConfigError(f"no model family takes a {type(config).__name__}: give an FFNConfig, a "
                      "TransformerConfig (GPT-2) or a LlamaConfig")


def build(config, strategy: str, mesh: MeshConfig | Mapping[str, int] | str, **options
          ) -> Program:
    """``config`` (an FFN, GPT-2 or Llama configuration) under ``strategy`` on ``mesh``.

    Options: ``sequence_parallel`` (``tensor``), ``ghost_width`` (phantom; default the
    configuration's), ``dtd`` (MoE under ``tensor``), ``seed``, ``model`` (a concrete plain
    model to parallelise instead of building one, e.g. a loaded Hugging Face checkpoint)."""
    name = get(strategy).name
    mesh = MeshConfig.parse(mesh) if isinstance(mesh, str) else MeshConfig.of(mesh)
    family, build_family = family_of(config)
    if family not in STRATEGIES[name].models:
        raise ConfigError(f"strategy {name!r} runs the models {STRATEGIES[name].models}, not "
                          f"{family!r}: pick one of {strategies_for(family)}")
    return build_family(config, name, mesh, **options)


# -------------------------------------------------------------------------------------------------
# Language models (GPT-2, Llama / Mixtral): the plans of jphantom.plans
# -------------------------------------------------------------------------------------------------


def check_lm_mesh(strategy: str, mesh: MeshConfig) -> MeshConfig:
    """The mesh a language model runs on under ``strategy`` (``dense``: one device; ``pmm3d``:
    ``x``, ``y``, ``z`` added with size 1 where absent; a staged mesh without ``model`` gets
    ``model=1``), or a ConfigError naming what does not fit."""
    if strategy == "dense":
        if mesh.device_count != 1:
            raise ConfigError(f"strategy 'dense' runs on one device, not on mesh {mesh}: use "
                              "'model=1', or 'gspmd' / 'tensor' / 'phantom' for several devices")
        return mesh
    if strategy.startswith("pmm3d"):
        extra = [a for a, s in mesh.axes if a not in ("data", "z", "y", "x", "stage") and s > 1]
        if extra:
            raise ConfigError(f"strategy {strategy!r} runs on the axes data, stage, z, y, x, not "
                              f"{extra}: drop them from the mesh ({mesh})")
        return MeshConfig.of({**dict(mesh.axes), **{a: mesh.size(a) for a in ("z", "y", "x")}})
    grid = [a for a in ("x", "y", "z") if mesh.size(a) > 1]
    if grid:
        raise ConfigError(f"the mesh axes {grid} are pmm3d's (AxoNN's 3D matrix multiply): use "
                          f"--strategy pmm3d, or put those devices on data or model ({mesh})")
    if "model" not in mesh.shape:
        return MeshConfig.of({**dict(mesh.axes), "model": 1})
    return mesh


def lm_plan(model: nnx.Module, strategy: str, mesh: MeshConfig, *, sequence_parallel=False,
            ghost_width=None, dtd=False):
    """Parallelise the language model ``model`` in place under ``strategy`` (``dtd``: duplicate
    token dropping in the routed MoE layers, ``tensor`` only)."""
    from jphantom import plans

    if sequence_parallel and strategy != "tensor":
        raise ConfigError("sequence_parallel applies to strategy 'tensor' (Megatron-SP), not "
                          f"to {strategy!r}")
    shape = mesh.shape
    if strategy in ("tensor",):
        plans.parallelize(model, shape, plans.megatron(model, sequence_parallel=sequence_parallel,
                                                       dtd=dtd))
    elif strategy in ("phantom", "phantom-unfused"):
        if ghost_width is None:
            raise ConfigError(f"strategy {strategy!r} needs ghost_width (k ghost neurons per rank "
                              "and token, seed 000), e.g. --ghost-width 8")
        plans.parallelize(model, shape, plans.phantom(model, ghost_width=ghost_width),
                          fused=strategy == "phantom")
    elif strategy == "gspmd":  # the same plan as annotations; jit's collectives
        plans.annotate(model, shape, plans.megatron(model))
    elif strategy == "pmm3d":
        plans.parallelize(model, shape, plans.pmm3d(model))
    return model


def lm_build(family_class: type, family_name: str):
    """The ``build`` of a language-model family whose module is ``family_class(config,
    rngs=...)`` with a ``loss(tokens, targets)`` method."""

    def build_lm(config, strategy: str, mesh: MeshConfig, *, sequence_parallel: bool = False,
                 ghost_width: int | None = None, seed: int = 0, model: nnx.Module | None = None,
                 dtd: bool = False, **options) -> Program:
        if options:
            raise ConfigError(f"options {sorted(options)} do not apply to the {family_name} model")
        check_experts(config, strategy, mesh, sequence_parallel=sequence_parallel, dtd=dtd)
        mesh = check_lm_mesh(strategy, mesh)
        positions = getattr(config, "seq_len", None)
        if sequence_parallel and positions is not None and positions % mesh.size("model"):
            raise ConfigError(f"seq_len={positions} is not divisible by the model axis size "
                              f"{mesh.size('model')}: sequence parallelism splits the sequence "
                              "over it; pick a sequence length divisible by it")
        k = ghost_width if ghost_width is not None else getattr(config, "ghost_width", None)

        def planned(m):
            return lm_plan(m, strategy, mesh, sequence_parallel=sequence_parallel, ghost_width=k,
                           dtd=dtd)

        if model is not None:
            create, built = None, planned(model)
        else:
            create = lambda key: planned(family_class(config, rngs=nnx.Rngs(key)))
            built = nnx.eval_shape(lambda: create(jax.random.PRNGKey(seed)))
        return Program(strategy, family_name, config, mesh, create, built, lm_loss,
                       metrics_fn=getattr(family_class, "metrics_fn", None),
                       spmd="gspmd" if strategy == "gspmd" else "shard_map",
                       options={"sequence_parallel": sequence_parallel, "ghost_width": k,
                                "dtd": dtd})

    return build_lm


def check_experts(config, strategy: str, mesh: MeshConfig, *, sequence_parallel: bool,
                  dtd: bool) -> None:
    """What a language model's mixture of experts (GPT-2's ``moe_every``, Llama's ``experts``)
    cannot run with, before anything is built."""
    routed = bool(getattr(config, "moe_every", 0))  # GPT-2's routed MoE blocks (capacity, aux)
    experts = routed or (not hasattr(config, "moe_every") and bool(getattr(config, "experts", 0)))
    if dtd and not (routed and strategy == "tensor"):
        raise ConfigError("dtd (duplicate token dropping) applies to the MoE blocks of GPT-2 "
                          "under strategy 'tensor' (TED): set moe_every and use 'tensor', or "
                          "leave dtd out")
    if "expert" in mesh.shape and not experts:
        raise ConfigError("an 'expert' mesh axis splits the experts of MoE blocks: give the "
                          "model MoE blocks (--moe-every 2 --experts 8) or drop the axis")
    if routed and "stage" in mesh.shape:
        raise ConfigError("MoE blocks do not run inside pipeline stages yet: drop the 'stage' "
                          "axis or set moe_every=0")
    if routed and sequence_parallel:
        raise ConfigError("MoE blocks run on the replicated stream: sequence_parallel with "
                          "moe_every is not implemented; leave one of them out")


def lm_loss(model, tokens, targets):
    """``loss_fn`` of the zoo's language models: the model's own ``loss`` (vocabulary-parallel
    cross-entropy when the head is; plus the MoE auxiliary losses)."""
    return model.loss(tokens, targets)


# -------------------------------------------------------------------------------------------------
# Seed 000's FFN
# -------------------------------------------------------------------------------------------------


def build_ffn(config, strategy: str, mesh: MeshConfig, **options) -> Program:
    raise ConfigError("the FFN as an NNX module is not built yet")


# -------------------------------------------------------------------------------------------------
# What each strategy's step moves: the formulas the HLO tests and the cost model check
# -------------------------------------------------------------------------------------------------


def collective_inventory(config, strategy: str, mesh, batch: int, *,
                         sequence_parallel: bool = False) -> dict[str, list[int]]:
    """Per-device result elements of each collective kind over ``model`` in one training step
    (``batch``: the per-data-rank batch; the data-parallel gradient reduction not included), from
    the designs' formulas: the GPT-2 transformer under ``tensor`` (Megatron, seeds 002/003) and
    ``phantom`` (seed 000 Sec. 5), the FFN under ``tensor``, ``tensor-t1`` and ``phantom``
    (seed 000 Table II). Strategies whose collectives are left to ``jax.jit`` or are
    Eqs. 5.1-5.5 (:mod:`jphantom.perf.axonn_model`) have none to list."""
    from jphantom.models.ffn import FFNConfig
    from jphantom.models.transformer import TransformerConfig

    name = get(strategy).name
    mesh = MeshConfig.parse(mesh) if isinstance(mesh, str) else MeshConfig.of(mesh)
    p = mesh.size("model")
    if isinstance(config, FFNConfig):
        from jphantom.sharding import phantom, tensor

        if name in ("tensor", "tensor-t1"):
            return tensor.collective_buffers(width=config.width, num_shards=p, depth=config.depth,
                                             batch=batch,
                                             layout="t1" if name == "tensor-t1" else "megatron")
        if STRATEGIES[name].family == "phantom":
            return phantom.collective_buffers(width=config.width, ghost_width=config.ghost_width,
                                              num_shards=p, depth=config.depth, batch=batch)
    elif isinstance(config, TransformerConfig):
        L, h, s = config.layers, config.hidden, config.seq_len
        tokens = batch * s
        if name == "tensor" and not sequence_parallel:
            # embedding all-reduce (fwd); per block g, g (fwd) and f, f (bwd); head f (bwd);
            # cross-entropy: max, sum of exponentials, target logit
            return {"all-reduce": [tokens * h] * (4 * L + 2) + [tokens] * 3}
        if name == "tensor":
            # each all-reduce of B*S*h becomes a reduce-scatter to B*S*h/p and an all-gather
            # back; plus the gradients of the sequence-parallel parameters (LayerNorms, row
            # biases, wpe)
            sp_grads = [L * h] * 6 + [h] * 2 + [s * h]
            return {"reduce-scatter": [tokens * h // p] * (4 * L + 2),
                    "all-gather": [tokens * h] * (4 * L + 2),
                    "all-reduce": [tokens] * 3 + sp_grads}
        if STRATEGIES[name].family == "phantom":
            k = config.ghost_width
            projections = 4 * L + 1
            return {"all-gather": [tokens * p * k] * projections,
                    "reduce-scatter": [tokens * k] * projections,
                    "all-reduce": [tokens] * (8 * L + 4 + 3)}
    raise ConfigError(f"strategy {name!r} has no hand-written collectives to list for "
                      f"{type(config).__name__}: inspect its compiled step instead "
                      "(jphantom inspect)")
