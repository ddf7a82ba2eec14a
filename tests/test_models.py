"""The Flax FFN model delegates to the strategy and holds no communication of its own."""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jphantom.errors import ConfigError
from jphantom.models.ffn import FFN
from jphantom.sharding import dense

from helpers import assert_tree_close, batch, mse


@pytest.mark.parametrize("strategy, extra", [("dense", {}), ("tensor", {"layout": "t1"}),
                                             ("tensor", {"layout": "t2"}),
                                             ("phantom", {"ghost_width": 2}),
                                             ("phantom", {"ghost_width": 2, "fused": False})])
def test_ffn_model_matches_its_dense_equivalent(strategy, extra, mesh_of):
    mesh = None if strategy == "dense" else mesh_of(4)
    model = FFN(width=32, depth=3, strategy=strategy, mesh=mesh, dtype=jnp.float64,
                rngs=nnx.Rngs(0), **extra)
    x, t = batch(32)
    loss_fn = lambda m: mse(m(x), t)
    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model)
    want_loss, want_grads = jax.jit(jax.value_and_grad(
        lambda p: mse(dense.forward(model.strategy.dense_equivalent(p), x), t)))(model.params())
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-12)
    got = [{name: grads.layers[i][name][...] for name in layer} for i, layer in enumerate(want_grads)]
    assert_tree_close(got, want_grads, 1e-10)


def test_sharded_model_needs_a_mesh_and_a_known_strategy():
    with pytest.raises(ConfigError, match="needs a mesh"):
        FFN(width=32, depth=1, strategy="phantom", ghost_width=2, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="'pipeline' is not one of"):
        FFN(width=32, depth=1, strategy="pipeline", rngs=nnx.Rngs(0))


def test_models_contain_no_collectives():
    """Models describe computation; communication lives in jphantom/sharding only."""
    pattern = re.compile(r"\b(lax\.|psum|all_gather|all_to_all|ppermute|shard_map)")
    for path in pathlib.Path(__file__).parents[1].joinpath("jphantom", "models").glob("*.py"):
        assert not pattern.search(path.read_text()), f"{path} contains a collective"
