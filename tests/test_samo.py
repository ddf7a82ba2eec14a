"""SAMO (seed 004 ch. 4): compressed master weights, Adam moments and gradients for a pruned
model; the trajectory of masked-dense Adam, an all-reduce of (1 - s) of the dense gradient, and
the model-state bytes of Eqs. 4.1-4.5."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jphantom import samo, strategies
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig, first_devices
from jphantom.models.ffn import FFNConfig
from jphantom.sharding import dense

from conftest import require_devices
from helpers import random_params

WIDTH, DEPTH = 16, 3


@functools.lru_cache(maxsize=None)
def _setup(mesh_text="data=2,model=1"):
    mesh_config = MeshConfig.parse(mesh_text)
    require_devices(mesh_config.device_count)
    program = strategies.get("tensor").program(FFNConfig(WIDTH, DEPTH), mesh_config)
    mesh = program.mesh.build(first_devices(program.mesh.device_count))
    rng = np.random.default_rng(0)
    x, t = (rng.standard_normal((16, WIDTH)).astype(np.float32) for _ in range(2))
    return program, mesh, random_params(program), x, t


def _samo(sparsity, compute, steps):
    program, mesh, params, x, t = _setup()
    config = samo.SamoConfig(sparsity, compute, learning_rate=1e-2)
    masks = samo.magnitude_masks(params, sparsity)
    state = samo.init(program, mesh, params, masks, config)
    step = samo.make_step(program, mesh, config)
    batch = [jax.device_put(a, s) for a, s in zip((x, t), program.batch_shardings(mesh))]
    loss = None
    for _ in range(steps):
        state, loss = step(state, *batch)
    return program, params, masks, state, loss, step, batch


def test_samo_follows_masked_dense_adam_for_100_steps():
    """float32 compute: 100 SAMO steps on data=2 equal Adam on the masked dense model on one
    device (gradients and parameters masked), float32 1e-5."""
    program, params, masks, state, loss, _, _ = _samo(0.5, "float32", 100)
    _, _, _, x, t = _setup()
    optimizer = optax.adam(1e-2)
    weights = jax.tree.map(lambda a, m: jnp.where(m, a, 0.0), params, masks)
    opt_state = optimizer.init(weights)

    @jax.jit
    def dense_step(weights, opt_state):
        value, grads = jax.value_and_grad(lambda w: jnp.mean(jnp.square(
            dense.forward(program.dense_equivalent(w), x) - t)))(weights)
        grads = jax.tree.map(lambda g, m: jnp.where(m, g, 0.0), grads, masks)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, value

    for _ in range(100):
        weights, opt_state, want = dense_step(weights, opt_state)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    for got, ref in zip(jax.tree.leaves(state.theta), jax.tree.leaves(weights)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0,
                                   atol=1e-5 * float(np.max(np.abs(ref))))


def test_compressed_all_reduce_moves_one_minus_s_of_the_dense_gradient():
    program, params, masks, state, _, step, batch = _samo(0.75, "bfloat16", 1)
    hlo = step.lower(state, *batch).compile().as_text()
    mesh_axes = {"data": 2, "model": 1}
    reduced = sum(int(np.prod(dims)) for c in collectives(hlo)
                  if c.kind == "all-reduce" and c.mesh_axes(mesh_axes) == ("data",)
                  for _, dims in c.shapes if dims)  # the loss scalar aside
    nonzeros = sum(int(np.sum(m)) for m in jax.tree.leaves(masks))
    phi = sum(int(np.size(m)) for m in jax.tree.leaves(masks))
    # The values of the nonzeros only (in bf16 on a GPU; XLA:CPU reduces bf16 in float32).
    assert reduced == nonzeros
    assert nonzeros / phi == pytest.approx(0.25, abs=0.02)  # weights 75% pruned, biases dense


@pytest.mark.parametrize("sparsity", [0.25, 0.9])
def test_model_state_bytes_match_the_formula(sparsity):
    _, params, masks, state, _, _, _ = _samo(sparsity, "bfloat16", 0)
    nonzeros = sum(int(np.sum(m)) for m in jax.tree.leaves(masks))
    phi = sum(int(np.size(m)) for m in jax.tree.leaves(masks))
    measured = samo.state_bytes(state)
    assert measured["total"] == pytest.approx(samo.formula_bytes(phi, nonzeros)["at_rest"],
                                              rel=0.05)


def test_samo_refuses_what_it_does_not_run():
    with pytest.raises(ConfigError, match="sparsity"):
        samo.SamoConfig(sparsity=1.0)
    require_devices(4)
    program = strategies.get("tensor").program(FFNConfig(8, 2), MeshConfig.parse("data=2,model=2"))
    with pytest.raises(ConfigError, match="pure data parallelism"):
        samo.make_step(program, None, samo.SamoConfig())
