"""ZeRO-1/2/3 on the data axis, gradient accumulation and global-norm clipping: the same training
trajectory as one device, and exactly ZeRO's collectives over ``data`` in the compiled step."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from jphantom.registry import program as program_module
from jphantom.analysis import hlo
from jphantom.errors import ConfigError
from jphantom.models.ffn import FFNConfig
from jphantom.step.train_step import make_train_step

from conftest import require_devices
from helpers import (assert_tree_close, compiled_hlo, gradient_catcher, gradient_step,
                     oracle_loss_and_grads, random_params)

WIDTH, DEPTH, BATCH = 8, 4, 16


def _config(strategy, depth=DEPTH):
    return FFNConfig(WIDTH, depth, 2 if strategy.startswith("phantom") else None, "float32")


def _program(strategy, mesh_text, depth=DEPTH):
    program = program_module.build(_config(strategy, depth), strategy, mesh_text)
    require_devices(program.mesh.device_count)
    return program, program.mesh.build(jax.devices()[:program.mesh.device_count])


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((BATCH, WIDTH)).astype(np.float32) for _ in range(2))


@functools.lru_cache(maxsize=None)
def _reference(strategy, mesh_text, steps=3):
    """Adam on one device in float64, through the plain model the parallel layers are (the
    parallel layout's parameters, differentiated through jphantom.plans.dense_equivalent)."""
    program, _, step, _ = gradient_step(strategy, _config(strategy), mesh_text)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), random_params(program))
    x, t = _data()
    optimizer = optax.adam(1e-2)
    state = optimizer.init(params)
    for _ in range(steps):
        loss, grads = oracle_loss_and_grads(step, params, x, t)
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return float(loss), jax.device_get(params)


def _check_three_adam_steps(strategy, mesh_text, zero):
    program, mesh = _program(strategy, mesh_text)
    optimizer = optax.adam(1e-2)
    step = program.train_step(mesh, optimizer, zero=zero, donate=False)
    state = step.init(random_params(program))
    for _ in range(3):
        state, loss = step(state, *_data())
    want_loss, want_params = _reference(strategy, mesh_text)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert_tree_close(jax.device_get(state.params), want_params, 1e-5)
    return step, state


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
    ("tensor", "stage=2,data=2,model=2", 3),
    pytest.param("phantom", "stage=2,data=2,model=2", 2, marks=pytest.mark.slow),
    pytest.param("tensor", "stage=2,data=2,model=2", 1, marks=pytest.mark.slow),
])
@pytest.mark.slow_cells("tensor-data=4,model=2-3", "phantom-data=2,model=4-3")
def test_zero_trains_like_one_device(strategy, mesh, zero):
    """Parameters and loss after 3 Adam steps equal the single-device run (float32, 1e-5), with
    tensor or phantom layers, and with a pipeline on stage=2,data=2,model=2."""
    step, state = _check_three_adam_steps(strategy, mesh, zero)
    if zero >= 1:  # Adam's moments are split over data: each rank holds 1/D of every large one
        specs = step.opt_param_specs
        assert any("data" in str(s) for s in specs)
        mu = jax.tree.leaves(state.opt_state[0].mu)
        assert len(mu) == len(specs)
        for leaf, spec in zip(mu, specs):
            assert leaf.sharding.is_equivalent_to(NamedSharding(step.mesh, spec), leaf.ndim)


# --------------------------------------------------------------------------------------------------
# Collectives over data, from the compiled step
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _data_collectives(zero, accumulate=1, depth=DEPTH):
    """Per kind: result elements per device per step of the collectives over ``data`` alone (the
    update runs after the shard_map on the global arrays: jax.jit's own collectives included); and
    per parameter its elements per rank without ZeRO (``full``), as stored (``local``), its ZeRO
    dimension and its rank."""
    program, mesh = _program("tensor", "data=4,model=2", depth)
    # Adam: ZeRO-1 shards its moments (an optimizer without state has nothing to shard, and the
    # update of replicated gradients needs no gather)
    step = program.train_step(mesh, optax.adam(1e-3), zero=zero, accumulate=accumulate)
    shape = ((BATCH, WIDTH), np.float32)
    found = {}
    for c in hlo.collectives(compiled_hlo(step, shape, shape)):
        c = dataclasses.replace(c, replica_groups=hlo.normalise_replica_groups(c.replica_groups))
        if c.mesh_axes(dict(mesh.shape)) == ("data",):
            found[c.kind] = found.get(c.kind, 0) + c.elements * c.count
    layout = step.layout
    sizes = lambda specs: [int(np.prod(NamedSharding(mesh, s).shard_shape(a.shape)))
                           for a, s in zip(layout.shapes, specs)]
    full = sizes(layout.specs)
    local = sizes(step.param_specs)
    dims = list(layout.zero_dims) if zero else [-1] * len(full)
    return found, full, local, dims, [a.ndim for a in layout.shapes]


def test_plain_data_parallelism_all_reduces_every_gradient_once():
    found, full, _, _, _ = _data_collectives(0)
    assert found == {"all-reduce": sum(full)}


def test_zero1_all_reduces_gradients_and_all_gathers_updated_parameters():
    """Cheng et al.'s ZeRO-1: the gradient all-reduce of DP, then each rank updates its 1/D slice and
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


def test_zero2_accumulating_reduce_scatters_each_micro_batch_into_shards():
    """ZeRO-2 over 2 micro-batches (DeepSpeed's gradient partitioning): each micro-batch's
    gradients reduce-scattered (the stacked layers' inside the backward, layer by layer, into
    float32 shards), so twice ZeRO-2's reduce-scatter and its one all-gather; a replicated
    parameter's gradient accumulated whole and all-reduced once."""
    found, full, _, dims, _ = _data_collectives(2, accumulate=2)
    split = sum(n for n, d in zip(full, dims) if d >= 0)
    replicated = sum(full) - split
    expected = {"reduce-scatter": 2 * split // 4, "all-gather": split}
    if replicated:
        expected["all-reduce"] = replicated
    assert found == expected


def test_zero3_gathers_each_layer_for_forward_and_again_for_backward():
    """ZeRO-3: each layer's split parameters all-gathered in the forward scan and again in the
    backward scan (the gathered copy is never kept: only one layer is ever whole), and the
    gradient reduce-scattered layer by layer; parameters sharded at rest (Cheng et al. Table 2)."""
    pairs = 4  # depth 8: Megatron's first (column, row) pair, then 3 under lax.scan
    found, full, local, dims, ndims = _data_collectives(3, depth=2 * pairs)
    split = sum(n for n, d in zip(full, dims) if d >= 0)
    replicated = sum(full) - split
    # The backward needs the weights again (not the biases): both of every pair's, the first
    # pair's column weight included (it serves only the data's gradient, but a layer's weights
    # are gathered as one flat buffer, and its row weight is needed).
    column, row = [n // pairs for n, d, k in zip(full, dims, ndims) if d >= 0 and k == 3]
    expected = {"all-gather": split + (column + row) * pairs,
                "reduce-scatter": split // 4}
    if replicated:
        expected["all-reduce"] = replicated
    assert found == expected
    assert sum(local) < sum(full)


def test_gradient_accumulation_equals_one_large_batch_with_one_reduction():
    program, mesh = _program("tensor", "data=2,model=4")
    params = random_params(program)
    batch = _data()
    one = program.train_step(mesh, optax.sgd(0.1), donate=False)
    four = program.train_step(mesh, optax.sgd(0.1), donate=False, accumulate=4)
    loss1, grads1 = jax.jit(one.value_and_grad())(params, *batch)
    loss4, grads4 = jax.jit(four.value_and_grad())(params, *batch)
    assert float(loss4) == pytest.approx(float(loss1), rel=1e-6)
    assert_tree_close(jax.device_get(grads4), jax.device_get(grads1), 1e-6)
    assert _data_collectives(0, accumulate=4)[0] == _data_collectives(0)[0]  # not 4 reductions


@pytest.mark.parametrize("strategy, mesh, zero", [("phantom", "data=2,model=4", 0),
                                                  ("tensor", "data=4,model=2", 2)])
@pytest.mark.slow_cells("phantom-data=2,model=4-0")
def test_clipped_gradients_equal_single_device_clipped_gradients(strategy, mesh, zero):
    """optax.clip_by_global_norm runs on the global gradient arrays after the shard_map (ZeRO
    slices included), so clipping equals clipping the whole model's gradient on one device."""
    program, _, step, _ = gradient_step(strategy, _config(strategy), mesh)
    host = random_params(program)
    x, t = _data()
    _, grads = oracle_loss_and_grads(step, host, x, t)
    norm = float(optax.tree.norm(grads))
    want, _ = optax.clip_by_global_norm(norm / 3).update(grads, None)
    clipping = optax.chain(optax.clip_by_global_norm(norm / 3), gradient_catcher())
    mesh_obj = step.mesh
    catcher = program.train_step(mesh_obj, clipping, zero=zero, donate=False)
    state, _ = catcher(catcher.init(host), x, t)
    clipped = state.opt_state[1]
    assert_tree_close(jax.device_get(clipped), want, 1e-5)


def test_bad_zero_settings_are_config_errors():
    program, mesh = _program("tensor", "data=4,model=1")
    with pytest.raises(ConfigError, match="zero=4"):
        program.train_step(mesh, optax.sgd(0.1), zero=4)
    model_only, model_mesh = _program("tensor", "model=4")
    with pytest.raises(ConfigError, match="add it to the mesh"):
        model_only.train_step(model_mesh, optax.sgd(0.1), zero=2)
    with pytest.raises(ConfigError, match="accumulate"):
        make_train_step(program.model, mesh, optax.sgd(0.1), program.loss_fn, accumulate=0)
