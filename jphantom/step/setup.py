"""What every part of a training step reads, checked once before anything is traced: the mesh, the
parameters' layout (:class:`~jphantom.step.layout.ParamLayout`), the precision, the user's loss,
ZeRO's stage, accumulation, the pipeline's cut, the attention kernel, the batch's specs.

:func:`setup_of` validates the options of :func:`jphantom.make_train_step` (each refusal a
``ConfigError`` naming the option and the fix) and returns a :class:`StepSetup`; the step's parts
(:mod:`jphantom.step.grads`, :mod:`~jphantom.step.reduce`, :mod:`~jphantom.step.pipeline`,
:mod:`~jphantom.step.gspmd`, :mod:`~jphantom.step.update`) each take it, and nothing else, so each
can be built and tested alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.runtime import comm
from jphantom.step import remat as remat_module
from jphantom.step import zero as zero_module
from jphantom.errors import ConfigError, check_int
from jphantom.nn import attention as attention_module
from jphantom.nn import metadata
from jphantom.nn.stack import Stacked, set_fp8, set_remat
from jphantom.step.precision import Precision
from jphantom.step.layout import (CONTEXT, ParamLayout, batch_axes_of, batch_spec_of,
                                   check_batch_specs, check_mesh, mean_share, private_copy,
                                   replace_dropout, warn_unstacked_blocks)
from jphantom.step.stages import PipelineLayout, cut_into_stages

SPMD = ("shard_map", "gspmd")
MASTER_WEIGHTS = ("replicated", "sharded")


@dataclasses.dataclass(eq=False)
class StepSetup:
    """The checked facts of one step (module docstring); built by :func:`setup_of`."""

    mesh: Mesh
    model_template: nnx.Module  # the step's private copy (remat policy, stage metadata set)
    layout: ParamLayout
    loss_fn: Callable
    precision: Precision
    zero: int
    accumulate: int
    spmd: str
    attention: str | None
    platform: str
    batch_axes: tuple[str, ...]
    batch_ranks: int
    batch_spec: P
    batch_specs: tuple[P, ...] | None
    context: tuple[int, bool] | None  # (C, balanced) with a context axis
    dropout: list[str]  # the paths of the model's dropout layers
    dropout_seed: int
    pipeline: Any = None  # a PipelineConfig with a 'stage' axis
    stages: Any = None  # its jphantom.step.stages.PipelineLayout
    master_weights: str = "replicated"  # "sharded": float32 master in shards, bf16 gathered

    @property
    def sharded_master(self) -> bool:
        """The state stores the float32 parameters in their ZeRO shards over ``data``: ZeRO-3,
        or ``master_weights="sharded"`` (gathered whole in the compute dtype once per step)."""
        return self.zero == 3 or self.master_weights == "sharded"

    # -- shardings ---------------------------------------------------------------------------

    @property
    def param_specs(self) -> tuple[P, ...]:
        """The parameters' specs as the state stores them (ZeRO-3, sharded master: shards)."""
        return self.layout.zero_specs() if self.sharded_master else self.layout.specs

    @property
    def grad_specs(self) -> tuple[P, ...]:
        """The reduced gradients' specs (ZeRO-2 and 3, sharded master: shards)."""
        return (self.layout.zero_specs() if self.zero >= 2 or self.sharded_master
                else self.layout.specs)

    @property
    def opt_param_specs(self) -> tuple[P, ...]:
        """The specs of the optimizer state's parameter-shaped leaves (ZeRO-1 and up: shards)."""
        return self.layout.zero_specs() if self.zero >= 1 else self.layout.specs

    def pure(self, leaves):
        """The pure dict (as ``TrainState.params``) of pure-order ``leaves``."""
        return jax.tree.unflatten(self.layout.pure_treedef, list(leaves))

    def shardings(self, specs):
        """A pure dict of the ``NamedSharding`` of each spec on the mesh."""
        return self.pure([NamedSharding(self.mesh, s) for s in specs])

    def specs_of_batch(self, count: int) -> tuple[P, ...]:
        """The specs of ``count`` batch arrays (``batch_specs``, or each split on its first
        dimension over the batch axes; none for none)."""
        if count == 0:
            return ()
        if self.batch_specs is None:
            return (self.batch_spec,) * count
        if len(self.batch_specs) == 1:
            return self.batch_specs * count
        if len(self.batch_specs) != count:
            raise ConfigError(f"batch_specs has {len(self.batch_specs)} entries for {count} "
                              "batch arrays")
        return self.batch_specs

    # -- per rank ----------------------------------------------------------------------------

    def ready(self, model: nnx.Module) -> nnx.Module:
        """A rank's ``model`` set up to compute: in the precision's dtypes (and FP8 GEMMs), its
        attention cores on the kernel ``attention`` picks for the mesh's platform."""
        model = self.precision.retype(model)
        if self.precision.fp8:
            set_fp8(model)
        return attention_module.configure(model, self.attention, self.platform)

    def mean_share(self, value, exclude=()):
        """This rank's share of a global mean, and the axes (mesh order) to ``psum`` it over."""
        share, axes = mean_share(value, exclude)
        return share, tuple(sorted(axes, key=self.mesh.axis_names.index))

    def global_value(self, share):
        """The global value of per-rank shares: one all-reduce over the axes they vary over (a
        pipeline's loss lives on its last stage)."""
        axes = tuple(sorted(metadata.varying_axes(share), key=self.mesh.axis_names.index))
        return comm.psum(share, axes) if axes else share

    def refuse_dropout(self, what: str) -> None:
        """The model's dropout layers cannot train under ``what``: a ConfigError naming one."""
        refuse_dropout(self.dropout, what)


def refuse_dropout(dropout: list[str], what: str) -> None:
    """The dropout layers ``dropout`` (their paths) cannot train under ``what``."""
    raise ConfigError(f"{dropout[0]}: nnx.Dropout trains in the shard_map step without a "
                      f"pipeline; {what} does not draw its masks yet: set its rate to 0 (or "
                      "deterministic=True) there")


def setup_of(model: nnx.Module, mesh: Mesh, loss_fn: Callable, *, zero: int = 0,
             accumulate: int = 1, precision: str | Precision = "float32", remat: str = "none",
             pipeline=None, spmd: str = "shard_map", batch_specs=None,
             attention: str | None = None, dropout_seed: int = 0,
             master_weights: str = "replicated") -> StepSetup:
    """The checked :class:`StepSetup` of :func:`jphantom.make_train_step`'s options (its
    docstring names them) on a private copy of ``model``."""
    if not isinstance(model, nnx.Module):
        raise ConfigError(f"make_train_step takes an nnx.Module, not {type(model).__name__}")
    if not callable(loss_fn):
        raise ConfigError("loss_fn must be a function loss_fn(model, *batch) -> mean loss")
    model = private_copy(model)
    dropout = replace_dropout(model)  # the step's keys (jphantom.nn.dropout)
    mesh = check_mesh(mesh)
    zero = zero_module.check(zero)
    accumulate = check_int("accumulate", accumulate)
    precision = _check_precision(Precision.named(precision), model)
    _set_remat(model, remat)
    if zero and "data" not in mesh.axis_names:
        raise ConfigError(f"zero={zero} shards over the 'data' axis: add it to the mesh")
    _check_spmd(spmd, model, pipeline)
    _check_master_weights(master_weights, precision, zero, mesh, spmd, pipeline)
    if dropout and (pipeline is not None or "stage" in mesh.axis_names or spmd != "shard_map"):
        what = ("a pipeline" if pipeline is not None or "stage" in mesh.axis_names
                else "spmd='gspmd'")
        refuse_dropout(dropout, what)
    pipeline, stack = cut_into_stages(model, mesh, pipeline, accumulate)
    layout = ParamLayout.of(model, mesh, zero)
    if zero == 3 and pipeline is None and spmd == "shard_map":  # GSPMD: jit's gathers
        warn_unstacked_blocks(model, layout)
    batch_axes = batch_axes_of(mesh)
    setup = StepSetup(
        mesh=mesh, model_template=model, layout=layout, loss_fn=loss_fn, precision=precision,
        zero=zero, accumulate=accumulate, spmd=spmd,
        attention=None if attention is None else attention_module.check_implementation(attention),
        platform=attention_module.platform_of(mesh.devices.flat[0]), batch_axes=batch_axes,
        batch_ranks=math.prod(dict(mesh.shape)[a] for a in batch_axes),
        batch_spec=batch_spec_of(mesh), batch_specs=check_batch_specs(batch_specs, mesh),
        context=attention_module.context_of(model), dropout=dropout,
        dropout_seed=check_int("dropout_seed", dropout_seed, minimum=0), pipeline=pipeline,
        master_weights=master_weights)
    if pipeline is not None:
        setup.stages = PipelineLayout.of(model, mesh, pipeline, stack, setup.ready,
                                         layout.pure_treedef)
    _check_context(setup)
    return setup


def _check_precision(precision: Precision, model: nnx.Module) -> Precision:
    """Mixed precision updates float32 master weights (:meth:`Precision.check_master`)."""
    precision.check_master(leaf.dtype for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))
                           if jnp.issubdtype(leaf.dtype, jnp.floating))
    return precision


def _check_master_weights(master_weights, precision, zero, mesh, spmd, pipeline) -> None:
    """``master_weights="sharded"`` (Megatron's distributed optimizer: float32 master shards and
    Adam moments over ``data``, bf16 parameters gathered whole once per step, bf16 gradients
    reduce-scattered, once per step however many micro-batches it accumulates or pipelines)
    runs where it is built: bf16 (or FP8 GEMMs on the bf16 parameters), ZeRO-1 (or ZeRO-2, whose
    accumulated gradients are shards too: :meth:`jphantom.step.grads.LocalGradients.
    into_sinks`), a data axis, the shard_map step."""
    if master_weights not in MASTER_WEIGHTS:
        raise ConfigError(f"master_weights={master_weights!r}: 'replicated' (the float32 "
                          "parameters on every data rank) or 'sharded' (float32 master shards "
                          "over data, bf16 parameters gathered once per step)")
    if master_weights == "replicated":
        return
    why = "master_weights='sharded' "
    if precision.name not in ("bf16", "fp8"):  # fp8: bf16 parameters, FP8 GEMM operands
        raise ConfigError(f"{why}keeps float32 master shards under bf16 parameters: use "
                          f"precision='bf16' or 'fp8' (--precision bf16), not "
                          f"{precision.name!r}")
    if zero not in (1, 2):
        raise ConfigError(f"{why}is ZeRO-1's state (the optimizer state and float32 master in "
                          f"shards over data; ZeRO-2 also the accumulated gradients; ZeRO-3 "
                          f"already stores them so, gathering per layer): use zero=1 or 2, "
                          f"not zero={zero}")
    if dict(mesh.shape).get("data", 1) < 2:
        raise ConfigError(f"{why}shards the master over the 'data' axis: give the mesh data>=2")
    if spmd != "shard_map":
        raise ConfigError(f"{why}runs in the shard_map step: leave out spmd='gspmd'")


def _set_remat(model: nnx.Module, remat: str) -> None:
    """The step's remat option becomes the policy of the model's Stacked blocks (``"none"``
    resets an earlier one)."""
    remat_module.check(remat)
    stacked = any(isinstance(m, Stacked) for _, m in nnx.iter_modules(model))
    if remat != "none" and not stacked:
        raise ConfigError(f"remat={remat!r} checkpoints the blocks of a "
                          "jphantom.nn.Stacked; the model has none: stack its repeated "
                          "blocks with Stacked, or leave remat out")
    if stacked:
        set_remat(model, remat)


def _check_spmd(spmd: str, model: nnx.Module, pipeline) -> None:
    """``spmd="gspmd"`` runs a plain model, and pipelines only as GPipe."""
    if spmd not in SPMD:
        raise ConfigError(f"spmd={spmd!r}: 'shard_map' (the parallel layers' own "
                          "collectives) or 'gspmd' (annotations, jit's collectives)")
    if spmd != "gspmd":
        return
    parallel = [type(m).__name__ for _, m in nnx.iter_modules(model)
                if callable(getattr(m, "dense_equivalent", None))]
    if parallel:
        raise ConfigError(f"spmd='gspmd' runs the plain model with sharding annotations "
                          f"(jphantom.plans.annotate); it holds parallel layers "
                          f"({parallel[0]}): annotate a plain model instead")
    if pipeline is not None and (pipeline.schedule != "gpipe" or pipeline.virtual_stages != 1):
        raise ConfigError(
            f"spmd='gspmd' pipelines by differentiating a loop of forward ticks (Praxis, "
            f"MaxText), so every backward runs after every forward: its schedule is "
            f"GPipe, not {pipeline.schedule!r} (with {pipeline.virtual_stages} virtual "
            "stages); 1F1B and interleaving order the backward by hand: use the "
            "shard_map step (strategy 'tensor' with model=1, or 'phantom')")


def _check_context(setup: StepSetup) -> None:
    """A context axis needs context attention, and ring attention no pipeline."""
    model = setup.model_template
    if setup.pipeline is not None and any(type(m) is attention_module.RingAttention
                                          for _, m in nnx.iter_modules(model)):
        raise ConfigError("ring attention inside a pipeline: its collective-permutes would "
                          "run in the schedule's conditional slots, which XLA:CPU aborts "
                          "on; with a 'stage' axis use context_attention='all-gather' "
                          "(--context-attention all-gather)")
    if dict(setup.mesh.shape).get(CONTEXT, 1) > 1 and setup.context is None:
        raise ConfigError("the mesh has a 'context' axis but the model's attention does not "
                          "run over it: parallelize it with jphantom.plans.context(model)")
