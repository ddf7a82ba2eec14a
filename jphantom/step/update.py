"""The step's optimizer update, after the ``shard_map`` and inside the same ``jax.jit``: optax on
the global gradient arrays with the parameters' shardings kept, so every transformation sees
what it would see on one device (``optax.clip_by_global_norm``, LAMB or Adafactor are exact; the
update's cross-shard reductions, a global norm, are the only collectives jit adds). Under ZeRO-1
and up the optimizer state is stored in shards over ``data`` (Rajbhandari et al. 2020), and the
new parameters are put back in theirs.

With ``keep_finite`` (:func:`jphantom.step.finite.drops_updates`: ``on_nonfinite="skip"``, or
``"stop"`` when the step watches) the user's optimizer is wrapped in
:func:`jphantom.step.finite.keep_if_finite`, here alone.

The optimizer also carries what the step reads before its gradients: the dynamic loss scale
(float16, :func:`jphantom.step.precision.dynamic_loss_scale`) and the step count that seeds the
dropout masks (:func:`jphantom.nn.dropout.counting`), both checkpointed with its state.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.errors import ConfigError
from jphantom.nn import dropout as dropout_module
from jphantom.step.layout import TrainState
from jphantom.step.setup import StepSetup


def check_optimizer(optimizer) -> None:
    """An optax transformation, or a ConfigError naming one."""
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ConfigError("optimizer must be an optax.GradientTransformation, e.g. "
                          "optax.adamw(3e-4)")


def check_learning_rate(opt_state) -> None:
    """A ConfigError when an ``optax.inject_hyperparams`` state in ``opt_state`` holds a
    negative or non-finite ``learning_rate`` (gradient ascent, or NaN parameters from the first
    update). Any other optax transformation keeps its rate in a closure jphantom cannot read:
    the CLI checks ``--learning-rate``, and ``on_nonfinite="warn"`` reports a NaN rate's first
    non-finite loss."""
    import math

    import numpy as np

    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        rate = getattr(node, "hyperparams", {}).get("learning_rate")
        if not isinstance(rate, jax.Array) or rate.ndim:
            continue
        value = float(np.asarray(rate.addressable_data(0)))  # one scalar, at init only
        if not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"the optimizer's learning_rate is {value:g} (its optax.inject_hyperparams "
                f"state{'; the updates would ascend the loss' if value < 0 else ''}): give a "
                "positive, finite learning rate, e.g. 3e-4")


class OptimizerUpdate:
    """``state = update(grads, state)``: the optimizer's step on the global gradients; built from
    the user's optax transformation and the setup (module docstring)."""

    def __init__(self, optimizer: optax.GradientTransformation, setup: StepSetup, *,
                 keep_finite: bool = False):
        check_optimizer(optimizer)
        if keep_finite:  # on_nonfinite skip (or stop): a non-finite update is dropped, counted
            from jphantom.step.finite import keep_if_finite
            optimizer = keep_if_finite(optimizer)
        if setup.dropout:  # the step count, the dropout keys' (checkpointed with the state)
            optimizer = dropout_module.counting(optimizer)
        if setup.precision.dynamic:  # the scale lives in the optimizer state (checkpointed)
            from jphantom.step.precision import dynamic_loss_scale
            optimizer = dynamic_loss_scale(optimizer, initial=setup.precision.loss_scale,
                                           period=setup.precision.period)
        self.optimizer, self.setup = optimizer, setup

    def state_shardings(self, params_shape):
        """The optimizer state's shardings for parameters of ``params_shape``: its
        parameter-shaped leaves in the parameters' (ZeRO-1 and up: data-sharded) specs, every
        other leaf replicated."""
        setup = self.setup
        specs = setup.pure(setup.opt_param_specs)
        state = jax.eval_shape(self.optimizer.init, params_shape)
        return optax.tree_map_params(
            self.optimizer, lambda _, spec: NamedSharding(setup.mesh, spec), state, specs,
            transform_non_params=lambda _: NamedSharding(setup.mesh, P()),
            is_leaf=lambda s: isinstance(s, P))

    def inputs(self, state: TrainState) -> dict:
        """What the gradients need from the optimizer state: ``scale`` (the dynamic loss scale)
        and ``key`` (this step's dropout key data, from the step count), where present."""
        setup, out = self.setup, {}
        if setup.precision.dynamic:
            out["scale"] = state.opt_state.scale
        if setup.dropout:  # this step's masks: the count the optimizer state carries
            counter = state.opt_state.inner if setup.precision.dynamic else state.opt_state
            out["key"] = dropout_module.step_key(setup.dropout_seed, counter.count)
        return out

    def __call__(self, grads, state: TrainState) -> TrainState:
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        params = jax.lax.with_sharding_constraint(params,
                                                  self.setup.shardings(self.setup.param_specs))
        return TrainState(params, opt_state)
