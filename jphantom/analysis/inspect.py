"""Compile one training step (forward + backward + SGD update) and report what it does.

From the compiled executable: every collective (kind, shape, dtype, bytes, replica groups) parsed
from the optimized HLO, FLOPs from ``cost_analysis()``, memory from ``memory_analysis()``; plus the
model's parameter count. Nothing is executed, and parameters are abstract, so large widths inspect
without allocating them.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jphantom import strategies
from jphantom.analysis.hlo import collectives, summarize
from jphantom.mesh import make_mesh
from jphantom.train import make_train_step


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What to compile: a strategy on a 1-D mesh of ``num_shards`` devices."""

    strategy: str
    width: int
    depth: int
    batch: int
    num_shards: int = 1
    ghost_width: int | None = None
    dtype: str = "float32"
    axis: str = "model"


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def compile_step(spec: StepSpec, optimizer: optax.GradientTransformation | None = None):
    """Lower and compile the training step of ``spec``; returns ``(compiled, seconds_to_compile)``."""
    strategy = strategies.get(spec.strategy)
    dtype = jnp.dtype(spec.dtype)
    mesh = None if strategy.single_device else make_mesh({spec.axis: spec.num_shards})
    shape_params = jax.eval_shape(lambda: strategy.init(
        jax.random.PRNGKey(0), width=spec.width, depth=spec.depth, num_shards=spec.num_shards,
        ghost_width=spec.ghost_width, dtype=dtype))
    if strategy.single_device:
        param_shardings = jax.tree.map(lambda _: strategy.input_sharding(None), shape_params)
    else:
        param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s),
                                       strategy.param_specs(shape_params, spec.axis))
    params = _abstract(shape_params, param_shardings)
    optimizer = optimizer or optax.sgd(0.1)
    opt_state = jax.eval_shape(optimizer.init, params)
    data_sharding = strategy.input_sharding(mesh, spec.axis)
    batch = jax.ShapeDtypeStruct((spec.batch, spec.width), dtype, sharding=data_sharding)
    step = make_train_step(strategy, mesh, optimizer, axis=spec.axis)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, batch, batch).compile()
    return compiled, time.perf_counter() - start


def xla_flops(compiled) -> float:
    """FLOPs of a compiled executable as XLA's ``cost_analysis()`` counts them (per device for an
    SPMD program; element-wise work included, see ``hlo.dot_flops`` for the GEMMs alone)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def _memory(compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    names = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
             "alias_size_in_bytes", "generated_code_size_in_bytes")
    return {name: int(getattr(stats, name, 0)) for name in names} if stats is not None else {}


def inspect_step(spec: StepSpec) -> dict:
    """Report for one strategy: ``collectives`` [{kind, count, bytes}], ``collective_ops``,
    ``flops`` (per device, as XLA counts them), ``params`` (weights), ``memory``, compile time."""
    compiled, compile_seconds = compile_step(spec)
    found = collectives(compiled.as_text())
    return {
        "strategy": spec.strategy,
        "config": dataclasses.asdict(spec),
        "collectives": summarize(found),
        "collective_bytes": sum(c.bytes for c in found),
        "collective_ops": [
            {"kind": c.kind, "shapes": [[d, list(s)] for d, s in c.shapes], "bytes": c.bytes,
             "replica_groups": c.replica_groups}
            for c in found
        ],
        "flops": xla_flops(compiled),
        "params": strategies.param_count(spec.strategy, width=spec.width, depth=spec.depth,
                                         num_shards=spec.num_shards, ghost_width=spec.ghost_width),
        "memory": _memory(compiled),
        "compile_seconds": compile_seconds,
    }


def format_report(reports: list[dict]) -> str:
    """Side-by-side table of several :func:`inspect_step` reports."""
    lines = []
    header = f"{'strategy':<16}{'params':>12}{'GFLOP/dev':>11}{'coll. MB/dev':>13}{'temp MB':>9}  collectives"
    lines.append(header)
    lines.append("-" * (len(header) + 30))
    for r in reports:
        colls = ", ".join(f"{c['count']}x {c['kind']} ({c['bytes'] / 1e6:.3f} MB)" for c in r["collectives"])
        lines.append(
            f"{r['strategy']:<16}{r['params']:>12,}{r['flops'] / 1e9:>11.3f}"
            f"{r['collective_bytes'] / 1e6:>13.3f}{r['memory'].get('temp_size_in_bytes', 0) / 1e6:>9.1f}"
            f"  {colls or 'none'}"
        )
    lines.append("")
    lines.append("Per collective op (result shape per device):")
    for r in reports:
        for op in r["collective_ops"]:
            shapes = " + ".join(f"{d}{s}" for d, s in op["shapes"])
            lines.append(f"  {r['strategy']:<16}{op['kind']:<16}{shapes:<28}{op['bytes']:>12,} B"
                         f"  groups={op['replica_groups']}")
    return "\n".join(lines)
