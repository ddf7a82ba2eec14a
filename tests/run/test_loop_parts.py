"""The training loop's parts, each built and tested alone (jphantom.loop): the non-finite
policy's verdicts, the records' keys, the run's checkpoints without a folder, the clock's rates
and the stop requests."""

from __future__ import annotations

import math
import types

import jax.numpy as jnp
import optax
import pytest

from jphantom.errors import TrainingDiverged
from jphantom.loop import (NonFinitePolicy, RolledBack, RunCheckpoints, RunResults, SkippedBatch,
                           StepClock, StepRecord, Stopping, fresh_history)
from jphantom.runtime.resilience import MAX_CONSECUTIVE_SKIPS, MAX_ROLLBACKS
from jphantom.loop.nonfinite import summary


def _config(policy: str):
    return types.SimpleNamespace(
        train=types.SimpleNamespace(on_nonfinite=policy, learning_rate=0.1, checkpoint_dir=None),
        model=types.SimpleNamespace(name="gpt2", dtype="float32"),
        parallel=types.SimpleNamespace(strategy="tensor"),
        step=types.SimpleNamespace(precision="float32"))


def _opt_state(dropped: int):
    """An optimizer state as optax.apply_if_finite keeps it, ``dropped`` updates skipped."""
    tx = optax.apply_if_finite(optax.sgd(0.1), 10)
    state = tx.init({"w": jnp.zeros(2)})
    return state._replace(total_notfinite=jnp.asarray(dropped))


def _no_checkpoint():
    return " (no --checkpoint-dir: no state was saved)"


def test_stop_ends_the_run_naming_the_step_and_the_last_good_state():
    policy = NonFinitePolicy(_config("stop"), None)
    assert policy.judge(0, 1.5, None, _no_checkpoint) == "ok"
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 4 \(gpt2, tensor.*no "
                                               r"--checkpoint-dir"):
        policy.judge(3, math.nan, None, _no_checkpoint)


def test_warn_goes_on_and_says_so_once():
    policy = NonFinitePolicy(_config("warn"), None)
    assert policy.judge(0, 1.5, None, _no_checkpoint) == "ok"
    assert policy.judge(3, math.nan, None, _no_checkpoint) == "warned"
    assert policy.warning(3, math.nan).startswith("training loss is nan at step 4 (gpt2")
    assert "going on (--on-nonfinite warn, said once)" in policy.warning(3, math.nan)
    assert [policy.judge(i, math.inf, None, _no_checkpoint) for i in (4, 5)] == ["ok", "ok"]
    assert policy.record()["skipped_steps"] == [] and policy.record()["policy"] == "warn"


def test_skip_counts_the_updates_the_optimizer_dropped_and_stops_after_too_many():
    policy = NonFinitePolicy(_config("skip"), _opt_state(0))
    assert policy.judge(0, 2.0, _opt_state(0), _no_checkpoint) == "ok"
    assert policy.judge(1, math.inf, _opt_state(1), _no_checkpoint) == "skipped"
    assert policy.judge(2, 2.0, _opt_state(1), _no_checkpoint) == "ok"  # a good step resets
    for i in range(MAX_CONSECUTIVE_SKIPS - 1):
        assert policy.judge(3 + i, math.nan, _opt_state(2 + i), _no_checkpoint) == "skipped"
    with pytest.raises(TrainingDiverged, match=f"{MAX_CONSECUTIVE_SKIPS} updates in a row"):
        policy.judge(20, math.nan, _opt_state(20), _no_checkpoint)
    assert policy.record()["skipped_steps"] == [2, *range(4, 3 + MAX_CONSECUTIVE_SKIPS), 21]
    # a non-finite loss whose update the optimizer did not drop cannot be skipped: it stops
    with pytest.raises(TrainingDiverged):
        NonFinitePolicy(_config("skip"), _opt_state(0)).judge(0, math.nan, _opt_state(0),
                                                               _no_checkpoint)


def test_rollback_asks_for_a_rollback_then_skips_the_bad_batch_once():
    policy = NonFinitePolicy(_config("rollback"), None)
    assert policy.judge(5, math.nan, None, _no_checkpoint) == "rollback"
    policy.rolled_back(5, 3, None)
    assert not policy.skips_batch(4)
    assert policy.skips_batch(5) and not policy.skips_batch(5)
    assert policy.record() == {"policy": "rollback", "skipped_steps": [], "skipped_updates": 0,
                               "rollbacks": [{"at_step": 6, "to_step": 3}],
                               "skipped_batches": [6], "empty_batches": []}
    policy.nothing_counted(7)  # a batch with nothing to count: recorded, said, not judged
    assert policy.record()["empty_batches"] == [8]
    assert "1 batch(es) had nothing to count" in summary(policy.record(), 10)


def test_a_finite_loss_with_a_nonfinite_state_is_judged_bad_and_rollbacks_are_bounded():
    with pytest.raises(TrainingDiverged, match="not finite after step 2 .its training loss 1.5"):
        NonFinitePolicy(_config("stop"), None).judge(1, 1.5, None, _no_checkpoint, False)
    policy = NonFinitePolicy(_config("rollback"), None)
    assert policy.judge(1, 1.5, None, _no_checkpoint, False) == "rollback"
    for i in range(MAX_ROLLBACKS):
        policy.rolling_back(1, 1.5, False, _no_checkpoint)
        policy.rolled_back(1, 1, None)
        if i == 1:
            policy.saved()  # progress: the count starts again
    policy.saved()
    for _ in range(MAX_ROLLBACKS):
        policy.rolling_back(1, math.nan, True, _no_checkpoint)
        policy.rolled_back(1, 1, None)
    with pytest.raises(TrainingDiverged, match=f"{MAX_ROLLBACKS} rollbacks without a new "
                                               "checkpoint"):
        policy.rolling_back(1, math.nan, True, _no_checkpoint)


def test_records_keep_the_keys_metrics_jsonl_always_had():
    record = StepRecord(step=3, train_loss=1.0, learning_rate=0.1, grad_norm=None,
                        step_seconds=0.5, tokens_per_second=10.0, model_tflops_per_device=None,
                        mfu=None, peak_memory_bytes=None, energy_joules=None,
                        joules_per_token=None, energy_source="modelled")
    found = record.as_dict()
    assert "validation_loss" not in found and "compiled" not in found
    assert found["grad_norm"] is None and found["step"] == 3  # always there, even when None
    record.update_skipped, record.validation_loss = False, 2.5
    assert record.as_dict()["update_skipped"] is False
    assert record.as_dict()["validation_loss"] == 2.5
    assert SkippedBatch(4).as_dict() == {"step": 4, "skipped_batch": True}
    assert RolledBack(6, 3).as_dict() == {"step": 6, "train_loss": None, "nonfinite": True,
                                          "rolled_back_to": 3}


def test_results_leave_out_what_does_not_apply():
    """results.json (as_dict) leaves out what a run does not have, and holds what callbacks
    added to ``extra`` beside the rest (not under an ``extra`` key)."""
    fields = {f: None for f in RunResults.__dataclass_fields__ if f != "extra"}
    fields |= {"config": {}, "history": fresh_history(), "nonfinite": {}, "throughput": {}}
    out = RunResults(**fields).as_dict()
    assert not {"energy", "moe", "pipeline", "checkpoints", "unigram_cross_entropy",
                "extra"} & set(out)
    assert {"final_validation_loss", "stopped_by", "history"} <= set(out)
    added = RunResults(**fields, extra={"seen": [1, 2]}).as_dict()
    assert added == out | {"seen": [1, 2]} and list(added)[-1] == "seen"


def test_a_run_without_a_checkpoint_folder_saves_nothing_and_says_so():
    checkpoints = RunCheckpoints(_config("stop").train, {"model": {}, "corpus": {}})
    assert not checkpoints and not checkpoints.due(1) and checkpoints.steps() == []
    assert "no --checkpoint-dir" in checkpoints.last_good()
    assert checkpoints.describe(0) is None
    checkpoints.close()


def test_the_last_good_state_is_the_newest_checkpoint_whose_recorded_loss_is_finite(tmp_path):
    """A folder whose newest checkpoint records a validation loss of inf (an older run's): the
    last good state named is the one before, saying --resume would take the newer; a rollback
    to it deletes the newer one, which the run writes again."""
    train = types.SimpleNamespace(checkpoint_dir=str(tmp_path), save_every=1, keep_checkpoints=3)
    checkpoints = RunCheckpoints(train, {"model": {}, "corpus": {}})
    state = types.SimpleNamespace(params={"w": jnp.ones(2)}, opt_state={"m": jnp.zeros(2)})
    for step, validation in [(1, 2.0), (2, 1.5), (3, math.inf)]:
        history = {**fresh_history(), "train_loss": [1.0], "validation_loss": [validation]}
        checkpoints.save(step, state, history, None)
    assert checkpoints.good_steps() == [2, 1]
    assert checkpoints.last_good() == (
        f"; the last good state is the checkpoint of step 2 in {tmp_path} (newer ones record a "
        "non-finite loss and --resume takes the newest: move step(s) 3 aside to continue from "
        "it)")
    assert checkpoints.drop_after(2) == [3] and checkpoints.steps() == [1, 2]
    assert checkpoints.last_good().endswith("(--resume continues from it)")
    checkpoints.close()


def test_the_clock_times_the_steps_after_the_first_and_gives_their_rates():
    """The first step compiles (its time is the compile time, not a step time); a step's
    TFLOP/s per device is its FLOPs over its seconds and devices; the median MFU over the peak."""
    import jax

    devices = jax.devices()[:2]
    clock = StepClock(devices, per_token=6_000, meter=None, start=0.0)
    clock.compiled(state=None, more=True)
    assert clock.compile_seconds > 0 and not clock.meter_running and clock.step_seconds == []
    clock.timed(0.5)
    clock.timed(1.5)
    assert clock.step_seconds == [0.5, 1.5] and clock.metered_steps == 0
    found = clock.measures(0.5, None, tokens=1_000)
    assert found["tokens_per_second"] == 2_000
    assert found["model_tflops_per_device"] == pytest.approx(6_000 * 1_000 / 0.5 / 2 / 1e12)
    results = clock.results(None, tokens=1_000)
    assert results["median_step_seconds"] == 1.0 and "energy" not in results
    assert results["throughput"]["devices"] == 2
    assert clock.close() is None  # no meter: no metered energy


def test_the_first_stop_request_wins_and_records_its_step():
    stopping = Stopping()
    stopping.listen()
    try:
        assert stopping.after(1) == (False, False)
        stopping.request("target_loss")
        stopping.request("another")
        assert stopping.after(2) == (True, False)
        assert stopping.after(3) == (True, False)
        assert stopping.iterations_to_target() == 2 and stopping.stopped_by() == "target_loss"
        assert not stopping.interrupted
    finally:
        stopping.close()
