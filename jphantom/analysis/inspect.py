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

from jphantom.analysis.compiled import (build, compile_built, compiled_memory, gemm_flops,
                                        normalise_collectives, state_bytes, xla_flops)
from jphantom.analysis.hlo import collectives, summarize
from jphantom.config import RunConfig, pipeline_summary


def inspect_step(config: RunConfig, optimizer=None, *, built=None) -> dict:
    """Report for one run's step: ``collectives`` (rows ``{kind, axes, count, bytes}`` per
    collective kind and mesh axes, loop trip counts applied), ``collective_bytes`` (per device,
    whole step), ``collective_ops`` (every op with its shapes, groups, axes and executions per
    step), ``flops`` (GEMM FLOPs per device, loops counted by trip count: :func:`gemm_flops`),
    ``xla_flops`` (XLA's ``cost_analysis()``: element-wise work included, loop bodies counted
    once), ``params`` (weights), ``memory`` (:func:`compiled_memory`: ``temp_bytes``,
    ``argument_bytes``, ``output_bytes``, ``alias_bytes``..., and from the shardings
    :func:`state_bytes`), compile time, and on a mesh with a ``stage`` axis ``pipeline``
    (schedule, micro-batches, virtual stages, stages). ``built``: :meth:`RunConfig.build`'s, where
    the caller has it."""
    from jphantom.analysis.memory import check_run

    program, mesh, step = build(config, optimizer, built)
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


