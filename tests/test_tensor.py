"""Tensor-parallel baselines, ``tensor-t1`` (row-sharded) and ``tensor`` (Megatron column/row
pairs), and the ``gspmd`` baseline, against the single-device dense oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphantom import strategies
from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig
from jphantom.models.ffn import FFNConfig
from jphantom.sharding import dense, tensor

from conftest import require_devices
from helpers import (DTYPE_NAME, TOLERANCE, assert_tree_close, batch, oracle_loss_and_grads,
                     random_params, step_loss_and_grads, to_dense_of)

WIDTH = 48

# Depths 1-4 cover Megatron's lone column layer, one pair, a pair and a lone column, two pairs;
# every p; float32 on a few (each case compiles one training step: about 1 s).
CASES = ([(1, 3), (2, 1), (2, 2), (2, 3), (4, 4), (8, 1), (8, 2), (8, 3)]
         + [(2, 3, jnp.float32), (8, 2, jnp.float32)])
CASES = [case if len(case) == 3 else (*case, jnp.float64) for case in CASES]


@pytest.mark.parametrize("num_shards, depth, dtype", CASES,
                         ids=[f"p{p}-L{d}-{DTYPE_NAME[t]}" for p, d, t in CASES])
@pytest.mark.parametrize("name", ["tensor-t1", "tensor"])
def test_tensor_parallel_matches_dense(name, num_shards, depth, dtype):
    """Loss and every gradient of the training step equal jax.grad of the dense model."""
    require_devices(num_shards)
    config = FFNConfig(width=WIDTH, depth=depth, dtype=DTYPE_NAME[dtype])
    program = strategies.get(name).program(config, MeshConfig.of({"model": num_shards}))
    params = random_params(program)
    x, t = batch(WIDTH, dtype=dtype)
    loss, grads = step_loss_and_grads(name, config, f"model={num_shards}", params, x, t)
    want_loss, want_grads = oracle_loss_and_grads(to_dense_of(name), params, x, t)
    np.testing.assert_allclose(loss, want_loss, rtol=TOLERANCE[dtype])
    assert_tree_close(grads, want_grads, TOLERANCE[dtype])


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_megatron_layout_round_trips(depth):
    """Even layers are column-parallel, odd layers row-parallel; interleaving gives them back."""
    layers = dense.init(jax.random.PRNGKey(3), width=WIDTH, depth=depth, dtype=jnp.float32)
    split = tensor.megatron_from_dense(layers)
    assert split["column"]["weight"].shape == ((depth + 1) // 2, WIDTH, WIDTH)
    assert split["row"]["weight"].shape == (depth // 2, WIDTH, WIDTH)
    assert_tree_close(tensor.megatron_dense_equivalent(split), layers, 0.0)


def test_tensor_parallel_programs_describe_the_dense_model():
    """Both layouts keep the dense model's global shapes (a checkpoint restores at any p) and its
    parameter count; only the specs say how they are split."""
    config = FFNConfig(width=WIDTH, depth=3)
    t1 = strategies.get("tensor-t1").program(config, MeshConfig.of({"model": 4}))
    megatron = strategies.get("tensor").program(config, MeshConfig.of({"model": 4}))
    assert jax.eval_shape(t1.init, jax.random.PRNGKey(0))["weight"].shape == (3, WIDTH, WIDTH)
    assert t1.param_count == megatron.param_count == dense.param_count(WIDTH, 3)


def test_bad_width_and_mesh_are_errors():
    config = FFNConfig(width=50, depth=1)
    for name in ("tensor", "tensor-t1"):
        with pytest.raises(ConfigError, match=r"width=50 is not divisible by num_shards=4"):
            strategies.get(name).program(config, MeshConfig.of({"model": 4}))
    with pytest.raises(ConfigError, match=r"an 'expert' mesh axis splits the experts of MoE"):
        strategies.get("tensor").program(FFNConfig(width=48), MeshConfig.of({"expert": 2, "model": 2}))
    with pytest.raises(ConfigError, match=r"strategy 'dense' runs on one device"):
        strategies.get("dense").program(FFNConfig(width=48), MeshConfig.of({"model": 4}))
    with pytest.raises(ConfigError, match=r"unknown strategy 'tensor-t2'"):
        strategies.get("tensor-t2")
