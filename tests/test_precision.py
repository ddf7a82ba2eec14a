"""Mixed precision as a policy of the step (:mod:`jphantom.precision`): float32 master weights
and optimizer state, bf16 / float16 compute, gradients back in float32."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jphantom import strategies
from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig, first_devices
from jphantom.models.ffn import FFNConfig
from jphantom.precision import Precision
from jphantom.step import make_train_step, make_value_and_grad

from conftest import require_devices
from helpers import assert_tree_close, random_params


@functools.lru_cache(maxsize=None)
def _case():
    mesh_config = MeshConfig.parse("data=2,model=2")
    require_devices(4)
    program = strategies.get("tensor").program(FFNConfig(64, 4, dtype="float32"), mesh_config)
    mesh = program.mesh.build(first_devices(4))
    rng = np.random.default_rng(0)
    batch = [jax.device_put(rng.standard_normal((32, 64)).astype(np.float32), s)
             for s in program.batch_shardings(mesh)]
    params = jax.device_put(random_params(program), program.shardings(mesh))
    return program, mesh, params, batch


@pytest.mark.parametrize("name, rtol", [("bf16", 3e-2), ("float16", 1e-2)])
def test_low_precision_gradients_are_float32_and_close(name, rtol):
    program, mesh, params, batch = _case()
    want_loss, want = make_value_and_grad(program, mesh)(params, *batch)
    loss, grads = make_value_and_grad(program, mesh, precision=name)(params, *batch)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype("float32")}
    assert loss.dtype == jnp.float32
    assert float(loss) == pytest.approx(float(want_loss), rel=rtol)
    assert_tree_close(grads, want, rtol * 3)


def test_master_weights_and_adam_state_stay_float32():
    program, mesh, params, batch = _case()
    optimizer = optax.adam(1e-3)
    from jphantom.train import init_optimizer_state

    state = init_optimizer_state(program, mesh, optimizer, params)
    new, state, _ = make_train_step(program, mesh, optimizer, donate=False,
                                    precision="bf16")(params, state, *batch)
    dtypes = {a.dtype for a in jax.tree.leaves((new, state)) if jnp.issubdtype(a.dtype,
                                                                               jnp.floating)}
    assert dtypes == {jnp.dtype("float32")}


def test_bad_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="precision='fp8'"):
        Precision.named("fp8")
    with pytest.raises(ConfigError, match="loss_scale"):
        Precision("float16", loss_scale=0)
