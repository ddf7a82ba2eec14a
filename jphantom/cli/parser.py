"""The flags commands share: one per setting of the run configuration, built from the sections'
fields (their type, default and help: :func:`jphantom.config.setting`), the settings read back
from them (and from ``--config``), and the argument parser whose errors are one line."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage is what ``--help`` is for); its
    subcommands' parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def strategy_names(model: str | None = "ffn") -> list[str]:
    """The strategies ``model`` runs under (every strategy for ``None``)."""
    from jphantom.registry import families, strategies

    return list(strategies.NAMES) if model is None else families.strategies_for(model)


def run_flag_choices() -> dict:
    """The choices of the run flags that have a fixed set (argparse refuses anything else)."""
    from jphantom.registry.attention_choices import ALGORITHMS, IMPLEMENTATIONS
    from jphantom.config import DTYPES, LR_SCHEDULES, OPTIMIZERS
    from jphantom.data.documents import LOSS_ON
    from jphantom.pipeline.config import GRAD_SUMS
    from jphantom.pipeline.schedule import ALL_SCHEDULES
    from jphantom.step.precision import NAMES as PRECISIONS
    from jphantom.step.remat import NAMES as REMATS
    from jphantom.registry.nonfinite import NONFINITE

    return {"schedule": ALL_SCHEDULES, "zero": (0, 1, 2, 3), "precision": PRECISIONS,
            "master_weights": ("replicated", "sharded"), "accumulate_grads_in": GRAD_SUMS,
            "remat": REMATS, "optimizer": OPTIMIZERS, "lr_schedule": LR_SCHEDULES,
            "dtype": DTYPES, "context_attention": ALGORITHMS,
            "on_nonfinite": NONFINITE, "attention": IMPLEMENTATIONS, "loss_on": LOSS_ON}


def add_run_flags(parser: argparse.ArgumentParser, defaults: dict | None = None,
                  only: tuple[str, ...] | None = None) -> None:
    """One flag per setting of :class:`jphantom.config.RunConfig` (flat names; ``--model`` is
    ``model.name``), typed by the sections' annotations, its help the field's (its metadata);
    ``defaults`` overrides shown defaults."""
    import typing

    from jphantom.config import FLAT, SECTIONS, field_of

    choices = run_flag_choices()
    defaults = defaults or {}
    for flat, (section, name) in FLAT.items():
        if only is not None and flat not in only:
            continue
        field = field_of(flat)
        kind = typing.get_type_hints(SECTIONS[section])[name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        default = defaults.get(flat, field.default)
        text = field.metadata["help"]
        text += f" (default {default})" if "default" not in text else ""
        flag = "--" + flat.replace("_", "-")
        aliases = ["--" + a.replace("_", "-") for a in field.metadata.get("aliases", ())]
        if base is bool:
            parser.add_argument(flag, *aliases, dest=flat, action=argparse.BooleanOptionalAction,
                                default=None, help=text)
            continue
        parser.add_argument(flag, *aliases, dest=flat, type=base if base in (int, float) else str,
                            default=None, choices=choices.get(flat), help=text)


def run_settings(args: argparse.Namespace, defaults: dict | None = None) -> dict:
    """The flat settings of a run: ``defaults``, then ``--config``'s file, then the flags; a
    ``--from-hf`` checkpoint that neither names a model chooses the family by its config.json's
    ``model_type`` (:func:`jphantom.registry.families.of_hf_checkpoint`)."""
    from jphantom.config import FLAT, load_toml

    given = {}
    if getattr(args, "config", None):
        given.update(load_toml(args.config))
    for flat in FLAT:
        value = getattr(args, flat, None)
        if value is not None:
            given[flat] = value
    if isinstance(given.get("from_hf"), str) and "model" not in given:
        from jphantom.registry import families

        given["model"] = families.of_hf_checkpoint(given["from_hf"]).name
    return {**(defaults or {}), **given}


def add_gpu_defaults_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """``--no-gpu-defaults``: leave :mod:`jphantom.runtime.gpu_defaults` out (``what`` they do here)."""
    parser.add_argument("--no-gpu-defaults", action="store_true",
                        help=f"do not {what}; without this flag they are used, and what is set "
                             "is reported")
