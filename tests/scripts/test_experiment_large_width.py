"""experiments/large_width.py --quick: the Fig. 6 grid from the step model, JSON keys and the PNG.

Pure arithmetic (no device, no compilation): about 2 s, so not marked slow.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "large_width.py"


def load_script():
    spec = importlib.util.spec_from_file_location("experiment_large_width", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_every_config_and_claim(tmp_path, capsys):
    load_script().main(["--quick", "--out", str(tmp_path)])
    assert "break-even" in capsys.readouterr().out.lower()
    assert (tmp_path / "large_width.png").stat().st_size > 0
    results = json.loads((tmp_path / "results.json").read_text())

    for key in ("experiment", "paper", "labels", "config", "device", "comm_model", "machine", "rows",
                "break_even_us", "oom_sweep", "claims", "table"):
        assert key in results, key
    config = results["config"]
    assert config["quick"] is True and config["batch"] == 256 and config["depth"] == 2
    assert results["device"]["memory_bytes"] == 64 * 2**30
    strategies = {"tensor (T1)", "phantom (fused)", "phantom (unfused)"}
    cells = {(r["width"], r["num_shards"], r["strategy"]) for r in results["rows"]}
    assert cells == {(n, p, s) for n in (131072, 262144) for p in (32, 64, 128, 256) for s in strategies}
    for row in results["rows"]:
        for key in ("parameters", "gradients", "optimizer_state", "activations", "total"):
            assert row["memory_gib"][key] >= 0
        for key in ("compute", "comm", "gemm_overhead", "total"):
            assert row["seconds"][key] >= 0
        assert set(row["estimate"]) == {"config", "exact", "modelled", "assumptions"}
    assert set(results["claims"]) == {"i", "ii", "iii"}
    for claim in results["claims"].values():
        assert set(claim) == {"paper", "ours"}
    assert len(results["break_even_us"]) == 8
    assert {(o["depth"], o["optimizer"]) for o in results["oom_sweep"]} == {
        (d, o) for d in range(1, 7) for o in ("sgd", "momentum", "adam")}
    # Exact arithmetic the claims rest on: TP at n = 262144, p = 32 with L = 2 and Adam holds
    # 4 x 16 GiB of weights, gradients and moments (plus biases and activations): above 64 GiB.
    tp = next(r for r in results["rows"]
              if (r["width"], r["num_shards"], r["strategy"]) == (262144, 32, "tensor (T1)"))
    assert tp["memory_bytes"]["parameters"] + tp["memory_bytes"]["gradients"] \
        + tp["memory_bytes"]["optimizer_state"] > 64 * 2**30
    assert not tp["fits_in_memory"]
    assert results["sensitivity"] is None  # --quick skips the sweeps
