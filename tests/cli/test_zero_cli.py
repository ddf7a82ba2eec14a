"""ZeRO, gradient accumulation and clipping from the command line: ``jphantom train --zero
--accumulate --clip-norm`` end to end at tiny sizes, bad values refused in one line before anything
compiles, and ``jphantom inspect --zero``'s per-device bytes of parameters, gradients and optimizer
state."""

import json

import pytest

from jphantom import cli
from jphantom.analysis.inspect import format_report
from jphantom.config import RunConfig
from jphantom.errors import ConfigError

from helpers import exit_code

FFN = ["train", "--model", "ffn", "--strategy", "tensor", "--width", "8", "--depth", "2",
       "--batch", "16", "--steps", "2", "--eval-every", "1", "--eval-batches", "1",
       "--no-progress"]


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_train_zero3_with_accumulation_and_clipping_matches_zero0(tmp_path, capsys):
    step = ["--mesh", "data=4,model=2", "--accumulate", "2", "--clip-norm", "1.0"]
    assert cli.main([*FFN, *step, "--zero", "3", "--out", str(tmp_path / "z3")]) == 0
    assert "step: ZeRO-3, 2 accumulation" in capsys.readouterr().out
    results = json.loads((tmp_path / "z3" / "results.json").read_text())
    config = results["config"]
    assert (config["zero"], config["accumulate"], config["clip_norm"]) == (3, 2, 1.0)
    assert results["step"] == {"zero": 3, "accumulate": 2, "clip_norm": 1.0,
                               "precision": "float32", "master_weights": "replicated",
                               "remat": "none"}
    assert results["history"]["validation_step"] == [1, 2]
    # ZeRO changes where the state lives, not the arithmetic: the same run without it
    assert cli.main([*FFN, *step, "--out", str(tmp_path / "z0")]) == 0
    plain = json.loads((tmp_path / "z0" / "results.json").read_text())
    assert plain["step"]["zero"] == 0
    for key in ("train_loss", "validation_loss"):
        assert results["history"][key] == pytest.approx(plain["history"][key], rel=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["--zero", "2", "--mesh", "model=8"], "zero=2 shards over the 'data' axis"),
    (["--accumulate", "3", "--mesh", "data=4,model=2"],
     "per-data-rank batch 4 is not divisible by accumulate=3"),
    (["--clip-norm", "0", "--mesh", "data=4,model=2"], "clip_norm=0.0 must be > 0"),
    (["--accumulate", "2", "--mesh", "stage=2,data=2,model=2", "--depth", "4"],
     "pipelines accumulate through --microbatches"),
    (["--zero", "1", "--strategy", "dense"], "zero=1 shards over the 'data' axis"),
])
def test_bad_step_settings_are_one_line_and_run_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert exit_code([*FFN, *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jphantom: error:") and err.count("\n") == 1, err
    assert message in err, err
    assert not out.exists()


def test_run_config_checks_the_step_settings_without_compiling():
    base = dict(model="ffn", strategy="tensor", width=8, batch=16, mesh="data=4,model=2",
                out=None)
    step = RunConfig.from_flags(**base, zero=2, accumulate=4, clip_norm=0.5).build().step
    assert (step.zero, step.accumulate) == (2, 4)
    for settings, message in ((dict(zero=4), "zero=4"), (dict(accumulate=0), "accumulate=0"),
                              (dict(clip_norm=float("nan")), "clip_norm=nan"),
                              (dict(accumulate=3), "not divisible by accumulate=3")):
        with pytest.raises(ConfigError, match=message):
            RunConfig.from_flags(**base, **settings).build()


def test_inspect_zero3_shards_parameters_gradients_and_adam_state_over_data(capsys):
    width, depth, data = 16, 2, 8
    memory = {}
    for zero in (0, 3):
        assert cli.main(["inspect", "--strategy", "tensor-t1", "--mesh", f"data={data},model=1",
                         "--width", str(width), "--depth", str(depth), "--batch", "16",
                         "--optimizer", "adam", "--zero", str(zero), "--json"]) == 0
        memory[zero] = json.loads(capsys.readouterr().out)["memory"]
    weights, biases = 4 * depth * width * width, 4 * depth * width  # float32 bytes
    count = 4  # Adam's int32 step count, replicated
    assert memory[0]["zero"] == 0 and memory[3]["zero"] == 3
    assert memory[0]["params_bytes"] == memory[0]["gradient_bytes"] == weights + biases
    assert memory[0]["optimizer_bytes"] == 2 * (weights + biases) + count
    # ZeRO-3: weights and biases 1/8 per device (model=1 splits nothing: the biases' dimension,
    # split over model on a wider mesh, is free for ZeRO here)
    assert memory[3]["params_bytes"] == memory[3]["gradient_bytes"] == (weights + biases) // data
    assert memory[3]["optimizer_bytes"] == 2 * (weights + biases) // data + count
    assert memory[3]["optimizer_bytes"] < memory[0]["optimizer_bytes"] / 5
    assert memory[3]["argument_bytes"] < memory[0]["argument_bytes"]  # XLA sees it too


def test_inspect_zero2_gradients_sgd_state_and_table(capsys):
    assert cli.main(["inspect", "--strategy", "tensor-t1", "--mesh", "data=4,model=2", "--width",
                     "16", "--batch", "16", "--zero", "2", "--accumulate", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    memory = report["memory"]
    assert report["config"]["zero"] == 2 and report["config"]["accumulate"] == 2
    assert memory["optimizer_bytes"] == 0  # SGD keeps no state
    assert memory["gradient_bytes"] < memory["params_bytes"]  # ZeRO-2: gradients split over data
    rows = {(c["kind"], tuple(c["axes"])) for c in report["collectives"]}
    assert ("reduce-scatter", ("data",)) in rows and ("all-gather", ("data",)) in rows
    header, _, row = format_report([report]).splitlines()[:3]
    assert "state MB" in header
    state = (memory["params_bytes"] + memory["gradient_bytes"]) / 1e6
    assert f"{state:.2f}" in row.split()
    assert exit_code(["inspect", "--strategy", "tensor-t1", "--mesh", "model=8", "--width", "16",
                       "--batch", "16", "--zero", "1"]) == 2
    assert "shards over the 'data' axis" in capsys.readouterr().err


def test_inspect_refuses_bad_precision_and_remat_before_compiling():
    """The names are checked by the configuration. (The old path refused remat and precision
    under gspmd; on the module step they are properties of the model's blocks and of the one
    step, so gspmd takes them too.)"""
    base = dict(model="ffn", strategy="tensor", width=8, depth=2, batch=8, mesh="model=2",
                out=None)
    with pytest.raises(ConfigError, match="precision='fp4'"):
        RunConfig.from_flags(**base, precision="fp4")
    with pytest.raises(ConfigError, match="remat='all'"):
        RunConfig.from_flags(**base, remat="all")
    gspmd = RunConfig.from_flags(**(base | {"strategy": "gspmd"}), remat="dots_saveable",
                                 precision="bf16")
    assert gspmd.build().step.spmd == "gspmd"
