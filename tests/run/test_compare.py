"""`jphantom compare`: TP and phantom trained to the same target, Table I's shape."""

import json

import pytest

from jphantom import cli
from jphantom.loop.compare import (CompareConfig, auto_ghost_width, format_table, run_compare,
                              write_outputs)
from jphantom.errors import ConfigError

REQUIRED = {"strategy", "shards", "ghost_width", "params", "iterations_to_target",
            "collective_bytes_per_iteration", "energy_per_iteration_j", "energy_total_j",
            "energy_source"}


@pytest.mark.slow  # trains TP and phantom to a target: ~13 s
def test_compare_table_rows_and_outputs(tmp_path):
    config = CompareConfig.from_flags(width=32, shards=(2, 4), ghost_widths=(2,), seeds=(0, 1),
                                      batch=16, steps=40, eval_every=10, train_size=512,
                                      eval_size=64)
    result = run_compare(config, progress=False, log=lambda *a: None)
    rows = result["rows"]
    assert len(rows) == 2 + 2
    for row in rows:
        assert REQUIRED <= row.keys()
        p, k = row["shards"], row["ghost_width"]  # Table I's weights (biases excluded)
        assert row["params"] == (2 * 32 * 32 if k is None else 2 * (32 * 32 // p + k * 32 * p))
        assert row["iterations_to_target"] is not None  # the automatic target is reachable by all
        assert row["energy_source"] == "modelled"
        assert row["energy_total_j"] == pytest.approx(row["energy_per_iteration_j"]
                                                      * row["iterations_to_target"])
    assert {r["strategy"] for r in rows} == {"tensor-t1", "phantom"}
    tp = {r["shards"]: r for r in rows if r["strategy"] == "tensor-t1"}
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
    assert json.loads(json_path.read_text())["rows"][0]["strategy"] == "tensor-t1"
    assert "tensor-t1" in format_table(result)
    assert png_path.stat().st_size > 10_000


def test_auto_ghost_width_is_inside_eq8():
    assert auto_ghost_width(4096, 8) == 56  # bound 448
    assert auto_ghost_width(16, 8) == 1


AT_BUILD = ("needs 16 devices", r"width=30 is not divisible by num_shards=4")


@pytest.mark.parametrize("settings, message", [
    (dict(shards=(16,)), "needs 16 devices"),
    (dict(ghost_widths="some"), "ghost_widths='some'"),
    (dict(ghost_widths=(0,)), r"ghost_widths=0 must be an integer >= 1"),
    (dict(ghost_widths=(2, 2)), r"ghost_widths=\(2, 2\) repeats \[2\]"),
    (dict(shards=(0,)), r"shards=0 must be an integer >= 1"),
    (dict(shards=(2, 4, 2)), r"repeats \[2\]"),
    (dict(seeds=(1, 1)), r"seeds=\(1, 1\) repeats \[1\]"),
    (dict(seeds=()), "seeds is empty"),
    (dict(batch=0), r"batch=0 must be at least 1"),
    (dict(width=2.5), r"width=2.5 must be int"),
    (dict(width=30, shards=(4,)), r"width=30 is not divisible by num_shards=4"),
    (dict(target_loss=0.0), r"target_loss=0.0 must be > 0"),
    (dict(learning_rate=-1.0), r"learning_rate=-1.0"),
    (dict(target_margin=-0.1), r"target_margin=-0.1"),
    (dict(model="gpt2", strategy="dense"), r"compare trains Seal et al.'s FFN"),
])
def test_compare_rejects_bad_settings(settings, message):
    """``CompareConfig.from_flags``: the base run's flat settings over the comparison's
    defaults, and the sweep (shards, ghost widths, seeds, margin), refused on construction;
    what needs the devices or every run's shapes, by ``build()``."""
    if message in AT_BUILD:
        config = CompareConfig.from_flags(**settings)  # valid as data
        with pytest.raises(ConfigError, match=message):
            config.build()
        return
    with pytest.raises(ConfigError, match=message):
        CompareConfig.from_flags(**settings)


def test_a_compare_configuration_is_pure_data(monkeypatch):
    """Constructing a CompareConfig validates it without jax's devices or the file system (as a
    RunConfig: test_run.py); build(), the explicit next step, checks the sweep against the
    devices, with the same error."""
    import jax

    def no_devices(*args, **kwargs):
        raise AssertionError("a configuration asked jax for its devices")

    for name in ("devices", "device_count", "local_devices"):
        monkeypatch.setattr(jax, name, no_devices)
    config = CompareConfig.from_flags(width=64, shards=(2, 16), ghost_widths=(2,), seeds=(0,))
    with pytest.raises(ConfigError, match="ghost_widths=0 must be an integer >= 1"):
        CompareConfig.from_flags(ghost_widths=(0,))  # the sweep's own rules: no jax either
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"shards=\(2, 16\) needs 16 devices, have "
                                          f"{jax.device_count()}"):
        config.build()


def test_compare_refuses_what_cannot_fit_before_training():
    """n = 2**20: 4 TiB of TP weights per device at p = 2; refused with the estimate at once."""
    config = CompareConfig.from_flags(width=2**20, shards=(2,), ghost_widths=(1,), seeds=(0,),
                                      batch=8)
    with pytest.raises(ConfigError, match=r"training ffn under tensor-t1 on mesh model=2 needs about"):
        run_compare(config, progress=False, log=lambda *a: None)


def test_cli_compare_fails_fast_on_bad_input(tmp_path, capsys):
    """A bad --out (an existing file, or a folder that cannot be created) and --ghost-width 0 fail
    before the first run, in one line, with exit status 2."""
    existing = tmp_path / "results.json"
    existing.write_text("{}")
    cases = [(["--out", str(existing), "--ghost-width", "1"], "is an existing file"),
             (["--out", str(existing / "sub"), "--ghost-width", "1"], "cannot be written"),
             (["--ghost-width", "0", "--out", str(tmp_path / "x")], "ghost_widths=0")]
    for extra, message in cases:
        assert cli.main(["compare", "--width", "16", "--shards", "2", "--seeds", "0",
                         "--max-steps", "2", "--no-progress", *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert existing.read_text() == "{}"
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # a full compare run through the CLI: ~7 s
def test_cli_compare_with_an_unreachable_target_still_reports(tmp_path, capsys):
    """No run reaches --target-loss 1e-9: the table is printed (iterations '-'), results.json and
    the plot (log scales with nothing positive to show) are written."""
    out = tmp_path / "out"
    assert cli.main(["compare", "--width", "16", "--shards", "2", "--ghost-width", "1",
                     "--seeds", "0", "--batch", "8", "--max-steps", "3", "--eval-every", "3",
                     "--target-loss", "1e-9", "--energy", "model", "--no-progress",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tensor-t1" in printed and "phantom" in printed and "wrote" in printed
    result = json.loads((out / "results.json").read_text())
    assert result["target_loss"] == 1e-9
    assert all(r["iterations_to_target"] is None and r["energy_total_j"] is None
               for r in result["rows"])
    assert (out / "comparison.png").stat().st_size > 10_000


def test_cli_reports_a_diverged_run_in_one_line(tmp_path, capsys):
    assert cli.main(["compare", "--width", "16", "--shards", "2", "--ghost-width", "1",
                     "--seeds", "0", "--batch", "8", "--max-steps", "50", "--eval-every", "50",
                     "--learning-rate", "1e30", "--energy", "model", "--no-progress",
                     "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "training diverged" in err and "at step" in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_compare_uses_a_power_meter_when_given(tmp_path):
    """With a meter (here a fake 100 W per device sampler) every row's energy is measured over the
    training window; the model's figure stays next to it."""
    from jphantom.energy import NvmlPowerMeter

    config = CompareConfig.from_flags(width=32, shards=(2,), ghost_widths=(2,), seeds=(0,),
                                      batch=16, steps=20, eval_every=10, train_size=512,
                                      eval_size=64)
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


def test_a_compare_builds_each_job_once_for_all_its_seeds(tmp_path, monkeypatch):
    """``jphantom compare`` builds each (strategy, p, k) once (``RunConfig.build``), and its
    seeds, its memory check and its step report use that ``Built``: 2 jobs of 2 seeds build
    twice (they used to build 20 times)."""
    from jphantom.config import RunConfig

    calls = []
    build = RunConfig.build
    monkeypatch.setattr(RunConfig, "build", lambda self: calls.append(self) or build(self))
    assert cli.main(["compare", "--width", "16", "--shards", "2", "--ghost-width", "1",
                     "--seeds", "0,1", "--batch", "8", "--max-steps", "2", "--eval-every", "2",
                     "--energy", "model", "--no-progress", "--out", str(tmp_path)]) == 0
    assert [(c.parallel.strategy, c.train.seed) for c in calls] == [("tensor-t1", 0),
                                                                  ("phantom", 0)]

