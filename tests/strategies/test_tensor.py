"""Tensor-parallel baselines, ``tensor-t1`` (row-sharded) and ``tensor`` (Megatron column/row
pairs), and the ``gspmd`` baseline, against the single-device dense oracle."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jphantom.registry import program as program_module
from jphantom.errors import ConfigError
from jphantom.models.ffn import FFN, FFNConfig
from jphantom.nn.tensor import ColumnParallelLinear, GatherFeatures, RowParallelLinear, T1Linear

from conftest import require_devices
from helpers import (DTYPE_NAME, TOLERANCE, assert_tree_close, batch, gradient_step,
                     oracle_loss_and_grads, param_shapes, random_params)

WIDTH = 48

# Depths 1-4 cover Megatron's lone column layer, one pair, a pair and a lone column, two pairs;
# every p; float32 on a few (each case compiles one training step: about 1 s).
CASES = ([(1, 3), (2, 1), (2, 2), (2, 3), (4, 4), (8, 1), (8, 2), (8, 3)]
         + [(2, 3, jnp.float32), (8, 2, jnp.float32)])
CASES = [case if len(case) == 3 else (*case, jnp.float64) for case in CASES]


@pytest.mark.parametrize("num_shards, depth, dtype", CASES,
                         ids=[f"p{p}-L{d}-{DTYPE_NAME[t]}" for p, d, t in CASES])
@pytest.mark.parametrize("name", ["tensor-t1", "tensor"])
# make test: p = 1, 2 and 8; depths 1, 2 and 3 (a lone layer, a pair, a pair and a lone layer);
# float64 and float32
@pytest.mark.slow_cells(
    "tensor-t1-p8-L2-float32", "tensor-t1-p2-L3-float32", "tensor-t1-p2-L2-float64",
    "tensor-p2-L2-float64", "tensor-p2-L1-float64", "tensor-t1-p2-L3-float64",
    "tensor-p4-L4-float64", "tensor-t1-p4-L4-float64", "tensor-t1-p1-L3-float64",
    "tensor-t1-p8-L1-float64", "tensor-t1-p8-L3-float64", "tensor-p2-L3-float64",
    "tensor-p8-L1-float64", "tensor-p8-L2-float64", "tensor-p8-L2-float32")
def test_tensor_parallel_matches_dense(name, num_shards, depth, dtype):
    """Loss and every gradient of the training step equal jax.grad of the dense model."""
    require_devices(num_shards)
    config = FFNConfig(width=WIDTH, depth=depth, dtype=DTYPE_NAME[dtype])
    program, _, step, value_and_grad = gradient_step(name, config, f"model={num_shards}")
    params = random_params(program)
    x, t = batch(WIDTH, dtype=dtype)
    loss, grads = value_and_grad(params, x, t)
    want_loss, want_grads = oracle_loss_and_grads(step, params, x, t)
    np.testing.assert_allclose(loss, want_loss, rtol=TOLERANCE[dtype])
    assert_tree_close(grads, want_grads, TOLERANCE[dtype])


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_megatron_layout_pairs_the_dense_layers(depth):
    """Megatron's FFN is the plain FFN with its layers grouped in pairs: pair u holds layers 2u
    (column-parallel) and 2u+1 (row-parallel), an odd last layer is a lone column layer; the
    feature-split input is gathered at the entry and, after a row layer, scattered at the exit.
    The paired module computes the FFN of its layers taken in that order."""
    config = FFNConfig(WIDTH, depth, dtype="float64")
    paired = FFN(config, pairs=True, rngs=nnx.Rngs(0))
    assert (paired.layers is None) == (depth == 1)
    assert (paired.last is not None) == (depth % 2 == 1)
    layers = []
    if paired.layers is not None:
        block = paired.layers.block
        for u in range(depth // 2):
            layers += [(block.first.kernel[...][u], block.first.bias[...][u]),
                       (block.second.kernel[...][u], block.second.bias[...][u])]
    if paired.last is not None:
        layers.append((paired.last.kernel[...], paired.last.bias[...]))
    x, _ = batch(WIDTH)
    y = np.asarray(x)
    for i, (kernel, bias) in enumerate(layers):
        y = (np.maximum(y, 0) if i else y) @ np.asarray(kernel) + np.asarray(bias)
    np.testing.assert_allclose(np.asarray(paired(x)), y, rtol=1e-12, atol=1e-12)
    program = program_module.build(config, "tensor", "model=4")
    model = program.model
    assert isinstance(model.entry, GatherFeatures)
    if depth > 1:
        assert isinstance(model.layers.block.first, ColumnParallelLinear)
        assert isinstance(model.layers.block.second, RowParallelLinear)
    assert (type(model.exit).__name__ == "ScatterFeatures") == (depth % 2 == 0)
    if depth % 2:
        assert isinstance(model.last, ColumnParallelLinear)


def test_tensor_parallel_programs_describe_the_dense_model():
    """Both layouts keep the dense model's global shapes (a checkpoint restores at any p) and its
    parameter count; only the specs say how they are split."""
    config = FFNConfig(width=WIDTH, depth=3)
    t1 = program_module.build(config, "tensor-t1", "model=4")
    megatron = program_module.build(config, "tensor", "model=4")
    assert isinstance(t1.model.layers.block.linear, T1Linear)
    assert param_shapes(t1)["layers"]["block"]["linear"]["kernel"].shape == (3, WIDTH, WIDTH)
    dense_count = 3 * (WIDTH * WIDTH + WIDTH)  # weights and biases
    assert t1.param_count == megatron.param_count == dense_count
    dense = program_module.build(config, "dense", "model=1")
    assert dense.param_count == dense_count


def test_bad_width_and_mesh_are_errors():
    config = FFNConfig(width=50, depth=1)
    for name in ("tensor", "tensor-t1"):
        with pytest.raises(ConfigError, match=r"width=50 is not divisible by num_shards=4"):
            program_module.build(config, name, "model=4")
    with pytest.raises(ConfigError, match=r"an 'expert' mesh axis splits the experts of MoE"):
        program_module.build(FFNConfig(width=48), "tensor", "expert=2,model=2")
    with pytest.raises(ConfigError, match=r"strategy 'dense' runs on one device"):
        program_module.build(FFNConfig(width=48), "dense", "model=4")
    with pytest.raises(ConfigError, match=r"unknown strategy 'tensor-t2'"):
        program_module.build(FFNConfig(width=48), "tensor-t2", "model=4")
    with pytest.raises(ConfigError, match=r"sequence_parallel .*applies to the transformer"):
        program_module.build(FFNConfig(width=48), "tensor", "model=4", sequence_parallel=True)


def test_feature_styles_fit_their_modules_only():
    """``t1`` takes an nnx.Linear, ``gather`` / ``scatter`` a Boundary; pmm3d's ``weights`` is
    one of kept, regather, deferred: anything else is refused by path before anything changes."""
    from jphantom import Style, parallelize

    model = FFN(FFNConfig(WIDTH, 2), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match=r"entry: style 't1' does not fit Boundary"):
        parallelize(model, {"model": 4}, {"entry": "t1"})
    with pytest.raises(ConfigError, match=r"layers.block.linear: style 'gather' does not fit"):
        parallelize(model, {"model": 4}, {"layers.block.linear": "gather"})
    with pytest.raises(ConfigError, match=r"weights='cached'"):
        Style("pmm3d", weights="cached")
    with pytest.raises(ConfigError, match=r"for 'pmm3d' only"):
        Style("column", weights="deferred")
    with pytest.raises(ConfigError, match=r"in_features=48 is not divisible"):
        parallelize(model, {"model": 5}, {"layers.block.linear": "t1"})
