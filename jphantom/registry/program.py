"""A model under a strategy on a mesh: the one object ``train``, ``inspect``, ``compare`` and
``plan`` build, and what :func:`jphantom.make_train_step` trains.

    program = jphantom.registry.program.build(GPT2 config, "tensor", MeshConfig.parse("data=2,model=4"),
                                     sequence_parallel=True)
    step = program.train_step(mesh, optax.adamw(3e-4), zero=1)     # a jphantom.TrainStep
    state = program.init(step, seed=0)                               # parameters in their shards

A :class:`Program` is small: the parallelised NNX model (abstract: ``nnx.eval_shape``), how to
create it (``create(key)``, run by ``step.init`` under ``jax.jit`` so each parameter is born in
its shards; one compilation serves every seed), its ``loss_fn(model, *batch)`` (and ``metrics_fn``), the batch arrays' specs when they
are not the default (Seal et al.'s FFN takes its features split over ``model``), and whether the
step is ``shard_map`` (the layers' own collectives) or ``gspmd`` (annotations, ``jax.jit``'s
collectives, the baseline). Everything about *how* the step runs (ZeRO, pipelines, precision,
remat, accumulation) is a step option, composed in one order by :class:`jphantom.TrainStep`.

A strategy is a row of :data:`STRATEGIES` (the one vocabulary of names of the CLI, the API,
``results.json``, the cost model and the docs); a model family (:func:`family_of`: FFN, GPT-2,
Llama) builds its NNX model from a configuration and applies the strategy's plan to it
(:mod:`jphantom.plans`): the language models through :func:`lm_build`, here, a family with its
own builder through it (:attr:`jphantom.registry.families.Family.build`: the FFN's is
:func:`jphantom.models.ffn.program.build`).

The vocabulary and the checks of a run's names against it (:func:`get`, :func:`check_runs`,
:func:`check_lm_mesh`) import no jax: a run's configuration reads them as it validates
(:class:`jphantom.config.RunConfig`); jax, flax and the layers are imported where a program is
built.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from jphantom.registry import strategies
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import MeshConfig
from jphantom.models import lm_loss  # noqa: F401  (the programs' loss_fn, jphantom.registry.program.lm_loss)

if TYPE_CHECKING:
    import jax
    from flax import nnx
    from jax.sharding import PartitionSpec as P


# The registry lives in jphantom.registry.strategies (no jax); its names are this module's too.
STRATEGIES, NAMES, Strategy, get = strategies.STRATEGIES, strategies.NAMES, strategies.Strategy, \
    strategies.get


def strategies_for(model: str) -> list[str]:
    """The strategies the model family ``model`` runs (:func:`jphantom.registry.families.strategies_for`)."""
    from jphantom.registry import families

    return families.strategies_for(model)


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
        import jax
        from flax import nnx

        _, state, _ = nnx.split(self.model, nnx.Param, ...)
        return sum(math.prod(a.shape) for a in jax.tree.leaves(state))

    def train_step(self, mesh, optimizer, **options):
        """The :class:`jphantom.TrainStep` of this program on ``mesh`` (a ``jax.sharding.Mesh``
        built from :attr:`mesh`); ``options`` are the step's (zero, accumulate, precision,
        remat, pipeline, donate)."""
        from jphantom.step.train_step import make_train_step

        zero = options.get("zero", 0)
        if zero and not get(self.strategy).zero:
            raise ConfigError(f"zero={zero}: {self.strategy} already shards every weight over "
                              "'z' (its z-only grid is ZeRO-3); leave zero out and give the mesh a "
                              "z axis")
        return make_train_step(self.model, mesh, optimizer, self.loss_fn,
                               batch_specs=self.batch_specs, spmd=self.spmd, **options)

    def init(self, step, seed: int = 0):
        """``step.init`` with this program's parameters created in their shards from ``seed``
        (one compilation for every seed), or the concrete model's parameters."""
        if self.create is None:
            return step.init()
        import jax

        return step.init(create=self.create, key=jax.random.PRNGKey(seed))


def family_of(config) -> tuple[str, Callable[..., Program]]:
    """The model family of a configuration (:func:`jphantom.registry.families.of_config`): its name
    and its ``build(config, strategy, mesh, **options) -> Program``: the one it declares
    (:attr:`jphantom.registry.families.Family.build`, the FFN's), else the language models'
    (:func:`lm_build`)."""
    from jphantom.registry import families

    found = families.of_config(config)
    if found.declares("build"):
        return found.name, found.build
    return found.name, lm_build(found.module, found.name)


def build(config, strategy: str, mesh: MeshConfig | Mapping[str, int] | str, **options
          ) -> Program:
    """``config`` (an FFN, GPT-2 or Llama configuration) under ``strategy`` on ``mesh``.

    Options: ``sequence_parallel`` (``tensor``), ``ghost_width`` (phantom; default the
    configuration's), ``dtd`` (MoE under ``tensor``), ``seed``, ``model`` (a concrete plain
    model to parallelise instead of building one, e.g. a loaded Hugging Face checkpoint)."""
    name = get(strategy).name
    mesh = MeshConfig.parse(mesh) if isinstance(mesh, str) else MeshConfig.of(mesh)
    family, build_family = family_of(config)
    check_runs(family, name)
    return build_family(config, name, mesh, **options)


def check_runs(family: str, strategy: str) -> None:
    """A ConfigError unless the model family ``family`` runs ``strategy`` (its registry entry)."""
    if get(strategy).name not in strategies_for(family):
        raise ConfigError(f"strategy {get(strategy).name!r} does not run the model family "
                          f"{family!r}: pick one of {strategies_for(family)}")


# -------------------------------------------------------------------------------------------------
# Language models (GPT-2, Llama / Mixtral): the plans of jphantom.plans
# -------------------------------------------------------------------------------------------------


def check_lm_mesh(strategy: str, mesh: MeshConfig) -> MeshConfig:
    """The mesh a language model runs on under ``strategy``
    (:meth:`jphantom.registry.strategies.Strategy.check_mesh`), or a ConfigError naming what does not
    fit."""
    return get(strategy).check_mesh(mesh)


def lm_plan(model: nnx.Module, strategy: str, mesh: MeshConfig, *, sequence_parallel=False,
            ghost_width=None, dtd=False, context_attention="ring", load_balance=True,
            collective_matmul=False, family: str):
    """Parallelise the language model ``model`` of the family ``family`` in place under
    ``strategy`` (:meth:`jphantom.registry.strategies.Strategy.plan`: its layers' plan, with the family's
    declared Megatron plan where it declares one, :attr:`jphantom.registry.families.Family.plan`, else the
    walkers'; ``dtd``: duplicate token dropping in the routed MoE layers, ``tensor`` only); with a
    ``context`` axis its attention runs over it (``context_attention``: ring or all-gather;
    ``load_balance``: the balanced causal layout)."""
    from jphantom import plans
    from jphantom.registry import families

    if mesh.size("context") > 1:
        plans.parallelize(model, mesh.shape, plans.context(model, algorithm=context_attention,
                                                           balanced=load_balance))
    strategies.check_sequence_parallel(strategy, sequence_parallel)
    strategies.check_collective_matmul(collective_matmul, sequence_parallel)
    return get(strategy).plan(model, mesh, families.get(family),
                              sequence_parallel=sequence_parallel, ghost_width=ghost_width,
                              dtd=dtd, collective_matmul=collective_matmul)


def lm_build(family_class: type, family_name: str):
    """The ``build`` of a language-model family whose module is ``family_class(config,
    rngs=...)`` with a ``loss(tokens, targets)`` method."""

    def build_lm(config, strategy: str, mesh: MeshConfig, *, sequence_parallel: bool = False,
                 ghost_width: int | None = None, seed: int = 0, model: nnx.Module | None = None,
                 dtd: bool = False, context_attention: str = "ring", load_balance: bool = True,
                 collective_matmul: bool = False, **options) -> Program:
        import jax
        from flax import nnx

        if options:
            raise ConfigError(f"options {sorted(options)} do not apply to the {family_name} model")
        check_experts(config, strategy, mesh, sequence_parallel=sequence_parallel, dtd=dtd)
        mesh = check_lm_mesh(strategy, mesh)
        check_context(config, strategy, mesh, sequence_parallel=sequence_parallel,
                      algorithm=context_attention, balanced=load_balance)
        positions = getattr(config, "seq_len", None)
        if sequence_parallel and positions is not None and positions % mesh.size("model"):
            raise ConfigError(f"seq_len={positions} is not divisible by the model axis size "
                              f"{mesh.size('model')}: sequence parallelism splits the sequence "
                              "over it; pick a sequence length divisible by it")
        k = ghost_width if ghost_width is not None else getattr(config, "ghost_width", None)

        def planned(m):
            return lm_plan(m, strategy, mesh, family=family_name,
                           sequence_parallel=sequence_parallel, ghost_width=k,
                           dtd=dtd, context_attention=context_attention,
                           load_balance=load_balance, collective_matmul=collective_matmul)

        if model is not None:
            create, built = None, planned(model)
        else:
            create = lambda key: planned(family_class(config, rngs=nnx.Rngs(key)))
            built = nnx.eval_shape(lambda: create(jax.random.PRNGKey(seed)))
        return Program(strategy, family_name, config, mesh, create, built, lm_loss,
                       metrics_fn=getattr(family_class, "metrics_fn", None),
                       spmd=get(strategy).spmd,
                       options={"sequence_parallel": sequence_parallel, "ghost_width": k,
                                "dtd": dtd, "context_attention": context_attention,
                                "load_balance": load_balance,
                                "collective_matmul": collective_matmul})

    return build_lm


def check_context(config, strategy: str, mesh: MeshConfig, *, sequence_parallel: bool,
                  algorithm: str, balanced: bool) -> None:
    """What context parallelism (a ``context`` axis) cannot run with, before anything is built:
    the sequence must split into C (2C balanced) chunks, and those into the ``model`` ranks under
    sequence parallelism; GSPMD and pmm3d keep the sequence whole; GPT-2's routed experts would
    need their capacity and statistics over ``context`` too (not done; Mixtral's run as is)."""
    from jphantom.nn.attention import check_algorithm

    check_algorithm(algorithm)
    c = mesh.size("context")
    if c == 1:
        return
    if not get(strategy).context:
        raise ConfigError(f"a 'context' axis runs the shard_map strategies tensor and phantom, "
                          f"not {strategy!r}: use --strategy tensor (model=1 for context "
                          "parallelism alone)")
    if getattr(config, "moe_every", 0):  # Mixtral's experts (no capacity, no aux) run as is
        raise ConfigError("context parallelism with GPT-2's routed MoE blocks (capacity and "
                          "load-balancing statistics per rank) is not supported yet: drop the "
                          "'context' axis or the MoE blocks, or use --model llama --moe-every 1 "
                          "(Mixtral's dropless experts)")
    seq = getattr(config, "seq_len", None)  # Llama's max_positions is a bound: the step checks
    parts = 2 * c if balanced else c
    if seq is not None and seq % (parts * (mesh.size("model") if sequence_parallel else 1)):
        extra = " x the model axis (sequence parallelism)" if sequence_parallel else ""
        raise ConfigError(f"seq_len={seq} does not split into {parts} chunks{extra} for "
                          f"context={c}" + (" (load-balanced: 2 per rank)" if balanced else "")
                          + ": pick a sequence length divisible by it")


def check_experts(config, strategy: str, mesh: MeshConfig, *, sequence_parallel: bool,
                  dtd: bool) -> None:
    """What a language model's mixture of experts (GPT-2's ``moe_every``, Llama's ``experts``)
    cannot run with, before anything is built."""
    routed = bool(getattr(config, "moe_every", 0))  # GPT-2's routed MoE blocks (capacity, aux)
    experts = routed or (not hasattr(config, "moe_every") and bool(getattr(config, "experts", 0)))
    strategies.check_dtd(strategy, dtd, routed_experts=routed)
    if "expert" in mesh.shape and not experts:
        raise ConfigError("an 'expert' mesh axis splits the experts of MoE blocks: give the "
                          "model MoE blocks (--moe-every 2 --experts 8) or drop the axis")
