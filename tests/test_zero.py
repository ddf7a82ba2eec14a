"""ZeRO-1/2/3 on the data axis, gradient accumulation and global-norm clipping: the same training
trajectory as one device, and exactly ZeRO's collectives over ``data`` in the compiled step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jphantom import strategies
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig, first_devices
from jphantom.models.ffn import FFNConfig
from jphantom.sharding import dense
from jphantom.step import make_train_step, make_value_and_grad, optimizer_state_specs
from jphantom.train import init_optimizer_state

from conftest import require_devices
from helpers import assert_tree_close, gradient_catcher, random_params

WIDTH, DEPTH, BATCH = 8, 4, 16


def _program(strategy, mesh_text, zero, depth=DEPTH):
    config = FFNConfig(WIDTH, depth, 2 if strategy.startswith("phantom") else None, "float32")
    mesh_config = MeshConfig.parse(mesh_text)
    require_devices(mesh_config.device_count)
    program = strategies.get(strategy).program(config, mesh_config, zero=zero)
    return program, program.mesh.build(first_devices(program.mesh.device_count))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((BATCH, WIDTH)).astype(np.float32) for _ in range(2))


def _dense_loss(program, x, t):
    return lambda p: jnp.mean(jnp.square(dense.forward(program.dense_equivalent(p), x) - t))


@functools.lru_cache(maxsize=None)
def _reference(strategy, mesh_text, zero, steps=3):
    """Adam on one device in float64, through the program's dense equivalent."""
    program, _ = _program(strategy, mesh_text, zero)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), random_params(program))
    x, t = (jnp.asarray(a, jnp.float64) for a in _data())
    loss_fn, optimizer = _dense_loss(program, x, t), optax.adam(1e-2)
    state = optimizer.init(params)
    for _ in range(steps):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return float(loss), params


def _check_three_adam_steps(strategy, mesh_text, zero):
    program, mesh = _program(strategy, mesh_text, zero)
    optimizer = optax.adam(1e-2)
    step = make_train_step(program, mesh, optimizer, donate=False)
    params = jax.device_put(random_params(program), program.shardings(mesh))
    state = init_optimizer_state(program, mesh, optimizer, params)
    batch = [jax.device_put(a, s) for a, s in zip(_data(), program.batch_shardings(mesh))]
    for _ in range(3):
        params, state, loss = step(params, state, *batch)
    want_loss, want_params = _reference(strategy, mesh_text, zero)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert_tree_close(params, want_params, 1e-5)
    return program, state


@pytest.mark.parametrize("strategy, mesh, zero", [
    ("tensor", "data=2,model=4", 0), ("tensor", "data=2,model=4", 1),
    ("tensor", "data=2,model=4", 2), ("tensor", "data=4,model=2", 3),
    pytest.param("phantom", "data=4,model=2", 1, marks=pytest.mark.slow),
    ("phantom", "data=2,model=4", 3),
    pytest.param("tensor", "data=4,model=2", 1, marks=pytest.mark.slow),
    pytest.param("tensor", "data=4,model=2", 2, marks=pytest.mark.slow),
    pytest.param("tensor", "data=2,model=4", 3, marks=pytest.mark.slow),
    pytest.param("phantom", "data=2,model=4", 0, marks=pytest.mark.slow),
    pytest.param("phantom", "data=2,model=4", 2, marks=pytest.mark.slow),
    pytest.param("phantom", "data=4,model=2", 3, marks=pytest.mark.slow),
    ("tensor", "stage=2,data=2,model=2", 3), ("phantom", "stage=2,data=2,model=2", 2),
    pytest.param("tensor", "stage=2,data=2,model=2", 1, marks=pytest.mark.slow),
])
def test_zero_trains_like_one_device(strategy, mesh, zero):
    """Parameters and loss after 3 Adam steps equal the single-device run (float32, 1e-5), with
    tensor or phantom layers, and with a pipeline on stage=2,data=2,model=2."""
    program, state = _check_three_adam_steps(strategy, mesh, zero)
    if zero >= 1:  # Adam's moments are split over data: each rank holds 1/D of every large one
        mu = state[0].mu
        specs = optimizer_state_specs(optax.adam(1e-2), jax.eval_shape(program.init,
                                                                        jax.random.PRNGKey(0)),
                                      program.state_specs)[0].mu
        assert any("data" in str(s) for s in jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)))
        for leaf, spec in zip(jax.tree.leaves(mu), jax.tree.leaves(
                specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))):
            want = jax.sharding.NamedSharding(leaf.sharding.mesh, spec)
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim)


# --------------------------------------------------------------------------------------------------
# Collectives over data, from the compiled step
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _data_collectives(zero, accumulate=1, depth=DEPTH):
    """Per kind: result elements per device per step of the collectives over ``data`` alone."""
    program, mesh = _program("tensor", "data=4,model=2", zero, depth)
    optimizer = optax.sgd(0.1)
    shapes = jax.eval_shape(program.init, jax.random.PRNGKey(0))
    abstract = lambda tree, specs: jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree,
        program.shardings(mesh, specs))
    opt_specs = optimizer_state_specs(optimizer, shapes, program.state_specs)
    x = jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32)
    batch = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
             for s in program.batch_shardings(mesh)]
    step = make_train_step(program, mesh, optimizer, accumulate=accumulate)
    hlo = step.lower(abstract(shapes, program.param_specs),
                     abstract(jax.eval_shape(optimizer.init, shapes), opt_specs),
                     *batch).compile().as_text()
    found = {}
    for c in collectives(hlo):
        if c.mesh_axes(dict(mesh.shape)) == ("data",):
            found[c.kind] = found.get(c.kind, 0) + c.elements * c.count
    sizes = lambda specs: [int(np.prod(s.shard_shape(a.shape))) for a, s in zip(
        jax.tree.leaves(shapes), jax.tree.leaves(program.shardings(mesh, specs)))]
    local = sizes(program.param_specs if zero < 3 else program.state_specs)  # per-rank params
    full = sizes(strategies.get("tensor").program(FFNConfig(WIDTH, depth), program.mesh)
                 .param_specs)
    dims = jax.tree.leaves(program.zero_dims) if zero else [-1] * len(full)
    return found, full, local, dims, [a.ndim for a in jax.tree.leaves(shapes)]


def test_plain_data_parallelism_all_reduces_every_gradient_once():
    found, full, _, _, _ = _data_collectives(0)
    assert found == {"all-reduce": sum(full)}


def test_zero1_all_reduces_gradients_and_all_gathers_updated_parameters():
    """Seed 001's ZeRO-1: the gradient all-reduce of DP, then each rank updates its 1/D slice and
    the slices are all-gathered (result elements: the whole parameter)."""
    found, full, _, dims, _ = _data_collectives(1)
    split = sum(n for n, d in zip(full, dims) if d >= 0)
    assert found == {"all-reduce": sum(full), "all-gather": split}


def test_zero2_reduce_scatters_gradients_and_all_gathers_updated_parameters():
    found, full, _, dims, _ = _data_collectives(2)
    split = sum(n for n, d in zip(full, dims) if d >= 0)
    replicated = sum(full) - split
    expected = {"reduce-scatter": split // 4, "all-gather": split}
    if replicated:
        expected["all-reduce"] = replicated
    assert found == expected


def test_zero3_gathers_each_layer_for_forward_and_again_for_backward():
    """ZeRO-3: each layer's split parameters all-gathered in the forward scan and again in the
    backward scan (the gathered copy is never kept: only one layer is ever whole), and the
    gradient reduce-scattered layer by layer; parameters sharded at rest (seed 001 Table 2)."""
    pairs = 4  # depth 8: Megatron's first (column, row) pair, then 3 under lax.scan
    found, full, local, dims, ndims = _data_collectives(3, depth=2 * pairs)
    split = sum(n for n, d in zip(full, dims) if d >= 0)
    replicated = sum(full) - split
    # The backward needs the weights again (not the biases) in every scanned pair; the first
    # pair's regather is outside any loop and XLA merges it with its forward gather.
    weights_again = sum(n for n, d, k in zip(full, dims, ndims) if d >= 0 and k == 3)
    expected = {"all-gather": split + weights_again * (pairs - 1) // pairs,
                "reduce-scatter": split // 4}
    if replicated:
        expected["all-reduce"] = replicated
    assert found == expected
    assert sum(local) < sum(full)


def test_gradient_accumulation_equals_one_large_batch_with_one_reduction():
    program, mesh = _program("tensor", "data=2,model=4", 0)
    params = jax.device_put(random_params(program), program.shardings(mesh))
    batch = [jax.device_put(a, s) for a, s in zip(_data(), program.batch_shardings(mesh))]
    loss1, grads1 = make_value_and_grad(program, mesh)(params, *batch)
    loss4, grads4 = make_value_and_grad(program, mesh, accumulate=4)(params, *batch)
    assert float(loss4) == pytest.approx(float(loss1), rel=1e-6)
    assert_tree_close(grads4, grads1, 1e-6)
    assert _data_collectives(0, accumulate=4)[0] == _data_collectives(0)[0]  # not 4 reductions


@pytest.mark.parametrize("strategy, mesh, zero", [("phantom", "data=2,model=4", 0),
                                                  ("tensor", "data=4,model=2", 2)])
def test_clipped_gradients_equal_single_device_clipped_gradients(strategy, mesh, zero):
    """The global norm sums every shard once (over model for split weights, over data for ZeRO
    slices), so clipping equals optax.clip_by_global_norm of the whole model's gradient."""
    program, mesh_obj = _program(strategy, mesh, zero)
    host = random_params(program)
    x, t = _data()
    grads = jax.grad(_dense_loss(program, *(jnp.asarray(a, jnp.float64) for a in (x, t))))(
        jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), host))
    norm = float(optax.tree.norm(grads))
    want, _ = optax.clip_by_global_norm(norm / 3).update(grads, None)
    step = make_train_step(program, mesh_obj, gradient_catcher(), donate=False,
                           clip_norm=norm / 3)
    params = jax.device_put(host, program.shardings(mesh_obj))
    state = init_optimizer_state(program, mesh_obj, gradient_catcher(), params)
    batch = [jax.device_put(a, s) for a, s in zip((x, t), program.batch_shardings(mesh_obj))]
    _, clipped, _ = step(params, state, *batch)
    assert_tree_close(clipped, want, 1e-5)


def test_bad_zero_settings_are_config_errors():
    require_devices(4)
    config = FFNConfig(WIDTH, DEPTH)
    with pytest.raises(ConfigError, match="zero=4"):
        strategies.get("tensor").program(config, MeshConfig.parse("data=4"), zero=4)
    with pytest.raises(ConfigError, match="add it to the mesh"):
        strategies.get("tensor").program(config, MeshConfig.parse("model=4"), zero=2)
    with pytest.raises(ConfigError, match="not per-rank"):
        strategies.get("gspmd").program(config, MeshConfig.parse("data=4"), zero=1)
    program, mesh = _program("tensor", "data=2,model=2", 0)
    with pytest.raises(ConfigError, match="accumulate"):
        make_train_step(program, mesh, optax.sgd(0.1), accumulate=0)
