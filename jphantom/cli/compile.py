"""``jphantom compile``: the run's training step compiled ahead of time for GPUs or a TPU slice
this machine does not have (:mod:`jphantom.costs.aot`); nothing runs."""

from __future__ import annotations

import argparse
import json
import os
import sys

from jphantom.cli.parser import (add_gpu_defaults_flag, add_run_flags, positive_int,
                                 strategy_names)
from jphantom.cli.step_defaults import COMPILE_MODEL, INSPECT_FLAGS, shown_defaults, step_settings
from jphantom.predict.device import names as device_names
from jphantom.registry.strategies import get as get_strategy


def add_parser(sub) -> None:
    target = sub.add_parser(
        "compile", help="compile the training step for H100/A100 or AMD MI250X/MI300X nodes or a "
                        "TPU slice from this machine: memory and collectives from XLA",
        description="Build the training step exactly as `train` would (same flags) and compile it "
                    "ahead of time for GPUs or TPUs this machine does not have "
                    "(jax.experimental.topologies): report per device XLA's memory (arguments, "
                    "outputs, temporaries, peak) against the device's memory, every collective "
                    "with its mesh axes, bytes and executions, whether XLA made it asynchronous "
                    "and overlapped it with compute, whether it crosses nodes, model FLOPs and "
                    "XLA's cost analysis. Nothing runs. Needs the GPU compiler (pip install "
                    "'jphantom[aot]'), the ROCm compiler (pip install 'jphantom[rocm]', Python "
                    ">= 3.12) or libtpu (pip install 'jphantom[tpu]').",
        epilog="Examples: jphantom compile --target gpu:h100 --nodes 4 --model llama --layers 2 "
               "--hidden 256 --heads 8 --seq-len 128 --vocab 1024 --batch 64 --strategy tensor "
               "--mesh data=4,model=8 | jphantom compile --target rocm:mi250x --nodes 2 --model llama "
               "--strategy tensor phantom --mesh data=2,model=8 | jphantom compile --target "
               "tpu:v5p:2x2x2 --model llama --mesh data=8 --zero 3 --json")
    target.add_argument("--target", default="gpu:h100",
                        help="gpu:h100, gpu:h200, gpu:a100 (SXM), rocm:mi250x (one device per "
                             "GCD, 8 per node as on Frontier), rocm:mi300x, rocm:mi350x, or "
                             "tpu:CHIP:TOPOLOGY, e.g. tpu:v5p:2x2x2 (default gpu:h100)")
    target.add_argument("--nodes", type=positive_int, default=1,
                        help="GPU nodes (default 1)")
    target.add_argument("--gpus-per-node", type=positive_int, default=None,
                        help="GPUs (MI250X: GCDs) per node (default 8)")
    target.add_argument("--target-config", metavar="FILE", default=None,
                        help="your GPU as a stream_executor.GpuTargetConfigProto text file "
                             "(default: the shipped description of the --target chip)")
    target.add_argument("--strategy", nargs="+", default=["tensor"], choices=strategy_names(None),
                        help="one or more strategies (default tensor)")
    target.add_argument("--config", metavar="FILE.toml",
                        help="settings from a TOML file (as train's; flags override)")
    add_run_flags(target, shown_defaults(COMPILE_MODEL), only=INSPECT_FLAGS)
    target.add_argument("--out", default=None, metavar="DIR",
                        help="also write DIR/compile.json and DIR/compile.png")
    target.add_argument("--hlo", default=None, metavar="FILE",
                        help="also write the optimised HLO text of the compiled step to FILE "
                             "(the kernels, fusions and schedule XLA chose); with several "
                             "--strategy values one file each, the strategy's name inserted "
                             "before FILE's suffix (step.hlo -> step.tensor.hlo)")
    add_gpu_defaults_flag(target, "compile with jphantom's GPU XLA flags (jphantom.runtime."
                                  "gpu_defaults: latency-hiding scheduler, pipelined "
                                  "collectives) where XLA_FLAGS does not set them")
    target.add_argument("--predict", action="store_true",
                        help="also play the compiled program on a modelled device and network "
                             "(jphantom.predict): step seconds split into compute, exposed and "
                             "hidden communication, MFU, tokens/s per GPU, joules per step and "
                             "per token (Seal et al.'s Eq. 1), the top ops; all modelled")
    target.add_argument("--device", default=None, metavar="NAME|FILE",
                        help="with --predict: the device description to price the program on, "
                             f"a shipped one ({', '.join(device_names())}) or a TOML file "
                             "benchmarks/calibrate.py wrote (default: the target's own, e.g. "
                             "h100-sxm for gpu:h100)")
    target.add_argument("--top", type=positive_int, default=10,
                        help="with --predict: the ops to list by predicted time (default 10)")
    target.add_argument("--json", action="store_true", help="print JSON instead of a table")
    target.set_defaults(handler=handle)


def hlo_paths(text: str | None, strategies: list[str]) -> dict[str, str | None]:
    """``--hlo FILE`` per strategy: FILE itself for one, FILE with ``.STRATEGY`` before its
    suffix for several (``step.hlo`` -> ``step.tensor.hlo``). Refuses, before anything
    compiles, a FILE that is a folder or whose folder cannot be written (or created)."""
    from pathlib import Path

    from jphantom.errors import ConfigError

    if text is None:
        return dict.fromkeys(strategies)
    path = Path(text)
    if path.is_dir():
        raise ConfigError(f"--hlo {text} is a folder: give a file name, e.g. "
                          f"{path / 'step.hlo'}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--hlo {text}: {str(parent)!r} is not a folder this process can write "
                          "in: pick another path")
    if len(strategies) == 1:
        return {strategies[0]: text}
    return {name: str(path.with_name(f"{path.stem}.{name}{path.suffix}")) for name in strategies}


def handle(args: argparse.Namespace) -> int:
    """``jphantom compile``: the run's step compiled for a GPU cluster or TPU slice it does not
    have (:mod:`jphantom.costs.aot`)."""
    from jphantom.costs import aot
    from jphantom.config import RunConfig
    from jphantom.errors import ConfigError

    target = aot.Target.parse(args.target, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                              target_config=args.target_config)
    strategies = list(dict.fromkeys(args.strategy))
    hlo = hlo_paths(args.hlo, strategies)
    predict_on = None
    if args.predict or args.device is not None:
        from jphantom.predict import device as described

        if not target.is_gpu:
            raise ConfigError("--predict prices GPU programs: give --target gpu:h100, gpu:h200, "
                              "gpu:a100, rocm:mi250x or rocm:mi300x")
        predict_on = (described.load(args.device) if args.device is not None
                      else described.for_target(f"{target.platform}:{target.chip}"))
    settings = step_settings(args, COMPILE_MODEL)
    if predict_on is not None:  # FP8 priced only where the device has FP8 GEMMs
        predict_on.check_precision(settings.get("precision", "float32"))
    aot.require_plugin(target.platform)  # before anything is built
    settings["mesh"] = settings.get("mesh") or aot.default_mesh(target)
    gpu_defaults = target.is_gpu and not args.no_gpu_defaults
    if gpu_defaults:  # XLA reads XLA_FLAGS when the plugin starts: before target.devices()
        from jphantom.runtime import gpu_defaults as defaults

        # the flags only (nothing is allocated), a pipeline's among them
        defaults.apply(allocator=False, pipelined=defaults.is_pipelined(settings["mesh"]))
    from jphantom.cli.quiet import filtered_stderr

    with filtered_stderr():  # the GPU plugin starts: without a GPU, its start-up lines dropped
        devices = target.devices()
    from jphantom.runtime.mesh import device_pool

    with device_pool(devices):  # every run validated before anything compiles
        runs = []
        for name in strategies:
            run = {**settings, "strategy": name, "out": None, "progress": False}
            if not get_strategy(name).needs_ghost_width:
                run.pop("ghost_width", None)
            RunConfig.from_flags(**run).build()
            runs.append(run)
    reports = [aot.compile_report(run, target, devices=devices, gpu_defaults=gpu_defaults,
                                  hlo_out=hlo[run["strategy"]], predict_on=predict_on,
                                  top=args.top)
               for run in runs]
    if predict_on is not None:  # each prediction with its device's error band on record
        from jphantom.predict.validation import error_band

        band = error_band(predict_on.name, settings.get("precision"))
        for report in reports:
            if "prediction" in report:
                report["prediction"]["measured_error"] = band
    if args.out:
        aot.write_reports(reports, args.out)
    if args.json:
        json.dump(reports[0] if len(reports) == 1 else reports, sys.stdout, indent=2)
        print()
        return 0
    for report in reports:
        print(aot.format_compile_report(report))
        for note in report["notes"]:
            print(f"note: {note}")
        if "prediction" in report:
            from jphantom.predict import Prediction, format_prediction

            fields = {f: report["prediction"][f] for f in Prediction.__dataclass_fields__}
            print(format_prediction(Prediction(**fields),
                                    f"prediction on {predict_on.description} ({predict_on.path}):"))
        print()
    if args.out:
        print(f"wrote {args.out}/compile.json and {args.out}/compile.png")
    for report in reports:
        if "hlo_file" in report:
            print(f"wrote the optimised HLO of {report['strategy']} to {report['hlo_file']}")
    return 0
