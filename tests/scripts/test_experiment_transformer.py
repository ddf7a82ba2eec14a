"""experiments/transformer_tp_vs_phantom.py runs end to end with --quick and writes its JSON and PNG.

No timing and no loss value is asserted beyond what is exact: the HLO collective bytes equal the
strategies' hand-written inventories, phantom's largest collectives are k/(h/p) of Megatron's, the
cumulative modelled energy is steps x energy per step, and dense, tensor and tensor + SP train the
same model (same initialisation and data) to the same loss.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import require_devices

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "transformer_tp_vs_phantom.py"


def load():
    spec = importlib.util.spec_from_file_location("experiment_transformer_tp_vs_phantom", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # four runs, each compiled twice (training step and inspected step): ~1 min
def test_transformer_tp_vs_phantom_quick(tmp_path):
    require_devices(8)
    load().main(["--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "transformer_tp_vs_phantom.png").stat().st_size > 10_000
    assert {"config", "machine", "eq8", "energy_source", "energy_model", "power_model",
            "comm_model", "matmul_flops_per_second_measured", "unigram_cross_entropy", "targets",
            "runs", "phantom_ratios", "paper", "paper_vs_ours"} <= result.keys()
    assert result["energy_source"] == "modelled"
    config = result["config"]
    h, p, k, tokens = config["hidden"], config["shards"], 2, config["batch"] * config["seq_len"]
    assert result["eq8"]["ghost_widths_below"] == [k] and result["eq8"]["bound"] == (h / p) * (1 - 1 / p)

    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["dense", "tensor", "tensor-sp", "phantom-k2"]
    for name, r in runs.items():
        assert (tmp_path / "runs" / name / "results.json").is_file()
        assert r["energy_source"] == "modelled" and r["energy_per_step_j"] > 0
        history = r["history"]
        assert history["validation_step"] == [3, 6]
        assert len(history["validation_loss"]) == 2
        assert history["cumulative_energy_j_modelled"] == pytest.approx(
            [s * r["energy_per_step_j"] for s in history["validation_step"]])
        assert r["flops_per_device_per_step"] > 0 and r["median_step_seconds_measured"] > 0
        assert {"steps", "energy_j"} <= r["to_tp_loss"].keys() and r["to_common"]["steps"] is not None
        if name != "dense":  # the compiled step moves exactly the strategy's hand-counted elements
            inventory = r["collective_inventory_elements"]
            assert r["collective_bytes_per_step"] == 4 * sum(sum(v) for v in inventory.values())
            assert r["devices"] == p and r["comm_seconds_per_step_modelled"] > 0

    dense, tensor, sp, phantom = (runs[n] for n in ("dense", "tensor", "tensor-sp", "phantom-k2"))
    assert dense["devices"] == 1 and dense["collective_bytes_per_step"] == 0
    assert dense["params"] == tensor["params"] == sp["params"]
    for other in (tensor, sp):  # the same dense GPT, initialisation and batches
        assert other["final_validation_loss"] == pytest.approx(dense["final_validation_loss"],
                                                               abs=1e-3)
    # Seal et al.'s communication claim: per collective k/(n/p) of TP's, here k/(h/p).
    assert phantom["collective_bytes_per_step"] < tensor["collective_bytes_per_step"]
    assert phantom["collective_bytes_per_step"] < sp["collective_bytes_per_step"]
    assert phantom["largest_collective_bytes"]["all-gather"] == 4 * tokens * p * k
    assert tensor["largest_collective_bytes"]["all-reduce"] == 4 * tokens * h
    (ratio,) = result["phantom_ratios"]
    assert ratio["all_gather_vs_tensor_all_reduce"] == ratio["k_over_h_per_p"] == k / (h / p)
    assert ratio["reduce_scatter_vs_sp_reduce_scatter"] == k / (h / p)
    assert ratio["bytes_per_step_vs_tensor"] < 1

    paper = result["paper"]
    assert paper["params_ratio"] == pytest.approx([1 / 64 + 2 * 64 / 16384, 1 / 8 + 16 * 8 / 16384])
    assert paper["energy_to_target_ratio"] == pytest.approx([0.1427, 0.8792], abs=1e-4)
    claims = [row["claim"] for row in result["paper_vs_ours"]]
    assert len(claims) == 6 and all({"paper", "ours", "holds"} <= row.keys()
                                    for row in result["paper_vs_ours"])
