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
    if not count:
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


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def _ghost_widths(text: str):
    return "auto" if text == "auto" else _int_list(text)


def _compare(args: argparse.Namespace) -> int:
    _setup_devices(args.devices)
    from jphantom.compare import (CompareConfig, format_table, gpu_meter_factory, run_compare,
                                  write_outputs)

    config = CompareConfig(
        width=args.width, depth=args.depth, shards=args.shards, ghost_widths=args.ghost_width,
        target_loss=args.target_loss, seeds=args.seeds, batch=args.batch,
        learning_rate=args.learning_rate, max_steps=args.max_steps, eval_every=args.eval_every,
    )
    meter_factory = gpu_meter_factory() if args.energy == "auto" else None
    result = run_compare(config, progress=not args.no_progress, meter_factory=meter_factory)
    json_path, png_path = write_outputs(result, args.out)
    print(format_table(result))
    print(f"\nwrote {json_path} and {png_path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """What one step communicates (inspect), then the Table-I comparison with default settings."""
    print("== One training step of each strategy, n=1024, L=2, batch 64, p=8, k=16 ==\n")
    _setup_devices(args.devices)
    args.devices = None
    from jphantom.analysis.inspect import StepSpec, format_report, inspect_step

    reports = [inspect_step(StepSpec(name, 1024, 2, 64, 8, 16 if name == "phantom" else None))
               for name in ("phantom", "tensor-t1", "tensor-t2", "gspmd")]
    print(format_report(reports).split("\n\nPer collective op")[0])
    print("\n== Training to the same target loss (Table I of seed 000, small scale) ==\n")
    return _compare(build_parser().parse_args(["compare", "--out", args.out]))


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

    compare = sub.add_parser(
        "compare", help="train TP and phantom to the same target loss (seed 000 Table I)",
        description="Train the dense model with tensor parallelism (T1) and phantom models with each "
                    "ghost width on the teacher task, for each shard count, to the same held-out MSE; "
                    "print a Table-I-shaped comparison and write results.json and comparison.png. "
                    "Energy is modelled (Eq. 1) unless measured on a GPU; see docs/methodology.md.",
    )
    compare.add_argument("--width", type=int, default=256, help="layer width n (default 256)")
    compare.add_argument("--depth", type=int, default=2, help="layers L (default 2)")
    compare.add_argument("--shards", type=_int_list, default=(2, 4, 8),
                         help="comma-separated shard counts p (default 2,4,8)")
    compare.add_argument("--ghost-width", type=_ghost_widths, default=(2, 4, 16),
                         help="comma-separated ghost widths k, or 'auto' (1/8 of Eq. 8's bound per p)")
    compare.add_argument("--target-loss", type=float, default=None,
                         help="held-out MSE to reach (default: chosen so that every run reaches it)")
    compare.add_argument("--seeds", type=_int_list, default=(0, 1, 2), help="default 0,1,2")
    compare.add_argument("--batch", type=int, default=64)
    compare.add_argument("--learning-rate", type=float, default=2e-3, help="Adam (default 2e-3)")
    compare.add_argument("--max-steps", type=int, default=300)
    compare.add_argument("--eval-every", type=int, default=10)
    compare.add_argument("--out", default="out/compare", help="output folder (default out/compare)")
    compare.add_argument("--no-progress", action="store_true", help="no progress bar")
    compare.add_argument("--energy", choices=("auto", "model"), default="auto",
                         help="auto: measure with NVML on NVIDIA GPUs, else model it (Eq. 1); "
                              "model: always the Eq. 1 model (default auto)")
    compare.add_argument("--devices", type=int, default=8,
                         help="simulated CPU devices (default 8); 0 = the machine's real devices")
    compare.set_defaults(handler=_compare)

    demo = sub.add_parser("demo", help="what `make demo` runs: inspect, then compare",
                          description="Inspect one step of each strategy, then run `compare` with "
                                      "its defaults on 8 simulated CPU devices.")
    demo.add_argument("--out", default="out/compare")
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
