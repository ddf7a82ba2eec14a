"""No collective over a one-device group: a mesh axis of size 1 is an axis nothing is split over,
so a layer, the batch, ZeRO and the gradient reduction issue no collective over it (XLA would keep
such a psum as a copy, and ``jphantom inspect`` would list it with empty axes).

Each case compiles a step on a mesh with size-1 axes through ``jphantom inspect --json`` and
asserts that every collective of the compiled program spans more than one device, and that the
ones that remain are over the axes of size > 1."""

import json

import pytest

from jphantom import cli

GPT = ["--model", "gpt2", "--layers", "2", "--hidden", "16", "--heads", "8", "--seq-len", "8",
       "--batch", "8"]
FFN = ["--model", "ffn", "--width", "16", "--depth", "2", "--batch", "16"]


def _inspect(capsys, *argv):
    assert cli.main(["inspect", *argv, "--json", "--devices", "8"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("argv, allowed", [
    ([*FFN, "--strategy", "tensor", "--mesh", "data=8,model=1"], {("data",)}),
    ([*GPT, "--strategy", "tensor", "--mesh", "data=8,model=1"], {("data",)}),
    ([*GPT, "--strategy", "tensor", "--mesh", "data=1,model=8"], {("model",)}),
    ([*GPT, "--strategy", "pmm3d", "--mesh", "data=8,x=1,y=1,z=1"], {("data",)}),
    ([*GPT, "--strategy", "pmm3d", "--mesh", "data=2,x=1,y=2,z=2"],
     {("data",), ("y",), ("z",), ("data", "z")}),
    ([*GPT, "--strategy", "tensor", "--mesh", "data=4,expert=2,model=1", "--moe-every", "2",
      "--experts", "4"], {("data",), ("expert",), ("data", "expert")}),
    ([*FFN, "--strategy", "tensor", "--mesh", "data=1,model=8", "--zero", "3"], {("model",)}),
])
# make test: data=1 (FFN under ZeRO-3) and model=1 (FFN); the rest: make test-all
@pytest.mark.slow_cells("argv1-allowed1", "argv5-allowed5", "argv3-allowed3", "argv2-allowed2",
                        "argv4-allowed4")
def test_no_collective_runs_over_a_size_one_axis(capsys, argv, allowed):
    report = _inspect(capsys, *argv)
    empty = [op for op in report["collective_ops"] if not op["axes"]]
    assert not empty, f"collectives over one-device groups: {empty}"
    assert {tuple(row["axes"]) for row in report["collectives"]} <= allowed
