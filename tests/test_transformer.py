"""The GPT transformer under every strategy equals the single-device model, and its compiled step
moves exactly the collectives the Megatron (seeds 002, 003) and phantom (seed 000 Sec. 5) designs
predict, with loop trip counts applied.

Each oracle test computes the loss and every gradient on the mesh (one shard_map step without the
optimizer) and compares them with ``jax.value_and_grad`` of the dense model on one device, in
float64, for the strategy's ``dense_equivalent`` of the same parameters.
"""

import dataclasses
import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jphantom import strategies
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig, first_devices
from jphantom.models.transformer import TransformerConfig
from jphantom.step import abstract_params, make_train_step, make_value_and_grad

from conftest import require_devices
from helpers import assert_tree_close, random_params

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH = 32, 8, 16, 8, 2, 4
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}


def _config(strategy, dtype="float32", **kw):
    base = dict(vocab_size=VOCAB, seq_len=SEQ, hidden=HIDDEN, heads=HEADS, layers=LAYERS,
                dtype=dtype, tied_head=not strategy.startswith("phantom"),
                ghost_width=3 if strategy.startswith("phantom") else None)
    return TransformerConfig(**{**base, **kw})


def _program(strategy, mesh_text, sequence_parallel=False, **kw):
    mesh_config = MeshConfig.parse(mesh_text)
    require_devices(mesh_config.device_count)
    mesh = mesh_config.build(first_devices(mesh_config.device_count))
    program = strategies.get(strategy).program(_config(strategy, **kw), mesh_config,
                                               sequence_parallel=sequence_parallel)
    return program, mesh


def _batch(batch=BATCH, seed=1):
    keys = jax.random.split(jax.random.PRNGKey(seed))
    return (np.asarray(jax.random.randint(keys[0], (batch, SEQ), 0, VOCAB)),
            np.asarray(jax.random.randint(keys[1], (batch, SEQ), 0, VOCAB)))


def _perturbed(program, mesh):
    """Random parameters of the program's shapes, made on the host (no init compile; LayerNorm
    scales around 1), placed in their shards."""
    params = random_params(program)
    blocks = params["blocks"]
    for name in ("ln1", "ln2"):
        blocks[name]["scale"] = 1.0 + blocks[name]["scale"]
    params["ln_f"]["scale"] = 1.0 + params["ln_f"]["scale"]
    return jax.device_put(params, program.shardings(mesh))


@functools.lru_cache(maxsize=None)
def _oracle_fn(strategy, num_shards):
    """jitted value_and_grad of the float64 dense model through the strategy's dense equivalent
    (one per parameter layout: every dense-family strategy shares one)."""
    program, _ = _program(strategy, f"model={num_shards}")
    dense_config = dataclasses.replace(_config(strategy), dtype="float64", ghost_width=None)
    dense = strategies.get("dense").program(dense_config, MeshConfig.parse("model=1"))
    dense_loss = dense.global_loss(dense.mesh.build(first_devices(1)))
    return jax.jit(jax.value_and_grad(
        lambda p, tokens, targets: dense_loss(program.dense_equivalent(p), tokens, targets)))


def _oracle(program, params, tokens, targets):
    """Loss and gradients w.r.t. the strategy's parameters, through its dense equivalent, f64."""
    phantom = program.strategy.startswith("phantom")
    fn = _oracle_fn("phantom" if phantom else "tensor",
                    program.mesh.size("model") if phantom else 1)
    host = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), params)
    return fn(jax.device_put(host, jax.devices()[0]), tokens, targets)


def _check_against_dense(strategy, mesh_text, sequence_parallel=False, dtype="float32", **kw):
    program, mesh = _program(strategy, mesh_text, sequence_parallel, dtype=dtype, **kw)
    params = _perturbed(program, mesh)
    tokens, targets = _batch()
    shardings = program.batch_shardings(mesh)
    loss, grads = make_value_and_grad(program, mesh)(
        params, jax.device_put(tokens, shardings[0]), jax.device_put(targets, shardings[1]))
    want_loss, want_grads = _oracle(program, params, tokens, targets)
    rtol = TOLERANCE[dtype]
    assert abs(float(loss) - float(want_loss)) <= rtol * abs(float(want_loss))
    assert_tree_close(grads, want_grads, rtol)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("mesh", ["model=1", "model=2", "model=4", "model=8", "data=2,model=4",
                                  "data=4,model=2"])
def test_tensor_transformer_equals_dense(mesh, sequence_parallel):
    """Megatron tensor parallelism, with and without sequence parallelism, alone and beside data
    parallelism: the loss and every gradient of the dense model (float32, 1e-5)."""
    _check_against_dense("tensor", mesh, sequence_parallel)


@pytest.mark.parametrize("strategy, mesh, sequence_parallel", [
    ("tensor", "model=4", True), ("tensor", "data=2,model=2", False),
    pytest.param("phantom", "data=2,model=4", False, marks=pytest.mark.slow),
    ("gspmd", "data=2,model=4", False),
])
def test_transformer_equals_dense_in_float64(strategy, mesh, sequence_parallel):
    _check_against_dense(strategy, mesh, sequence_parallel, dtype="float64")


@pytest.mark.parametrize("strategy, mesh", [
    ("phantom", "model=2"), ("phantom", "model=4"),
    pytest.param("phantom", "model=8", marks=pytest.mark.slow),
    ("phantom", "data=4,model=2"), ("phantom-unfused", "model=4"),
])
def test_phantom_transformer_equals_its_dense_equivalent(strategy, mesh):
    _check_against_dense(strategy, mesh)


def test_vocabulary_parallel_cross_entropy_equals_optax():
    from jax.sharding import PartitionSpec as P

    from jphantom.sharding.vocab import cross_entropy_sum

    require_devices(4)
    mesh = MeshConfig.parse("model=4").build(first_devices(4))
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 32)) * 4
    targets = jax.random.randint(jax.random.PRNGKey(1), (3, 5), 0, 32)
    sharded = jax.jit(jax.shard_map(lambda lg, t: cross_entropy_sum(lg, t, "model"), mesh=mesh,
                                    in_specs=(P(None, None, "model"), P()), out_specs=P()))
    want = optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()
    assert float(sharded(logits, targets)) == pytest.approx(float(want), rel=1e-6)


# --------------------------------------------------------------------------------------------------
# Collectives of the compiled step
# --------------------------------------------------------------------------------------------------


def _compiled_buffers(program, mesh, axis):
    """Per-device result elements of every collective over ``axis``, each repeated as often as it
    runs in one step (loop trip counts applied)."""
    params = abstract_params(program, mesh)
    optimizer = optax.sgd(0.1)
    state = jax.eval_shape(optimizer.init, params)
    batch = BATCH * program.mesh.size("data")
    shardings = program.batch_shardings(mesh)
    tokens = jax.ShapeDtypeStruct((batch, SEQ), jnp.int32, sharding=shardings[0])
    text = make_train_step(program, mesh, optimizer).lower(params, state, tokens, tokens).compile(
        ).as_text()
    buffers = {}
    for op in collectives(text):
        if op.mesh_axes(program.mesh.shape) != (axis,):
            continue
        for _, shape in op.shapes:
            buffers.setdefault(op.kind, []).extend([int(np.prod(shape))] * op.count)
    return {kind: sorted(sizes) for kind, sizes in buffers.items()}


def _inventory(program, **kw):
    strategy = strategies.get(program.strategy)
    config = _config(program.strategy, **kw)
    found = strategy.collective_inventory(config, program.mesh, BATCH,
                                          sequence_parallel=program.options["sequence_parallel"])
    return {kind: sorted(sizes) for kind, sizes in found.items() if sizes}


@pytest.mark.parametrize("layers", [1, 3])
def test_megatron_block_has_two_all_reduces_forward_and_two_backward(layers):
    """Per block, g after the attention output and after MLP-down (forward) and f before QKV and
    before MLP-up (backward): four all-reduces of B*S*h, inside the scan over blocks."""
    require_devices(4)
    program, mesh = _program("tensor", "model=4", layers=layers)
    buffers = _compiled_buffers(program, mesh, "model")
    assert buffers == _inventory(program, layers=layers)
    tokens = BATCH * SEQ
    assert Counter(buffers["all-reduce"])[tokens * HIDDEN] == 4 * layers + 2  # + embedding, head


def test_sequence_parallel_turns_each_all_reduce_into_reduce_scatter_and_all_gather():
    require_devices(4)
    program, mesh = _program("tensor", "model=4", sequence_parallel=True)
    buffers = _compiled_buffers(program, mesh, "model")
    assert buffers == _inventory(program)
    plain_program, _ = _program("tensor", "model=4")
    plain = _compiled_buffers(plain_program, mesh, "model")
    tokens, p = BATCH * SEQ, 4
    # the same network volume: an all-reduce of n moves what a reduce-scatter + all-gather move
    assert buffers["reduce-scatter"] == [tokens * HIDDEN // p] * Counter(plain["all-reduce"])[
        tokens * HIDDEN]
    assert buffers["all-gather"] == [tokens * HIDDEN] * len(buffers["reduce-scatter"])


def test_phantom_block_moves_what_its_docstring_says():
    require_devices(4)
    program, mesh = _program("phantom", "model=4")
    buffers = _compiled_buffers(program, mesh, "model")
    assert buffers == _inventory(program)
    tokens, k, p = BATCH * SEQ, 3, 4
    assert set(buffers["all-gather"]) == {tokens * p * k}  # only k ghosts per token cross
    assert set(buffers["reduce-scatter"]) == {tokens * k}


def test_data_parallelism_adds_one_gradient_reduction_per_parameter():
    require_devices(8)
    program, mesh = _program("tensor", "data=2,model=4")
    data = _compiled_buffers(program, mesh, "data")
    local = jax.tree.map(lambda a: a.sharding.shard_shape(a.shape), abstract_params(program, mesh))
    params = sorted(int(np.prod(s)) for s in jax.tree.leaves(local, is_leaf=lambda s: isinstance(
        s, tuple)))
    assert data == {"all-reduce": sorted(params + [1])}  # every gradient once, and the loss
    assert _compiled_buffers(program, mesh, "model") == _inventory(program)


@pytest.mark.parametrize("strategy, mesh, kw, message", [
    ("tensor", "model=8", dict(heads=4), "heads=4 is not divisible"),
    ("tensor", "model=4", dict(vocab_size=30), "vocab_size=30 is not divisible"),
    ("phantom", "model=4", dict(ghost_width=None), "needs ghost_width"),
    ("dense", "model=2", {}, "runs on one device"),
    ("tensor-t1", "model=2", {}, "runs the models"),
])
def test_bad_transformer_layouts_are_named_errors(strategy, mesh, kw, message):
    with pytest.raises(ConfigError, match=message):
        strategies.get(strategy).program(_config(strategy, **kw), MeshConfig.parse(mesh))


def test_sequence_parallelism_needs_a_divisible_sequence_and_the_tensor_strategy():
    with pytest.raises(ConfigError, match="seq_len=6 is not divisible"):
        strategies.get("tensor").program(_config("tensor", seq_len=6), MeshConfig.parse("model=4"),
                                         sequence_parallel=True)
    with pytest.raises(ConfigError, match="sequence_parallel applies"):
        strategies.get("phantom").program(_config("phantom"), MeshConfig.parse("model=4"),
                                          sequence_parallel=True)
