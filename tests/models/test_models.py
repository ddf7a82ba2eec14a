"""The FFN is a Flax NNX module of plain layers holding no communication; every strategy is a plan
applied to it, and the parallel model trains like the plain model it is."""

import pathlib
import re

import jax
import numpy as np
import pytest
from flax import nnx

from jphantom.registry import program as program_module
from jphantom.errors import ConfigError
from jphantom.models.ffn import FFN, FFNConfig

from conftest import require_devices
from helpers import assert_tree_close, batch, gradient_step, oracle_loss_and_grads


@pytest.mark.parametrize("depth, pairs", [(1, False), (3, False), (1, True), (2, True),
                                         (3, True)])
def test_the_plain_ffn_is_seal_et_al_s_ffn(depth, pairs):
    """y = W_L relu(... relu(W_1 x + b_1)) + b_L, written out layer by layer, equals the module
    (stacked units under lax.scan, the first peeled, ReLU from the unit's index) and its loss is
    the mean squared error."""
    config = FFNConfig(width=16, depth=depth, dtype="float64")
    model = FFN(config, pairs=pairs, rngs=nnx.Rngs(3))
    layers = []
    if model.layers is not None:
        block = model.layers.block
        names = ("first", "second") if pairs else ("linear",)
        for u in range(model.layers.layers):
            layers += [(getattr(block, n).kernel[...][u], getattr(block, n).bias[...][u])
                       for n in names]
    if model.last is not None:
        layers.append((model.last.kernel[...], model.last.bias[...]))
    assert len(layers) == depth
    x, t = batch(16)
    y = np.asarray(x)
    for i, (kernel, bias) in enumerate(layers):
        y = (np.maximum(y, 0) if i else y) @ np.asarray(kernel) + np.asarray(bias)
    np.testing.assert_allclose(np.asarray(model(x)), y, rtol=1e-12, atol=1e-12)
    assert float(model.loss(x, t)) == pytest.approx(float(np.mean((y - np.asarray(t)) ** 2)),
                                                   rel=1e-12)


@pytest.mark.parametrize("strategy", [
    "dense", "tensor-t1", "phantom", "phantom-unfused", "tensor", "gspmd", "pmm3d"])
# make test: phantom and tensor (the FFN's own layers); the others' layers are each strategy's
# own tests' (test_tensor.py, test_pmm3d.py, test_data_parallel.py's GSPMD)
@pytest.mark.slow_cells("tensor-t1", "phantom-unfused", "dense", "gspmd", "pmm3d")
def test_ffn_model_matches_its_dense_equivalent(strategy):
    """Each strategy's parallelised FFN, created in its shards (program.init) and trained one SGD
    step, moves its parameters by exactly the gradient of the plain model it is (one device,
    float64): loss and update."""
    mesh = {"dense": "model=1", "pmm3d": "z=2,y=1,x=2"}.get(strategy, "model=4")
    require_devices(1 if strategy == "dense" else 4)
    config = FFNConfig(width=32, depth=3, ghost_width=2, dtype="float64")
    program, mesh_obj, step, _ = gradient_step(strategy, config, mesh)
    state = program.init(step)
    before = jax.device_get(state.params)
    x, t = batch(32)
    new, loss = step(state, x, t)
    want_loss, want_grads = oracle_loss_and_grads(step, before, x, t)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-12)
    moved = jax.tree.map(lambda a, b: (np.asarray(b) - np.asarray(a)) / -0.1, before,
                         jax.device_get(new.params))  # SGD(0.1): p - 0.1 g
    assert_tree_close(moved, want_grads, 1e-9)


def test_model_config_and_strategy_are_validated():
    with pytest.raises(ConfigError, match=r"width=0 must be an integer >= 1"):
        FFNConfig(width=0)
    with pytest.raises(ConfigError, match=r"ghost_width=0 must be an integer >= 1"):
        FFNConfig(width=32, ghost_width=0)
    with pytest.raises(ConfigError, match=r"dtype='int8'"):
        FFNConfig(width=32, dtype="int8")
    with pytest.raises(ConfigError, match="needs ghost_width"):
        program_module.build(FFNConfig(width=32, depth=1), "phantom", "model=1")
    with pytest.raises(ConfigError, match="unknown strategy 'pipeline'"):
        program_module.build(FFNConfig(width=32, depth=1), "pipeline", "model=1")
    with pytest.raises(ConfigError, match=r"options \['heads'\] do not apply to the ffn"):
        program_module.build(FFNConfig(width=32, depth=1), "tensor", "model=1", heads=4)


def test_a_concrete_plain_ffn_is_parallelised_in_place():
    """``build(..., model=FFN(...))`` parallelises a given plain model (no create): its
    parameters are the plain model's."""
    config = FFNConfig(width=32, depth=2)
    plain = FFN(config, pairs=True, rngs=nnx.Rngs(5))
    kernel = np.asarray(plain.layers.block.first.kernel[...])
    program = program_module.build(config, "tensor", "model=4", model=plain)
    assert program.create is None
    np.testing.assert_array_equal(np.asarray(program.model.layers.block.first.kernel[...]), kernel)
    with pytest.raises(ConfigError, match="pairs=True"):
        program_module.build(config, "tensor", "model=4", model=FFN(config, rngs=nnx.Rngs(0)))


def test_float64_needs_x64():
    with jax.enable_x64(False), pytest.raises(ConfigError, match="float64.*jax_enable_x64"):
        FFNConfig(width=32, dtype="float64")


def test_models_contain_no_collectives():
    """Models describe computation; communication lives in the parallel layers (jphantom/nn) and
    the step (lax.scan and other non-collective lax functions are fine)."""
    pattern = re.compile(r"\blax\.(psum\w*|pmean|pmax|pmin|all_gather\w*|all_to_all|ppermute|"
                         r"pshuffle|axis_index|pcast)\b|\bshard_map\(")
    for path in pathlib.Path(__file__).parents[2].joinpath("jphantom", "models").glob("*.py"):
        assert not pattern.search(path.read_text()), f"{path} contains a collective"
