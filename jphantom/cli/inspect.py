"""``jphantom inspect``: one training step compiled on this machine's devices and read back
(collectives, FLOPs, memory, optionally the compute/communication breakdown); nothing trained."""

from __future__ import annotations

import argparse
import json
import sys

from jphantom.registry import strategies
from jphantom.cli.devices import add_device_flag, setup_devices
from jphantom.cli.parser import add_run_flags, positive_int, strategy_names
from jphantom.cli.step_defaults import INSPECT_FLAGS, INSPECT_MODEL, shown_defaults, step_settings


def add_parser(sub) -> None:
    inspect = sub.add_parser(
        "inspect", help="compile one training step and report its collectives, FLOPs, memory",
        epilog="Example: jphantom inspect --model transformer --layers 2 --hidden 64 --heads 4 "
               "--seq-len 32 --batch 8 --strategy tensor --sequence-parallel --mesh data=2,model=4 "
               "--devices 8",
        description="Compile one training step (forward, backward, optimizer update: SGD for "
                    "the FFN, AdamW for GPT-2 and Llama, unless --optimizer) of the FFN, GPT-2 "
                    "or Llama, with the same defaults as `jphantom compile` for the same --model, "
                    "and report, "
                    "from the compiled HLO, every collective (kind, shape, bytes, groups, mesh "
                    "axes, executions per step), FLOPs, parameter count and memory (XLA's, and "
                    "the parameters', gradients' and optimizer state's bytes per device). "
                    "Nothing is trained.",
    )
    inspect.add_argument("--strategy", nargs="+", default=["phantom"],
                         choices=strategy_names(None),
                         help="one or more strategies to compare side by side (default: phantom)")
    inspect.add_argument("--config", metavar="FILE.toml",
                         help="settings from a TOML file (as train's; flags override)")
    add_run_flags(inspect, shown_defaults(INSPECT_MODEL), only=INSPECT_FLAGS)
    inspect.add_argument("--shards", type=positive_int, default=None,
                         help="shorthand for --mesh model=N")
    inspect.add_argument("--breakdown", action="store_true",
                         help="also run the step with and without its data-parallel reductions and "
                              "report Cheng et al.'s compute/communication breakdown (t_iter, "
                              "t_compute, t_comm, shares; Eq. 26's modelled communication)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_device_flag(inspect)
    inspect.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    setup_devices(args.devices)
    import jax

    from jphantom.analysis.inspect import format_report, inspect_step
    from jphantom.config import RunConfig
    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import MeshConfig

    settings = step_settings(args, INSPECT_MODEL)
    if settings.get("dtype") == "float64":
        jax.config.update("jax_enable_x64", True)
    if args.shards is not None:
        if "mesh" in settings and MeshConfig.parse(settings["mesh"]).size("model") != args.shards:
            raise ConfigError(f"--shards {args.shards} disagrees with --mesh {settings['mesh']}: "
                              "give one of them")
        settings.setdefault("mesh", f"model={args.shards}")
    mesh = settings.get("mesh") or f"model={jax.device_count()}"
    configs = []
    for name in dict.fromkeys(args.strategy):  # every run validated before anything compiles
        run = {**settings, "strategy": name, "mesh": mesh, "out": None, "progress": False}
        if not strategies.get(name).needs_ghost_width:
            run.pop("ghost_width", None)
        configs.append(RunConfig.from_flags(**run))
        configs[-1].build()  # its shapes against the mesh, before anything compiles
    reports = []
    for config in configs:
        report = inspect_step(config)
        if args.breakdown and MeshConfig.parse(config.parallel.mesh).size("data") > 1:
            from jphantom.analysis.timing import breakdown

            report["breakdown"] = breakdown(config)
        elif args.breakdown:
            report["notes"].append("--breakdown splits the step into compute and data-parallel "
                                   "communication: this mesh has no data axis (> 1), so there "
                                   "is nothing to break down")
        reports.append(report)
    if args.json:
        json.dump(reports[0] if len(reports) == 1 else reports, sys.stdout, indent=2)
        print()
        return 0
    config = configs[0]
    m = config.model
    loaded = config.build().program.config if m.from_hf else m  # a checkpoint's shape, not flags'
    layers, hidden, heads = (getattr(loaded, k, getattr(m, k))
                             for k in ("layers", "hidden", "heads"))
    vocab = getattr(loaded, "vocab_size", m.vocab)
    shape = (f"{m.name} L={layers}, h={hidden}, heads={heads}, S={m.seq_len}, V={vocab}"
             + (", sequence-parallel" if config.parallel.sequence_parallel else "")
             if m.family.is_language_model else f"width={m.width}, depth={m.depth}")
    staged = next((r["pipeline"] for r in reports if "pipeline" in r), None)
    pipe = "" if staged is None else (
        f" (pipeline: {staged['schedule']}, {staged['stages']} stages, "
        f"{staged['microbatches']} micro-batches, {staged['virtual_stages']} virtual "
        "stage(s) per device)")
    step = "".join((f", ZeRO-{config.step.zero}" if config.step.zero else "",
                    ", float32 master sharded" if config.step.master_weights == "sharded" else "",
                    f", {config.step.accumulate} accumulation micro-batches"
                    if config.step.accumulate > 1 else ""))
    names = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
    print(f"One training step (forward + backward + {names[config.train.optimizer]}{step}), "
          f"{shape}, batch={config.train.batch}, mesh {mesh}{pipe}, {m.dtype}; bytes are per "
          "device, counts per step (loops included); state MB: parameters + gradients + "
          "optimizer state.\n")
    print(format_report(reports))
    for report in reports:
        for note in report["notes"]:
            print(f"note ({report['strategy']}): {note}")
    for report in reports:
        if "breakdown" in report:
            b = report["breakdown"]
            print(f"breakdown {report['strategy']}: t_iter {b['t_iter'] * 1e3:.2f} ms = "
                  f"compute {b['t_compute'] * 1e3:.2f} ms ({b['r_compute']:.1%}) + data "
                  f"communication {b['t_comm'] * 1e3:.2f} ms ({b['r_comm']:.1%}); Eq. 26 "
                  f"(Frontier, modelled): {b['t_comm_eq26_frontier_modelled'] * 1e3:.3f} ms")
    return 0
