"""The training step's parts, each built and tested alone from one StepSetup: the
gradient provider against jax.grad on one device, the reducer's sum over data, the reducer that
does not reduce, the optimizer update; and the step is their composition."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jphantom.errors import ConfigError
from jphantom.step.grads import LocalGradients
from jphantom.step.layout import TrainState
from jphantom.step.rank_params import RankParameters
from jphantom.step.reduce import NoReduction, Reducer
from jphantom.step.setup import setup_of
from jphantom.step.update import OptimizerUpdate


def _loss(model, x, t):
    return jnp.mean(jnp.square(model(x) - t))


@pytest.fixture(scope="module")
def parts():
    from jphantom.runtime.mesh import MeshConfig, first_devices

    mesh = MeshConfig.of({"data": 2}).build(first_devices(2))
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    setup = setup_of(model, mesh, _loss)
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((6, 4)), rng.standard_normal((6, 3)))
    return model, mesh, setup, batch


def _per_rank(setup, reducer, batch):
    """The provider (with the rank's parameters) then the reducer in a shard_map over the setup's
    mesh, as the step runs them."""
    gradients = LocalGradients(setup, RankParameters(setup))

    def per_rank(leaves, *b):
        share, grads, _ = gradients(leaves, *b)
        loss, grads = reducer(share, grads)
        if reducer.check_vma:
            return loss, grads
        return loss[None], [g[None] for g in grads]  # each rank's own, stacked over data

    leaves = tuple(jax.tree.leaves(nnx.to_pure_dict(nnx.state(setup.model_template, nnx.Param))))
    out = P() if reducer.check_vma else P("data")
    fn = jax.shard_map(per_rank, mesh=setup.mesh,
                       in_specs=(tuple(setup.param_specs), P("data"), P("data")),
                       out_specs=(out, [out] * len(leaves)), check_vma=reducer.check_vma)
    return jax.jit(fn)(leaves, *batch), leaves


def test_provider_and_reducer_alone_give_the_one_device_gradient(parts):
    model, _, setup, batch = parts
    (loss, grads), _ = _per_rank(setup, Reducer(setup), batch)
    want_loss, want = nnx.value_and_grad(_loss)(model, *batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
    np.testing.assert_allclose(grads[0], want["bias"].get_value(), rtol=1e-12)
    np.testing.assert_allclose(grads[1], want["kernel"].get_value(), rtol=1e-12)


def test_no_reduction_leaves_each_rank_its_own_share(parts):
    """NoReduction (the compute-only measurement's reducer, its shard_map unchecked): each rank's
    loss is its own half's mean loss and its gradient that half's; nothing was summed."""
    model, _, setup, batch = parts
    (losses, grads), _ = _per_rank(setup, NoReduction(setup), batch)
    for rank, i in enumerate((0, 3)):
        half = (batch[0][i:i + 3], batch[1][i:i + 3])
        want_loss, want = nnx.value_and_grad(_loss)(model, *half)
        np.testing.assert_allclose(losses[rank], want_loss, rtol=1e-12)
        np.testing.assert_allclose(grads[1][rank], want["kernel"].get_value(), rtol=1e-12)


def test_update_alone_is_the_optimizers_step(parts):
    _, _, setup, _ = parts
    update = OptimizerUpdate(optax.sgd(0.5), setup)
    params = setup.pure([jnp.ones(3), jnp.ones((4, 3))])
    grads = setup.pure([jnp.full(3, 2.0), jnp.zeros((4, 3))])
    state = update(grads, TrainState(params, update.optimizer.init(params)))
    np.testing.assert_allclose(state.params["bias"], np.zeros(3))
    np.testing.assert_allclose(state.params["kernel"], np.ones((4, 3)))
    assert update.inputs(state) == {}  # no loss scale, no dropout key
    with pytest.raises(ConfigError, match="optax.GradientTransformation"):
        OptimizerUpdate(lambda g: g, setup)


def test_the_step_is_its_parts(parts):
    """make_train_step composes exactly these parts; the compute-only step swaps the reducer."""
    import jphantom
    from jphantom.experimental.compute_only import make_compute_only_step

    model, mesh, _, _ = parts
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), _loss)
    assert (type(step.params), type(step.gradients), type(step.reducer), type(step.update)) == (
        RankParameters, LocalGradients, Reducer, OptimizerUpdate)
    assert step.gradients.params is step.params  # the provider builds the rank's model alone:
    assert not hasattr(Reducer, "model") and not hasattr(Reducer, "gather")  # no layout here
    measured = make_compute_only_step(model, mesh, optax.sgd(0.1), _loss)
    assert type(measured.reducer) is NoReduction
