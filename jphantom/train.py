"""One jitted training step (forward, backward, optax update) for any strategy and mesh, and a loop
that trains to a target held-out loss (seed 000's fixed-loss experiments)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from tqdm.auto import tqdm

from jphantom import strategies
from jphantom.data import Teacher, TeacherConfig
from jphantom.errors import ConfigError, TrainingDiverged
from jphantom.mesh import make_mesh
from jphantom.strategies import Strategy


def mse(prediction: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over batch and features (seed 000's loss). On feature-sharded outputs the
    mean is the only cross-device reduction of the step: one scalar all-reduce."""
    return jnp.mean(jnp.square(prediction - target))


def make_loss_fn(strategy: Strategy, mesh: Mesh | None, axis: str = "model") -> Callable:
    def loss_fn(params, x, y):
        return mse(strategy.apply(params, x, mesh, axis), y)

    return loss_fn


def make_train_step(
    strategy: Strategy,
    mesh: Mesh | None,
    optimizer: optax.GradientTransformation,
    *,
    axis: str = "model",
    donate: bool = True,
) -> Callable:
    """``step(params, opt_state, x, y) -> (params, opt_state, loss)``, jitted.

    Params keep the sharding they were placed with (``strategy.place``); for sharded strategies every
    parameter is owned by exactly one device, so the optimizer update is local.
    """
    loss_fn = make_loss_fn(strategy, mesh, axis)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


# --------------------------------------------------------------------------------------------------
# Training to a target loss (seed 000's fixed-loss experiments, Table I)
# --------------------------------------------------------------------------------------------------

OPTIMIZERS = {"sgd": optax.sgd, "adam": optax.adam}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run of the teacher task. Validated on construction."""

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
    axis: str = "model"

    def __post_init__(self):
        strategies.get(self.strategy)
        for name in ("width", "depth", "num_shards", "batch", "max_steps", "eval_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}; use one of {sorted(OPTIMIZERS)}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ConfigError(f"learning_rate={self.learning_rate} must be a positive number")
        if self.target_loss is not None and not self.target_loss > 0:
            raise ConfigError(f"target_loss={self.target_loss} must be > 0 (or None to run max_steps)")
        if strategies.get(self.strategy).uses_ghost_width and self.ghost_width is None:
            raise ConfigError(f"strategy {self.strategy!r} needs ghost_width")


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


def train(config: TrainConfig, teacher: Teacher | None = None, *, metrics_path=None,
          progress: bool = False, meter=None) -> TrainResult:
    """Train ``config.strategy`` on the teacher until ``target_loss`` (held-out MSE, checked every
    ``eval_every`` steps) or ``max_steps``. Raises :class:`TrainingDiverged` naming the step on a
    NaN/inf loss. ``metrics_path`` gets one JSON line per step (and per evaluation).

    ``meter`` (e.g. :class:`jphantom.energy.NvmlPowerMeter`): started after the first step has
    finished (compilation and runtime start-up excluded, as seed 000 excludes initialisation) and
    stopped after the last; its window spans the remaining steps and their held-out evaluations.
    The result's ``energy`` and ``metered_steps`` give joules per step."""
    strategy = strategies.get(config.strategy)
    dtype = jnp.dtype(config.dtype)
    teacher = teacher or Teacher(TeacherConfig(width=config.width, seed=config.seed), dtype)
    if teacher.config.width != config.width:
        raise ConfigError(f"teacher width {teacher.config.width} != model width {config.width}")
    mesh = None if strategy.single_device else make_mesh({config.axis: config.num_shards})
    sharding = strategy.input_sharding(mesh, config.axis)
    params = strategy.init(jax.random.PRNGKey(config.seed + 1), width=config.width,
                           depth=config.depth, num_shards=config.num_shards,
                           ghost_width=config.ghost_width, dtype=dtype)
    params = strategy.place(params, mesh, config.axis)
    optimizer = OPTIMIZERS[config.optimizer](config.learning_rate)
    opt_state = optimizer.init(params)
    loss_fn = jax.jit(make_loss_fn(strategy, mesh, config.axis))

    start = time.perf_counter()
    x, y = teacher.train_batch(0, config.batch, sharding)
    step = make_train_step(strategy, mesh, optimizer, axis=config.axis).lower(
        params, opt_state, x, y).compile()
    compile_seconds = time.perf_counter() - start

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
    finally:
        bar.close()
        if sink:
            sink.close()
        if meter_running:
            measurement = meter.stop()
            result.energy = measurement if result.metered_steps else None
    return result
