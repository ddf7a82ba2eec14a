"""Pipeline parallelism from the command line: ``jphantom schedule`` (pure arithmetic), ``jphantom
train`` and ``jphantom inspect`` on a mesh with a ``stage`` axis, and bad pipeline settings refused
in one line before anything compiles."""

import json
import math
import os
import subprocess
import sys

import pytest

from jphantom import cli
from jphantom.config import RunConfig, load_toml
from jphantom.errors import ConfigError
from jphantom.pipeline.schedule import lockstep, simulate

from helpers import exit_code


def _one_line_error(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.startswith("jphantom: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


# --------------------------------------------------------------------------------------------------
# jphantom schedule
# --------------------------------------------------------------------------------------------------


def test_schedule_prints_timeline_bubble_beside_formula_and_lockstep(capsys):
    assert cli.main(["schedule", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("stage ")]
    assert len(rows) == 4 and all(row.endswith("|") for row in rows)
    assert "F0" in rows[0] and "B7" in rows[3] and "." in rows[3]  # the last stage idles first
    assert "(P-1)/(M+P-1)" in out
    assert out.count("27.27%") == 3  # simulated = Narayanan et al.'s 3/11 = lock-step executor's
    assert "4 3 2 1" in out  # PipeDream-Flush: P - s in flight on stage s
    steps = lockstep("1f1b", 4, 8)
    assert " ".join(map(str, steps.peak_in_flight)) in out
    ticks = next(line for line in out.splitlines() if line.strip().startswith("ticks"))
    assert ticks.split()[-1] == str(len(steps.ticks))


def test_schedule_json_matches_the_simulator_and_the_lockstep_table(capsys):
    argv = ["schedule", "--schedule", "interleaved-1f1b", "--stages", "2", "--microbatches", "4",
            "--virtual-stages", "2", "--backward-cost", "3", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    simulation = simulate("interleaved-1f1b", 2, 4, 2, backward_cost=3.0)
    steps = lockstep("interleaved-1f1b", 2, 4, 2)
    assert (result["stages"], result["microbatches"], result["virtual_stages"]) == (2, 4, 2)
    assert result["backward_cost"] == 3.0
    assert result["simulated"] == {"bubble_fraction": simulation.bubble_fraction,
                                   "makespan": simulation.makespan,
                                   "peak_in_flight": simulation.peak_in_flight}
    assert result["formula"]["expression"] == "(P-1)/(P-1+V*M)"
    assert math.isclose(result["formula"]["bubble_fraction"], 1 / (1 + 2 * 4))
    assert math.isclose(result["simulated"]["bubble_fraction"], 1 / 9)
    assert result["lockstep"] == {"ticks": len(steps.ticks),
                                  "peak_in_flight": list(steps.peak_in_flight),
                                  "cost": steps.cost(3.0),
                                  "bubble_fraction": steps.bubble_fraction(3.0)}
    assert result["timeline"] == simulation.timeline()


def test_schedule_gpipe_formula_and_width(capsys):
    assert cli.main(["schedule", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2",
                     "--width", "30", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["formula"] == {"expression": "(P-1)/(M+P-1)", "bubble_fraction": 1 / 3}
    assert result["simulated"]["peak_in_flight"] == [2, 2]  # GPipe holds all M
    assert all(len(row) == len("stage 0 |") + 30 + 1 for row in result["timeline"].splitlines())


@pytest.mark.parametrize("argv, message", [
    (["--stages", "0"], "--stages 0 must be at least 1"),
    (["--microbatches", "0"], "--microbatches 0 must be at least 1"),
    (["--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "6",
      "--virtual-stages", "2"], "microbatches divisible by stages"),
    (["--schedule", "1f1b", "--virtual-stages", "2"], "only applies to 'interleaved-1f1b'"),
    (["--backward-cost", "0"], "backward_cost=0.0 must be a positive finite number"),
    (["--width", "0"], "--width 0 is too narrow"),
    (["--width", "1"], "--width 1 is too narrow to show each task apart: give --width >= 33"),
])
def test_schedule_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert exit_code(["schedule", *argv]) == 2
    _one_line_error(capsys, message)


def test_schedule_says_the_executor_runs_the_zero_bubble_schedules(capsys):
    assert cli.main(["schedule", "--schedule", "zb-h1", "--stages", "2", "--microbatches",
                     "2"]) == 0
    out = capsys.readouterr().out
    assert "`jphantom train --schedule` runs them" in out and "not run" not in out


def test_schedule_unknown_name_is_refused_by_the_parser(capsys):
    assert exit_code(["schedule", "--schedule", "zero-bubble"]) == 2
    assert "invalid choice: 'zero-bubble'" in capsys.readouterr().err


def test_schedule_needs_no_jax_backend():
    """With an unusable JAX_PLATFORMS a backend would fail to start: the command must not ask."""
    env = {**os.environ, "JAX_PLATFORMS": "no-such-platform"}
    done = subprocess.run([sys.executable, "-m", "jphantom.cli", "schedule", "--stages", "3",
                           "--microbatches", "3", "--json"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["formula"]["bubble_fraction"] == pytest.approx(2 / 5)


def test_help_texts_name_the_pipeline_flags(capsys):
    for command, flags in (("schedule", ("--schedule", "--stages", "--microbatches",
                                         "--virtual-stages", "--backward-cost", "--json")),
                           ("train", ("--schedule", "--microbatches", "--virtual-stages",
                                      "stage=2")),
                           ("inspect", ("--schedule", "--microbatches", "--virtual-stages"))):
        assert exit_code([command, "--help"]) == 0
        out = capsys.readouterr().out
        for flag in flags:
            assert flag in out, (command, flag)
    assert exit_code(["--help"]) == 0
    assert "schedule" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# jphantom train on a stage axis
# --------------------------------------------------------------------------------------------------


def test_train_pipelined_ffn_writes_the_pipeline_into_results(tmp_path, capsys):
    out = tmp_path / "pipe"
    assert cli.main(["train", "--model", "ffn", "--strategy", "tensor-t1", "--width", "16",
                     "--depth", "2", "--batch", "8", "--mesh", "stage=2,data=2,model=2",
                     "--microbatches", "2", "--schedule", "gpipe", "--steps", "2",
                     "--eval-every", "1", "--eval-batches", "1", "--optimizer", "sgd",
                     "--learning-rate", "0.1", "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["pipeline"] == {"schedule": "gpipe", "microbatches": 2, "virtual_stages": 1,
                                   "stages": 2, "unroll_layers": 8,
                                  "accumulate_grads_in": "float32"}
    assert results["mesh"] == "data=2,stage=2,model=2"
    assert results["config"]["microbatches"] == 2
    assert results["config"]["schedule"] == "gpipe"
    assert results["config"]["lr_schedule"] == "constant"  # the learning-rate schedule
    assert all(math.isfinite(v) for v in results["history"]["train_loss"])
    assert results["history"]["validation_step"] == [1, 2]
    assert "pipeline: gpipe, 2 stages, 2 micro-batches" in capsys.readouterr().out


FFN = dict(model="ffn", strategy="tensor-t1", width=16, out=None, progress=False)


def test_unpipelined_results_have_no_pipeline_entry():
    config = RunConfig.from_flags(**FFN, mesh="data=2,model=4", batch=8)
    assert config.pipeline() is None and config.build().step.pipeline is None


def test_default_microbatches_are_the_stages():
    from jphantom.config.sections import ParallelConfig
    from jphantom.pipeline.config import PipelineConfig

    config = RunConfig.from_flags(**FFN, depth=4, batch=8, mesh="stage=4,model=2")
    pipeline = config.pipeline()
    assert (pipeline.schedule, pipeline.microbatches, pipeline.virtual_stages) == ("1f1b", 4, 1)
    # unroll_layers is written once, in PipelineConfig; the flag's help says that value
    assert pipeline.unroll_layers == PipelineConfig().unroll_layers
    help_text = ParallelConfig.__dataclass_fields__["unroll_layers"].metadata["help"]
    assert f"the pipeline's, {PipelineConfig().unroll_layers})" in help_text, help_text
    assert config.build().step.pipeline == pipeline
    assert config.program().mesh.device_count == 8
    # batch 4 over data=2: 2 rows per data rank, the default 2 micro-batches of one row each
    RunConfig.from_flags(**FFN, batch=4, mesh="stage=2,data=2,model=2")


@pytest.mark.parametrize("kwargs, message", [
    (dict(mesh="data=2,model=4", microbatches=2), r"--microbatches 2 only apply to a pipelined "
                                                  r"step.*add stage=N to the mesh"),
    (dict(mesh="model=4", schedule="gpipe"), r"--schedule gpipe.*stage=N"),
    (dict(mesh="model=4", virtual_stages=2), r"--virtual-stages 2.*stage=N"),
    (dict(mesh="model=4", unroll_layers=0), r"--unroll-layers 0.*stage=N"),
    (dict(mesh="stage=2,model=4", unroll_layers=-1), r"unroll_layers=-1 must be at least 0"),
    (dict(mesh="stage=2,data=2,model=2", batch=6, microbatches=2),
     r"batch=6 over data=2: the per-data-rank batch 3 is not divisible by microbatches=2"),
    (dict(mesh="stage=2,model=4", virtual_stages=2), r"--schedule interleaved-1f1b"),
    (dict(mesh="stage=2,model=4", schedule="interleaved-1f1b", virtual_stages=2,
          layers=2), r"layers=2 is not divisible by stages x virtual stages = 2 x 2"),
    (dict(mesh="stage=2,model=4", schedule="interleaved-1f1b", microbatches=3,
          batch=12), r"interleaved-1f1b needs microbatches divisible by the 2 stages"),
    (dict(mesh="stage=2,model=4", schedule="zero-bubble"), r"schedule="),
    (dict(mesh="stage=2,model=4", microbatches=0), r"microbatches=0 must be at least 1"),
    (dict(mesh="stage=2,model=4", strategy="dense"), r"does not run inside pipeline stages"),
])
def test_bad_pipeline_settings_are_refused_before_training(kwargs, message):
    settings = dict(strategy="tensor", layers=2, hidden=16, heads=4, seq_len=8, batch=8) | kwargs
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_flags(**settings).build()  # construction, or the explicit build


def test_cli_train_bad_pipeline_flag_is_one_line_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    assert cli.main(["train", "--strategy", "tensor", "--mesh", "data=2,model=4",
                     "--microbatches", "2", "--out", str(out)]) == 2
    _one_line_error(capsys, "add stage=N to the mesh")
    assert cli.main(["train", "--strategy", "tensor", "--mesh", "stage=2,data=2,model=2",
                     "--batch", "6", "--microbatches", "2", "--out", str(out)]) == 2
    _one_line_error(capsys, "not divisible by microbatches=2")
    assert not out.exists()


def test_train_pipeline_settings_from_toml(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('schedule = "gpipe"\nmicrobatches = 4\nmesh = "stage=2,model=4"\n'
                    'strategy = "tensor"\nlayers = 2\nhidden = 16\nheads = 4\nbatch = 8\n')
    config = RunConfig.from_flags(**load_toml(str(toml)))
    assert (config.parallel.schedule, config.parallel.microbatches) == ("gpipe", 4)
    assert config.build().step.pipeline.microbatches == 4


# --------------------------------------------------------------------------------------------------
# jphantom inspect on a stage axis
# --------------------------------------------------------------------------------------------------


def test_inspect_pipelined_ffn_reports_memory_and_collective_permutes(capsys):
    assert cli.main(["inspect", "--strategy", "tensor-t1", "--width", "32", "--depth", "2",
                     "--batch", "8", "--mesh", "stage=2,data=2,model=2", "--microbatches", "2",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pipeline"] == {"schedule": "1f1b", "microbatches": 2, "virtual_stages": 1,
                                  "stages": 2, "unroll_layers": 8,
                                  "accumulate_grads_in": "float32"}
    memory = report["memory"]
    assert memory["temp_bytes"] > 0 and memory["argument_bytes"] > 0 and memory["output_bytes"] > 0
    assert "alias_bytes" in memory
    assert memory["temp_size_in_bytes"] == memory["temp_bytes"]  # XLA's names are kept
    rows = {(c["kind"], tuple(c["axes"])): c for c in report["collectives"]}
    permute = rows[("collective-permute", ("stage",))]
    # 1F1B on 2 stages, 2 micro-batches: every activation and cotangent crosses the stage boundary
    assert permute["count"] >= 2 * 2
    permutes = [op for op in report["collective_ops"] if op["kind"] == "collective-permute"]
    assert permutes and all(op["source_target_pairs"] for op in permutes)
    assert ("all-gather", ("model",)) in rows  # tensor parallelism inside each stage


def test_inspect_unpipelined_report_has_memory_and_no_pipeline(capsys):
    assert cli.main(["inspect", "--strategy", "tensor-t1", "--width", "32", "--batch", "8",
                     "--mesh", "data=2,model=4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "pipeline" not in report
    assert report["memory"]["argument_bytes"] > 0
    assert not any(c["kind"] == "collective-permute" for c in report["collectives"])


def test_inspect_pipelined_table(capsys):
    assert cli.main(["inspect", "--strategy", "tensor-t1", "--width", "32", "--depth", "2",
                     "--batch", "8",
                     "--mesh", "stage=2,data=2,model=2", "--schedule", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: gpipe, 2 stages, 2 micro-batches" in out
    assert "collective-permute [stage]" in out and "pairs={{" in out


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "data=2,model=4", "--microbatches", "2"], "add stage=N to the mesh"),
    (["--mesh", "stage=2,data=2,model=2", "--microbatches", "3"],
     "per-data-rank batch 4 is not divisible by microbatches=3"),
    (["--mesh", "stage=2,data=2,model=2", "--virtual-stages", "2"],
     "applies to 'interleaved-1f1b' only"),
    (["--mesh", "stage=2,model=4", "--depth", "3"], "depth=3 is not divisible by stages"),
])
def test_inspect_bad_pipeline_flags_are_one_line(argv, message, capsys):
    assert exit_code(["inspect", "--strategy", "tensor-t1", "--width", "32", "--batch", "8",
                       *argv]) == 2
    _one_line_error(capsys, message)


def test_inspect_settings_check_the_batch_against_microbatches_without_compiling():
    """What ``inspect`` builds (the run's configuration) is checked on construction."""
    ffn = dict(FFN, width=32, depth=2)
    with pytest.raises(ConfigError, match="per-data-rank batch 3 is not divisible"):
        RunConfig.from_flags(**ffn, batch=6, mesh="stage=2,data=2,model=2",
                             microbatches=2).build()
    with pytest.raises(ConfigError, match="only apply to a pipelined step"):
        RunConfig.from_flags(**ffn, batch=8, mesh="model=4", schedule="gpipe").build()
    config = RunConfig.from_flags(**ffn, batch=8, mesh="stage=2,model=4")
    assert config.pipeline().microbatches == 2
