"""benchmarks/calibrate.py and benchmarks/gpu_predict.py run end to end in ``--small`` mode (tiny
shapes, on the CPU) and write complete results: a device description the simulator loads, the
predicted and measured steps. What they measure on a CPU is never asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--small",
                           "--out", str(out)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow  # a dozen tiny GEMMs, attention and launch programs: ~15 s
def test_calibrate_small_writes_a_loadable_description(tmp_path):
    from jphantom.predict.device import load

    _run("calibrate.py", tmp_path)
    data = json.loads((tmp_path / "calibrate.json").read_text())
    for key in ("device", "jax", "date", "base", "gemm", "attention", "stream", "launch",
                "power", "measured", "skipped", "description_path", "description"):
        assert key in data, key
    assert data["complete"] is True
    device = load(data["description_path"])
    assert device.name == "cpu-small-measured"
    for key in ("gemm_efficiency.bf16", "gemm_shape.k_half", "memory.stream_efficiency",
                "launch.kernel_us", "attention_efficiency.forward_hd64"):
        section, name = key.split(".")
        assert device.numbers[section][name].source == "measured", key
        assert "benchmarks/calibrate.py" in device.numbers[section][name].cite
    assert "power" in data["skipped"]  # no NVML here: the base's power kept
    assert device.numbers["power"]["busy_watts"].source != "measured"


@pytest.mark.slow  # calibrate plus two tiny compiled training steps: ~50 s
def test_gpu_predict_small_predicts_and_measures(tmp_path):
    from jphantom.predict.device import load

    _run("gpu_predict.py", tmp_path)
    data = json.loads((tmp_path / "gpu_predict.json").read_text())
    for key in ("device", "jax", "date", "calibration", "descriptions", "primary", "cases",
                "summary", "trace", "peer", "skipped"):
        assert key in data, key
    load(data["calibration"]["description_path"])
    assert data["primary"] == "shipped"
    ran = [c for c in data["cases"] if "step_seconds" in c.get("measured", {})]
    assert len(ran) >= 2, [c.get("measured", {}).get("stderr_tail") for c in data["cases"]]
    for case in ran:
        assert Path(case["measured"]["hlo_path"]).is_file()
        for label in ("shipped", "calibrated"):
            p = case["predicted"][label]
            for key in ("step_s", "error", "mfu", "measured_mfu", "joules_per_token"):
                assert key in p, (label, key)
            assert p["step_s"] > 0
    summary = data["summary"][data["primary"]]
    assert summary["cases"] == len(ran)
    for key in ("median_abs_error", "worst_abs_error", "spearman_step_seconds"):
        assert key in summary
    assert "predicted_top10" in data["trace"] or "error" in data["trace"]
    assert data["peer"].get("skipped") or "step_seconds" in data["peer"]
    assert (tmp_path / "gpu_predict.png").is_file()


def test_the_committed_h200_validation_is_what_the_simulator_says_now(tmp_path, monkeypatch):
    """benchmarks/results/gpu_predict/ (the first run on a lent H200) regenerates: two of its
    cases priced again by ``gpu_predict.py --repredict`` from their saved HLO on the run's
    calibrated description give the committed predictions, one of them merged from the trace
    run where the first run's budget skipped it. A change to the simulator that moves them
    fails here: run ``--repredict`` on the folder and commit what it says."""
    import shutil

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_predict

    committed = ROOT / "benchmarks" / "results" / "gpu_predict"
    first = json.loads((committed / "gpu_predict.json").read_text())
    rows = {r["name"]: r for r in first["cases"]}
    mine, merged = "0.1b-s1024-b8-bf16", "1.2b-s1024-b1-bf16"
    run, other = tmp_path / "run", tmp_path / "other"
    for folder in (run / "hlo", run / "calibration", other / "hlo"):
        folder.mkdir(parents=True)
    shutil.copy(committed / "calibration" / "h200-measured.toml", run / "calibration")
    shutil.copy(committed / "hlo" / f"{mine}.hlo.txt.gz", run / "hlo")
    shutil.copy(committed / "trace_run" / "hlo" / f"{merged}.hlo.txt.gz", other / "hlo")
    skipped = {"name": merged, "case": rows[merged]["case"], "skipped": "budget"}
    (run / "gpu_predict.json").write_text(json.dumps(
        dict(first, cases=[rows[mine], skipped], skipped=[merged], trace=None)))
    second = json.loads((committed / "trace_run" / "gpu_predict.json").read_text())
    (other / "gpu_predict.json").write_text(json.dumps(
        dict(second, cases=[r for r in second["cases"] if r["name"] == merged])))

    gpu_predict.repredict(run, [other])
    again = json.loads((run / "gpu_predict.json").read_text())
    assert again["repredicted"]["merged"][0]["cases"] == [merged] and not again["skipped"]
    for row in again["cases"]:
        was = rows[row["name"]]["predicted"]["calibrated"]
        now = row["predicted"]["calibrated"]
        assert now["step_s"] == pytest.approx(was["step_s"], rel=1e-6), row["name"]
        assert now["error"] == pytest.approx(was["error"], rel=1e-6)
        assert row["measured"]["hlo_path"] == f"hlo/{row['name']}.hlo.txt.gz"  # relative
