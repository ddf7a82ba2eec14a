"""The planner's best layouts compiled for the target and re-ranked by what the compiler says
(``jphantom plan --compile-top K``): each plan row's run (:func:`plan_row_flags`), compiled
ahead of time (:func:`jphantom.costs.aot.compile_report`) and, with a time or energy objective,
simulated on the device (:mod:`jphantom.predict`) beside the plan's modelled figures."""

from __future__ import annotations

from jphantom.costs.aot import Target, compile_report
from jphantom.errors import ConfigError
from jphantom.perf.axonn_model import BLOCKS, GPT2_BLOCKS
from jphantom.planner.report import per_token


def plan_row_flags(row, shape: dict, batch: int, precision: str = "bf16") -> dict | None:
    """The run of one :class:`jphantom.planner.PlanRow` (``shape``: the plan's model assumptions,
    :class:`jphantom.perf.axonn_model.GPTShape` as a dict), as the :meth:`RunConfig.from_flags`
    names: the planner's model (its zoo family of the same sizes), float32
    parameters with ``precision`` compute (16 bytes of state per parameter with Adam, as the
    planner counts), per-layer activation checkpointing (``remat=nothing_saveable``: the
    planner's Korthikanti count of checkpointed activations). ``None`` for phantom rows (another
    model)."""
    if not row.same_model:
        return None
    kind = BLOCKS.get(shape.get("family"), GPT2_BLOCKS)
    flags = {"model": shape.get("model") or kind.name,
             "layers": shape["layers"],
             "hidden": shape["hidden"],
             "heads": shape["heads"], "seq_len": shape["seq_len"], "vocab": shape["vocab_size"],
             "batch": batch, "optimizer": "adamw", "dtype": "float32", "precision": precision,
             "remat": "nothing_saveable", "strategy": row.strategy,
             "mesh": ",".join(item for item in row.mesh.split(",") if not item.endswith("=1"))}
    if kind.sized:
        flags |= {"intermediate": shape["intermediate"], "kv_heads": shape["kv_heads"]}
    options = dict(row.options)
    for key in ("sequence_parallel", "zero", "schedule", "microbatches"):
        if key in options:
            flags[key] = options[key]
    return flags


def compile_plan(result, top: int, target: Target, *, devices: list | None = None,
                 progress=None, predict_on=None) -> list[dict]:
    """Compile the ``top`` best same-model layouts of a :class:`jphantom.planner.Ranking` for
    ``target`` and re-rank them by what the compiler says: layouts whose compiled peak fits the
    device first, then fewer collective bytes per device that cross nodes, then fewer in all.
    Each entry: the plan row, its run's flags, the compile report's memory and collectives (or
    ``error``: why jphantom refused to build it), and ``memory_ratio`` (modelled / compiled
    peak). With ``predict_on`` (a :class:`jphantom.predict.DeviceModel`) each compiled program is
    also simulated (``simulated``: step seconds, J/token, MFU...) beside the plan's modelled step
    and J/token, and the ranking is by the simulated figure of the plan's objective (``time``:
    step seconds, ``energy``: joules per token), compiled peak fits first."""
    a = result.assumptions
    rows = [row for row in result.rows if row.same_model][:top]
    devices = target.devices() if devices is None else devices
    out = []
    for row in rows:
        flags = plan_row_flags(row, a["model"], a["batch_sequences"],
                               "bf16" if a["precision"]["name"] == "bf16" else "float32")
        entry = {"plan_rank": row.rank, "layout": row.layout, "mesh": row.mesh,
                 "options": dict(row.options), "modelled_memory_bytes": row.memory["total"],
                 "modelled_comm_s": row.comm_s, "modelled_step_s": row.step_s,
                 "modelled_joules_per_token": row.joules_per_token, "flags": flags}
        try:
            report = compile_report(flags, target, devices=devices, predict_on=predict_on)
        except ConfigError as error:
            entry["error"] = str(error).split("\n")[0]
        else:
            across = sum(o["bytes"] * o["count"] for o in report["collective_ops"]
                         if o["crosses_nodes"] and not o["trivial"])
            entry |= {"compiled_peak_bytes": report["memory"]["peak_bytes"],
                      "compiled_memory": {k: report["memory"][k] for k in (
                          "argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                          "params_bytes", "gradient_bytes", "optimizer_bytes")},
                      "fits": report["memory"]["fits"],
                      "memory_ratio": row.memory["total"] / report["memory"]["peak_bytes"],
                      "collective_bytes": report["collective_bytes"],
                      "collective_bytes_across_nodes": across,
                      "collectives": report["collectives"],
                      "compile_seconds": report["compile_seconds"]}
            if "prediction" in report:
                entry["simulated"] = {k: report["prediction"][k] for k in (
                    "step_s", "compute_s", "exposed_comm_s", "hidden_comm_s",
                    "joules_per_token", "mfu", "tokens_per_second_per_gpu")}
        out.append(entry)
        if progress is not None:
            progress(entry)
    objective = a.get("objective", "comm")
    if predict_on is not None and objective in ("time", "energy"):
        field = "step_s" if objective == "time" else "joules_per_token"
        ok = sorted((e for e in out if "error" not in e),
                    key=lambda e: (not e["fits"], e["simulated"][field]))
    else:
        ok = sorted((e for e in out if "error" not in e),
                    key=lambda e: (not e["fits"], e["collective_bytes_across_nodes"],
                                   e["collective_bytes"]))
    for rank, entry in enumerate(ok, 1):
        entry["compiled_rank"] = rank
    return ok + [e for e in out if "error" in e]


def _table(entries: list[dict], header: str, rank_width: int, mesh_width: int, first,
           rest) -> list[str]:
    """One line per entry: its compiled and plan ranks, layout and mesh, ``first(e)`` (what the
    plan modelled), then ``rest(e)`` (what the compiler or the simulation said) or why
    jphantom refused to build it."""
    lines = [header]
    for e in entries:
        head = (f"{e.get('compiled_rank', '-'):>{rank_width}} {e['plan_rank']:>4}  "
                f"{e['layout']:<14} {e['mesh']:<{mesh_width}} {first(e)}")
        lines.append(head + (f"refused: {e['error']}" if "error" in e else rest(e)))
    return lines


def format_compiled_plan(entries: list[dict]) -> str:
    gib = 2**30
    header = (f"{'compiled':>8} {'plan':>4}  {'layout':<14} {'mesh':<26} {'modelled GiB':>12} "
              f"{'compiled GiB':>12} {'fits':>5} {'coll. GB':>9} {'x-node GB':>9} "
              f"{'compile s':>9}")
    return "\n".join(_table(
        entries, header, 8, 26, lambda e: f"{e['modelled_memory_bytes'] / gib:>12.1f} ",
        lambda e: (f"{e['compiled_peak_bytes'] / gib:>12.1f} "
                   f"{'yes' if e['fits'] else 'NO':>5} {e['collective_bytes'] / 1e9:>9.2f} "
                   f"{e['collective_bytes_across_nodes'] / 1e9:>9.2f} "
                   f"{e['compile_seconds']:>9.1f}")))


def _simulated(e: dict) -> str:
    sim = e["simulated"]
    mfu = f"{sim['mfu']:.1%}" if sim.get("mfu") is not None else "-"
    return (f"{sim['step_s']:>8.3f} {sim['exposed_comm_s']:>8.3f} "
            f"{per_token(e['modelled_joules_per_token']):>7} "
            f"{per_token(sim['joules_per_token']):>9} "
            f"{mfu:>6} {e['compiled_peak_bytes'] / 2**30:>6.1f} "
            f"{'yes' if e['fits'] else 'NO':>4}")


def format_simulated_plan(entries: list[dict]) -> str:
    """The compiled layouts with the plan's modelled step and J/token beside the simulated ones,
    and where the simulated order differs from the plan's."""
    header = (f"{'sim':>4} {'plan':>4}  {'layout':<14} {'mesh':<24} {'step s':>8} {'sim s':>8} "
              f"{'exposed':>8} {'J/tok':>7} {'sim J/tok':>9} {'MFU':>6} {'GiB':>6} {'fits':>4}")
    lines = _table(entries, header, 4, 24, lambda e: f"{e['modelled_step_s']:>8.3f} ",
                   _simulated)
    ranked = [e for e in entries if "error" not in e]
    order = sorted(e["plan_rank"] for e in ranked)
    moved = [e for e in ranked if e["compiled_rank"] != order.index(e["plan_rank"]) + 1]
    lines.append("the simulation keeps the plan's order" if not moved else
                 "order changed: " + "; ".join(
                     f"{e['layout']} {e['mesh']} plan #{e['plan_rank']} -> #{e['compiled_rank']}"
                     for e in moved))
    lines.append("step s, J/tok: the plan's model (nothing overlapped); sim: the compiled "
                 "program played on the device (jphantom.predict); all modelled")
    return "\n".join(lines)
