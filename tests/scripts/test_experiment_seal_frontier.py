"""experiments/seal_frontier.py --quick: tiny FFNs compiled for the CPU devices, priced on the
MI250X GCD's description and by Seal et al.'s Eq. 26; every ratio from its runs, Eq. 1's joules,
the collectives Table II names, the JSON and the PNG. (The paper's sizes, compiled for rocm:mi250x,
are the full run's: experiments/results/seal_frontier.)"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "seal_frontier.py"


def load_script():
    spec = importlib.util.spec_from_file_location("experiment_seal_frontier", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("seal_frontier")
    load_script().main(["--quick", "--out", str(out)])
    return out, json.loads((out / "results.json").read_text())


def test_quick_run_writes_every_pair_and_the_png(quick):
    out, results = quick
    assert (out / "seal_frontier.png").stat().st_size > 0
    assert results["config"]["quick"] and results["config"]["target"] == "cpu"
    assert {(r["p"], r["strategy"]) for r in results["runs"]} == {
        (p, s) for p in (8,) for s in ("tensor-t1", "phantom")}
    assert [r["p"] for r in results["rows"]] == [8]
    assert set(results["claims"]) == set()  # no paper width in the quick grid
    assert results["device"]["name"] == "mi250x-gcd"


def test_ratios_and_joules_follow_from_the_runs(quick):
    _, results = quick
    by = {(r["p"], r["strategy"]): r for r in results["runs"]}
    for row in results["rows"]:
        tp, pp = by[(row["p"], "tensor-t1")], by[(row["p"], "phantom")]
        assert math.isclose(row["time_ratio"], pp["step_s"] / tp["step_s"])
        assert math.isclose(row["eq26_energy_ratio"], pp["eq26_joules"] / tp["eq26_joules"])
    for run in results["runs"]:  # Eq. 1 on every device: A = 560 W computing, B = 90 W waiting
        assert math.isclose(run["joules"], run["p"] * (
            560 * run["compute_s"] + 90 * run["exposed_comm_s"]), rel_tol=1e-9)
        assert math.isclose(run["step_s"], run["compute_s"] + run["exposed_comm_s"],
                            rel_tol=1e-9)


def test_eq26_prices_the_collectives_table_ii_names(quick):
    """One all-gather forward per layer (L = 2) and one reduce-scatter backward per layer, except
    T1's first (no gradient of the input) where phantom still needs Gamma_1 for its compressor's
    gradient; and the reported loss's scalar all-reduce. Each at Table III's latency c1 log2 p
    (AG 149.94, RS 145.52, AR 33.4 us) plus bandwidth."""
    _, results = quick
    for run in results["runs"]:
        scatters = 2 if run["strategy"] == "phantom" else 1
        assert run["eq26_collectives"] == {"all-gather": 2, "reduce-scatter": scatters,
                                           "all-reduce": 1}, run
        latency = (2 * 149.94 + scatters * 145.52 + 33.4) * math.log2(run["p"]) * 1e-6
        assert latency < run["eq26_comm_s"] < latency + 1e-3
