"""``jphantom compare``: tensor and phantom parallelism trained to the same target loss, Seal et
al.'s Table I at small scale (:mod:`jphantom.loop.compare`), with its comma-separated list flags."""

from __future__ import annotations

import argparse

from jphantom.cli.devices import add_device_flag, setup_devices
from jphantom.cli.parser import positive_int


def int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r} repeats {repeated}: give each value once")
    return values


def ghost_widths(text: str):
    return "auto" if text == "auto" else int_list(text)


def add_parser(sub) -> None:
    compare = sub.add_parser(
        "compare", help="train TP and phantom to the same target loss (Seal et al. Table I)",
        description="Train the dense model with tensor parallelism (tensor-t1) and phantom models "
                    "with each ghost width on the teacher task, for each shard count, to the same "
                    "held-out MSE; print a Table-I-shaped comparison and write results.json and "
                    "comparison.png. Energy is modelled (Eq. 1) unless measured on a GPU; see "
                    "docs/methodology.md.",
    )
    compare.add_argument("--width", type=positive_int, default=256,
                         help="layer width n (default 256)")
    compare.add_argument("--depth", type=positive_int, default=2, help="layers L (default 2)")
    compare.add_argument("--shards", type=int_list, default=(2, 4, 8),
                         help="comma-separated shard counts p (default 2,4,8)")
    compare.add_argument("--ghost-width", type=ghost_widths, default=(2, 4, 16),
                         help="comma-separated ghost widths k, or 'auto' (1/8 of Eq. 8's bound per p)")
    compare.add_argument("--target-loss", type=float, default=None,
                         help="held-out MSE to reach (default: chosen so that every run reaches it)")
    compare.add_argument("--seeds", type=int_list, default=(0, 1, 2), help="default 0,1,2")
    compare.add_argument("--batch", type=positive_int, default=64)
    compare.add_argument("--learning-rate", type=float, default=2e-3, help="Adam (default 2e-3)")
    compare.add_argument("--max-steps", type=positive_int, default=300)
    compare.add_argument("--eval-every", type=positive_int, default=10)
    compare.add_argument("--out", default="out/compare", help="output folder (default out/compare)")
    compare.add_argument("--no-progress", action="store_true", help="no progress bar")
    compare.add_argument("--energy", choices=("auto", "model"), default="auto",
                         help="auto: measure with NVML on NVIDIA GPUs, else model it (Eq. 1); "
                              "model: always the Eq. 1 model (default auto)")
    add_device_flag(compare)
    compare.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    setup_devices(args.devices)
    from jphantom.loop.compare import (CompareConfig, format_table, gpu_meter_factory,
                                  prepare_output_dir, run_compare, write_outputs)

    config = CompareConfig.from_flags(
        width=args.width, depth=args.depth, shards=args.shards, ghost_widths=args.ghost_width,
        target_loss=args.target_loss, seeds=args.seeds, batch=args.batch,
        learning_rate=args.learning_rate, steps=args.max_steps, eval_every=args.eval_every,
    )
    built = config.build()  # every run against the devices, before the folder or any training
    prepare_output_dir(args.out)  # a bad --out fails before any training
    meter_factory = gpu_meter_factory() if args.energy == "auto" else None
    result = run_compare(config, built=built, progress=not args.no_progress,
                         meter_factory=meter_factory)
    print(format_table(result))
    json_path, png_path = write_outputs(result, args.out)
    print(f"\nwrote {json_path} and {png_path}")
    return 0
