"""A run that survives the cluster and its user (jphantom.runtime.resilience, jphantom.runtime.launch): SIGTERM
ends a run with a checkpoint of the step reached and ``--resume`` finishes it with the
uninterrupted run's loss; a stopped rank under ``--step-timeout`` ends every process, naming the
timeout; ``launch --max-restarts`` starts a killed run again from its newest checkpoint; the
non-finite policies warn, skip, stop or roll back.

Real processes: one single-process SIGTERM in ``make test``; under ``launch`` (two processes)
the slow suite."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jphantom import cli
from helpers import child_env

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16",
        "--vocab", "256", "--batch", "4", "--eval-batches", "1", "--no-progress"]


def _env():
    env = {k: v for k, v in child_env().items() if not k.startswith("JPHANTOM_")}
    return {**env, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _when(condition, proc, limit=120.0):
    start = time.monotonic()
    while not condition():
        if proc.poll() is not None or time.monotonic() - start > limit:
            if proc.poll() is None:
                proc.kill()
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"gave up waiting (rc={proc.returncode})\n{err[-3000:]}")
        time.sleep(0.05)


def _final_loss(out: Path) -> float:
    return json.loads((out / "results.json").read_text())["final_validation_loss"]


def test_sigterm_writes_a_checkpoint_of_the_step_reached_and_resume_finishes_the_run(tmp_path,
                                                                                      capsys):
    """No --save-every: SIGTERM mid-run (sent to this process from a thread once 3 steps are in
    metrics.jsonl) leaves a checkpoint of the step it reached, exit status 143 and one line;
    --resume ends with the uninterrupted run's validation loss."""
    import threading

    steps = ["--steps", "80", "--eval-every", "80"]  # ~4 ms a step: SIGTERM lands at 3-10
    ck, out = tmp_path / "ck", tmp_path / "out"

    def preempt():
        while len(_metrics(out)) < 3:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=preempt, daemon=True).start()
    assert cli.main(["train", *TINY, *steps, "--checkpoint-dir", str(ck), "--out",
                     str(out)]) == 143
    err = capsys.readouterr().err
    reached = json.loads((out / "results.json").read_text())
    assert reached["interrupted"] and reached["stopped_by"] == "SIGTERM"
    assert reached["checkpoints"]["steps"] == [reached["steps_done"]]
    assert 3 <= reached["steps_done"] < 80
    assert err.strip().splitlines()[-1] == (
        f"SIGTERM: stopped after step {reached['steps_done']}, wrote what the run had into "
        f"{out}; checkpoint of step {reached['steps_done']} in {ck} (continue with --resume)")
    assert cli.main(["train", *TINY, *steps, "--checkpoint-dir", str(ck), "--out", str(out),
                     "--resume"]) == 0
    assert cli.main(["train", *TINY, *steps, "--out", str(tmp_path / "whole")]) == 0
    assert _final_loss(out) == pytest.approx(_final_loss(tmp_path / "whole"), rel=1e-6)


# ------------------------------------------------------------------------------------------------
# The non-finite policies (the FFN's teacher data, one batch made NaN)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def nan_at_step_4(monkeypatch):
    from jphantom.loop import trainer as run_module

    train = run_module.TeacherSource.train

    def poisoned(self, index):
        x, t = train(self, index)
        return (np.full_like(x, np.nan), t) if index == 3 else (x, t)

    monkeypatch.setattr(run_module.TeacherSource, "train", poisoned)


FFN = ["--model", "ffn", "--width", "16", "--batch", "8", "--steps", "8", "--eval-every", "8",
       "--eval-batches", "1", "--no-progress", "--optimizer", "sgd"]


def test_a_nonfinite_loss_stops_and_names_the_last_good_checkpoint(nan_at_step_4, tmp_path,
                                                                     capsys):
    assert cli.main(["train", *FFN, "--checkpoint-dir", str(tmp_path / "ck"), "--save-every",
                     "2", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "training loss is nan at step 4" in err and "checkpoint of step 2" in err
    assert err.count("\n") == 1


def test_skip_drops_the_update_and_counts_it(nan_at_step_4, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["train", *FFN, "--on-nonfinite", "skip", "--out", str(out)]) == 0
    assert "non-finite: skipped 1 of 8 updates (steps 4: non-finite)" in capsys.readouterr().out
    records = _metrics(out)
    assert [r["update_skipped"] for r in records] == [False] * 3 + [True] + [False] * 4
    assert records[3]["train_loss"] is None and np.isfinite(records[-1]["validation_loss"])
    results = json.loads((out / "results.json").read_text())
    assert results["nonfinite"]["skipped_steps"] == [4]


def test_warn_goes_on_says_so_once_and_the_run_fails_at_its_end(nan_at_step_4, tmp_path,
                                                                 capsys):
    """warn keeps training on the NaN parameters (no update dropped, no checkpoint of them): one
    line at step 4, and the run ends saying its state is not finite."""
    out = tmp_path / "out"
    assert cli.main(["train", *FFN, "--on-nonfinite", "warn", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out.count("going on (--on-nonfinite warn, said once)") == 1
    assert "training loss is nan at step 4" in captured.out
    assert captured.err.count("\n") == 1
    assert "not finite after step 8 (--on-nonfinite warn)" in captured.err
    assert len(_metrics(out)) == 8 and "update_skipped" not in _metrics(out)[3]


def test_one_vocabulary_names_what_a_nonfinite_loss_does(capsys):
    """The step's on_nonfinite, the configuration, the command line's choices and its help take
    the names of jphantom.registry.nonfinite.NONFINITE."""
    from jphantom.cli.parser import run_flag_choices
    from jphantom.config import TrainConfig
    from jphantom.registry.nonfinite import NONFINITE
    from jphantom.step.finite import check_policy

    assert NONFINITE == ("warn", "skip", "stop", "rollback")
    assert tuple(run_flag_choices()["on_nonfinite"]) == NONFINITE
    for name in NONFINITE:  # every name a run's and its step's (rollback: the loop's alone)
        assert TrainConfig(on_nonfinite=name, checkpoint_dir="ck", save_every=1).on_nonfinite \
            == name == check_policy(name, watch=False)[0]
        assert name == "rollback" or check_policy(name)[0] == name
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--on-nonfinite {warn,skip,stop,rollback}" in capsys.readouterr().out


def test_rollback_reloads_the_checkpoint_and_skips_the_batch(nan_at_step_4, tmp_path):
    out = tmp_path / "out"
    assert cli.main(["train", *FFN, "--on-nonfinite", "rollback", "--checkpoint-dir",
                     str(tmp_path / "ck"), "--save-every", "2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["nonfinite"]["rollbacks"] == [{"at_step": 4, "to_step": 2}]
    assert results["nonfinite"]["skipped_batches"] == [4]
    assert results["history"]["step"] == [1, 2, 3, 5, 6, 7, 8]
    assert np.isfinite(results["final_validation_loss"])


@pytest.fixture
def inf_params_after_step_2(monkeypatch):
    """Step 2's loss is finite but its update leaves infinite parameters (a learning rate far
    too large), once."""
    import jax

    from jphantom.loop import trainer as run_module
    from jphantom.step.layout import TrainState

    update, done = run_module.Trainer._update, []

    def overflowing(self, run, index, pair):
        found = update(self, run, index, pair)
        if index == 1 and not done:
            done.append(index)
            self.state = TrainState(jax.tree.map(lambda p: p * np.inf, self.state.params),
                                    self.state.opt_state)
        return found

    monkeypatch.setattr(run_module.Trainer, "_update", overflowing)


def test_rollback_skips_the_batch_whose_update_left_infinite_parameters(
        inf_params_after_step_2, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["train", *FFN, "--steps", "4", "--eval-every", "4", "--on-nonfinite",
                     "rollback", "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "1",
                     "--out", str(out)]) == 0
    assert "not finite after step 2 (its training loss" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["nonfinite"]["rollbacks"] == [{"at_step": 2, "to_step": 1}]
    assert results["nonfinite"]["skipped_batches"] == [2]
    assert results["nonfinite"]["final_state_finite"] is True
    assert np.isfinite(results["final_validation_loss"])


def test_a_nonfinite_state_is_never_checkpointed_and_the_run_fails_saying_so(
        inf_params_after_step_2, tmp_path, capsys):
    """skip cannot drop a state made non-finite outside its update: the checkpoints stop at step
    1, and the run exits 1 with one line; results.json records it."""
    out = tmp_path / "out"
    assert cli.main(["train", *FFN, "--steps", "3", "--eval-every", "3", "--on-nonfinite",
                     "skip", "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "1",
                     "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "not writing the checkpoint of step 2" in captured.out
    assert captured.err.count("\n") == 1 and "not finite after step 3" in captured.err
    results = json.loads((out / "results.json").read_text())
    assert results["checkpoints"]["steps"] == [1]
    assert results["nonfinite"]["final_state_finite"] is False


DIVERGING = [*FFN, "--learning-rate", "1e6"]  # sgd: the loss 1e19 at step 3, inf after


def test_a_run_that_diverges_at_its_end_records_what_it_printed(tmp_path, capsys):
    """skip keeps the parameters finite (1e19-sized), the final validation loss is inf: the run
    exits 1 with one line, and results.json's nonfinite.diverged is that line."""
    out = tmp_path / "out"
    assert cli.main(["train", *DIVERGING, "--on-nonfinite", "skip", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the final validation loss is inf after step 8" in err
    nonfinite = json.loads((out / "results.json").read_text())["nonfinite"]
    assert err.strip() == f"jphantom: error: training diverged: {nonfinite['diverged']}"
    assert nonfinite["final_state_finite"] is True  # finite, if huge: the loss says what went on


def test_rollback_goes_back_to_the_newest_checkpoint_whose_loss_is_finite(tmp_path, capsys):
    """Step 3's validation loss is inf: its checkpoint is not written, the rollbacks go to step 2
    and say so, and the line the run ends with names step 2 as the last good state."""
    out, ck = tmp_path / "out", tmp_path / "ck"
    assert cli.main(["train", *DIVERGING, "--eval-every", "1", "--on-nonfinite", "rollback",
                     "--checkpoint-dir", str(ck), "--save-every", "1", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "not writing the checkpoint of step 3: its validation loss is inf" in captured.out
    assert (f"rolled back to the checkpoint of step 2 in {ck} (the newest whose recorded loss "
            "and parameters are finite)") in captured.out
    assert f"the last good state is the checkpoint of step 2 in {ck}" in captured.err
    results = json.loads((out / "results.json").read_text())
    assert {r["to_step"] for r in results["nonfinite"]["rollbacks"]} == {2}
    assert results["checkpoints"]["steps"] == [1, 2]
    assert captured.err.strip().endswith(results["nonfinite"]["diverged"])


@pytest.mark.parametrize("flags, fragment", [
    (["--on-nonfinite", "rollback"], "rollback reloads the newest checkpoint"),
    (["--on-nonfinite", "retry"], "invalid choice: 'retry'"),
    (["--step-timeout", "0"], "step_timeout=0.0 must be > 0"),
])
def test_bad_resilience_settings_are_one_line(flags, fragment, capsys):
    try:
        code = cli.main(["train", *FFN, *flags])
    except SystemExit as exit:  # argparse's own refusal: one line too
        code = exit.code
    assert code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


# ------------------------------------------------------------------------------------------------
# Under launch: two processes
# ------------------------------------------------------------------------------------------------

LAUNCHED = ["--steps", "60", "--eval-every", "60", "--strategy", "tensor", "--mesh", "data=2",
            "--save-every", "5"]


def _launch(tmp_path, name, *extra, launch_flags=()):
    out, ck = tmp_path / name / "out", tmp_path / name / "ck"
    command = [sys.executable, "-m", "jphantom", "launch", "-n", "2", "--devices-per-process",
               "1", *launch_flags, "--", "jphantom", "train", *TINY, *LAUNCHED, "--out",
               str(out), "--checkpoint-dir", str(ck), *extra]
    proc = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    return proc, out, ck


def _children(parent: int) -> dict[int, int]:
    """rank -> pid of the processes ``jphantom launch`` (pid ``parent``) started."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != parent:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        for item in environ:
            if item.startswith(b"JPHANTOM_PROCESS_ID="):
                found[int(item.split(b"=")[1])] = int(stat.parent.name)
    return found


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    proc, out, _ = _launch(tmp_path, "whole")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return _final_loss(out)


@pytest.mark.slow
def test_sigterm_to_launch_checkpoints_every_process_and_resume_is_exact(tmp_path, uninterrupted):
    proc, out, ck = _launch(tmp_path, "run", launch_flags=("--grace", "60"))
    _when(lambda: len(_metrics(out)) >= 8, proc, 300)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["stopped_by"] == "SIGTERM" and results["steps_done"] in results[
        "checkpoints"]["steps"]
    again, out, _ = _launch(tmp_path, "run", "--resume")
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert _final_loss(out) == pytest.approx(uninterrupted, rel=1e-6)


@pytest.mark.slow
def test_a_suspended_rank_ends_every_process_within_the_step_timeout(tmp_path):
    proc, out, _ = _launch(tmp_path, "stuck", "--step-timeout", "20")
    _when(lambda: len(_metrics(out)) >= 4, proc, 300)
    children = _children(proc.pid)
    os.kill(children[1], signal.SIGSTOP)
    start = time.monotonic()
    _, err = proc.communicate(timeout=90)
    assert time.monotonic() - start < 60 and proc.returncode == 1, err[-3000:]
    assert "did not finish within --step-timeout 20 s" in err
    assert "process(es) 1 were suspended (SIGSTOP)" in err
    for pid in children.values():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text(
        ).rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
def test_a_killed_rank_is_restarted_from_the_newest_checkpoint(tmp_path, uninterrupted):
    proc, out, ck = _launch(tmp_path, "restart", launch_flags=("--max-restarts", "1"))
    _when(lambda: ck.exists() and any(p.name.isdigit() for p in ck.iterdir())
          and len(_metrics(out)) >= 12, proc, 300)
    os.kill(_children(proc.pid)[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "restart 1 of 1 from the newest checkpoint (--resume)" in err
    assert _final_loss(out) == pytest.approx(uninterrupted, rel=1e-6)


@pytest.mark.slow
def test_a_killed_rank_under_min_processes_restarts_without_it(tmp_path, uninterrupted):
    """--min-processes 1: the restart runs one process on mesh data=1 (the data axis shrunk
    with the processes), resumes the checkpoint two processes wrote and ends with the
    uninterrupted run's loss."""
    proc, out, ck = _launch(tmp_path, "shrink", launch_flags=("--max-restarts", "1",
                                                              "--min-processes", "1"))
    _when(lambda: ck.exists() and any(p.name.isdigit() for p in ck.iterdir())
          and len(_metrics(out)) >= 12, proc, 300)
    os.kill(_children(proc.pid)[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert ("restart 1 of 1 with 1 processes (--mesh data=1) from the newest checkpoint "
            "(--resume)") in err
    assert json.loads((out / "results.json").read_text())["mesh"] == "data=1,model=1"
    assert _final_loss(out) == pytest.approx(uninterrupted, rel=1e-6)


@pytest.mark.slow
def test_resume_names_a_changed_model_or_corpus(tmp_path, capsys):
    """A changed --hidden on --resume used to be blamed on the mesh; another corpus said
    nothing."""
    ck = str(tmp_path / "ck")
    base = [*TINY, "--steps", "2", "--eval-every", "2", "--checkpoint-dir", ck]
    assert cli.main(["train", *base, "--out", str(tmp_path / "a")]) == 0
    capsys.readouterr()
    steps4 = ["--steps", "4", "--resume", "--out", str(tmp_path / "b")]
    assert cli.main(["train", *base, "--hidden", "64", *steps4]) == 2
    assert "was saved by model gpt2 with hidden=32; this run's has hidden=64" in (
        capsys.readouterr().err)
    corpus = tmp_path / "other.txt"
    corpus.write_text("another corpus\n" * 400)
    assert cli.main(["train", *base, "--data", str(corpus), *steps4]) == 2
    assert "was trained on data=None" in capsys.readouterr().err


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_one_warning_line(tmp_path):
    """Its arrays damaged: --resume falls back to the one before with one line on stderr (it
    used to print hundreds of asyncio/TensorStore tracebacks and the library line first)."""
    ffn = [*FFN[:6], "--eval-batches", "1", "--no-progress", "--optimizer", "sgd",
           "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "2", "--keep-checkpoints",
           "5", "--out", str(tmp_path / "o")]
    first = subprocess.run([sys.executable, "-m", "jphantom", "train", *ffn, "--steps", "4",
                            "--eval-every", "4"], env=_env(), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    for path in (tmp_path / "ck" / "4" / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"not a checkpoint")
    again = subprocess.run([sys.executable, "-m", "jphantom", "train", *ffn, "--steps", "6",
                            "--eval-every", "6", "--resume"], env=_env(), capture_output=True,
                           text=True)
    assert again.returncode == 0, again.stderr
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jphantom: warning: newer checkpoints")
    assert "resumed from step 2" in lines[0]
