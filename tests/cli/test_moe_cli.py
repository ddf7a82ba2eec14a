"""MoE from the command line: ``jphantom train --moe-every --experts --top-k --capacity-factor
--dtd --cac`` end to end at tiny sizes (dropped fraction reported), ``jphantom inspect`` listing the
all-to-alls, impossible settings refused in one line before anything compiles; the experiment and
the benchmark scripts run (``--quick``)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jphantom import cli

from helpers import exit_code

ROOT = Path(__file__).resolve().parents[2]
GPT = ["--model", "transformer", "--strategy", "tensor", "--layers", "2", "--hidden", "16",
       "--heads", "2", "--seq-len", "8", "--batch", "8"]
TRAIN = ["train", *GPT, "--steps", "2", "--eval-every", "1", "--eval-batches", "1",
         "--no-progress"]


@pytest.mark.slow  # DTD and CAC: tests/models/test_moe_transformer.py in make test
@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_train_ted_with_dtd_and_cac_reports_dropped_tokens(tmp_path, capsys):
    out = tmp_path / "moe"
    assert cli.main([*TRAIN, "--mesh", "data=2,expert=2,model=2", "--moe-every", "2",
                     "--experts", "4", "--top-k", "1", "--capacity-factor", "1.0", "--dtd",
                     "--cac", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "MoE: every 2 block(s), 4 experts, top-1" in printed and "dropped" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["step"]["remat"] == "collectives_saveable"
    moe = results["moe"]
    assert (moe["experts"], moe["top_k"], moe["dtd"]) == (4, 1, True)
    assert 0.0 <= moe["final_dropped_fraction"] < 1.0
    assert len(results["history"]["dropped_fraction"]) == 2
    assert moe["active_params"] < results["params"]


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_inspect_lists_the_all_to_alls_over_expert(capsys):
    assert cli.main(["inspect", *GPT, "--mesh", "expert=4,model=2", "--moe-every", "1",
                     "--experts", "4", "--json", "--devices", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = [r for r in report["collectives"] if r["kind"] == "all-to-all"]
    assert [tuple(r["axes"]) for r in rows] == [("expert",)]
    assert rows[0]["count"] == 4 * 2  # two MoE blocks, two each way
    # per rank 16 tokens, C = ceil(1.25 * 16 * 2 / 4) = 10: one [E, C, h] float32 buffer each
    assert rows[0]["bytes"] == 4 * 2 * 4 * 10 * 16 * 4


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "expert=2,model=1"], "an 'expert' mesh axis splits the experts"),
    (["--moe-every", "2", "--top-k", "9"], "top_k=9 > experts=8"),
    (["--moe-every", "2", "--capacity-factor", "0"], "capacity_factor=0.0 must be > 0"),
    (["--moe-every", "2", "--experts", "6", "--mesh", "expert=4,model=1"],
     "experts=6 is not divisible by the expert axis size 4"),
    (["--moe-every", "3"], "layers=2 is not divisible by moe_every=3"),
    (["--moe-every", "2", "--dtd", "--strategy", "phantom", "--ghost-width", "2"], "dtd"),
    (["--moe-every", "2", "--cac", "--remat", "dots_saveable", "--mesh", "model=2"],
     "contradicts remat"),
    (["--moe-every", "2", "--cac", "--remat", "none", "--mesh", "model=2"],
     "contradicts remat='none'"),
])
def test_bad_moe_settings_are_one_line_and_run_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "never"
    assert exit_code([*TRAIN, *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jphantom: error:") and err.count("\n") == 1, err
    assert message in err, err
    assert not out.exists()


@pytest.mark.slow  # three short trainings and three compiled steps: ~1 min
def test_moe_experiment_runs_and_reports_dtd_and_eq_7_4(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "experiments" / "moe.py"), "--quick", "--out",
                    str(tmp_path)], check=True, cwd=ROOT, capture_output=True, text=True,
                   timeout=900)
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["training"]) == {"dense", "moe-cf1.25", "moe-cf1.0"}
    assert result["all_to_all"]["dtd_ratio"] > 1
    memory = result["memory"]
    # float32 Adam without ZeRO: 16 bytes per parameter (+ Adam's step counts)
    assert 0 <= memory["measured_model_state_bytes"] - memory["eq_7_4_no_zero_bytes"] < 64
    assert (tmp_path / "moe.png").exists()


@pytest.mark.slow  # two compiled AdamW steps on 8 devices: ~20 s
def test_quick_moe_benchmark_reports_the_ratio(tmp_path):
    spec = importlib.util.spec_from_file_location("moe_bench", ROOT / "benchmarks" / "moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["moe_over_dense_per_active_flop"] > 0
    assert set(result["models"]) == {"dense", "moe"}
