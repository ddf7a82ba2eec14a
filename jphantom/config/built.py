"""What a run configuration builds before it reads data: the program, the jax mesh, the step
and its jitted evaluation functions (:class:`Built`), nothing compiled; the one place that asks
jax for its devices and checks every shape and the batch against the mesh (:func:`build`)."""

import dataclasses
import functools
import math

from jphantom.config.sections import ModelConfig, ParallelConfig, StepConfig, TrainConfig
from jphantom.errors import ConfigError
from jphantom.registry.strategies import get as get_strategy


def build(config) -> "Built":
    """What ``config`` runs, built (:meth:`RunConfig.build`): the explicit step between the
    configuration (data) and the work."""
    return config.build()


@dataclasses.dataclass(frozen=True)
class Built:
    """What a run builds before it reads data: the program, the jax mesh, the step (a
    :class:`jphantom.TrainStep`), its jitted evaluation functions and the batch shardings."""

    program: object
    mesh: object
    step: object
    loss: object
    metrics: object | None
    shardings: tuple


def pipeline_of(parallel: ParallelConfig, train: TrainConfig, program=None):
    """The pipeline of the mesh's ``stage`` axis (:meth:`RunConfig.pipeline`)."""
    from jphantom.pipeline.config import pipeline_for

    mesh = program.mesh if program is not None else parallel.mesh_config()
    return pipeline_for(mesh, train.batch, schedule=parallel.schedule,
                        microbatches=parallel.microbatches,
                        virtual_stages=parallel.virtual_stages,
                        unroll_layers=parallel.unroll_layers,
                        accumulate_grads_in=parallel.accumulate_grads_in)


def pipeline_summary(pipeline, mesh) -> dict:
    """What ``results.json`` and ``inspect`` report of a step's pipeline: the schedule, the
    micro-batches (per data rank), the virtual stages per device, the stages of ``mesh``, the
    most layers a chunk runs unrolled and the dtype the gradients are summed in."""
    return {"schedule": pipeline.schedule, "microbatches": pipeline.microbatches,
            "virtual_stages": pipeline.virtual_stages, "stages": mesh.size("stage"),
            "unroll_layers": pipeline.unroll_layers,
            "accumulate_grads_in": pipeline.accumulate_grads_in}


def optimizer_of(train: TrainConfig, step: StepConfig):
    """The run's optax optimizer, assembled here alone: the schedule's rule
    (:meth:`TrainConfig.optimizer_transform`), clipped, the gradient norm recorded, as the
    sections say (:meth:`RunConfig.optimizer`); the step drops a non-finite update under
    ``--on-nonfinite skip`` (:func:`train_step_of`)."""
    import optax

    optimizer = train.optimizer_transform()
    if step.clip_norm is not None:  # exact: the update sees the global gradients
        optimizer = optax.chain(optax.clip_by_global_norm(step.clip_norm), optimizer)
    if train.grad_norm:  # the norm before clipping, as Megatron and torchtitan log it
        from jphantom.costs.metrics import record_grad_norm
        optimizer = optax.chain(record_grad_norm(), optimizer)
    return optimizer


def train_step_of(config, program, mesh, optimizer):
    """The :class:`jphantom.TrainStep` of ``program`` with ``config``'s step options and its
    ``--on-nonfinite``, which the Trainer applies (``watch=False``:
    :mod:`jphantom.loop.nonfinite` judges each loss; the step drops a bad update under
    ``skip``)."""
    return program.train_step(mesh, optimizer, zero=config.step.zero,
                              accumulate=config.step.accumulate,
                              precision=config.step.precision, remat=config.step.step_remat,
                              master_weights=config.step.master_weights,
                              pipeline=pipeline_of(config.parallel, config.train, program),
                              attention=config.step.attention,
                              on_nonfinite=config.train.on_nonfinite, watch=False)


@functools.lru_cache(maxsize=16)
def build_cached(model: ModelConfig, parallel: ParallelConfig, step: StepConfig,
                 train: TrainConfig, devices: tuple) -> Built:
    """:meth:`RunConfig.build` of the sections on ``devices``, once per process for the same
    sections and devices."""
    from jphantom.registry import program as programs

    mesh_config = parallel.mesh_config()
    if mesh_config.device_count > len(devices):
        raise ConfigError(f"mesh {mesh_config} needs {mesh_config.device_count} devices but "
                          f"{len(devices)} are available: pass --devices "
                          f"{mesh_config.device_count} to simulate them on CPU, or a smaller "
                          "mesh")
    used = devices[:mesh_config.device_count]
    idle = sorted({d.process_index for d in devices} - {d.process_index for d in used})
    if idle:  # a process with no device of the mesh has no part of the step to run
        processes = len({d.process_index for d in devices})
        raise ConfigError(f"mesh {mesh_config} uses {len(used)} of the {len(devices)} devices of "
                          f"{processes} processes; process(es) {', '.join(map(str, idle))} hold "
                          "none of them: give the mesh every process's devices, or start fewer "
                          "processes")
    options = {}
    if parallel.sequence_parallel:
        options["sequence_parallel"] = True
    if parallel.dtd:
        options["dtd"] = True
    if parallel.collective_matmul:
        options["collective_matmul"] = True
    if parallel.mesh_config().size("context") > 1:
        options["context_attention"] = parallel.context_attention
        options["load_balance"] = parallel.load_balance
    if model.family.program == "lm" and get_strategy(parallel.strategy).needs_ghost_width:
        options["ghost_width"] = model.ghost_width  # LlamaConfig holds no k: the plan takes it
    if model.from_hf:
        from jphantom.models import hf
        options["model"] = hf.load(model.from_hf)
    program = programs.build(model.family_config(parallel.strategy), parallel.strategy,
                             mesh_config, **options)
    mesh = program.mesh.build(devices[:program.mesh.device_count])
    config = _Sections(model, parallel, step, train)
    train_step = train_step_of(config, program, mesh, optimizer_of(train, step))
    _check_batch(train.batch, train_step, program.mesh)
    metrics = None
    if program.metrics_fn is not None and train_step.pipeline is None:
        metrics = train_step.metrics(program.metrics_fn)
    return Built(program, mesh, train_step, train_step.loss(), metrics,
                 train_step.batch_shardings(2))


def _check_batch(batch: int, train_step, mesh) -> None:
    """The global ``batch`` splits evenly over the mesh axes its rows are split on (``data``;
    ``expert`` / ``z`` where the model has them) and each rank's share over the accumulation
    micro-batches (a pipeline's micro-batches: :func:`jphantom.pipeline.runner.pipeline_for`)."""
    spec = train_step.batch_shardings(2)[0].spec  # (inputs, targets): rows split alike
    rows = spec[0] if len(spec) else None
    axes = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    ranks = math.prod(mesh.size(a) for a in axes)
    if batch % ranks:
        named = " x ".join(axes)
        word = "axis" if len(axes) == 1 else "axes"
        raise ConfigError(f"batch={batch} is not divisible by the {named} {word} ({ranks}) of mesh "
                          f"{mesh}: every {named} rank takes batch/{ranks} rows; pick a multiple "
                          f"of {ranks}")
    if train_step.pipeline is None and (batch // ranks) % train_step.accumulate:
        raise ConfigError(f"the per-data-rank batch {batch // ranks} is not divisible by "
                          f"accumulate={train_step.accumulate} (batch={batch} over {ranks} "
                          f"rank(s)): pick a batch that is a multiple of "
                          f"{ranks * train_step.accumulate}")


@dataclasses.dataclass(frozen=True)
class _Sections:
    model: ModelConfig
    parallel: ParallelConfig
    step: StepConfig
    train: TrainConfig
