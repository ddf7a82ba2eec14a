"""The API step's non-finite policy (jphantom.step.finite): the default says once, without a host
sync, that a loss went non-finite; skip and stop keep the last finite state, counting what they
dropped, including an update whose finite gradients overflow the parameters."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jphantom
from jphantom.errors import ConfigError, JPhantomWarning, TrainingDiverged
from jphantom.step.finite import keep_if_finite, skipped_updates, state_is_finite


def _loss(model, x, t):
    return jnp.mean(jnp.square(model(x) - t))


def _step(lr, **options):
    from jphantom.runtime.mesh import MeshConfig, first_devices

    mesh = MeshConfig.of({"data": 2}).build(first_devices(2))
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    step = jphantom.make_train_step(model, mesh, optax.sgd(lr), _loss, **options)
    return step, step.init()


def _batch(scale=1.0):
    rng = np.random.default_rng(0)
    return (np.float32(scale) * rng.standard_normal((4, 4)).astype(np.float32),
            rng.standard_normal((4, 3)).astype(np.float32))


def test_keep_if_finite_drops_an_update_that_overflows_finite_gradients():
    params = {"w": jnp.ones(3, jnp.float32)}  # float32: 1e40 overflows
    tx = keep_if_finite(optax.sgd(1e30))
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.full(3, 1e10, jnp.float32)}, state, params)  # 1e40: inf
    assert np.all(np.asarray(optax.apply_updates(params, updates)["w"]) == 1.0)
    assert skipped_updates(state) == 1
    updates, state = tx.update({"w": jnp.full(3, 1e-30, jnp.float32)}, state, params)  # a finite update
    assert np.all(np.asarray(optax.apply_updates(params, updates)["w"]) < 1.0)
    assert skipped_updates(state) == 1 and bool(state_is_finite(state))
    # optax.apply_if_finite checks only the gradients: the overflow passes it
    plain = optax.apply_if_finite(optax.sgd(1e30), 10)
    updates, _ = plain.update({"w": jnp.full(3, 1e10, jnp.float32)}, plain.init(params), params)
    assert not np.all(np.isfinite(np.asarray(optax.apply_updates(params, updates)["w"])))


def test_the_default_warns_once_when_a_loss_goes_nonfinite():
    step, state = _step(0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, loss = step(state, *_batch())
        jax.block_until_ready(loss)
        for _ in range(3):
            state, loss = step(state, *_batch(np.nan))
            jax.block_until_ready(loss)
    said = [w for w in caught if issubclass(w.category, JPhantomWarning)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "training loss is nan at call 2" in str(said[0].message)


def test_skip_and_stop_keep_the_last_finite_state():
    step, state = _step(1e30, on_nonfinite="skip")
    before = np.asarray(state.params["kernel"])
    for _ in range(2):  # finite gradients whose sgd update overflows
        state, loss = step(state, *_batch(1e5))
    assert np.isfinite(float(loss)) and step.skipped_updates(state) == 2
    np.testing.assert_array_equal(np.asarray(state.params["kernel"]), before)

    step, state = _step(1e30, on_nonfinite="stop")
    with pytest.raises(TrainingDiverged, match="call 1 of the step.*not applied") as error:
        step(state, *_batch(1e5))
    assert bool(state_is_finite(error.value.state))
    np.testing.assert_array_equal(np.asarray(error.value.state.params["kernel"]), before)


def test_an_unknown_policy_is_one_line():
    with pytest.raises(ConfigError, match="on_nonfinite='retry' must be one of 'warn', 'skip', "
                                          "'stop', 'rollback'"):
        _step(0.1, on_nonfinite="retry")


def test_rollback_is_a_loops_and_a_step_alone_refuses_it_naming_the_fix():
    with pytest.raises(ConfigError, match="on_nonfinite='rollback' reloads the newest good "
                                          "checkpoint.*--checkpoint-dir.*'stop'"):
        _step(0.1, on_nonfinite="rollback")


def _run_nan(step, state, calls=3):
    """``calls`` calls of ``step`` on NaN inputs; the JPhantomWarnings they gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            state, loss = step(state, *_batch(np.nan))
            jax.block_until_ready(loss)
    return state, [w for w in caught if issubclass(w.category, JPhantomWarning)]


@pytest.mark.parametrize("policy", ["warn", "skip", "stop", "rollback"])
def test_a_loop_that_judges_the_losses_gets_a_step_that_reads_none(policy):
    """watch=False (the Trainer's step): no warning, no TrainingDiverged, every policy accepted;
    the bad update is dropped under skip only (a loop's stop names its checkpoint, its step pays
    no check)."""
    step, state = _step(0.1, on_nonfinite=policy, watch=False)
    before = np.asarray(state.params["kernel"])
    state, said = _run_nan(step, state)
    assert not said and step.watch.policy == policy
    if policy == "skip":
        assert step.skipped_updates(state) == 3
        np.testing.assert_array_equal(np.asarray(state.params["kernel"]), before)
    else:
        assert step.skipped_updates(state) is None
        assert not bool(state_is_finite(state))


def test_ignore_is_deprecated_for_watch_false():
    """The old fifth name still means what it did (nothing checked, nothing dropped) for one
    release, saying what replaces it."""
    with pytest.warns(DeprecationWarning, match="on_nonfinite='ignore' is deprecated.*"
                                                "watch=False"):
        step, state = _step(0.1, on_nonfinite="ignore")
    state, said = _run_nan(step, state)
    assert not said and step.skipped_updates(state) is None and not step.watch.on


def test_a_batch_with_nothing_to_count_is_not_a_nonfinite_loss():
    """A weighted loss_fn's batch with nothing to count comes back NaN with no update applied
    (jphantom.step.token_mean reports it): the watch passes over it, and warns at the next NaN."""
    from jphantom.step.finite import NonFiniteWatch

    empty = [1]
    watch = NonFiniteWatch("warn", lambda: empty[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", JPhantomWarning)
        watch(None, jnp.float32(jnp.nan))  # the empty batch
    with pytest.warns(JPhantomWarning, match="training loss is nan at call 2"):
        watch(None, jnp.float32(jnp.nan))
