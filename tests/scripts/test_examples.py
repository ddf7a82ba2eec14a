"""The scripts under examples/ run as printed (the docs include them)."""

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    import sys

    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # make test: the README's own TinyLM block on 8 devices, tests/models/test_byo_model.py
def test_byo_flax_model_trains_the_same_on_one_and_eight_devices(capsys):
    assert _load("byo_flax_model").main(3) == 0
    assert "largest difference over 3 steps" in capsys.readouterr().out


@pytest.mark.slow
def test_byo_phantom_matches_its_dense_equivalent():
    assert _load("byo_phantom").main(3) == 0
