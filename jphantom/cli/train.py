"""``jphantom train``: the run the flags (and ``--config FILE.toml``) describe, trained by
:func:`jphantom.loop.trainer.run`, with jphantom's GPU defaults set first on NVIDIA GPUs."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from jphantom.registry import strategies
from jphantom.cli.devices import accelerator_visible, add_device_flag, setup_devices
from jphantom.cli.parser import add_gpu_defaults_flag, add_run_flags, run_settings

TRAIN_DEFAULTS = {"grad_norm": True}  # train's defaults where they differ from RunConfig's


def add_parser(sub) -> None:
    train = sub.add_parser(
        "train", help="train the FFN, GPT-2 or Llama under any strategy and mesh",
        description="Train and write metrics.jsonl, curves.png and results.json into --out. Every "
                    "setting can also come from --config FILE.toml (flat keys as below, with - or "
                    "_, or sections [model], [parallel], [step], [train]: examples/train.toml); "
                    "flags override the file.",
        epilog="Examples: jphantom train  (a 4-layer width-256 GPT-2 on the standard library's "
               "sources) | jphantom train --strategy tensor --mesh data=2,model=4 "
               "--sequence-parallel --devices 8 | jphantom train --model ffn --strategy phantom "
               "--ghost-width 8 --width 256 --mesh model=4 --devices 4 | jphantom train --model "
               "llama --strategy tensor --mesh stage=2,data=2,model=2 --microbatches 4 --schedule "
               "gpipe (a pipeline of 2 stages) | jphantom train --strategy tensor --mesh "
               "data=4,model=2 --zero 3 --accumulate 2 --clip-norm 1.0 (FSDP, 2 micro-batches, "
               "clipping)")
    train.add_argument("--config", metavar="FILE.toml", help="settings from a TOML file")
    add_run_flags(train)
    add_device_flag(train)
    add_gpu_defaults_flag(train, "set jphantom's GPU defaults on NVIDIA GPUs (jphantom.runtime."
                                 "gpu_defaults: XLA flags for the latency-hiding scheduler and "
                                 "pipelined collectives, XLA_PYTHON_CLIENT_MEM_FRACTION=0.9) "
                                 "where the environment does not set them")
    train.set_defaults(handler=handle)


def train_gpu_defaults(args: argparse.Namespace | None = None) -> None:
    """``train`` on NVIDIA GPUs: :mod:`jphantom.runtime.gpu_defaults` into the environment where it does
    not set them (with its FP8 flags when ``args``' settings say ``--precision fp8``, its pipeline
    flags when their mesh has a ``stage`` axis), and one
    line saying what was set (by the first process of a multi-process run)."""
    from jphantom.runtime import gpu_defaults
    from jphantom.runtime.distributed import ENV_PROCESS_ID

    if not gpu_defaults.nvidia_gpu_visible():
        return
    settings = run_settings(args, TRAIN_DEFAULTS) if args is not None else {}
    applied = gpu_defaults.apply(precision=settings.get("precision"),
                                 pipelined=gpu_defaults.is_pipelined(settings.get("mesh")))
    if os.environ.get(ENV_PROCESS_ID, "0").strip() in ("", "0"):
        print("gpu defaults: " + (" ".join(applied) if applied else
                                  "none set (XLA_FLAGS and the environment set them all)"))


def _family_from_checkpoint(args: argparse.Namespace, settings: dict) -> bool:
    """Whether the run's family came from its ``--from-hf`` checkpoint: neither ``--model`` nor
    ``--config``'s file names one (:func:`jphantom.cli.parser.run_settings`)."""
    from jphantom.config import load_toml

    if not settings.get("from_hf") or getattr(args, "model", None) is not None:
        return False
    return not (getattr(args, "config", None) and "model" in load_toml(args.config))


def handle(args: argparse.Namespace) -> int:
    settings = run_settings(args, TRAIN_DEFAULTS)
    from jphantom.runtime import distributed

    devices, at_least = args.devices, False
    if devices is None and not accelerator_visible():
        # On CPU simulate as many devices as the mesh needs (one for dense): fewer simulated devices
        # leave each one more of the host's threads.
        from jphantom.runtime.mesh import MeshConfig
        mesh = settings.get("mesh")
        if mesh is not None:
            devices = MeshConfig.parse(mesh).device_count
        elif strategies.get(settings.get("strategy", "dense")).one_device:
            devices = 1
        at_least = True
    if not distributed.is_initialized():  # else the launcher gave every process its devices
        setup_devices(devices, at_least=at_least)
    import jax

    from jphantom.config import RunConfig
    from jphantom.loop.trainer import run
    if settings.get("dtype") == "float64":
        jax.config.update("jax_enable_x64", True)
    config = RunConfig.from_flags(**settings)
    built = config.build()  # every shape against the mesh, before any data is read
    used, available = config.parallel.mesh_config().device_count, jax.device_count()
    if used < available and jax.process_index() == 0:
        print(f"note: mesh {config.parallel.mesh_config()} uses {used} of the {available} "
              f"devices; {available - used} stay idle (give the mesh more ranks to use them)")
    if jax.process_index() == 0 and _family_from_checkpoint(args, settings):
        print(f"model: {config.model.name}, the family --from-hf {settings['from_hf']}'s "
              "config.json names (model_type)")
    if jax.process_index() == 0 and (line := _files_line(config.train)) is not None:
        print(line)
    results = run(config, built=built)
    if results.pipeline is not None:
        pipe = results.pipeline
        print(f"pipeline: {pipe['schedule']}, {pipe['stages']} stages, {pipe['microbatches']} "
              f"micro-batches, {pipe['virtual_stages']} virtual stage(s) per device")
    step = results.step
    if step != {"zero": 0, "accumulate": 1, "clip_norm": None, "precision": "float32",
                "master_weights": "replicated", "remat": "none"}:
        print(f"step: ZeRO-{step['zero']}, {step['accumulate']} accumulation micro-batch(es), "
              + ("no clipping" if step["clip_norm"] is None
                 else f"gradients clipped to global norm {step['clip_norm']:g}")
              + f", {step['precision']} compute, {step['master_weights']} master weights, "
              f"remat {step['remat']}")
    if (moe_line := _moe_line(results)) is not None:
        print(moe_line)
    if (data_line := _data_line(results.data or {})) is not None:
        print(data_line)
    if results.interrupted:
        from jphantom.runtime.resilience import EXIT_STATUS

        where = f" into {config.train.out}" if config.train.out is not None else ""
        saved = (results.checkpoints or {}).get("steps") or []
        kept = (f"; checkpoint of step {max(saved)} in {config.train.checkpoint_dir} (continue "
                "with --resume)" if saved else "; no checkpoint (give --checkpoint-dir to keep "
                "the state)")
        if jax.process_index() == 0:
            print(f"{results.stopped_by or 'interrupted'}: stopped after step "
                  f"{results.steps_done}, wrote what the run had{where}{kept}",
                  file=sys.stderr)
        return EXIT_STATUS.get(results.stopped_by, 130)
    from jphantom.loop.nonfinite import summary as nonfinite_summary

    summary = nonfinite_summary(results.nonfinite, results.steps_done)
    if summary:
        print(summary)
    final = results.final_validation_loss
    if final is None:
        print("final validation loss: none (no evaluation ran)")
    else:
        print(f"final validation loss {final:.4f}"
              + (f" nats/token; unigram cross-entropy {results.unigram_cross_entropy:.4f}; "
                 f"ratio {results.validation_over_unigram:.3f}"
                 if results.unigram_cross_entropy is not None else " (MSE)"))
    if jax.process_index() == 0 and config.train.out is not None:  # process 0 alone writes
        print(f"wrote {config.train.out}/results.json, metrics.jsonl and curves.png")
    return 0


def _moe_line(results) -> str | None:
    """The run's mixture of experts in one line: GPT-2's routed blocks (capacity, drops) or a
    Mixtral / Qwen3-MoE MLP in every block (no capacity: nothing dropped)."""
    if results.moe is not None:
        moe = results.moe
        active = ("" if moe["active_params"] is None
                  else f", {moe['active_params']:,} active parameters")
        return (f"MoE: every {moe['moe_every']} block(s), {moe['experts']} experts, "
                f"top-{moe['top_k']}{active}; dropped {100 * moe['final_dropped_fraction']:.2f}% "
                "of token-expert assignments")
    model = results.model or {}
    if not model.get("experts") or "moe_every" in model:
        return None
    E, k = model["experts"], model["top_k"]
    idle = (E - k) * 3 * model["hidden"] * model["intermediate"] * model["layers"]
    active = f", {results.params - idle:,} active parameters"
    return (f"MoE: every block, {E} experts, top-{k}{active}; dropless (no token-expert "
            "assignment dropped)")


def _files_line(train, shown: int = 8) -> str | None:
    """Dataset files in one line, before anything is read: each file's split and every file
    skipped with why (:func:`jphantom.data.dataset_files.data_files`), at most ``shown`` names
    per list (results.json lists them all); None for other data."""
    from jphantom.data.dataset_files import is_dataset_data
    from jphantom.data.dataset_files import data_files
    from jphantom.data.documents import HELD_OUT

    if not is_dataset_data(train.data):
        return None
    files, root = data_files(train.data, train.val_data), Path(train.data)
    root = root if root.is_dir() else root.parent

    def names(found):
        named = [str(p.relative_to(root)) if p.is_relative_to(root) else str(p) for p in found]
        more = f" and {len(named) - shown} more" if len(named) > shown else ""
        return ", ".join(named[:shown]) + more

    parts = [f"train {names(files['train'])}", "validation " + (
        names(files["validation"]) if files["validation"] else
        f"none (the last {HELD_OUT:.0%} of the training rows held out)")]
    if files["test (not read)"]:
        parts.append(f"test (not read) {names(files['test (not read)'])}")
    skipped = files["skipped"]
    for why in dict.fromkeys(skipped.values()):
        parts.append(f"skipped {names([p for p in skipped if skipped[p] == why])} ({why})")
    return f"data: {train.data}: " + "; ".join(parts)


def _data_line(data: dict) -> str | None:
    """Dataset files in one line: rows, tokens and loss tokens of each split, what the loss is
    on, and packed rows or padded documents."""
    if "packed" not in data:
        return None
    split = lambda s: (f"{s['rows']:,} row{'s' * (s['rows'] != 1)}, {s['tokens']:,} tokens, "
                       f"{s['loss_tokens']:,} loss tokens")
    layout = (f"packed into {data['rows_per_epoch']:,.1f} rows of {data['seq_len']} per epoch"
              if data["packed"] else
              f"one document per row of {data['seq_len']}, padded "
              f"({data['truncated_documents']:,} truncated)")
    return (f"data: train {split(data['train'])}; validation {split(data['validation'])} "
            f"({data['validation_split']}); loss on {data['loss_on']}; {layout}")
