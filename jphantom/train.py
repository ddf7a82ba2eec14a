"""One jitted training step (forward, backward, optax update) for any strategy and mesh."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jphantom.strategies import Strategy


def mse(prediction: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over batch and features (seed 000's loss). On feature-sharded outputs the
    mean is the only cross-device reduction of the step: one scalar all-reduce."""
    return jnp.mean(jnp.square(prediction - target))


def make_loss_fn(strategy: Strategy, mesh: Mesh | None, axis: str = "model") -> Callable:
    def loss_fn(params, x, y):
        return mse(strategy.apply(params, x, mesh, axis), y)

    return loss_fn


def make_train_step(
    strategy: Strategy,
    mesh: Mesh | None,
    optimizer: optax.GradientTransformation,
    *,
    axis: str = "model",
    donate: bool = True,
) -> Callable:
    """``step(params, opt_state, x, y) -> (params, opt_state, loss)``, jitted.

    Params keep the sharding they were placed with (``strategy.place``); for sharded strategies every
    parameter is owned by exactly one device, so the optimizer update is local.
    """
    loss_fn = make_loss_fn(strategy, mesh, axis)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())
