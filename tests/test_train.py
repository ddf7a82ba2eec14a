"""Training to a target loss on the teacher task."""

import json

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
    (dict(strategy="phantom", width=32, num_shards=4, ghost_width=0), r"ghost_width=0 must be an integer >= 1"),
    (dict(strategy="phantom", width=32, num_shards=4, ghost_width=1.5), r"ghost_width=1.5"),
    (dict(strategy="dense", width=32, learning_rate=float("nan")), "learning_rate=nan"),
    (dict(strategy="dense", width=32, learning_rate=0.0), "learning_rate=0.0"),
    (dict(strategy="dense", width=32, target_loss=0.0), "target_loss=0.0"),
    (dict(strategy="dense", width=32, target_loss=float("inf")), "target_loss=inf"),
    (dict(strategy="dense", width=32, target_loss=-1.0), "target_loss=-1.0"),
    (dict(strategy="nope", width=32), "unknown strategy 'nope'"),
    (dict(strategy="tensor-t2", width=32), "unknown strategy 'tensor-t2'"),
    (dict(strategy="dense", width=2.5), r"width=2.5 must be an integer"),
    (dict(strategy="dense", width=True), r"width=True must be an integer"),
    (dict(strategy="dense", width=32, depth=0), r"depth=0 must be an integer >= 1"),
    (dict(strategy="dense", width=32, batch=0), r"batch=0 must be an integer >= 1"),
    (dict(strategy="dense", width=32, batch=8.0), r"batch=8.0 must be an integer"),
    (dict(strategy="dense", width=32, max_steps=0), r"max_steps=0"),
    (dict(strategy="dense", width=32, eval_every=False), r"eval_every=False"),
    (dict(strategy="dense", width=32, seed=-1), r"seed=-1 must be an integer >= 0"),
    (dict(strategy="tensor-t1", width=30, num_shards=4), r"width=30 is not divisible by num_shards=4"),
    (dict(strategy="phantom", width=30, num_shards=4, ghost_width=2), r"width=30 is not divisible"),
    (dict(strategy="dense", width=32, num_shards=4), r"strategy 'dense' runs on one device"),
    (dict(strategy="dense", width=32, dtype="int8"), r"dtype='int8'"),
    (dict(strategy="dense", width=32, optimizer="lion"), r"optimizer='lion'"),
    (dict(strategy="tensor", width=32, mesh="data=2,model=x"), r"size 'x', not an integer"),
    (dict(strategy="tensor", width=32, mesh="data=3,model=2", batch=32), r"batch=32 is not divisible by the data axis \(3\)"),
    (dict(strategy="tensor", width=32, mesh="data=2,model=2", num_shards=4), r"num_shards=4 disagrees with mesh"),
])
def test_bad_training_config_is_an_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**kwargs)


def test_float64_needs_x64_and_mesh_defaults():
    import jax

    with jax.enable_x64(False), pytest.raises(ConfigError, match="jax_enable_x64"):
        TrainConfig("dense", width=32, dtype="float64")
    assert str(TrainConfig("dense", width=32).mesh_config()) == "model=1"
    assert str(TrainConfig("tensor-t1", width=32, num_shards=4).mesh_config()) == "model=4"
    config = TrainConfig("phantom", width=32, ghost_width=2, mesh="model=4,data=2")
    assert config.num_shards == 4 and str(config.mesh_config()) == "data=2,model=4"


def test_float16_adam_uses_a_safe_epsilon():
    """Adam's default eps = 1e-8 is 0 in float16; float16 runs use FLOAT16_ADAM_EPS instead and
    take finite steps even where a gradient is 0 (second moment 0)."""
    import jax.numpy as jnp

    from jphantom.train import FLOAT16_ADAM_EPS, make_optimizer

    assert float(jnp.float16(1e-8)) == 0.0 and float(jnp.float16(FLOAT16_ADAM_EPS)) > 0
    params = {"w": jnp.zeros(4, jnp.float16)}
    grads = {"w": jnp.array([0.0, 1e-4, 1.0, -1.0], jnp.float16)}
    for dtype, finite in (("float16", True), ("float32", False)):
        optimizer = make_optimizer("adam", 1e-3, dtype)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        assert bool(jnp.all(jnp.isfinite(updates["w"]))) == finite, dtype
    result = train(TrainConfig("dense", width=32, batch=16, max_steps=3, dtype="float16"),
                   Teacher(TeacherConfig(width=32, train_size=64, eval_size=32), jnp.float16))
    assert all(np.isfinite(result.train_losses))


def test_data_parallel_training_follows_the_single_device_run():
    """tensor on data=2,model=2 trains like on model=2: the same global batch, the same losses
    (up to float32 rounding). (Every strategy's data-parallel gradients: test_data_parallel.py.)"""
    small = {**SMALL, "max_steps": 10}
    model_only = train(TrainConfig("tensor", **small, mesh="model=2"), _teacher())
    data_parallel = train(TrainConfig("tensor", **small, mesh="data=2,model=2"), _teacher())
    np.testing.assert_allclose(data_parallel.train_losses, model_only.train_losses, rtol=1e-4)
    np.testing.assert_allclose(data_parallel.eval_losses, model_only.eval_losses, rtol=1e-4)


def test_a_model_too_large_for_the_memory_is_refused_before_allocation():
    """width 2**20 is 8 TiB of dense weights: refused with the estimate, in well under a second."""
    import time

    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"needs about .* GiB per device \(parameters .*more than"):
        train(TrainConfig("dense", width=2**20, batch=8, max_steps=1),
              Teacher(TeacherConfig(width=2**20, train_size=8, eval_size=8)))
    assert time.perf_counter() - start < 30
