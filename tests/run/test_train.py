"""Training to a target loss on the teacher task: the one training loop (:func:`jphantom.loop.trainer.run`)
stops at the target, repeats itself for a seed, reports a diverged run with its step, meters
energy over the training window, refuses bad settings and what cannot fit before anything runs."""

import json

import numpy as np
import pytest

from jphantom.config import RunConfig
from jphantom.data import Teacher, TeacherConfig
from jphantom.errors import ConfigError, TrainingDiverged
from jphantom.loop.trainer import run

# Seal et al.'s set-up at a small width: Adam (optax's betas), no warm-up, every held-out batch
SMALL = dict(model="ffn", width=32, depth=2, batch=32, optimizer="adam", adam_b2=0.999,
             warmup_steps=0, learning_rate=3e-3, eval_every=5, steps=400, out=None,
             progress=False)


def _config(**settings) -> RunConfig:
    return RunConfig.from_flags(**(SMALL | settings))


def _teacher():
    return Teacher(TeacherConfig(width=32, train_size=1024, eval_size=128))


@pytest.mark.parametrize("strategy, extra", [("phantom", {"mesh": "model=4", "ghost_width": 2}),
                                             pytest.param("tensor-t1", {"mesh": "model=4"},
                                                          marks=pytest.mark.slow),
                                             ("dense", {})])
@pytest.mark.slow_cells("tensor-t1-extra1", "phantom-extra0", "dense-extra2")
def test_training_reaches_the_target_and_stops(strategy, extra, tmp_path):
    teacher = _teacher()
    # the first evaluation (step 5) is the same whatever the number of steps
    first = run(_config(strategy=strategy, steps=5, **extra), teacher=teacher)
    target = 0.7 * first.history["validation_loss"][0]  # a clear improvement: reachable
    result = run(_config(strategy=strategy, target_loss=target, out=str(tmp_path), **extra),
                 teacher=teacher)
    reached, history = result.iterations_to_target, result.history
    assert reached is not None
    assert history["validation_loss"][-1] <= target < max(history["validation_loss"])
    assert len(history["train_loss"]) == reached < SMALL["steps"]
    assert history["validation_step"][-1] == reached
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, reached + 1))
    assert json.loads((tmp_path / "results.json").read_text())["iterations_to_target"] == reached


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_same_seed_gives_the_same_loss_curve():
    config = _config(strategy="phantom", mesh="model=4", ghost_width=2, steps=20, eval_every=20)
    a, b = run(config, teacher=_teacher()), run(config, teacher=_teacher())
    np.testing.assert_array_equal(a.history["train_loss"], b.history["train_loss"])
    c = run(_config(strategy="phantom", mesh="model=4", ghost_width=2, steps=20, eval_every=20,
                    seed=1), teacher=_teacher())
    assert a.history["train_loss"] != c.history["train_loss"]


DIVERGING = dict(strategy="dense", optimizer="sgd", learning_rate=1e12, steps=50, eval_every=50)


def test_nan_loss_is_reported_with_its_step():
    with pytest.raises(TrainingDiverged, match=r"at step \d+ \(ffn, dense, precision float32, "
                                               r"dtype float32, learning_rate=1e\+12\)"):
        run(_config(**DIVERGING), teacher=_teacher())


def test_meter_spans_the_training_window_and_is_stopped_on_divergence():
    from jphantom.energy import NvmlPowerMeter

    meter = NvmlPowerMeter(interval_s=0.005, sampler=lambda: 50.0)
    result = run(_config(strategy="dense", batch=16, steps=12, eval_every=12), teacher=_teacher(),
                 meter=meter)
    energy = result.energy
    assert energy["metered_steps"] == 11  # every step but the first (compilation, start-up)
    assert energy["mean_watts"] == pytest.approx(50.0)
    assert energy["joules_per_step"] == pytest.approx(energy["joules"] / 11)
    with pytest.raises(TrainingDiverged):
        run(_config(**DIVERGING), teacher=_teacher(), meter=meter)
    meter.start()  # would raise "called twice" had the diverged run left it running
    meter.stop()


@pytest.mark.parametrize("settings, message", [
    (dict(strategy="phantom", mesh="model=4"), "needs ghost_width"),
    (dict(strategy="phantom", mesh="model=4", ghost_width=0), r"ghost_width=0 must be at least 1"),
    (dict(strategy="phantom", mesh="model=4", ghost_width=1.5), r"ghost_width=1.5 must be int"),
    (dict(strategy="dense", learning_rate=float("nan")), "learning_rate=nan"),
    (dict(strategy="dense", learning_rate=0.0), "learning_rate=0.0"),
    (dict(strategy="dense", target_loss=0.0), "target_loss=0.0"),
    (dict(strategy="dense", target_loss=float("inf")), "target_loss=inf"),
    (dict(strategy="dense", target_loss=-1.0), "target_loss=-1.0"),
    (dict(strategy="nope"), "unknown strategy 'nope'"),
    (dict(strategy="tensor-t2"), "unknown strategy 'tensor-t2'"),
    (dict(strategy="dense", width=2.5), r"width=2.5 must be int"),
    (dict(strategy="dense", width=True), r"width=True must be int"),
    (dict(strategy="dense", depth=0), r"depth=0 must be at least 1"),
    (dict(strategy="dense", batch=0), r"batch=0 must be at least 1"),
    (dict(strategy="dense", batch=8.0), r"batch=8.0 must be int"),
    (dict(strategy="dense", steps=0), r"steps=0"),
    (dict(strategy="dense", eval_every=False), r"eval_every=False"),
    (dict(strategy="dense", seed=-1), r"seed=-1 must be at least 0"),
    (dict(strategy="tensor-t1", width=30, mesh="model=4"),
     r"width=30 is not divisible by num_shards=4"),
    (dict(strategy="phantom", width=30, mesh="model=4", ghost_width=2), r"width=30 is not divisible"),
    (dict(strategy="dense", mesh="model=4"), r"strategy 'dense' runs on one device"),
    (dict(strategy="dense", dtype="int8"), r"dtype='int8'"),
    (dict(strategy="dense", optimizer="lion"), r"optimizer='lion'"),
    (dict(strategy="tensor", mesh="data=2,model=x"), r"size 'x', not an integer"),
    (dict(strategy="tensor", mesh="data=3,model=2", batch=32),
     r"batch=32 is not divisible by the data axis \(3\) of mesh data=3,model=2"),
    (dict(strategy="tensor", mesh="data=2,model=2", accumulate=3, batch=8),
     r"per-data-rank batch 4 is not divisible by accumulate=3 \(batch=8 over 2 rank"),
])
def test_bad_training_config_is_an_error(settings, message):
    with pytest.raises(ConfigError, match=message):  # on construction, or at the explicit build
        _config(**settings).build()


def test_float64_needs_x64_and_mesh_defaults():
    import jax

    with jax.enable_x64(False), pytest.raises(ConfigError, match="jax_enable_x64"):
        _config(strategy="dense", dtype="float64")
    assert _config(strategy="dense").build().program.mesh.shape == {"model": 1}
    assert str(_config(strategy="tensor-t1").parallel.mesh_config()) == \
        f"model={jax.device_count()}"
    config = _config(strategy="phantom", ghost_width=2, mesh="model=4,data=2")
    assert str(config.build().program.mesh) == "data=2,model=4"


def test_float16_refuses_adam_and_trains_with_sgd():
    """Adam's eps = 1e-8 is 0 in float16 (its update divides by zero where a gradient's second
    moment underflows): float16 weights with an adaptive optimizer are refused with the fixes
    (float32 master weights through --precision float16, bfloat16, or SGD); SGD trains finite."""
    import jax.numpy as jnp

    assert float(jnp.float16(1e-8)) == 0.0
    with pytest.raises(ConfigError, match=r"dtype='float16' with an adaptive optimizer.*"
                                          r"--precision float16"):
        _config(strategy="dense", dtype="float16")
    result = run(_config(strategy="dense", batch=16, steps=3, dtype="float16", optimizer="sgd",
                         learning_rate=0.01),
                 teacher=Teacher(TeacherConfig(width=32, train_size=64, eval_size=32), jnp.float16))
    assert all(np.isfinite(result.history["train_loss"]))
    assert np.isfinite(result.final_validation_loss)


def test_data_parallel_training_follows_the_single_device_run():
    """tensor on data=2,model=2 trains like on model=2: the same global batch, the same losses
    (up to float32 rounding). (Every strategy's data-parallel gradients: test_data_parallel.py.)"""
    small = dict(strategy="tensor", steps=10)
    model_only = run(_config(**small, mesh="model=2"), teacher=_teacher())
    data_parallel = run(_config(**small, mesh="data=2,model=2"), teacher=_teacher())
    for key in ("train_loss", "validation_loss"):
        np.testing.assert_allclose(data_parallel.history[key], model_only.history[key],
                                   rtol=1e-4)


def test_a_model_too_large_for_the_memory_is_refused_before_allocation(tmp_path):
    """width 2**20 is 8 TiB of dense weights: refused with the estimate, in well under a second
    of work, before any output is written."""
    import time

    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"needs about .* GiB per device \(parameters .*more than"):
        run(_config(strategy="dense", width=2**20, batch=8, steps=1, out=str(tmp_path / "o")),
            teacher=Teacher(TeacherConfig(width=2**20, train_size=8, eval_size=8)))
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "o").exists()
