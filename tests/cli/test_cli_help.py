"""The run flags' help has one source: each field of the configuration's sections carries its
help in its metadata (:func:`jphantom.config.setting`), and the parsers build from it."""

import argparse
import dataclasses
import re

import pytest

from jphantom import cli
from jphantom.config import ALIASES, FLAT, SECTIONS, field_of


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_section_field_carries_its_help():
    for cls in SECTIONS.values():
        for field in dataclasses.fields(cls):
            assert field.metadata.get("help"), f"{cls.__name__}.{field.name} has no help"


@pytest.mark.parametrize("command", ["train", "inspect", "compile", "verify"])
def test_each_run_flag_has_its_fields_help(command):
    """Every flag the parser builds from a configuration field shows that field's help (and the
    default where the help names none), under the field's flat name and its aliases."""
    from jphantom.cli.verify import used_flags

    built = {"train": set(FLAT), "verify": set(used_flags())}.get(command,
                                                                  set(cli.INSPECT_FLAGS))
    flags = {a.dest: a for a in _subparser(command)._actions if a.dest in built}
    assert set(flags) == built  # inspect's and compile's own --strategy takes several
    for flat, action in flags.items():
        field = field_of(flat)
        text = field.metadata["help"]
        if "default" in text:
            assert action.help == text, flat
        else:  # the default the command shows, after the field's help
            assert re.fullmatch(re.escape(text) + r" \(default [^()]*\)", action.help), flat
        names = {"--" + name.replace("_", "-") for name in
                 [flat, *(a for a, b in ALIASES.items() if b == flat)]}
        assert names <= set(action.option_strings), flat
    if command == "train":
        assert "--from-gpt2" in flags["from_hf"].option_strings
