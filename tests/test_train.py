"""Training to a target loss on the teacher task."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jphantom.data import Teacher, TeacherConfig
from jphantom.errors import ConfigError, TrainingDiverged
from jphantom.train import TrainConfig, train

SMALL = dict(width=32, depth=2, batch=32, learning_rate=3e-3, eval_every=5, max_steps=400)


def _teacher():
    return Teacher(TeacherConfig(width=32, train_size=1024, eval_size=128))


@pytest.mark.parametrize("strategy, extra", [("phantom", {"num_shards": 4, "ghost_width": 2}),
                                             ("tensor-t1", {"num_shards": 4}), ("dense", {})])
def test_training_reaches_the_target_and_stops(strategy, extra, tmp_path):
    teacher = _teacher()
    first = train(TrainConfig(strategy, **SMALL, **extra), teacher)
    target = 0.7 * first.eval_losses[0]  # reachable: a clear improvement on the first evaluation
    config = TrainConfig(strategy, **SMALL, **extra, target_loss=target)
    result = train(config, teacher, metrics_path=tmp_path / "m.jsonl")
    assert result.iterations_to_target is not None
    assert result.eval_losses[-1] <= target < max(result.eval_losses)
    assert len(result.train_losses) == result.iterations_to_target < SMALL["max_steps"]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, result.iterations_to_target + 1))


def test_same_seed_gives_the_same_loss_curve():
    config = TrainConfig("phantom", **{**SMALL, "max_steps": 20}, num_shards=4, ghost_width=2)
    a, b = train(config, _teacher()), train(config, _teacher())
    np.testing.assert_array_equal(a.train_losses, b.train_losses)
    c = train(TrainConfig("phantom", **{**SMALL, "max_steps": 20}, num_shards=4, ghost_width=2,
                          seed=1), _teacher())
    assert a.train_losses != c.train_losses


def test_nan_loss_is_reported_with_its_step():
    config = TrainConfig("dense", width=32, depth=2, batch=32, optimizer="sgd",
                         learning_rate=1e12, max_steps=50)
    with pytest.raises(TrainingDiverged, match=r"at step \d+ \(dense, learning_rate=1e\+12\)"):
        train(config, _teacher())


def test_meter_spans_the_training_window_and_is_stopped_on_divergence():
    from jphantom.energy import NvmlPowerMeter

    meter = NvmlPowerMeter(interval_s=0.005, sampler=lambda: 50.0)
    result = train(TrainConfig("dense", width=32, batch=16, max_steps=12), _teacher(), meter=meter)
    assert result.metered_steps == 11  # every step but the first (compilation, start-up)
    assert result.energy.mean_watts == pytest.approx(50.0)
    assert result.joules_per_step == pytest.approx(result.energy.joules / 11)
    diverging = TrainConfig("dense", width=32, depth=2, batch=32, optimizer="sgd",
                            learning_rate=1e12, max_steps=50)
    with pytest.raises(TrainingDiverged):
        train(diverging, _teacher(), meter=meter)
    meter.start()  # would raise "called twice" had the diverged run left it running
    meter.stop()


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="phantom", width=32, num_shards=4), "needs ghost_width"),
    (dict(strategy="dense", width=32, learning_rate=float("nan")), "learning_rate=nan"),
    (dict(strategy="dense", width=32, target_loss=0.0), "target_loss=0.0"),
    (dict(strategy="nope", width=32), "unknown strategy 'nope'"),
])
def test_bad_training_config_is_an_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)
