"""Every experiment script runs end to end with --quick (tiny sizes) and writes its JSON and PNG.

No timing is asserted (timings are noisy); what is asserted is what the scripts compute exactly:
GEMM counts, FLOP formulas, byte ratios, and the paper's numbers they quote.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import require_devices

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load(name):
    spec = importlib.util.spec_from_file_location(f"experiment_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_decompressor_fusion_quick(tmp_path):
    """E11: the unfused layer runs 3(p-1) decompressor GEMMs (Eqs. 11, 17, 21 per sender) and 6 others
    (compressor, local, dL/dL, dL/dC and the two products of dL/dy); the fused one 7 GEMMs at every p.
    The decompressor's share of the FLOPs grows with p."""
    load("decompressor_fusion").main(["--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "decompressor_fusion.png").stat().st_size > 10_000
    rows = result["rows"]
    assert [r["shards"] for r in rows] == [8, 16]
    for r in rows:
        p = r["shards"]
        assert r["unfused"]["dot_ops"] == 3 * (p - 1) + 6
        assert r["fused"]["dot_ops"] == 7
        assert r["fused"]["median_s"] > 0 and r["unfused"]["median_s"] > 0
        # The compiled GEMMs do exactly the analytic multiply-adds: unfused, the paper's p-1
        # decompressors; fused, all p slots (own one masked) and the dropped k x pk corner of the
        # one weight-gradient GEMM (Eqs. 19-21).
        m, k, b = r["block"], 16, 32
        assert r["unfused"]["dot_flops"] == r["flops"]["total"]
        assert r["fused"]["dot_flops"] == 2 * b * (2 * k * m + 2 * m * m + 2 * p * k * m
                                                   + (m + k) * (m + p * k))
        for name in ("fused", "unfused"):
            assert r[name]["xla_flops"] >= r[name]["dot_flops"]  # + element-wise work
    assert rows[1]["decompress_flop_share"] > rows[0]["decompress_flop_share"]


@pytest.mark.slow
def test_fixed_loss_quick(tmp_path):
    """Table I / Fig. 7: compare's rows plus the paper's Table I ratios side by side."""
    require_devices(4)
    result = load("fixed_loss").main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {"config", "rows", "ratios", "paper", "paper_vs_ours"} <= saved.keys()
    for name in ("comparison.png", "fig7.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    paper = saved["paper_vs_ours"]
    assert paper["e9_energy_tp_over_phantom"]["paper"] == pytest.approx(265.9, abs=0.05)
    assert paper["energy_total_ratio"]["paper"] == pytest.approx([0.1427, 0.8792], abs=1e-4)
    assert paper["iterations_ratio"]["paper"] == pytest.approx([157 / 453, 488 / 453])
    assert all(r["iterations_to_target"] is not None for r in result["rows"])


@pytest.mark.slow
def test_fixed_iteration_quick(tmp_path):
    """Fig. 5: the measured part's HLO bytes equal the analytic step model's; every paper panel is
    modelled for TP (tensor-t1), the paper's Table II TP and phantom."""
    from jphantom.perf.step_model import StepShape, estimate_step

    require_devices(4)
    result = load("fixed_iteration").main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "fixed_iteration.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "results.json").read_text())
    measured = [r for r in saved["rows"] if r["part"] == "measured"]
    assert {(r["shards"], r["ghost_width"]) for r in measured} == {
        (p, k) for p in (2, 4) for k in (None, 2, 4)}
    for r in measured:
        shape = StepShape(r["strategy"], r["width"], r["depth"], r["shards"], r["batch"],
                          ghost_width=r["ghost_width"])
        assert r["collective_bytes_per_device"] == estimate_step(shape).collective_bytes
        assert r["seconds_per_iteration_measured"] > 0
    modelled = [r for r in saved["rows"] if r["part"] == "modelled"]
    for panel in ("5a", "5b", "5c"):
        strategies = {r["strategy"] for r in modelled if r["panel"] == panel}
        assert strategies == {"tensor-t1", "tensor-table2", "phantom"}
        assert set(result["verdicts"][panel]) == {"paper", "metric", "t1", "table2"}
    for r in modelled:
        if r["strategy"] == "tensor-table2":  # T1 plus a broadcast and an all-reduce of n B
            assert r["bytes_ratio_vs_tp"] > 1 and r["comm_ratio_vs_tp"] > 1


@pytest.mark.slow  # four FFN steps compiled and four GPT steps timed: ~1 min
def test_pmm3d_quick(tmp_path):
    """AxoNN's 3D matmul: on every grid the FFN step's HLO collectives equal Eqs. 5.1-5.4's
    buffers summed over the layers, element for element (Singh's thesis ch. 5)."""
    require_devices(8)
    assert load("pmm3d").main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results-8.json").read_text())
    assert (tmp_path / "pmm3d-8.png").stat().st_size > 0
    assert len(result["ffn"]) == 4 and all(row["exact"] for row in result["ffn"])
    assert len(result["gpt"]["rows"]) == 4
    assert {"GPT-20B", "GPT-40B"} == set(result["planner"])


def test_quick_runs_never_write_into_committed_results(tmp_path):
    """Every benchmark and experiment with --quick takes its folder from
    ``analysis.machine.output_folder``: --out when given, else the committed results for a full
    run and a fresh scratch folder for a --quick one."""
    from jphantom.analysis.machine import output_folder

    committed = tmp_path / "results" / "name"
    assert output_folder(None, committed, quick=False, name="name") == committed
    scratch = output_folder(None, committed, quick=True, name="name")
    assert scratch.is_dir() and committed not in (scratch, *scratch.parents)
    scratch.rmdir()
    assert output_folder(tmp_path / "given", committed, quick=True, name="name") == \
        tmp_path / "given"
    scripts = [*EXPERIMENTS.glob("*.py"), *(EXPERIMENTS.parent / "benchmarks").glob("*.py")]
    for script in scripts:
        text = script.read_text()
        if "--quick" in text and script.name != "versus_previous.py":
            assert "output_folder(" in text, f"{script.name}: --quick must not default to results/"


@pytest.mark.slow  # ~80 s: five compiles of a ring step; tests/strategies/test_context.py covers the rest
def test_long_context_quick(tmp_path):
    """The script runs; ring attention's temporary memory is below the unsplit step's already at
    64 tokens."""
    import json

    assert load("long_context").main(["--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    memory = {(r["attention"], r["context"]): r["temp_bytes_per_device"] for r in rows}
    assert memory[("ring", 8)] < memory[("none", 1)]
    assert (tmp_path / "long_context.png").exists()


@pytest.mark.slow  # five compiled pipelines and FSDP steps
def test_pipeline_vs_fsdp_quick(tmp_path):
    """The script runs; a pipeline moves fewer collective bytes per device than FSDP's gathers
    of the whole model; ZB-H1, executed, trains to 1F1B's loss, and its lock-step table, priced
    with the measured task times, is shorter."""
    import json

    assert load("pipeline_vs_fsdp").main(["--quick", "--out", str(tmp_path)]) == 0
    rows = {r["label"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    bytes_of = lambda r: sum(r["collective_bytes_by_axis"].values())
    assert bytes_of(rows["1f1b P=2"]) < bytes_of(rows["fsdp (zero-3)"])
    zb, base = rows["zb-h1 P=2"], rows["1f1b P=2"]
    assert zb["stretch"] < base["stretch"]
    assert zb["loss"] == pytest.approx(base["loss"], rel=1e-4)
    assert set(zb["task_ms"]) == {"F", "backward", "B", "W"}
    assert zb["vs_1f1b"]["lockstep_time"] == pytest.approx(zb["lockstep_ms"] / base["lockstep_ms"])
