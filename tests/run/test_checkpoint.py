"""Orbax checkpoints: a resumed run continues its loss curve exactly, a tensor-parallel
checkpoint restores on another mesh, a phantom one is refused where its shapes differ, old
checkpoints are pruned, and a run killed during a save resumes from the last complete one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jphantom import cli
from jphantom.errors import ConfigError
from jphantom.config import RunConfig
from jphantom.loop.trainer import run

from conftest import require_devices
from helpers import child_env

FFN = dict(model="ffn", strategy="tensor", width=16, depth=2, batch=16, eval_every=2,
           eval_batches=1, progress=False)


def _config(**settings) -> RunConfig:
    return RunConfig.from_flags(**settings)  # the command line's flat names


@pytest.mark.parametrize("strategy", [pytest.param("tensor", marks=pytest.mark.slow), "gspmd"])
@pytest.mark.slow_cells("gspmd")
def test_a_resumed_run_continues_the_loss_curve_exactly(tmp_path, strategy):
    """Also the GSPMD baseline, whose restored optimizer state must land on the step's devices."""
    require_devices(4)
    settings = dict(FFN, mesh="data=2,model=2", strategy=strategy)
    whole = run(_config(**settings, steps=6, out=str(tmp_path / "whole")))
    ckpt = tmp_path / "ckpt"
    run(_config(**settings, steps=4, out=str(tmp_path / "part"), checkpoint_dir=str(ckpt),
                  save_every=2, keep_checkpoints=2))
    resumed = run(_config(**settings, steps=6, out=str(tmp_path / "part"),
                            checkpoint_dir=str(ckpt), save_every=2, keep_checkpoints=2,
                            resume=True))
    assert resumed.history["train_loss"] == whole.history["train_loss"]
    assert resumed.checkpoints["resumed_from"] == 4
    assert resumed.checkpoints["steps"] == [4, 6]  # keep the newest two
    lines = (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 7))


@pytest.mark.slow  # docs/multi-host-and-checkpoints.md resumes onto a pipeline mesh in make test
@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_a_tensor_checkpoint_restores_on_other_meshes(tmp_path):
    """Saved on data=2,model=4 after 2 steps; resumed on model=4 and on model=2, the next steps'
    losses equal the uninterrupted run's (dense-shaped weights: only their shards move)."""
    require_devices(8)
    settings = dict(FFN, eval_every=4)
    whole = run(_config(**settings, mesh="data=2,model=4", steps=4, out=str(tmp_path / "w")))
    saved = tmp_path / "saved"
    run(_config(**settings, mesh="data=2,model=4", steps=2, out=str(tmp_path / "a"),
                  checkpoint_dir=str(saved)))
    for mesh in ("model=4", "model=2"):
        ckpt = tmp_path / f"ckpt-{mesh}"
        shutil.copytree(saved, ckpt)
        resumed = run(_config(**settings, mesh=mesh, steps=4, out=str(tmp_path / mesh),
                                checkpoint_dir=str(ckpt), resume=True))
        assert resumed.history["train_loss"] == pytest.approx(
            whole.history["train_loss"], rel=1e-5)


def test_a_phantom_checkpoint_is_refused_where_its_shapes_differ(tmp_path):
    require_devices(4)
    settings = dict(FFN, strategy="phantom", ghost_width=2)
    run(_config(**settings, mesh="model=2", steps=1, out=str(tmp_path / "a"),
                  checkpoint_dir=str(tmp_path / "ckpt")))
    with pytest.raises(ConfigError, match="depend on the mesh"):
        run(_config(**settings, mesh="model=4", steps=2, out=str(tmp_path / "b"),
                      checkpoint_dir=str(tmp_path / "ckpt"), resume=True))


@pytest.mark.parametrize("argv, message", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--save-every", "2"], "--save-every needs --checkpoint-dir"),
    (["--checkpoint-dir", "{tmp}/ckpt", "--resume"], "no complete checkpoint"),
])
def test_bad_checkpoint_settings_are_one_line(argv, message, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = cli.main(["train", "--model", "ffn", "--strategy", "tensor", "--width", "8",
                         "--mesh", "model=2", "--batch", "8", "--steps", "2", "--no-progress",
                         "--out", str(tmp_path / "out"), *argv])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("jphantom: error:") and err.count("\n") == 1 and message in err, err


@pytest.mark.slow  # two subprocess trainings of 40 steps: ~40 s
def test_a_run_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    """SIGKILL while checkpoints are being written every step: the newest complete checkpoint
    is intact (a half-written one never shadows it) and the resumed run's loss curve equals an
    uninterrupted run's."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    common = ["train", "--model", "ffn", "--strategy", "tensor", "--width", "64", "--depth", "4",
              "--mesh", "data=2,model=2", "--batch", "32", "--steps", "40", "--eval-every", "40",
              "--eval-batches", "1", "--no-progress", "--devices", "4"]
    env = child_env(devices=4)
    command = [sys.executable, "-m", "jphantom.cli", *common, "--checkpoint-dir", str(ckpt),
               "--save-every", "1", "--keep-checkpoints", "100", "--out", str(out)]
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(ckpt.glob("[0-9]*"))) < 5:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    resumed = subprocess.run([*command[:-2], "--resume", "--out", str(out)], env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    whole = subprocess.run([sys.executable, "-m", "jphantom.cli", *common, "--out",
                            str(tmp_path / "whole")], env=env, capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr
    got = json.loads((out / "results.json").read_text())
    want = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert got["checkpoints"]["resumed_from"] >= 1
    assert got["history"]["train_loss"] == want["history"]["train_loss"]


# make test: SIGTERM's stop, checkpoint, one line and resume (test_resilience.py), in this process
@pytest.mark.slow
def test_ctrl_c_stops_at_a_step_writes_what_the_run_has_and_exits_130(tmp_path):
    """SIGINT (Ctrl-C) during training: the run stops, writes metrics.jsonl (every logged step),
    results.json (``interrupted``: true) and a final checkpoint of the state it reached, and the
    command exits 130 without a traceback; the checkpoint resumes."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    command = [sys.executable, "-m", "jphantom.cli", "train", "--model", "ffn", "--strategy",
               "tensor", "--width", "16", "--depth", "2", "--mesh", "data=2,model=1",
               "--batch", "16", "--steps", "100000", "--eval-every", "100000",
               "--eval-batches", "1", "--no-progress", "--devices", "2",
               "--checkpoint-dir", str(ckpt), "--out", str(out)]
    env = child_env(devices=2)
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists()
                                      or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 130, stderr
    assert "Traceback" not in stderr and "SIGINT: stopped after step" in stderr
    results = json.loads((out / "results.json").read_text())
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert results["interrupted"] is True and logged == list(range(1, len(logged) + 1))
    saved = sorted(int(p.name) for p in ckpt.glob("[0-9]*"))
    assert saved and saved[-1] >= logged[-1], stderr  # the state it reached


def test_resume_skips_a_damaged_newest_checkpoint_and_says_so(tmp_path):
    """The newest checkpoint's arrays damaged on disk: --resume restores the newest one that
    restores, with a warning naming the step it skipped, and continues the curve from there."""
    require_devices(2)
    settings = dict(FFN, mesh="data=2,model=1", checkpoint_dir=str(tmp_path / "ckpt"),
                    save_every=2, keep_checkpoints=5)
    run(_config(**settings, steps=4, out=str(tmp_path / "a")))
    newest = tmp_path / "ckpt" / "4"
    damaged = [p for p in (newest / "state").rglob("*") if p.is_file()]
    assert damaged
    for path in damaged:
        path.write_bytes(b"not a checkpoint")
    from jphantom.errors import JPhantomWarning

    with pytest.warns(JPhantomWarning, match=r"step 4: .*resumed from step 2"):
        resumed = run(_config(**settings, steps=6, resume=True, out=str(tmp_path / "a")))
    assert resumed.checkpoints["resumed_from"] == 2


def test_resume_with_another_optimizer_is_one_line_naming_it(tmp_path):
    require_devices(2)
    settings = dict(FFN, mesh="data=2,model=1", checkpoint_dir=str(tmp_path / "ckpt"))
    run(_config(**settings, steps=2, optimizer="sgd", out=str(tmp_path / "a")))
    with pytest.raises(ConfigError, match="another optimizer's state"):
        run(_config(**settings, steps=4, optimizer="adamw", resume=True,
                    out=str(tmp_path / "a")))


def test_resume_refusals_come_before_the_step_compiles(tmp_path, monkeypatch):
    """Another model, optimizer or a checkpoint at the last step: refused from the checkpoint's
    JSON and the abstract state, before the compiled memory check (they came after the step was
    compiled and the state created, 11-17 s)."""
    import jphantom.loop.trainer as run_module

    require_devices(2)
    settings = dict(FFN, mesh="data=2,model=1", checkpoint_dir=str(tmp_path / "ckpt"))
    run(_config(**settings, steps=2, optimizer="sgd", out=str(tmp_path / "a")))

    def compiles(*args, **kwargs):
        raise AssertionError("the step was compiled before the refusal")

    monkeypatch.setattr(run_module, "check_memory", compiles)
    for changed, message in [(dict(optimizer="adamw"), "another optimizer's state"),
                             (dict(optimizer="sgd", width=32),
                              "saved by model ffn with width=16; this run's has width=32"),
                             (dict(optimizer="sgd", steps=2), "at step 2, not before steps=2")]:
        with pytest.raises(ConfigError, match=message):
            run(_config(**{**settings, "steps": 4, **changed}, resume=True,
                        out=str(tmp_path / "a")))


def test_a_damaged_checkpoint_reason_quotes_no_bound_method():
    """Some bindings' errors read ``<bound method ...>``: the warning's reason drops the repr."""
    from jphantom.loop.checkpointer import reason_of

    class Store:
        def read(self):
            pass

    assert reason_of(ValueError(repr(Store().read))) == "ValueError"
    assert reason_of(ValueError(f"reading {Store().read!r} failed: truncated")) == (
        "ValueError: reading  failed: truncated")
    assert reason_of(ValueError("Expecting value: line 1")) == "ValueError: Expecting value: line 1"
