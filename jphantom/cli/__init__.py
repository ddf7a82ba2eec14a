"""The ``jphantom`` command line. Run ``jphantom --help`` or ``jphantom <command> --help``.

Devices. Every command runs on the machine's accelerators when it has some, and on simulated CPU
devices otherwise: ``--devices N`` simulates N CPU devices (and forces the CPU backend); without it
the choice is made *before* jax starts (jax cannot change its device count afterwards), from
what is visible without starting it (:func:`accelerator_visible`): ``JAX_PLATFORMS`` if set, else
an NVIDIA (``nvidia-smi``) or AMD (``rocm-smi``) tool on the PATH together with an installed jax
plugin for it. No accelerator: :data:`DEFAULT_SIMULATED_DEVICES` (8) CPU devices are simulated.

Errors. A bad value (:class:`jphantom.errors.ConfigError`) or a diverged training run
(:class:`jphantom.errors.TrainingDiverged`) prints one line, ``jphantom: error: ...``, and exits with
status 2 (bad value) or 1 (diverged), without a traceback.

One module per command (``train``, ``generate``, ``inspect``, ``compile``, ``compare``,
``schedule``, ``tokenize``, ``verify``, ``demo``; ``plan`` and ``launch`` live in
:mod:`jphantom.planner` and :mod:`jphantom.runtime.launch`), each with its ``add_parser(sub)`` and
``handle(args)``; the flags they share in :mod:`jphantom.cli.parser` (the run's, built from the
configuration's fields), :mod:`jphantom.cli.devices` and :mod:`jphantom.cli.step_defaults`. This
module is the entry point: :func:`build_parser` and :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import sys

from jphantom.cli import (compare, compile, demo, generate, inspect, schedule, tokenize, train,
                          verify)
from jphantom.cli.devices import DEFAULT_SIMULATED_DEVICES, accelerator_visible
from jphantom.cli.parser import Parser
from jphantom.cli.schedule import MAX_SCHEDULE_TASKS
from jphantom.cli.step_defaults import (COMPILE_MODEL, FFN_DEFAULTS, INSPECT_FLAGS, INSPECT_MODEL,
                                        LM_DEFAULTS, STEP_DEFAULTS, step_settings)
from jphantom.cli.train import TRAIN_DEFAULTS, train_gpu_defaults

__all__ = ["COMPILE_MODEL", "DEFAULT_SIMULATED_DEVICES", "FFN_DEFAULTS", "INSPECT_FLAGS",
           "INSPECT_MODEL", "LM_DEFAULTS", "MAX_SCHEDULE_TASKS", "STEP_DEFAULTS",
           "TRAIN_DEFAULTS", "accelerator_visible", "build_parser", "main", "step_settings",
           "train_gpu_defaults"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="jphantom",
        description="Model-parallel training in JAX (FFNs, GPT-2, the Llama family and your own "
                    "Flax NNX models), measured on communication and energy. "
                    "Phantom parallelism (Seal et al.), Megatron tensor and sequence "
                    "parallelism, pipelines, ZeRO, experts, AxoNN's 3D matmul.",
        epilog="Example: jphantom inspect --strategy phantom --width 4096 --depth 2 "
               "--ghost-width 16 --devices 8 --batch 256",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect.add_parser(sub)
    compare.add_parser(sub)
    compile.add_parser(sub)
    train.add_parser(sub)
    generate.add_parser(sub)
    tokenize.add_parser(sub)
    schedule.add_parser(sub)
    from jphantom.planner import add_parser as add_plan_parser

    add_plan_parser(sub)
    from jphantom.runtime.launch import add_parser as add_launch_parser

    add_launch_parser(sub)
    verify.add_parser(sub)
    demo.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["compile"]:
        # before jax loads the CUDA plugin, which logs that this machine has no GPU: known here
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from jphantom.cli.quiet import quiet_missing_gpu

    quiet_missing_gpu()  # no GPU, the CUDA plugin installed: JAX_PLATFORMS=cpu, no plugin noise
    args = build_parser().parse_args(argv)
    from jphantom.errors import ConfigError, TrainingDiverged

    _one_line_warnings()

    if args.command == "train" and not args.no_gpu_defaults and args.devices is None:
        train_gpu_defaults(args)  # before jax.distributed or anything else starts jax
    try:
        if args.command != "launch":  # a process started by `jphantom launch`, srun or mpirun
            from jphantom.runtime import distributed

            distributed.initialize_from_env()
        return args.handler(args)
    except ConfigError as error:
        print(f"jphantom: error: {_message(error)}", file=sys.stderr)
        return 2
    except TrainingDiverged as error:
        print(f"jphantom: error: training diverged: {_message(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before or after the training loop, which handles its own
        print("jphantom: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `jphantom plan ... | head`: the reader left; nothing to report
        _quiet_stdout()
        return 141  # a shell's code for a process ended by SIGPIPE


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's own flush at exit does not
    raise the broken pipe again (Python's documented way: the ``signal`` module's notes on
    SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _one_line_warnings() -> None:
    """jphantom's own warnings on the command line: one line, ``jphantom: warning: ...``, not the
    library file and line they were raised at."""
    import warnings

    from jphantom.errors import JPhantomWarning

    previous = warnings.showwarning
    if getattr(previous, "_jphantom", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, JPhantomWarning):
            print(f"jphantom: warning: {message}", file=file or sys.stderr)
            return
        previous(message, category, filename, lineno, file, line)

    show._jphantom = True
    warnings.showwarning = show


def _message(error: Exception) -> str:
    """The error's own words on one line (without what jax appends to errors raised while it
    traces: a separator and a note on its filtered traceback)."""
    return str(error).split("\n--------------------")[0].strip()
