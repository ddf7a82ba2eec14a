"""Shared test utilities: the single-device oracle, gradients out of the real training step, and
tree comparisons."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jphantom.sharding import dense


def batch(width: int, size: int = 16, dtype=jnp.float64, seed: int = 1):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(kx, (size, width), dtype), jax.random.normal(ky, (size, width), dtype))


def perturb(params, scale: float = 0.1, seed: int = 7):
    """Random non-zero biases and off-init weights, so that every parameter matters in the test."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [a + scale * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
    )


def random_params(program, seed: int = 7):
    """Parameters of ``program``'s shapes and dtype filled with numpy random numbers (no jax
    compilation): weights N(0, 1/fan_in) (fan_in = the last dimension), biases N(0, 0.01).
    Any values do for the oracle tests; phantom's own decompressor slot gets a random value too,
    which must have no effect."""
    shapes = jax.eval_shape(program.init, jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        scale = 0.1 if "bias" in name else 1.0 / np.sqrt(leaf.shape[-1])
        return (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def mse(y, t):
    return jnp.mean(jnp.square(y - t))


def identity(params):
    """The dense equivalent of dense-shaped parameters (dense, gspmd, tensor-t1)."""
    return params


def to_dense_of(strategy: str):
    """The dense equivalent of ``strategy``'s parameters, as a module-level function (so that the
    oracle's compilation is shared by every test with the same shapes)."""
    from jphantom.sharding import phantom, tensor

    return {"phantom": phantom.dense_equivalent, "phantom-unfused": phantom.dense_equivalent,
            "tensor": tensor.megatron_dense_equivalent}.get(strategy, identity)


@functools.lru_cache(maxsize=None)
def _oracle(to_dense):
    def loss(params, x, t):
        return mse(dense.forward(to_dense(params), x), t)

    return jax.jit(jax.value_and_grad(loss))


def oracle_loss_and_grads(to_dense, params, x, t):
    """Loss and gradients w.r.t. the *sharded* params, computed on one device by differentiating
    the dense equivalent ``to_dense(params)`` = ``{"weight": [L, n, n], "bias": [L, n]}`` through
    ``dense.forward`` (float64 so that float32 runs are compared with the exact answer)."""
    cpu0 = jax.devices()[0]
    params64, x64, t64 = jax.device_put(
        jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), (params, x, t)), cpu0)
    return _oracle(to_dense)(params64, x64, t64)


def gradient_catcher() -> optax.GradientTransformation:
    """An "optimizer" whose state is the last gradient and whose update is zero: the training step
    then returns the exact gradients it computed (all reductions included) as its new state."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


@functools.lru_cache(maxsize=64)
def gradient_step(strategy: str, model_config, mesh: str):
    """``(program, mesh, step)`` with ``step(params, state, x, t) -> (params, grads, loss)``: the
    real training step (:func:`jphantom.step.make_train_step`) with :func:`gradient_catcher`.
    Cached, so tests asking for the same configuration share one compilation."""
    from jphantom import strategies
    from jphantom.mesh import MeshConfig, first_devices
    from jphantom.step import make_train_step

    config = MeshConfig.parse(mesh)
    mesh_obj = config.build(first_devices(config.device_count))
    program = strategies.get(strategy).program(model_config, config)
    return program, mesh_obj, make_train_step(program, mesh_obj, gradient_catcher(), donate=False)


def step_loss_and_grads(strategy: str, model_config, mesh: str, params, x, t):
    """Loss and gradients of ``params`` out of the compiled training step on ``mesh``."""
    program, mesh_obj, step = gradient_step(strategy, model_config, mesh)
    params = jax.device_put(params, program.shardings(mesh_obj))
    x, t = (jax.device_put(a, s) for a, s in zip((x, t), program.batch_shardings(mesh_obj)))
    state = jax.tree.map(jnp.zeros_like, params)
    _, grads, loss = step(params, state, x, t)
    return loss, grads


def assert_tree_close(actual, expected, rtol):
    """Every leaf: max |a - e| <= rtol * max |e| (a norm-wise relative error, robust near zeros).
    A leaf whose expected value is zero up to rounding (below 1e-6 of the tree's largest, such as
    the gradient of an attention key bias, which softmax cancels exactly) is measured against the
    tree's largest instead: its computed value is rounding noise of the others."""
    a_leaves, a_tree = jax.tree.flatten(actual)
    e_leaves, e_tree = jax.tree.flatten(expected)
    assert a_tree == e_tree
    largest = max((float(np.max(np.abs(np.asarray(e, np.float64)))) for e in e_leaves
                   if np.size(e)), default=1.0)
    for path, a, e in zip(jax.tree_util.tree_flatten_with_path(expected)[0], a_leaves, e_leaves):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = np.max(np.abs(e)) if e.size else 1.0
        scale = scale if scale > 1e-6 * largest else max(largest, 1e-30)
        err = np.max(np.abs(a - e)) / scale if e.size else 0.0
        assert err <= rtol, f"{jax.tree_util.keystr(path[0])}: relative error {err:.3e} > {rtol:g}"


TOLERANCE = {jnp.float64: 1e-10, jnp.float32: 1e-5}
DTYPE_NAME = {jnp.float64: "float64", jnp.float32: "float32"}


def exit_code(argv):
    """``jphantom.cli.main(argv)``'s exit status, argparse's SystemExit included."""
    from jphantom import cli

    try:
        return cli.main(argv)
    except SystemExit as exit_info:
        return exit_info.code
