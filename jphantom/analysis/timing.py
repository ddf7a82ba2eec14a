"""Timing compiled training steps side by side: build a strategy's step on a mesh, run several
round-robin so that load from other processes on the machine hits all of them alike.

Used by ``benchmarks/phantom_vs_tp.py`` and the fixed-iteration experiment (seed 000 Fig. 5). Times are
wall-clock medians of calls ended by ``block_until_ready``; compilation is excluded.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jphantom import strategies
from jphantom.analysis.hlo import collectives, summarize
from jphantom.analysis.inspect import xla_flops
from jphantom.train import make_train_step


class Runner:
    """One compiled computation and its state; ``run()`` executes it once, blocks, returns seconds."""

    def __init__(self, name, compiled, state, *, threads_state, flops_per_device, devices):
        self.name = name
        self.compiled = compiled
        self.state = state
        self.threads_state = threads_state  # a step: outputs (params, opt_state) feed the next call
        self.flops_per_device = flops_per_device
        self.devices = devices
        self.times: list[float] = []

    def run(self) -> float:
        start = time.perf_counter()
        out = self.compiled(*self.state)
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
        if self.threads_state:
            params, opt_state, _ = out
            self.state = (params, opt_state, *self.state[2:])
        return elapsed


def build_step(name: str, mesh: Mesh, *, width: int, depth: int, ghost_width: int | None,
               batch: int, learning_rate: float, key: jax.Array, label: str | None = None,
               axis: str = "model"):
    """Initialise, place and compile one strategy's SGD training step on ``mesh``.

    Returns ``(Runner, report)``; the report has the parameter count, XLA's per-device FLOPs, the
    compiled HLO's collectives (exact bytes per device) and the compile time.
    """
    strategy = strategies.get(name)
    p = mesh.shape[axis]
    k_params, k_x, k_y = jax.random.split(key, 3)
    params = strategy.init(k_params, width=width, depth=depth, num_shards=p,
                           ghost_width=ghost_width, dtype=jnp.float32)
    params = strategy.place(params, mesh, axis)
    optimizer = optax.sgd(learning_rate)
    opt_state = optimizer.init(params)
    sharding = strategy.input_sharding(mesh, axis)
    x = jax.device_put(jax.random.normal(k_x, (batch, width), jnp.float32), sharding)
    y = jax.device_put(jax.random.normal(k_y, (batch, width), jnp.float32), sharding)
    step = make_train_step(strategy, mesh, optimizer, axis=axis)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, x, y).compile()
    compile_seconds = time.perf_counter() - start
    found = collectives(compiled.as_text())
    flops = xla_flops(compiled)
    report = {
        "strategy": name,
        "batch": batch,
        "params": strategies.param_count(name, width=width, depth=depth, num_shards=p,
                                         ghost_width=ghost_width),
        "flops_per_device": flops,
        "flops_step": flops * p,
        "collective_bytes_per_device": sum(c.bytes for c in found),
        "collectives": summarize(found),
        "compile_seconds": compile_seconds,
    }
    runner = Runner(label or name, compiled, (params, opt_state, x, y), threads_state=True,
                    flops_per_device=flops, devices=p)
    return runner, report


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
