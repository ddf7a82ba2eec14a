"""Tensor-parallel baselines T1 and T2 against the single-device dense oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphantom.errors import ConfigError
from jphantom.sharding import dense, tensor

from helpers import TOLERANCE, assert_tree_close, batch, mse, oracle_loss_and_grads, perturb

WIDTH = 48


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_shards", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["t1", "t2"])
def test_tensor_parallel_matches_dense(layout, num_shards, depth, dtype, mesh_of):
    mesh = mesh_of(num_shards)
    params = perturb(tensor.init(jax.random.PRNGKey(0), width=WIDTH, num_shards=num_shards,
                                 depth=depth, layout=layout, dtype=dtype))
    x, t = batch(WIDTH, dtype=dtype)
    fn = lambda p: mse(tensor.forward(p, x, mesh, layout=layout), t)
    loss, grads = jax.jit(jax.value_and_grad(fn))(params)
    to_dense = lambda p: tensor.dense_equivalent(p, layout)
    want_loss, want_grads = oracle_loss_and_grads(to_dense, params, x, t)
    np.testing.assert_allclose(loss, want_loss, rtol=TOLERANCE[dtype])
    assert_tree_close(grads, want_grads, TOLERANCE[dtype])


@pytest.mark.parametrize("layout", ["t1", "t2"])
def test_from_dense_round_trips(layout):
    layers = dense.init(jax.random.PRNGKey(3), width=WIDTH, depth=3, dtype=jnp.float32)
    back = tensor.dense_equivalent(tensor.from_dense(layers, 4, layout), layout)
    assert_tree_close(back, layers, 0.0)


def test_unknown_layout_and_bad_width_are_errors():
    with pytest.raises(ConfigError, match=r"layout='t3'.*\('t1', 't2'\)"):
        tensor.init(jax.random.PRNGKey(0), width=48, num_shards=4, depth=1, layout="t3")
    with pytest.raises(ConfigError, match=r"width=50 is not divisible by num_shards=4"):
        tensor.init(jax.random.PRNGKey(0), width=50, num_shards=4, depth=1)
