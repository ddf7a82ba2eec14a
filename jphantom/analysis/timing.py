"""Timing compiled training steps side by side: build a strategy's step on a mesh, run several
round-robin so that load from other processes on the machine hits all of them alike.

Used by the benchmarks (``benchmarks/*.py``) and the experiments that time steps (Seal et al. Fig. 5,
pipelines, pmm3d, Cheng et al.'s breakdown). Times are wall-clock medians of calls ended by
``block_until_ready``; compilation is excluded.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import numpy as np

from jphantom.registry import strategies
from jphantom.analysis.compiled import (abstract_batch, build, compiled_memory, gemm_flops,
                                        normalise_collectives, xla_flops)
from jphantom.analysis.hlo import collectives, summarize
from jphantom.config import RunConfig
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import mesh_config_of


class Runner:
    """One compiled computation and its state; ``run()`` executes it once, blocks, returns seconds."""

    def __init__(self, name, compiled, state, *, threads_state, flops_per_device, devices):
        self.name = name
        self.compiled = compiled
        self.state = state
        self.threads_state = threads_state  # a step: its output TrainState feeds the next call
        self.flops_per_device = flops_per_device
        self.devices = devices
        self.times: list[float] = []

    def run(self) -> float:
        start = time.perf_counter()
        out = self.compiled(*self.state)
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
        if self.threads_state:
            self.state = (out[0], *self.state[1:])
        return elapsed


def build_step(name: str, mesh: Mesh, *, width: int, depth: int, ghost_width: int | None,
               batch: int, learning_rate: float, key: jax.Array, label: str | None = None):
    """Initialise (directly in the shards) and compile one strategy's float32 SGD training step
    of Seal et al.'s FFN on ``mesh`` (e.g. ``model=8`` or ``data=2,model=4``).

    Returns ``(Runner, report)``; the report has the parameter count, the per-device GEMM FLOPs
    (``compiled.gemm_flops``: loops counted by trip count; XLA's own count next to it), the
    compiled HLO's collectives (exact bytes per device, loop trip counts applied, grouped by kind
    and mesh axes) and the compile time. Refuses (``ConfigError``) a step that cannot fit in the
    device memory, before allocating it.
    """
    from jphantom.analysis.memory import check_run
    from jphantom.config import RunConfig

    config = RunConfig.from_flags(
        model="ffn", strategy=name, mesh=str(mesh_config_of(mesh)), width=width, depth=depth,
        ghost_width=ghost_width if strategies.get(name).needs_ghost_width else None, batch=batch,
        optimizer="sgd", learning_rate=learning_rate, warmup_steps=0, out=None, progress=False)
    program, mesh, step = build(config)
    check_run(config, program, step)
    k_x, k_y = jax.random.split(key)
    x_sharding, y_sharding = step.batch_shardings(2)
    x = jax.device_put(jax.random.normal(k_x, (batch, width), jnp.float32), x_sharding)
    y = jax.device_put(jax.random.normal(k_y, (batch, width), jnp.float32), y_sharding)
    runner, report = build_program_step(program, step, (x, y), label=label or name,
                                        seed=int(jax.random.randint(key, (), 0, 2**30)))
    return runner, {"strategy": name, "batch": batch, **report}


def build_program_step(program, step, batch: tuple, *, label: str, seed: int = 0):
    """Initialise ``program``'s parameters in their shards for ``step`` (a
    :class:`jphantom.TrainStep`) and compile it on ``batch`` (arrays already placed); returns
    ``(Runner, report)`` with the mesh, parameter count, per-device GEMM FLOPs (loops by trip
    count), XLA's FLOPs, the HLO's collectives (bytes per device, trip counts applied) and the
    compile time."""
    state = program.init(step, seed=seed)
    start = time.perf_counter()
    compiled = step.lower(state, *batch).compile()
    compile_seconds = time.perf_counter() - start
    found = normalise_collectives(collectives(compiled.as_text()))
    flops = gemm_flops(compiled)
    devices = program.mesh.device_count
    report = {
        "mesh": str(program.mesh),
        "params": program.param_count,
        "flops_per_device": flops,
        "flops_step": flops * devices,
        "xla_flops_per_device": xla_flops(compiled),
        "collective_bytes_per_device": sum(c.total_bytes for c in found if not c.trivial),
        "collectives": summarize(found),
        "compile_seconds": compile_seconds,
        "memory": compiled_memory(compiled),
    }
    runner = Runner(label, compiled, (state, *batch), threads_state=True,
                    flops_per_device=flops, devices=devices)
    return runner, report


def build_run_step(config, batch: tuple, *, label: str, optimizer=None, seed: int = 0):
    """The training step of the run ``config`` (a :class:`jphantom.config.RunConfig`: its model
    under its strategy on its mesh, with its step options; ``optimizer`` in place of the run's
    when given), its parameters created in their shards from ``seed``, compiled on ``batch`` (host
    arrays, placed here in the step's batch shardings). Refuses (``ConfigError``) a step that
    cannot fit in the device memory before allocating it. Returns ``(Runner, report)`` as
    :func:`build_program_step`; ``runner.state`` is ``(TrainState, *batch)``."""
    from jphantom.analysis.memory import check_run

    program, mesh, step = build(config, optimizer)
    check_run(config, program, step)
    placed = tuple(jax.device_put(a, s) for a, s in zip(batch, step.batch_shardings(len(batch))))
    return build_program_step(program, step, placed, label=label, seed=seed)


def time_round_robin(runners: list[Runner], steps: int, warmup: int) -> dict[str, float]:
    """Warm every runner up, then ``steps`` rounds of one run each, rotating the order every round.
    Returns the median seconds per runner name (all times stay in ``runner.times``)."""
    for runner in runners:
        for _ in range(warmup):
            runner.run()
    for round_index in range(steps):
        shift = round_index % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            runner.times.append(runner.run())
    return {runner.name: statistics.median(runner.times) for runner in runners}


def breakdown(config: RunConfig, *, steps: int = 5, warmup: int = 2) -> dict:
    """Cheng et al.'s bottom-up breakdown of one step (Sec. 3.1, Eqs. 2-4): the median time of the
    step (``t_iter``) and of the same step compiled without its data-parallel reductions
    (``t_compute``: :mod:`jphantom.experimental.compute_only`), measured side by side; ``t_comm = t_iter - t_compute``
    and the shares ``r_compute``, ``r_comm``; and the Eq. 26 cost (Seal et al. Table III, Frontier)
    of the step's collectives over ``data``, modelled. Only the ``data`` reductions are removed:
    collectives over ``model`` stay in ``t_compute``. Needs the shard_map step without ZeRO; it
    initialises and runs the step (unlike the rest of ``inspect``)."""
    from jphantom.experimental.compute_only import make_compute_only_step
    from jphantom.perf.comm_model import FRONTIER

    program, mesh, step = build(config)
    if program.spmd != "shard_map" or config.step.zero:
        raise ConfigError("the breakdown compiles the step without its data reductions: use a "
                          "per-rank strategy (tensor or phantom) with --zero 0")
    rng = np.random.default_rng(0)
    batch = []
    for struct in abstract_batch(config, program, step):
        data = (rng.integers(0, config.model.vocab, struct.shape)
                if np.issubdtype(struct.dtype, np.integer) else rng.standard_normal(struct.shape))
        batch.append(jax.device_put(np.asarray(data, struct.dtype), struct.sharding))
    # the same step less its reductions (jphantom.experimental.compute_only)
    compute = make_compute_only_step(
        program.model, mesh, config.optimizer(), program.loss_fn,
        batch_specs=program.batch_specs, accumulate=config.step.accumulate,
        precision=config.step.precision, remat=config.step.step_remat,
        pipeline=config.pipeline(program), attention=config.step.attention,
        on_nonfinite=config.train.on_nonfinite, watch=False)
    runners = []
    for label, measured in (("step", step), ("compute", compute)):
        state = program.init(measured)
        runners.append(Runner(label, measured.lower(state, *batch).compile(),
                              (state, *batch), threads_state=True, flops_per_device=0,
                              devices=mesh.size))
    times = time_round_robin(runners, steps, warmup)
    t_iter, t_compute = times["step"], times["compute"]
    t_comm = max(t_iter - t_compute, 0.0)
    n = mesh.shape.get("data", 1)
    compiled = runners[0].compiled
    over_data = [c for c in normalise_collectives(collectives(compiled.as_text()))
                 if c.mesh_axes(dict(mesh.shape)) == ("data",)]
    modelled = FRONTIER.step_time_us(over_data, n) * 1e-6 if n > 1 and over_data else 0.0
    return {"t_iter": t_iter, "t_compute": t_compute, "t_comm": t_comm,
            "r_compute": t_compute / t_iter, "r_comm": t_comm / t_iter,
            "t_comm_eq26_frontier_modelled": modelled, "data": n, "steps": steps}
