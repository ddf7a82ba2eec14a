"""The Flax FFN model delegates to the strategy and holds no communication of its own."""

import pathlib
import re

import jax
import pytest
from flax import nnx

from jphantom.errors import ConfigError
from jphantom.models.ffn import FFN, FFNConfig

from helpers import assert_tree_close, batch, mse, oracle_loss_and_grads, to_dense_of


@pytest.mark.parametrize("strategy", [
    "dense", "tensor-t1", "phantom", "phantom-unfused", "tensor", "gspmd"])
def test_ffn_model_matches_its_dense_equivalent(strategy, mesh_of):
    mesh = mesh_of(1 if strategy == "dense" else 4)
    config = FFNConfig(width=32, depth=3, ghost_width=2, dtype="float64")
    model = FFN(config, strategy=strategy, mesh=mesh, rngs=nnx.Rngs(0))
    x, t = batch(32)
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: mse(m(x), t)))(model)
    params = model.arrays()
    want_loss, want_grads = oracle_loss_and_grads(to_dense_of(strategy), params, x, t)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-12)
    assert_tree_close(nnx.to_pure_dict(grads)["params"], want_grads, 1e-10)
    assert_tree_close(model.dense_equivalent(), to_dense_of(strategy)(params), 0.0)


def test_model_config_and_strategy_are_validated():
    with pytest.raises(ConfigError, match=r"width=0 must be an integer >= 1"):
        FFNConfig(width=0)
    with pytest.raises(ConfigError, match=r"ghost_width=0 must be an integer >= 1"):
        FFNConfig(width=32, ghost_width=0)
    with pytest.raises(ConfigError, match=r"dtype='int8'"):
        FFNConfig(width=32, dtype="int8")
    with pytest.raises(ConfigError, match="needs ghost_width"):
        FFN(FFNConfig(width=32, depth=1), strategy="phantom", rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="unknown strategy 'pipeline'"):
        FFN(FFNConfig(width=32, depth=1), strategy="pipeline", rngs=nnx.Rngs(0))


def test_float64_needs_x64():
    with jax.enable_x64(False), pytest.raises(ConfigError, match="float64.*jax_enable_x64"):
        FFNConfig(width=32, dtype="float64")


def test_models_contain_no_collectives():
    """Models describe computation; communication lives in jphantom/sharding only (lax.scan and
    other non-collective lax functions are fine)."""
    pattern = re.compile(r"\blax\.(psum\w*|pmean|pmax|pmin|all_gather\w*|all_to_all|ppermute|"
                         r"pshuffle|axis_index|pcast)\b|\bshard_map\(")
    for path in pathlib.Path(__file__).parents[1].joinpath("jphantom", "models").glob("*.py"):
        assert not pattern.search(path.read_text()), f"{path} contains a collective"
