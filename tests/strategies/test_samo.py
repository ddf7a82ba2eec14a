"""SAMO (Singh's thesis ch. 4) as an option of the module step: compressed master weights, Adam moments
and gradients for a pruned model; the trajectory of masked-dense Adam, an all-reduce of (1 - s) of
the dense gradient, and the model-state bytes of Eqs. 4.1-4.5.

The model is a small plain NNX MLP written here (``nnx.Linear`` layers, ReLU), never imported by
the library."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jphantom
from jphantom.experimental import samo
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import make_mesh, first_devices

from conftest import require_devices

WIDTH, DEPTH = 16, 3


class MLP(nnx.Module):
    """``DEPTH`` square ``nnx.Linear`` layers with ReLU between them (random non-zero biases, so
    that every parameter matters)."""

    def __init__(self, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([nnx.Linear(WIDTH, WIDTH, bias_init=nnx.initializers.normal(0.1),
                                           rngs=rngs) for _ in range(DEPTH)])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(jax.nn.relu(x))
        return x


def loss_fn(model, x, t):  # as written for one device
    return jnp.mean(jnp.square(model(x) - t))


@functools.lru_cache(maxsize=None)
def _setup(mesh_text="data=2"):
    require_devices(2)
    mesh = make_mesh(mesh_text, first_devices(2))
    rng = np.random.default_rng(0)
    x, t = (rng.standard_normal((16, WIDTH)).astype(np.float32) for _ in range(2))
    return mesh, x, t


def _params(model):
    return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])


def _samo(sparsity, precision, steps):
    mesh, x, t = _setup()
    model = MLP()
    params = jax.tree.map(np.asarray, _params(model))
    step = samo.make_samo_step(model, mesh, optax.adam(1e-2), loss_fn, samo.SamoConfig(sparsity),
                               precision=precision)
    state = step.init()
    masks = samo.magnitude_masks(params, sparsity)
    loss = None
    for _ in range(steps):
        state, loss = step(state, x, t)
    return params, masks, state, loss, step


def test_samo_follows_masked_dense_adam_for_100_steps():
    """float32 compute: 100 SAMO steps on data=2 equal Adam on the masked dense model on one
    device (gradients and parameters masked), float32 1e-5."""
    params, masks, state, loss, _ = _samo(0.5, "float32", 100)
    _, x, t = _setup()
    graphdef = nnx.graphdef(MLP())
    optimizer = optax.adam(1e-2)
    weights = jax.tree.map(lambda a, m: jnp.where(m, a, 0.0), params, masks)
    opt_state = optimizer.init(weights)

    @jax.jit
    def dense_step(weights, opt_state):
        value, grads = jax.value_and_grad(
            lambda w: loss_fn(nnx.merge(graphdef, w), x, t))(weights)
        grads = jax.tree.map(lambda g, m: jnp.where(m, g, 0.0), grads, masks)
        updates, opt_state = optimizer.update(grads, opt_state, weights)
        return optax.apply_updates(weights, updates), opt_state, value

    for _ in range(100):
        weights, opt_state, want = dense_step(weights, opt_state)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    got_leaves, ref_leaves = jax.tree.leaves(state.params), jax.tree.leaves(weights)
    assert len(got_leaves) == len(ref_leaves) == 2 * DEPTH
    for got, ref in zip(got_leaves, ref_leaves):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0,
                                   atol=1e-5 * float(np.max(np.abs(ref))))


def _data_all_reduce_elements(step, state, x, t) -> int:
    hlo = step.lower(state, x, t).compile().as_text()
    assert [c.kind for c in collectives(hlo) if c.kind != "all-reduce"] == []
    return sum(int(np.prod(dims)) for c in collectives(hlo)
               if c.kind == "all-reduce" and c.mesh_axes({"data": 2}) == ("data",)
               for _, dims in c.shapes if dims)  # the loss scalar aside


def test_compressed_all_reduce_moves_one_minus_s_of_the_dense_gradient():
    """The compiled SAMO step all-reduces exactly the nonzeros over ``data``; the same model's
    plain step all-reduces phi. (The old FFN stacked its biases as [L, n] and pruned them too;
    here biases are 1-D and stay dense, as the mask's rule says, so the kept fraction of phi is
    (0.25 weights + biases) / phi, and the 25% is asserted on the weights.)"""
    params, masks, state, _, step = _samo(0.75, "bf16", 0)
    mesh, x, t = _setup()
    reduced = _data_all_reduce_elements(step, state, x, t)
    nonzeros = sum(int(np.sum(m)) for m in jax.tree.leaves(masks))
    phi = sum(int(np.size(m)) for m in jax.tree.leaves(masks))
    # The values of the nonzeros only (in bf16 on a GPU; XLA:CPU reduces bf16 in float32).
    assert reduced == nonzeros
    weights = [m for m in jax.tree.leaves(masks) if m.ndim >= 2]
    assert sum(int(m.sum()) for m in weights) == sum(m.size for m in weights) // 4  # 75% pruned
    assert nonzeros == sum(m.size for m in weights) // 4 + DEPTH * WIDTH  # biases dense
    dense = jphantom.make_train_step(MLP(), mesh, optax.adam(1e-2), loss_fn, precision="bf16")
    assert _data_all_reduce_elements(dense, dense.init(), x, t) == phi  # the dense gradient


@pytest.mark.parametrize("sparsity", [0.25, 0.9])
def test_model_state_bytes_match_the_formula(sparsity):
    _, masks, state, _, _ = _samo(sparsity, "bf16", 0)
    nonzeros = sum(int(np.sum(m)) for m in jax.tree.leaves(masks))
    phi = sum(int(np.size(m)) for m in jax.tree.leaves(masks))
    measured = samo.state_bytes(state)
    assert measured["theta"] == 2 * phi  # theta16 dense in bf16: 2 phi
    assert measured["master"] == measured["index"] == 4 * nonzeros  # 4 f phi each
    assert measured["moments"] == 8 * nonzeros  # Adam's m and v: 8 f phi
    assert measured["total"] == pytest.approx(samo.formula_bytes(phi, nonzeros)["at_rest"],
                                              rel=0.05)


def test_samo_refuses_what_it_does_not_run():
    with pytest.raises(ConfigError, match="sparsity"):
        samo.SamoConfig(sparsity=1.0)
    require_devices(4)
    config, optimizer = samo.SamoConfig(), optax.adam(1e-3)
    with pytest.raises(ConfigError, match="pure data parallelism"):
        samo.make_samo_step(MLP(), make_mesh("data=2,model=2", first_devices(4)), optimizer,
                            loss_fn, config)
    data = make_mesh("data=2", first_devices(2))
    with pytest.raises(ConfigError, match="zero=0"):
        samo.make_samo_step(MLP(), data, optimizer, loss_fn, config, zero=1)
    with pytest.raises(ConfigError, match="spmd='shard_map'"):
        samo.make_samo_step(MLP(), data, optimizer, loss_fn, config, spmd="gspmd")
    with pytest.raises(ConfigError, match="pipeline"):
        samo.make_samo_step(MLP(), make_mesh("stage=2,data=2", first_devices(4)), optimizer,
                            loss_fn, config)
    with pytest.raises(ConfigError, match="jphantom.experimental.samo.make_samo_step"):
        jphantom.make_train_step(MLP(), data, optimizer, loss_fn, samo=config)
    with pytest.raises(ConfigError,
                       match="jphantom.experimental.compute_only.make_compute_only_step"):
        jphantom.make_train_step(MLP(), data, optimizer, loss_fn, communicate=False)
