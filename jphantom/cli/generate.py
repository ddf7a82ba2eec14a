"""``jphantom generate``: continue prompts with a model taken as ``train`` takes one
(``--from-hf DIR``, a jphantom checkpoint with ``--checkpoint-dir DIR --resume`` and the run's
flags, or a fresh model from the flags), under its ``--strategy`` and ``--mesh``; prompts from
``--prompt`` or ``--prompts FILE`` (:mod:`jphantom.generation.prompts`); the completions printed
or written to ``--out FILE.jsonl``, the figures (:mod:`jphantom.generation.report`) printed and
written to ``--results FILE.json``. Every bad input is one line and exit status 2 before
anything compiles."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jphantom.cli.devices import add_device_flag, setup_devices
from jphantom.cli.parser import add_run_flags, positive_int, run_settings
from jphantom.registry.strategies import get

MODEL_FLAGS = ("model", "from_hf", "strategy", "mesh", "layers", "hidden", "heads", "kv_heads",
               "seq_len", "ghost_width", "dtype", "seed", "tokenizer", "chat_template",
               "checkpoint_dir", "resume", "experts", "optimizer")
"""The run flags that describe the model (``train``'s, with their help and defaults)."""


def add_parser(sub) -> None:
    gen = sub.add_parser(
        "generate", help="continue prompts or answer chat messages with a Hugging Face, "
                         "trained or fresh model",
        description="Generate with a key/value cache, prefill and decode in one compiled loop, "
                    "under the model's strategy and mesh. The model is taken as train takes it "
                    "(--from-hf DIR; --checkpoint-dir DIR --resume with the run's flags; or a "
                    "fresh one from the flags). Prints time to first token, decode tokens/s and "
                    "joules per generated token (measured on GPUs, else modelled, and said so).",
        epilog="Example: jphantom generate --from-hf tuned --prompts chat.jsonl "
               "--max-new-tokens 16 (a .jsonl of {\"messages\": [...]} rows is rendered with "
               "the checkpoint's chat template and its generation prompt)")
    gen.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="append", metavar="TEXT",
                     help="a user message, rendered with the chat template and its generation "
                          "prompt (repeatable: one conversation each)")
    gen.add_argument("--prompts", metavar="FILE", help="prompts: a text file (one a line) or a "
                     ".jsonl file of {\"messages\": [...]}, {\"prompt\": ...} or {\"text\": ...}")
    gen.add_argument("--max-new-tokens", type=positive_int, default=32,
                     help="tokens generated per prompt at most (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="0: greedy (default); above 0: sampled")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most probable "
                     "tokens (default 0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample within the nucleus of this "
                     "probability (default 1.0: all)")
    gen.add_argument("--sample-seed", type=int, default=0, help="the sampling seed (default 0)")
    gen.add_argument("--stop-token", type=int, action="append", metavar="ID",
                     help="a token id that ends a completion (repeatable; default: the "
                          "tokenizer's end-of-sequence token)")
    gen.add_argument("--out", metavar="FILE.jsonl", help="write the completions here (one "
                     "{\"prompt\", \"completion\", \"tokens\"} a line) instead of printing them")
    gen.add_argument("--results", metavar="FILE.json", default="out/generate/results.json",
                     help="the figures as JSON (default out/generate/results.json)")
    gen.add_argument("--device", metavar="NAME|FILE", default=None,
                     help="price the decode step's HBM roofline and the prefill on this device "
                          "description (h100-sxm, mi250x-gcd, ... or a TOML file; default: the "
                          "GPU this runs on, where a description names it); modelled")
    add_run_flags(gen, only=MODEL_FLAGS)
    add_device_flag(gen)
    gen.set_defaults(handler=handle)


def _generation_config(args, stops):
    from jphantom.generation import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.sample_seed,
                            stop_tokens=tuple(args.stop_token) if args.stop_token else stops)


def _model(settings: dict):
    """``(model, mesh or None)``: a Hugging Face checkpoint on one device, else the run the
    flags describe built as ``train`` builds it (its parameters restored with ``--resume``)."""
    if settings.get("from_hf") and not settings.get("mesh") and get(settings.get(
            "strategy", "dense")).one_device and not settings.get("resume"):
        from jphantom.models import hf
        return hf.load(settings["from_hf"]), None
    from jphantom.config import RunConfig
    from jphantom.loop.checkpoints import RunCheckpoints

    config = RunConfig.from_flags(**settings)
    built = config.build()
    state = built.program.init(built.step, seed=config.train.seed)
    if config.train.resume:
        identity = {"model": {"name": config.model.name}, "corpus": {}}
        state = RunCheckpoints(config.train, identity).restore(state, None)[0]
    mesh = built.mesh if built.mesh.devices.size > 1 else None
    return built.step.model(state), mesh


def handle(args: argparse.Namespace) -> int:
    from jphantom.generation import prompts as reading

    from jphantom.cli.train import TRAIN_DEFAULTS  # a checkpoint's optimizer state: train's

    settings = {k: v for k, v in run_settings(args, TRAIN_DEFAULTS).items()
                if k in MODEL_FLAGS or k in TRAIN_DEFAULTS}
    if args.device is not None:  # a bad description: one line before anything is read or built
        from jphantom.predict.device import load
        load(args.device)
    rows = reading.read_rows(args.prompt, args.prompts, args.chat)
    tokenizer, template, special = reading.tokenizer_and_template(
        settings.get("tokenizer"), settings.get("from_hf"), settings.get("chat_template"))
    config = _generation_config(args, reading.stop_ids(tokenizer, special))
    ids = reading.encode(rows, tokenizer, template)
    devices = args.devices
    if devices is None and settings.get("mesh"):
        from jphantom.runtime.mesh import MeshConfig
        devices = MeshConfig.parse(settings["mesh"]).device_count
    setup_devices(devices, at_least=args.devices is None)
    from jphantom.generation import check_prompts
    from jphantom.generation.report import measured, summary

    device = _device(args.device)
    model, mesh = _model(settings)
    check_prompts(ids, getattr(getattr(model, "config", None), "vocab_size", None))
    out, figures = measured(model, ids, config, mesh)
    figures["roofline"] = roofline(model, settings, figures, config.max_new_tokens, device)
    figures["roofline"]["same_device"] = args.device is None and device is not None
    texts = [tokenizer.decode([t for t in c if t not in config.stop_tokens])
             for c in out.completions]
    _write(args, rows, texts, out.completions, figures)
    print(summary(figures))
    print(roofline_line(figures))
    return 0


def _device(name: str | None):
    """The description ``--device`` names (a bad one: one line, exit 2, before anything runs),
    else the one naming this machine's first GPU, else None."""
    from jphantom.predict.device import for_kind, load

    if name is not None:
        return load(name)
    import jax

    first = jax.devices()[0]
    return for_kind(first.device_kind) if first.platform == "gpu" else None


def roofline(model, settings: dict, figures: dict, new_tokens: int, device) -> dict:
    """The decode step's HBM roofline (the bytes of weights and cache one step reads per device
    over the bandwidth) and the prefill's bound on ``device``, for the run's batch, bucket, mesh
    and strategy (:func:`jphantom.perf.inference.decode_roofline`, all modelled); what cannot be
    priced says why."""
    from jphantom.errors import ConfigError
    from jphantom.perf.inference import decode_roofline, prefill_bound

    if device is None:
        return {"unpriced": "no device description names this machine's devices: give --device"}
    config = getattr(model, "config", None)
    strategy = settings.get("strategy", "dense")
    options = dict(mesh=settings.get("mesh") or "model=1",  # one device priced as tensor's
                   strategy="tensor" if get(strategy).one_device else strategy,
                   ghost_width=settings.get("ghost_width"),
                   dtype=_element(model))
    batch, bucket = figures["prompts"], figures["bucket"]
    try:
        decode = decode_roofline(config, batch, bucket + new_tokens, device, **options)
        prefill = prefill_bound(config, batch, bucket, device, **options)
    except (ConfigError, AttributeError, TypeError, ValueError) as error:
        return {"unpriced": str(error).split("\n")[0], "device": device.name}
    return {"device": device.name, "label": "modelled", "decode": decode, "prefill": prefill}


def _element(model) -> str:
    """The dtype a decode step reads the model's weights and cache in, as the pricing names it:
    ``bf16`` for 16-bit parameters, else ``f32``."""
    import jax
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return "bf16" if leaves and leaves[0].dtype.itemsize == 2 else "f32"


def roofline_line(figures: dict) -> str:
    """One line: the roofline beside the measured figures (module docstring)."""
    r = figures["roofline"]
    if "unpriced" in r:
        return f"roofline: not priced ({r['unpriced']})"
    d, f = r["decode"], r["prefill"]
    measured = figures.get("decode_tokens_per_s")
    share = (f"; measured decode at {measured / d['roofline_tokens_per_s']:.0%} of it"
             if measured and r.get("same_device") else "")
    return (f"roofline on {r['device']} (modelled): a decode step reads "
            f"{d['bytes_per_step'] / 2**20:.3g} MiB a device, {d['roofline_tokens_per_s']:,.0f} "
            f"tokens/s at the HBM bound; predicted {d['tokens_per_s']:,.0f} tokens/s, "
            f"{d['joules_per_token']:.3g} J/token; prefill {f['step_seconds'] * 1e3:.3g} ms"
            + share)


def _write(args, rows, texts, completions, figures) -> None:
    """The completions printed or written to ``--out``; the figures to ``--results``."""
    lines = [{"prompt": row.get("text", row.get("messages")), "completion": text,
              "tokens": tokens} for row, text, tokens in zip(rows, texts, completions)]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("".join(json.dumps(line) + "\n" for line in lines))
        print(f"completions: {len(lines)} written to {args.out}")
    else:
        for line in lines:
            print(f"> {line['completion']}")
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps({"generate": figures}, indent=2) + "\n")
