"""`jphantom compare`: TP and phantom trained to the same target, Table I's shape."""

import json

import pytest

from jphantom import cli
from jphantom.compare import CompareConfig, auto_ghost_width, run_compare, write_outputs
from jphantom.errors import ConfigError

REQUIRED = {"strategy", "shards", "ghost_width", "params", "iterations_to_target",
            "collective_bytes_per_iteration", "energy_per_iteration_j", "energy_total_j",
            "energy_source"}


def test_compare_table_rows_and_outputs(tmp_path):
    config = CompareConfig(width=32, shards=(2, 4), ghost_widths=(2,), seeds=(0, 1), batch=16,
                           max_steps=40, eval_every=10, train_size=512, eval_size=64)
    result = run_compare(config, progress=False, log=lambda *a: None)
    rows = result["rows"]
    assert len(rows) == 2 + 2
    for row in rows:
        assert REQUIRED <= row.keys()
        assert row["iterations_to_target"] is not None  # the automatic target is reachable by all
        assert row["energy_source"] == "modelled"
        assert row["energy_total_j"] == pytest.approx(row["energy_per_iteration_j"]
                                                      * row["iterations_to_target"])
    tp = {r["shards"]: r for r in rows if r["strategy"] == "tensor"}
    assert tp[2]["iterations_to_target"] == tp[4]["iterations_to_target"]  # same dense model
    for row in rows:
        if row["strategy"] != "phantom":
            continue
        ratio = row["ghost_width"] / (config.width / row["shards"])
        per_op = lambda r, kind: next(c["bytes"] / c["count"] for c in r["collectives"]
                                      if c["kind"] == kind)
        for kind in ("all-gather", "reduce-scatter"):
            assert per_op(row, kind) == pytest.approx(ratio * per_op(tp[row["shards"]], kind))
    for q in result["ratios"]:  # the same fact, as the table reports it
        assert q["ghost_width_over_block"] == q["ghost_width"] / (config.width / q["shards"])
        for kind in ("all-gather", "reduce-scatter"):
            assert q["bytes_per_collective"][kind] == pytest.approx(q["ghost_width_over_block"])
    json_path, png_path = write_outputs(result, tmp_path)
    assert json.loads(json_path.read_text())["rows"][0]["strategy"] == "tensor"
    assert png_path.stat().st_size > 10_000


def test_auto_ghost_width_is_inside_eq8():
    assert auto_ghost_width(4096, 8) == 56  # bound 448
    assert auto_ghost_width(16, 8) == 1


def test_compare_rejects_bad_settings(capsys):
    with pytest.raises(ConfigError, match="needs 16 devices"):
        CompareConfig(shards=(16,))
    with pytest.raises(ConfigError, match="ghost_widths='some'"):
        CompareConfig(ghost_widths="some")
    with pytest.raises(SystemExit):
        cli.main(["compare", "--shards", "two"])
    assert "not a comma-separated list of integers" in capsys.readouterr().err


def test_compare_uses_a_power_meter_when_given(tmp_path):
    """With a meter (here a fake 100 W per device sampler) every row's energy is measured over the
    training window; the model's figure stays next to it."""
    from jphantom.energy import NvmlPowerMeter

    config = CompareConfig(width=32, shards=(2,), ghost_widths=(2,), seeds=(0,), batch=16,
                           max_steps=20, eval_every=10, train_size=512, eval_size=64)
    factory = lambda p: NvmlPowerMeter(interval_s=0.005, sampler=lambda: [100.0] * p,
                                       device_names=[f"fake{i}" for i in range(p)])
    result = run_compare(config, progress=False, log=lambda *a: None, meter_factory=factory)
    for row in result["rows"]:
        assert row["energy_source"] == "measured"
        assert row["energy_meter"]["device_names"] == ["fake0", "fake1"]
        assert row["energy_meter"]["mean_watts"] == pytest.approx(200.0)
        assert row["energy_meter"]["metered_steps"] == [19]  # the first (start-up) step excluded
        assert row["energy_per_iteration_j"] > 0 and row["energy_per_iteration_j_modelled"] > 0
        assert row["energy_total_j"] == pytest.approx(row["energy_per_iteration_j"]
                                                      * row["iterations_to_target"])
