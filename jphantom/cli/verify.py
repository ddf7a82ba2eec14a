"""``jphantom verify``: one step of the run the flags describe against the plain model on one
device (float64 there; under a mixed precision, the one-device step at that precision), loss and
every gradient: is the layout exact?

It takes the flags that shape the step (the model, the layout, the step's options, ``--batch``
and ``--seed``) and lists none of train's others: verify takes no step of an optimizer and writes
nothing. Those keys in a ``--config`` file (shared with train) are left out, and it says so."""

from __future__ import annotations

import argparse
import json
import sys

from jphantom.cli.devices import add_device_flag, setup_devices
from jphantom.cli.parser import add_run_flags, run_settings

# train's settings that one step's gradients do not depend on: verify does not list them
UNUSED = ("steps", "optimizer", "learning_rate", "weight_decay", "adam_b2", "warmup_steps",
          "lr_schedule", "clip_norm", "eval_every", "eval_batches", "target_loss", "data",
          "tokenizer", "out", "save_hf", "checkpoint_dir", "save_every", "keep_checkpoints",
          "resume", "progress", "grad_norm", "tensorboard", "on_nonfinite", "step_timeout")


def used_flags() -> tuple[str, ...]:
    """The run settings (flat names) verify takes: every one but :data:`UNUSED`."""
    from jphantom.config import FLAT

    return tuple(flat for flat in FLAT if flat not in UNUSED)


def add_parser(sub) -> None:
    verify = sub.add_parser(
        "verify", help="one step of a layout against the one-device model: is it exact?",
        description="Build the run as train would (same flags), take one step's loss and every "
                    "gradient with all its collectives, and compare them with the same "
                    "parameters through the plain model on one device (float64 there; under "
                    "--precision bf16, float16 or fp8, the one-device step at that precision, "
                    "under fp8 quantised per data rank and micro-batch as the step is): "
                    "the largest relative difference of the loss and of each gradient, the worst "
                    "parameter named. Exit 0 when all are within --tolerance, 1 when not. "
                    "Train's optimizer, data, output and checkpoint flags do not apply.",
        epilog="Example: jphantom verify --model llama --layers 2 --hidden 64 --heads 4 "
               "--kv-heads 2 --seq-len 32 --batch 8 --strategy tensor --sequence-parallel "
               "--mesh data=2,model=4")
    verify.add_argument("--config", metavar="FILE.toml", help="settings from a TOML file")
    add_run_flags(verify, only=used_flags())
    add_device_flag(verify)
    verify.add_argument("--tolerance", type=float, default=None,
                        help="largest relative difference allowed (default 1e-5 in float32, "
                             "reported as exact; under a mixed precision a bound derived from "
                             "its rounding, reported as within the documented bound)")
    verify.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    verify.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """``jphantom verify``: :func:`jphantom.step.exactness.verify_step` of the run the flags describe."""
    settings = run_settings(args)
    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import MeshConfig

    unused = sorted(flat for flat in settings if flat in UNUSED)
    if unused:  # only a --config file gives them: the flags are not listed
        print(f"verify: leaving out {', '.join(unused)} from {args.config} (one step's "
              "gradients do not depend on them)", file=sys.stderr)
        settings = {k: v for k, v in settings.items() if k not in UNUSED}
    if args.tolerance is not None and not args.tolerance > 0:
        raise ConfigError(f"--tolerance {args.tolerance}: give a positive number, e.g. 1e-5")
    mesh = settings.get("mesh")
    setup_devices(args.devices if args.devices is not None else
                  (MeshConfig.parse(mesh).device_count if mesh else None), at_least=True)
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)  # the one-device reference in float64
    from jphantom.analysis.compiled import abstract_batch
    from jphantom.config import RunConfig
    from jphantom.step.exactness import verify_step

    config = RunConfig.from_flags(**{**settings, "out": None, "progress": False})
    built = config.build()
    state = built.program.init(built.step, seed=config.train.seed)
    rng = np.random.default_rng(config.train.seed)
    batch = []
    for struct in abstract_batch(config, built.program, built.step):
        if np.issubdtype(struct.dtype, np.integer):
            batch.append(rng.integers(0, config.family_config().vocab_size, struct.shape
                                      ).astype(struct.dtype))
        else:
            batch.append(rng.standard_normal(struct.shape).astype(struct.dtype))
    report = verify_step(built.step, state.params, *batch, tolerance=args.tolerance)
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print(f"{config.parallel.strategy} on {config.parallel.mesh_config()}: {report}")
    return 0 if report.ok else 1
