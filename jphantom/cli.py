"""The ``jphantom`` command line. Run ``jphantom --help`` or ``jphantom <command> --help``."""

from __future__ import annotations

import argparse
import json
import sys

STRATEGY_NAMES = ("dense", "gspmd", "phantom", "phantom-unfused", "tensor-t1", "tensor-t2")


def _add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices", type=int, default=None, metavar="N",
        help="simulate N CPU devices (forces the CPU backend; use on a laptop or CI). "
             "Omit to use the real devices of this machine.",
    )


def _setup_devices(count: int | None) -> None:
    """Must run before anything touches a jax backend."""
    if count is None:
        return
    import jax

    from jphantom.mesh import simulate_cpu_devices

    jax.config.update("jax_platforms", "cpu")
    simulate_cpu_devices(count)


def _inspect(args: argparse.Namespace) -> int:
    _setup_devices(args.devices)
    from jphantom.analysis.inspect import StepSpec, format_report, inspect_step

    import jax

    num_shards = args.shards or jax.device_count()
    names = args.strategy
    reports = []
    for name in names:
        spec = StepSpec(
            strategy=name, width=args.width, depth=args.depth, batch=args.batch,
            num_shards=1 if name == "dense" else num_shards,
            ghost_width=args.ghost_width if name.startswith("phantom") else None, dtype=args.dtype,
        )
        reports.append(inspect_step(spec))
    if args.json:
        json.dump(reports[0] if len(reports) == 1 else reports, sys.stdout, indent=2)
        print()
    else:
        print(f"One training step (forward + backward + SGD), width={args.width}, depth={args.depth}, "
              f"batch={args.batch}, {num_shards} shards, {args.dtype}; bytes are per device.\n")
        print(format_report(reports))
    return 0


def _demo(args: argparse.Namespace) -> int:
    """Phantom and TP side by side: what one step computes and communicates."""
    args.strategy = ["phantom", "tensor-t1", "tensor-t2", "gspmd"]
    args.json = False
    args.shards = None
    return _inspect(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jphantom",
        description="Model-parallel FFN training in JAX, measured on communication and energy. "
                    "Phantom parallelism (Seal et al.) against tensor parallelism.",
        epilog="Example: jphantom inspect --strategy phantom --width 4096 --depth 2 "
               "--ghost-width 16 --devices 8 --batch 256",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = sub.add_parser(
        "inspect", help="compile one training step and report its collectives, FLOPs, memory",
        description="Compile one training step (forward, backward, SGD update) of an FFN and report, "
                    "from the compiled HLO, every collective (kind, shape, bytes, groups), FLOPs, "
                    "parameter count and memory. Nothing is trained.",
    )
    inspect.add_argument("--strategy", nargs="+", default=["phantom"], choices=STRATEGY_NAMES,
                         help="one or more strategies to compare side by side (default: phantom)")
    inspect.add_argument("--width", type=int, default=4096, help="layer width n (default 4096)")
    inspect.add_argument("--depth", type=int, default=2, help="number of layers L (default 2)")
    inspect.add_argument("--ghost-width", type=int, default=16,
                         help="phantom ghost neurons per rank, k of seed 000 (default 16)")
    inspect.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    inspect.add_argument("--shards", type=int, default=None,
                         help="model-parallel degree p (default: all devices)")
    inspect.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_device_flag(inspect)
    inspect.set_defaults(handler=_inspect)

    demo = sub.add_parser("demo", help="phantom vs tensor parallelism side by side (make demo)",
                          description="Inspect phantom, TP T1, TP T2 and GSPMD on the same FFN.")
    demo.add_argument("--width", type=int, default=4096)
    demo.add_argument("--depth", type=int, default=2)
    demo.add_argument("--ghost-width", type=int, default=16)
    demo.add_argument("--batch", type=int, default=256)
    demo.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    demo.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jphantom.errors import ConfigError

    try:
        return args.handler(args)
    except ConfigError as error:
        print(f"jphantom: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
