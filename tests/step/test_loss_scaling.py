"""float16 with dynamic loss scaling (Micikevicius et al. 2018; Megatron-LM): a step whose
gradients overflow is skipped and halves the scale, finite steps double it after a period, and a
float16 GPT-2 trains as float32 does."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jphantom.step.precision import LossScaleState, dynamic_loss_scale


def test_an_overflowing_step_is_skipped_and_halves_the_scale():
    optimizer = dynamic_loss_scale(optax.adam(0.1), initial=8.0, period=2)
    params = {"w": jnp.ones(3)}
    state = optimizer.init(params)
    assert isinstance(state, LossScaleState) and float(state.scale) == 8.0
    bad = {"w": jnp.array([1.0, jnp.inf, 0.0])}
    updates, after = optimizer.update(bad, state, params)
    assert float(after.scale) == 4.0 and int(after.good_steps) == 0
    assert np.all(np.asarray(updates["w"]) == 0)  # skipped: parameters unchanged
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), after.inner, state.inner))
    good = {"w": jnp.array([0.1, 0.2, 0.3])}
    _, once = optimizer.update(good, after, params)
    _, twice = optimizer.update(good, once, params)
    assert float(once.scale) == 4.0 and float(twice.scale) == 8.0  # doubled after 2 finite
    assert int(twice.good_steps) == 0
    scale = 1.0
    state = optimizer.init(params)._replace(scale=jnp.asarray(scale, jnp.float32))
    _, floor = optimizer.update(bad, state, params)
    assert float(floor.scale) == 1.0  # never below the minimum


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_float16_gpt2_trains_as_float32(tmp_path):
    """The same 6 steps in float16 compute (float32 master weights, dynamic scale) and in
    float32: the loss curves agree to float16's precision."""
    from jphantom.config import RunConfig
    from jphantom.loop.trainer import run

    curves = {}
    for precision in ("float32", "float16"):
        config = RunConfig.from_flags(
            model="gpt2", strategy="tensor", mesh="data=2,model=2", precision=precision,
            layers=1, hidden=32, heads=4, seq_len=16, batch=8, steps=6, eval_every=6,
            eval_batches=1, out=None, progress=False)
        curves[precision] = np.asarray(run(config).history["train_loss"])
    assert np.all(np.isfinite(curves["float16"]))
    np.testing.assert_allclose(curves["float16"], curves["float32"], rtol=5e-3)
