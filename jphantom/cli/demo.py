"""``jphantom demo`` (what ``make demo`` runs): one step of each strategy inspected, then
``compare`` with its defaults on the devices at hand."""

from __future__ import annotations

import argparse

from jphantom.cli import compare as compare_command
from jphantom.cli.devices import add_device_flag, setup_devices
from jphantom.cli.parser import Parser
from jphantom.cli.step_defaults import FFN_DEFAULTS


def add_parser(sub) -> None:
    demo = sub.add_parser("demo", help="what `make demo` runs: inspect, then compare",
                          description="Inspect one step of each strategy, then run `compare` with "
                                      "its defaults (on the GPUs, or on 8 simulated CPU devices).")
    demo.add_argument("--out", default="out/compare")
    add_device_flag(demo)
    demo.set_defaults(handler=handle)


def compare_arguments(argv: list[str]) -> argparse.Namespace:
    """``jphantom compare``'s arguments parsed from ``argv`` (the words after ``compare``)."""
    parser = Parser(prog="jphantom")
    compare_command.add_parser(parser.add_subparsers(dest="command", required=True,
                                                     metavar="COMMAND"))
    return parser.parse_args(["compare", *argv])


def handle(args: argparse.Namespace) -> int:
    """What one step communicates (inspect), then the Table-I comparison with default settings."""
    setup_devices(args.devices)
    import jax

    from jphantom.analysis.inspect import format_report, inspect_step
    from jphantom.loop.compare import prepare_output_dir
    from jphantom.config import RunConfig
    from jphantom.registry.strategies import get

    prepare_output_dir(args.out)
    count = jax.device_count()
    p = max(q for q in (1, 2, 4, 8) if q <= count)
    print(f"== One training step of each strategy, n=1024, L=2, batch 64, p={p}, k=16 ==\n")
    settings = {**FFN_DEFAULTS, "model": "ffn", "width": 1024, "depth": 2, "batch": 64,
                "mesh": f"model={p}", "out": None, "progress": False, "ghost_width": None}
    reports = [inspect_step(RunConfig.from_flags(
        **(settings | {"strategy": name, "ghost_width": 16 if get(name).needs_ghost_width else None})))
        for name in ("phantom", "tensor-t1", "tensor", "gspmd")]
    print(format_report(reports).split("\n\nPer collective op")[0])
    print("\n== Training to the same target loss (Table I of Seal et al., small scale) ==\n")
    shards = ",".join(str(q) for q in (2, 4, 8) if q <= count) or "1"
    compare_args = compare_arguments(["--out", args.out, "--shards", shards])
    compare_args.devices = None  # already set up
    return compare_command.handle(compare_args)
