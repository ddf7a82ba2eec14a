"""The SAMO, precision and data-parallel experiment scripts run end to end (reduced settings)
and write what the README quotes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script, tmp_path, *args):
    subprocess.run([sys.executable, str(ROOT / "experiments" / script), "--out", str(tmp_path),
                    *args], check=True, cwd=ROOT, capture_output=True, text=True, timeout=900)
    return json.loads((tmp_path / "results.json").read_text())


@pytest.mark.slow  # five SAMO states and steps: ~15 s
def test_samo_experiment_matches_the_formula(tmp_path):
    rows = _run("samo.py", tmp_path, "--width", "64", "--depth", "2")["rows"]
    assert [r["sparsity"] for r in rows] == [0.0, 0.25, 0.5, 0.8, 0.9]
    for r in rows:
        assert r["at_rest_ratio"] == pytest.approx(1.0, rel=0.05)
        assert r["all_reduce_elements"] == r["nonzeros"]


@pytest.mark.slow  # six short trainings: ~1 min
def test_precision_experiment_reports_steps_to_target(tmp_path):
    models = _run("precision.py", tmp_path, "--quick")["models"]
    assert set(models) == {"ffn", "transformer"}
    assert all(m["steps_to_target"]["float32"] is not None for m in models.values())


@pytest.mark.slow  # three data-parallel sizes, two compiled steps each: ~20 s
def test_data_parallel_experiment_predicts_and_measures(tmp_path):
    result = _run("data_parallel.py", tmp_path, "--quick")
    assert [r["data"] for r in result["rows"]] == [1, 2, 4]
    assert result["summary"]["mse_eq4"] is not None
