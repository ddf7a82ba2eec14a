"""experiments/pipeline_schedules.py runs end to end (reduced grid) and its JSON holds what the
README quotes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # compiles 8 steps and times them: ~1 min
def test_pipeline_schedules_quick(tmp_path):
    out = tmp_path / "ps"
    subprocess.run([sys.executable, str(ROOT / "experiments/pipeline_schedules.py"), "--quick",
                    "--width", "64", "--depth", "8", "--microbatch", "8", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)
    results = json.loads((out / "results.json").read_text())
    assert (out / "pipeline_schedules.png").stat().st_size > 0
    for row in results["bubbles"]:
        assert row["simulated"] == pytest.approx(row["formula"])
        assert row["lockstep"] == pytest.approx(row["formula"])
    rows = {(r["microbatches"], r["schedule"]): r for r in results["memory_and_time"]}
    assert rows[(8, "gpipe")]["temp_bytes"] > rows[(2, "gpipe")]["temp_bytes"]
    assert all(r["step_seconds"] > 0 and r["permute_bytes"] > 0 for r in rows.values())
    p2p = {r["stages"]: r["permute_bytes_per_device"] for r in results["point_to_point"]}
    assert p2p[1] == 0 < p2p[2]
