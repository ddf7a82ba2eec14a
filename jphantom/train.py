"""Training to a target held-out loss on seed 000's teacher task (the fixed-loss experiments).

A run is a :class:`TrainConfig` (validated on construction: it builds the strategy's program, so an
impossible shape fails before anything runs); :func:`train` builds the mesh, initialises the
parameters directly in their shards and runs :func:`jphantom.step.make_train_step`'s one jitted
``shard_map`` per step until the held-out MSE reaches ``target_loss`` or ``max_steps``.

Optimizers: ``sgd`` and ``adam`` (optax). In float16, Adam's default epsilon 1e-8 underflows to 0
(float16's smallest subnormal is 6e-8) and its update divides by zero where a gradient's second
moment underflows too, so float16 runs use ``eps=1e-4`` (:data:`FLOAT16_ADAM_EPS`), the usual
mixed-precision choice; the other dtypes keep optax's default.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from tqdm.auto import tqdm

from jphantom import strategies
from jphantom.analysis.memory import OPTIMIZER_STATES, check_fits, estimate_training_memory
from jphantom.data import Teacher, TeacherConfig
from jphantom.errors import ConfigError, TrainingDiverged, check_int
from jphantom.mesh import MeshConfig, first_devices, model_mesh
from jphantom.models.ffn import DTYPES, FFNConfig, mse  # noqa: F401  (re-exported)
from jphantom.step import (  # noqa: F401  (re-exported: the one train step of jphantom)
    make_loss_fn,
    make_train_step,
    optimizer_state_specs,
)

OPTIMIZERS = ("sgd", "adam")
FLOAT16_ADAM_EPS = 1e-4


def make_optimizer(name: str, learning_rate: float, dtype: str = "float32"):
    """``optax.sgd`` or ``optax.adam`` at ``learning_rate``; Adam in float16 with a safe epsilon
    (module docstring)."""
    if name == "sgd":
        return optax.sgd(learning_rate)
    if name == "adam":
        return optax.adam(learning_rate, eps=FLOAT16_ADAM_EPS) if dtype == "float16" \
            else optax.adam(learning_rate)
    raise ConfigError(f"optimizer={name!r}; use one of {OPTIMIZERS}")


def init_optimizer_state(program, mesh, optimizer, params):
    """``optimizer.init(params)`` with every moment in its parameter's shards (jit, out_shardings)."""
    specs = optimizer_state_specs(optimizer, jax.eval_shape(lambda: params), program.state_specs)
    return jax.jit(optimizer.init, out_shardings=program.shardings(mesh, specs))(params)


# --------------------------------------------------------------------------------------------------
# Training to a target loss (seed 000's fixed-loss experiments, Table I)
# --------------------------------------------------------------------------------------------------


def _check_positive_real(name, value, fix):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not value > 0:
        raise ConfigError(f"{name}={value!r} must be a finite number > 0; {fix}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run of the teacher task. Validated on construction.

    ``mesh`` is a mesh string (``"data=2,model=4"``); the default is ``model=<num_shards>``
    (``dense`` runs on ``model=1``, the default ``num_shards``). With a mesh, ``num_shards`` is its ``model`` size (give one or the
    other, or both consistently). ``ghost_width`` is required by the phantom strategies and ignored
    by the others.
    """

    strategy: str
    width: int
    depth: int = 2
    num_shards: int = 1
    ghost_width: int | None = None
    batch: int = 64
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    max_steps: int = 1000
    target_loss: float | None = None
    eval_every: int = 10
    seed: int = 0
    dtype: str = "float32"
    mesh: str | None = None

    def __post_init__(self):
        strategy = strategies.get(self.strategy)
        for name in ("width", "depth", "num_shards", "batch", "max_steps", "eval_every"):
            check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        if self.ghost_width is not None:
            check_int("ghost_width", self.ghost_width, 1)
        if strategy.family == "phantom" and self.ghost_width is None:
            raise ConfigError(f"strategy {self.strategy!r} needs ghost_width (k of seed 000), "
                              "e.g. ghost_width=16")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}; use one of {OPTIMIZERS}")
        _check_positive_real("learning_rate", self.learning_rate, "e.g. 1e-3")
        if self.target_loss is not None:
            _check_positive_real("target_loss", self.target_loss,
                                 "give a held-out MSE to reach, or None to run max_steps")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {DTYPES}")
        mesh = self.mesh_config()
        object.__setattr__(self, "num_shards", mesh.size("model"))
        data = mesh.size("data")
        if self.batch % data:
            raise ConfigError(f"batch={self.batch} is not divisible by the data axis ({data}) of "
                              f"mesh {mesh}: every data rank takes batch/{data} samples")
        self.program()  # the strategy validates the shapes (width divisible, dense on one device)

    def mesh_config(self) -> MeshConfig:
        return model_mesh(self.mesh, self.num_shards)

    def model_config(self) -> FFNConfig:
        phantom = strategies.get(self.strategy).family == "phantom"
        return FFNConfig(width=self.width, depth=self.depth,
                         ghost_width=self.ghost_width if phantom else None, dtype=self.dtype)

    def program(self):
        return strategies.get(self.strategy).program(self.model_config(), self.mesh_config())


@dataclasses.dataclass
class TrainResult:
    config: TrainConfig
    train_losses: list[float]
    eval_steps: list[int]
    eval_losses: list[float]
    iterations_to_target: int | None
    step_seconds: list[float]  # wall time of each step after the compiled one, start-up excluded
    compile_seconds: float
    energy: object | None = None  # a PowerMeasurement when train() got a meter
    metered_steps: int = 0  # steps inside the metered window

    @property
    def joules_per_step(self) -> float | None:
        """Metered energy per step (all metered devices), or None without a meter."""
        if self.energy is None or self.metered_steps == 0:
            return None
        return self.energy.joules / self.metered_steps

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(self.step_seconds) if self.step_seconds else float("nan")

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["median_step_seconds"] = self.median_step_seconds
        return out


def evaluate(loss_fn, params, teacher: Teacher, batch: int, sharding) -> float:
    """Mean held-out MSE over the whole eval split."""
    total, count = 0.0, 0
    for x, y in teacher.eval_batches(batch, sharding):
        total += float(loss_fn(params, x, y)) * x.shape[0]
        count += x.shape[0]
    return total / count


@dataclasses.dataclass(frozen=True)
class _Built:
    """What a run needs besides its seed: mesh, program, jitted init, optimizer, step and loss."""

    mesh: object
    program: object
    init: object
    optimizer: object
    step: object
    loss: object
    memory: dict


def check_memory(config: TrainConfig):
    """The run's mesh, program and per-device memory estimate; raises :class:`ConfigError` with
    the estimate when it cannot fit in the device memory (:mod:`jphantom.analysis.memory`).
    Nothing is allocated."""
    mesh_config = config.mesh_config()
    mesh = mesh_config.build(first_devices(mesh_config.device_count))
    program = config.program()
    memory = estimate_training_memory(program, mesh, config.model_config(), batch=config.batch,
                                      optimizer_states=OPTIMIZER_STATES[config.optimizer])
    check_fits(memory, mesh, f"training {config.strategy} at width={config.width}, depth="
                             f"{config.depth}, batch={config.batch} on mesh {mesh_config} with "
                             f"{config.optimizer}")
    return mesh, program, memory


@functools.lru_cache(maxsize=8)
def _build(key: TrainConfig) -> _Built:
    """Built once per configuration up to its seed, target and step counts (``key`` has them
    normalised), so that the seeds of a comparison share one compilation of each function."""
    mesh, program, memory = check_memory(key)
    optimizer = make_optimizer(key.optimizer, key.learning_rate, key.dtype)
    init = jax.jit(program.init, out_shardings=program.shardings(mesh))
    return _Built(mesh, program, init, optimizer, make_train_step(program, mesh, optimizer),
                  make_loss_fn(program, mesh), memory)


def train(config: TrainConfig, teacher: Teacher | None = None, *, metrics_path=None,
          progress: bool = False, meter=None) -> TrainResult:
    """Train ``config.strategy`` on the teacher until ``target_loss`` (held-out MSE, checked every
    ``eval_every`` steps) or ``max_steps``. Raises :class:`TrainingDiverged` naming the step on a
    NaN/inf loss, and :class:`ConfigError` before allocating anything when the step cannot fit in
    the device memory (:mod:`jphantom.analysis.memory`). ``metrics_path`` gets one JSON line per
    step (and per evaluation).

    ``meter`` (e.g. :class:`jphantom.energy.NvmlEnergyMeter`): started after the first step has
    finished (compilation and runtime start-up excluded, as seed 000 excludes initialisation) and
    stopped after the last, both after ``jax.block_until_ready``; its window spans the remaining
    steps and their held-out evaluations. Every process of a multi-process run must pass one: its
    ``stop()`` sums the processes' energies.
    The result's ``energy`` and ``metered_steps`` give joules per step."""
    dtype = jnp.dtype(config.dtype)
    teacher = teacher or Teacher(TeacherConfig(width=config.width, seed=config.seed), dtype)
    if teacher.config.width != config.width:
        raise ConfigError(f"teacher width {teacher.config.width} != model width {config.width}")
    data = config.mesh_config().size("data")
    if teacher.config.eval_size % config.batch % data:
        raise ConfigError(f"the last held-out batch has {teacher.config.eval_size % config.batch} "
                          f"samples, not divisible by the data axis ({data}): make eval_size a "
                          f"multiple of {data} or of batch={config.batch}")
    start = time.perf_counter()
    built = _build(dataclasses.replace(config, seed=0, target_loss=None, max_steps=1,
                                       eval_every=1))
    sharding = built.program.batch_shardings(built.mesh)[0]
    params = built.init(jax.random.PRNGKey(config.seed + 1))
    opt_state = init_optimizer_state(built.program, built.mesh, built.optimizer, params)
    x, y = teacher.train_batch(0, config.batch, sharding)
    step = built.step.lower(params, opt_state, x, y).compile()
    compile_seconds = time.perf_counter() - start
    loss_fn = built.loss

    result = TrainResult(config, [], [], [], None, [], compile_seconds)
    meter_running = False
    sink = open(metrics_path, "a") if metrics_path else None
    bar = tqdm(total=config.max_steps, desc=f"{config.strategy} p={config.num_shards}",
               disable=not progress, leave=False)
    try:
        for index in range(config.max_steps):
            x, y = teacher.train_batch(index, config.batch, sharding)
            jax.block_until_ready((x, y))
            tick = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, x, y)
            loss = float(loss)  # waits for the step
            if index > 0:  # the first call includes one-off runtime start-up
                result.step_seconds.append(time.perf_counter() - tick)
                if meter is not None:
                    result.metered_steps += 1
            elif meter is not None and config.max_steps > 1:
                jax.block_until_ready((params, opt_state))  # the window opens on an idle device
                meter.start()
                meter_running = True
            if not math.isfinite(loss):
                raise TrainingDiverged(
                    f"training loss is {loss} at step {index + 1} ({config.strategy}, "
                    f"learning_rate={config.learning_rate:g}): lower the learning rate or check the data")
            result.train_losses.append(loss)
            record = {"step": index + 1, "train_loss": loss}
            if (index + 1) % config.eval_every == 0 or index + 1 == config.max_steps:
                eval_loss = evaluate(loss_fn, params, teacher, config.batch, sharding)
                result.eval_steps.append(index + 1)
                result.eval_losses.append(eval_loss)
                record["eval_loss"] = eval_loss
                bar.set_postfix(eval_loss=f"{eval_loss:.4g}")
                if config.target_loss is not None and eval_loss <= config.target_loss:
                    result.iterations_to_target = index + 1
            if sink:
                sink.write(json.dumps(record) + "\n")
            bar.update()
            if result.iterations_to_target is not None:
                break
        if meter_running:
            jax.block_until_ready((params, opt_state))  # ... and closes once the work is done
    finally:
        bar.close()
        if sink:
            sink.close()
        if meter_running:
            measurement = meter.stop()
            result.energy = measurement if result.metered_steps else None
    return result
