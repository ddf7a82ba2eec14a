"""Shared test utilities: the single-device oracle and tree comparisons."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def mse(y, t):
    return jnp.mean(jnp.square(y - t))


def oracle_loss_and_grads(to_dense, params, x, t):
    """Loss and gradients w.r.t. the *sharded* params, computed on one device by differentiating
    the dense equivalent (float64 so that float32 runs are compared with the exact answer)."""
    params64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    fn = lambda p: mse(dense.forward(to_dense(p), x.astype(jnp.float64)), t.astype(jnp.float64))
    cpu0 = jax.devices()[0]
    return jax.jit(jax.value_and_grad(fn))(jax.device_put(params64, cpu0))


def assert_tree_close(actual, expected, rtol):
    """Every leaf: max |a - e| <= rtol * max |e| (a norm-wise relative error, robust near zeros)."""
    a_leaves, a_tree = jax.tree.flatten(actual)
    e_leaves, e_tree = jax.tree.flatten(expected)
    assert a_tree == e_tree
    for path, a, e in zip(jax.tree_util.tree_flatten_with_path(expected)[0], a_leaves, e_leaves):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(np.max(np.abs(e)), 1e-30)
        err = np.max(np.abs(a - e)) / scale
        assert err <= rtol, f"{jax.tree_util.keystr(path[0])}: relative error {err:.3e} > {rtol:g}"


TOLERANCE = {jnp.float64: 1e-10, jnp.float32: 1e-5}
