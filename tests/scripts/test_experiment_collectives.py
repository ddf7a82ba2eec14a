"""experiments/collectives.py --quick: both transports run, every collective is fitted with Eq. 26.

The simulated transport runs on sub-meshes of the 8 devices conftest.py simulates in this process;
the gloo transport starts its own one-device worker processes over 127.0.0.1. No timing is asserted:
only that every measurement is a positive time and every fit has a finite RMSE (Seal et al. Table III's
error measure).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from conftest import require_devices

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "collectives.py"
KINDS = {"all-gather", "reduce-scatter", "all-reduce", "broadcast"}
TRANSPORTS = {"simulated", "gloo"}


def load_script():
    spec = importlib.util.spec_from_file_location("experiment_collectives", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quick_run_fits_every_collective_in_both_transports(tmp_path):
    require_devices(4)  # --quick measures p = 2, 4
    load_script().main(["--quick", "--out", str(tmp_path)])

    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "collectives.png").stat().st_size > 0

    assert set(results["fits"]) == TRANSPORTS
    for transport, by_kind in results["fits"].items():
        assert set(by_kind) == KINDS, transport
        for kind, cost in by_kind.items():
            for name in ("c1", "c2", "c3"):
                assert math.isfinite(cost[name]), (transport, kind, name)
            assert math.isfinite(cost["rmse_log2_us"]) and cost["rmse_log2_us"] >= 0, (transport, kind)
            assert cost["samples"] == 8  # 4 sizes x 2 group sizes

    timed = [s for s in results["samples"] if s["kind"] in KINDS]
    assert {(s["transport"], s["kind"]) for s in timed} == {(t, k) for t in TRANSPORTS for k in KINDS}
    assert {s["p"] for s in timed} == {2, 4}
    assert {s["m"] for s in timed} == {2**2, 2**6, 2**10, 2**14}
    for s in results["samples"]:
        assert s["times_us"] and all(t > 0 for t in s["times_us"]), s
        assert s["median_us"] > 0
    for s in timed:
        # Broadcast is a masked psum: it compiles to an all-reduce (no CPU collective-broadcast).
        assert s["hlo_ops"] == ["all-reduce" if s["kind"] == "broadcast" else s["kind"]], s
    for s in (s for s in timed if s["transport"] == "gloo"):
        assert len(s["times_us_by_rank"]) == s["p"]  # process 0 gathered every rank's times
        assert len(s["wrong_elements_by_rank"]) == s["p"]
    # Every result was checked against its expected value. gloo's reduce-scatter is exempt: on
    # jax 0.10 it intermittently corrupts the tail of rank 0's result (jax-ml/jax#40830), which the
    # script records (wrong_results) instead of failing the run.
    for s in results["samples"]:
        if (s["transport"], s["kind"]) != ("gloo", "reduce-scatter"):
            assert s["wrong_elements"] == 0, s["wrong_detail"]
    assert all(w["transport"] == "gloo" and w["kind"] == "reduce-scatter" for w in results["wrong_results"])
    assert set(results["frontier"]) == KINDS
