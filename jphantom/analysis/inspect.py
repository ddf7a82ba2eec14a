"""Compile one training step (forward + backward + optimizer update) and report what it does.

The step is the one ``train`` runs for the same :class:`jphantom.config.RunConfig` (one
``jax.jit`` of one ``shard_map`` over the mesh, e.g. ``data=2,model=4``), built and validated the
same way. From the compiled executable: every collective (kind, shape, dtype,
bytes, replica groups, the mesh axes it spans, and how many times it runs per step: layers under
``lax.scan`` run inside an HLO loop, whose trip count multiplies) parsed from the optimized HLO,
GEMM FLOPs from the HLO's ``dot`` ops (trip counts applied; ``cost_analysis()`` counts a loop body
once and is reported next to them), memory from ``memory_analysis()``; plus the model's parameter
count, and the per-device bytes of the parameters, gradients and optimizer state from their
shardings (what ZeRO shards over ``data``). Nothing is executed, and parameters are abstract, so
large widths inspect without allocating them.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from jphantom.analysis.hlo import collectives, dot_flops, normalise_replica_groups, summarize
from jphantom.config import RunConfig, pipeline_summary
from jphantom.errors import ConfigError
from jphantom.mesh import first_devices


def build(config: RunConfig, optimizer=None):
    """The run's program, jax mesh and :class:`jphantom.TrainStep` (nothing compiled): what
    ``train`` builds, validated the same way."""
    program = config.program()
    mesh = program.mesh.build(first_devices(program.mesh.device_count))
    return program, mesh, config.train_step(program, mesh, optimizer)


def abstract_batch(config: RunConfig, program, step) -> tuple:
    """``ShapeDtypeStruct``s of the batch with their shardings: FFN rows of ``width`` features,
    language models ``[batch, seq_len]`` token ids (inputs and targets)."""
    if config.model.name == "ffn":
        shape, dtype = (config.train.batch, config.model.width), config.model.dtype
    else:
        seq = min(config.model.seq_len, getattr(program.config, "seq_len", config.model.seq_len))
        shape, dtype = (config.train.batch, seq), "int32"
    return tuple(jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=s)
                 for s in step.batch_shardings(2))


def normalise_collectives(found):
    """``found`` with :func:`normalise_replica_groups` applied to every collective's groups, so
    that ``hlo.summarize(found, axes=...)`` can map GSPMD's collectives onto mesh axes too."""
    return [dataclasses.replace(c, replica_groups=normalise_replica_groups(c.replica_groups))
            for c in found]


def compile_step(config: RunConfig, optimizer=None):
    """Lower and compile the run's training step on abstract parameters; returns ``(compiled,
    seconds_to_compile)``."""
    program, mesh, step = build(config, optimizer)
    return compile_built(config, program, step)


def compile_built(config, program, step, compiler_options: dict | None = None):
    """Lower and compile ``step`` (of ``program``, built for ``config``) on abstract parameters
    and batch, with XLA's ``compiler_options`` (flag name -> value, for this compilation alone:
    :func:`jphantom.gpu_defaults.compiler_options`); returns ``(compiled,
    seconds_to_lower_and_compile)``."""
    start = time.perf_counter()
    lowered = step.lower(step.abstract_state(), *abstract_batch(config, program, step))
    compiled = lowered.compile(compiler_options=compiler_options) if compiler_options else \
        lowered.compile()
    return compiled, time.perf_counter() - start


def xla_flops(compiled) -> float:
    """FLOPs of a compiled executable as XLA's ``cost_analysis()`` counts them (per device for an
    SPMD program; element-wise work included). XLA counts the body of a ``while`` loop once,
    whatever its trip count, so for layers under ``lax.scan`` this undercounts: use
    :func:`gemm_flops` for a step's FLOPs."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def gemm_flops(compiled) -> int:
    """GEMM FLOPs per device of a compiled executable, every ``dot`` counted as many times as its
    loop runs (``hlo.dot_flops``; 2 per multiply-add, element-wise work left out)."""
    return dot_flops(compiled.as_text())[0]


_MEMORY_FIELDS = ("argument", "output", "temp", "alias", "generated_code")


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes from ``compiled.memory_analysis()``: ``temp_bytes`` (XLA's scratch: the
    activations, residuals and buffers live during the step), ``argument_bytes`` (parameters,
    optimizer state, batch), ``output_bytes``, ``alias_bytes`` (outputs sharing an argument's
    buffer) and ``generated_code_bytes``; also under XLA's own names (``temp_size_in_bytes``...).
    Empty where the backend reports nothing."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    values = {field: int(getattr(stats, f"{field}_size_in_bytes", 0)) for field in _MEMORY_FIELDS}
    return ({f"{field}_bytes": value for field, value in values.items()}
            | {f"{field}_size_in_bytes": value for field, value in values.items()})


def per_device_bytes(structs) -> int:
    """Bytes one device holds of a tree of sharded abstract arrays: per leaf, its shard's size
    (``sharding.shard_shape``) times its item size."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(structs))


def state_bytes(step) -> dict[str, int]:
    """Per-device bytes of the training state from its shardings: ``params_bytes``,
    ``gradient_bytes`` (the gradients the optimizer sees: the parameters' layout for ZeRO 0 and 1,
    whose all-reduce leaves the whole gradient on every data rank, ZeRO-sharded for ZeRO 2 and 3),
    ``optimizer_bytes`` (the optimizer's state: 0 for SGD) and ``zero``."""
    from jax.sharding import NamedSharding

    state = step.abstract_state()
    grads = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(step.mesh, spec))
             for a, spec in zip(step.layout.shapes, step.grad_specs)]
    out = {"params_bytes": per_device_bytes(state.params), "gradient_bytes": per_device_bytes(grads),
           "optimizer_bytes": per_device_bytes(state.opt_state), "zero": step.zero}
    out["model_state_bytes"] = sum(out[k] for k in ("params_bytes", "gradient_bytes",
                                                    "optimizer_bytes"))
    out.update(zero_formula_bytes(step, state.params))
    return out


def zero_formula_bytes(step, params) -> dict[str, float]:
    """ZeRO's model-state bytes per device for Adam (Cheng et al. Sec. 1.4, Table 1), with P the
    parameters per model-parallel rank (the ``data`` axis aside) and N the data-parallel degree:
    Cheng et al.'s mixed-precision figures (2-byte parameters and gradients, 12 bytes of float32
    master weights and moments): 16P, 4P + 12P/N, 2P + 14P/N, 16P/N; and jphantom's, whose float32
    parameters are the master weights (no separate copy: the compute dtype is a cast inside the
    step): 4P parameters + 4P gradients + 8P moments = 16P, 8P + 8P/N, 4P + 12P/N, 16P/N. Only
    meaningful for Adam-like optimizers (two moments)."""
    n = dict(step.mesh.shape).get("data", 1)
    per_rank = sum(math.prod(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(params))
    p = per_rank * (n if step.zero == 3 else 1)  # the parameters a rank holds without ZeRO-3
    seed001 = {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}
    ours = {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}
    return {"model_state_formula_bytes": ours[step.zero],
            "seed001_formula_bytes": seed001[step.zero], "data_parallel": n,
            "params_per_model_rank": p}


def inspect_step(config: RunConfig, optimizer=None) -> dict:
    """Report for one run's step: ``collectives`` (rows ``{kind, axes, count, bytes}`` per
    collective kind and mesh axes, loop trip counts applied), ``collective_bytes`` (per device,
    whole step), ``collective_ops`` (every op with its shapes, groups, axes and executions per
    step), ``flops`` (GEMM FLOPs per device, loops counted by trip count: :func:`gemm_flops`),
    ``xla_flops`` (XLA's ``cost_analysis()``: element-wise work included, loop bodies counted
    once), ``params`` (weights), ``memory`` (:func:`compiled_memory`: ``temp_bytes``,
    ``argument_bytes``, ``output_bytes``, ``alias_bytes``..., and from the shardings
    :func:`state_bytes`), compile time, and on a mesh with a ``stage`` axis ``pipeline``
    (schedule, micro-batches, virtual stages, stages)."""
    from jphantom.analysis.memory import check_run

    program, mesh, step = build(config, optimizer)
    check_run(config, program, step)  # refuse what cannot fit before compiling it
    compiled, compile_seconds = compile_built(config, program, step)
    found = normalise_collectives(collectives(compiled.as_text()))
    axes = dict(mesh.shape)
    report = {
        "strategy": config.parallel.strategy,
        "mesh": str(program.mesh),
        "config": config.flat(),
        "collectives": [row | {"axes": list(row["axes"])} for row in summarize(found, axes=axes)],
        "collective_bytes": sum(c.total_bytes for c in found if not c.trivial),
        "collective_ops": [
            {"kind": c.kind, "shapes": [[d, list(s)] for d, s in c.shapes], "bytes": c.bytes,
             "count": c.count, "axes": list(c.mesh_axes(axes)), "replica_groups": c.replica_groups}
            | ({"source_target_pairs": c.source_target_pairs}
               if c.kind == "collective-permute" else {})
            for c in found
        ],
        "flops": gemm_flops(compiled),
        "xla_flops": xla_flops(compiled),
        "params": program.param_count,
        "memory": compiled_memory(compiled) | state_bytes(step),
        "compile_seconds": compile_seconds,
    }
    if step.pipeline is not None:
        report["pipeline"] = pipeline_summary(step.pipeline, program.mesh)
    report["notes"] = _notes(config, found, mesh)
    return report


def _notes(config: RunConfig, found, mesh) -> list[str]:
    """What the reader of the report must know: a CPU compile of 16-bit collectives runs them in
    float32 (XLA:CPU upcasts them), so their bytes are the CPU program's, twice the model's."""
    notes = []
    sixteen = (config.step.precision in ("bf16", "float16")
               or config.model.dtype in ("bfloat16", "float16"))
    platform = next(iter(mesh.devices.flat)).platform
    if sixteen and platform == "cpu" and any(dtype == "f32" for c in found
                                             for dtype, _ in c.shapes):
        notes.append("16-bit compute on XLA:CPU: the collectives of 16-bit activations run in "
                     "float32 here (the CPU backend upcasts them), twice the bytes a GPU or TPU "
                     "compile moves; the bytes above are the CPU program's")
    return notes


def _state_megabytes(report: dict) -> float:
    memory = report["memory"]
    return sum(memory.get(key, 0) for key in ("params_bytes", "gradient_bytes",
                                              "optimizer_bytes")) / 1e6


def format_report(reports: list[dict]) -> str:
    """Side-by-side table of several :func:`inspect_step` reports (``state MB``: parameters,
    gradients and optimizer state per device, :func:`state_bytes`)."""
    lines = []
    mesh_width = max([16, *(len(r["mesh"]) + 2 for r in reports)])
    kind_width = max([16, *(len(op["kind"]) + 2 for r in reports for op in r["collective_ops"])])
    header = (f"{'strategy':<16}{'mesh':<{mesh_width}}{'params':>12}{'GFLOP/dev':>11}"
              f"{'coll. MB/dev':>13}{'temp MB':>9}{'state MB':>10}  collectives (executions x "
              "kind [mesh axes])")
    lines.append(header)
    lines.append("-" * (len(header) + 10))
    for r in reports:
        colls = ", ".join(f"{c['count']}x {c['kind']} [{','.join(c['axes'])}] "
                          f"({c['bytes'] / 1e6:.3f} MB)" for c in r["collectives"])
        lines.append(
            f"{r['strategy']:<16}{r['mesh']:<{mesh_width}}{r['params']:>12,}"
            f"{r['flops'] / 1e9:>11.3f}{r['collective_bytes'] / 1e6:>13.3f}"
            f"{r['memory'].get('temp_bytes', 0) / 1e6:>9.1f}{_state_megabytes(r):>10.2f}"
            f"  {colls or 'none'}"
        )
    lines.append("")
    lines.append("Per collective op (result shape per device, executions per step):")
    for r in reports:
        for op in r["collective_ops"]:
            shapes = " + ".join(f"{d}{s}" for d, s in op["shapes"])
            peers = (f"pairs={op['source_target_pairs']}" if "source_target_pairs" in op
                     else f"groups={op['replica_groups']}")
            lines.append(f"  {r['strategy']:<16}{op['kind']:<{kind_width}}{shapes:<28}"
                         f"{op['bytes']:>12,} B x{op['count']:<4} [{','.join(op['axes'])}]"
                         f"  {peers}")
    return "\n".join(lines)


def breakdown(config: RunConfig, *, steps: int = 5, warmup: int = 2) -> dict:
    """Cheng et al.'s bottom-up breakdown of one step (Sec. 3.1, Eqs. 2-4): the median time of the
    step (``t_iter``) and of the same step compiled without its data-parallel reductions
    (``t_compute``: ``communicate=False``), measured side by side; ``t_comm = t_iter - t_compute``
    and the shares ``r_compute``, ``r_comm``; and the Eq. 26 cost (Seal et al. Table III, Frontier)
    of the step's collectives over ``data``, modelled. Only the ``data`` reductions are removed:
    collectives over ``model`` stay in ``t_compute``. Needs the shard_map step without ZeRO; it
    initialises and runs the step (unlike the rest of ``inspect``)."""
    from jphantom.analysis.timing import Runner, time_round_robin
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
    runners = []
    for label, communicate in (("step", True), ("compute", False)):
        measured = program.train_step(mesh, config.optimizer(), zero=0,
                                      accumulate=config.step.accumulate,
                                      precision=config.step.precision,
                                      remat=config.step.step_remat,
                                      pipeline=config.pipeline(program), communicate=communicate,
                                      attention=config.step.attention)
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
