"""The transformer with MoE blocks (issue 10) under every strategy and mesh equals the
single-device model: loss and every gradient, with TED (experts tensor-parallel over ``model``),
duplicate token dropping, phantom-parallel experts and the dropless path; gradients are reduced
over the right groups (experts' over data only, the rest over data and expert)."""

import dataclasses
import functools

import math
from collections import Counter

import jax
import numpy as np
import optax
import pytest

from jphantom import strategies
from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig, first_devices
from jphantom.models.transformer import TransformerConfig
from jphantom.analysis.hlo import collectives
from jphantom.sharding.zero import spec_axes
from jphantom.step import abstract_params, make_metrics_fn, make_train_step, make_value_and_grad

from conftest import require_devices
from helpers import assert_tree_close, random_params

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH, EXPERTS = 32, 8, 16, 8, 2, 8, 8


def _config(strategy="tensor", **kw):
    phantom = strategy.startswith("phantom")
    base = dict(vocab_size=VOCAB, seq_len=SEQ, hidden=HIDDEN, heads=HEADS, layers=LAYERS,
                tied_head=not phantom, ghost_width=3 if phantom else None, moe_every=2,
                experts=EXPERTS, top_k=2, capacity_factor=float(EXPERTS))  # drops nothing
    return TransformerConfig(**{**base, **kw})


@functools.lru_cache(maxsize=None)
def _program(strategy, mesh_text, dtd=False, **kw):
    mesh_config = MeshConfig.parse(mesh_text)
    require_devices(mesh_config.device_count)
    mesh = mesh_config.build(first_devices(mesh_config.device_count))
    config = _config(strategy, **dict(kw))
    return strategies.get(strategy).program(config, mesh_config, dtd=dtd), mesh


def _batch(seed=1):
    keys = jax.random.split(jax.random.PRNGKey(seed))
    return (np.asarray(jax.random.randint(keys[0], (BATCH, SEQ), 0, VOCAB)),
            np.asarray(jax.random.randint(keys[1], (BATCH, SEQ), 0, VOCAB)))


def _params(program):
    params = random_params(program)
    for stack in ("blocks", "moe_blocks"):
        for name in ("ln1", "ln2"):
            if stack in params:
                params[stack][name]["scale"] = 1.0 + params[stack][name]["scale"]
    params["ln_f"]["scale"] = 1.0 + params["ln_f"]["scale"]
    return params


@functools.lru_cache(maxsize=None)
def _oracle_fn(strategy, num_shards, **kw):
    """value_and_grad of the float64 dense MoE model (every expert on every token) through the
    strategy's dense equivalent, on one device."""
    program, _ = _program(strategy, f"model={num_shards}", **dict(kw))
    config = dataclasses.replace(_config(strategy, **dict(kw)), dtype="float64",
                                 ghost_width=None)
    dense = strategies.get("dense").program(config, MeshConfig.parse("model=1"))
    loss = dense.global_loss(dense.mesh.build(first_devices(1)))
    return jax.jit(jax.value_and_grad(
        lambda p, tokens, targets: loss(program.dense_equivalent(p), tokens, targets)))


def _check(strategy, mesh_text, dtd=False, rtol=1e-5, **kw):
    program, mesh = _program(strategy, mesh_text, dtd, **kw)
    params = _params(program)
    tokens, targets = _batch()
    shardings = program.batch_shardings(mesh)
    placed = jax.device_put(params, program.shardings(mesh))
    batch = (jax.device_put(tokens, shardings[0]), jax.device_put(targets, shardings[1]))
    loss, grads = make_value_and_grad(program, mesh)(placed, *batch)
    phantom = strategy.startswith("phantom")
    oracle = _oracle_fn(strategy, MeshConfig.parse(mesh_text).size("model") if phantom else 1,
                        **kw)
    host = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    want_loss, want_grads = oracle(jax.device_put(host, jax.devices()[0]), tokens, targets)
    assert abs(float(loss) - float(want_loss)) <= rtol * abs(float(want_loss))
    assert_tree_close(grads, want_grads, rtol)
    metrics = make_metrics_fn(program, mesh)(placed, *batch)
    assert int(metrics["dropped"]) == 0
    assert int(metrics["assignments"]) == BATCH * SEQ * 2 * _config(strategy, **kw).moe_layers


SLOW = pytest.mark.slow  # the longer half of the grid: make test-all


@pytest.mark.parametrize("strategy, mesh, dtd, kw", [
    pytest.param("tensor", "data=8,model=1", False, {}, marks=SLOW),  # every expert everywhere
    pytest.param("tensor", "expert=2,model=2", False, {"moe_every": 1}, marks=SLOW),
    pytest.param("tensor", "expert=4,model=2", False, {}, marks=SLOW),
    ("tensor", "expert=8,model=1", False, {}),
    pytest.param("tensor", "data=2,expert=2,model=2", False, {}, marks=SLOW),
    ("tensor", "data=2,expert=2,model=2", True, {}),
    pytest.param("phantom", "data=2,expert=2,model=2", False, {}, marks=SLOW),
    pytest.param("tensor", "expert=4,model=2", False, {"capacity_factor": None},
                 marks=SLOW),  # dropless (its layer test runs in make test)
])
def test_moe_transformer_equals_the_single_device_model(strategy, mesh, dtd, kw):
    """Loss and every gradient equal the dense single-device MoE transformer (float64 oracle,
    float32 1e-5): expert parallelism on 1, 2, 4 and 8 ranks, TED meshes with DTD on and off,
    phantom-parallel experts, the dropless path; nothing dropped, assignments counted."""
    _check(strategy, mesh, dtd, **kw)


def _step_collectives(program, mesh, remat="none"):
    step = make_train_step(program, mesh, optax.sgd(0.1), donate=False, remat=remat)
    params = abstract_params(program, mesh)
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), np.int32, sharding=program.batch_shardings(mesh)[0])
    text = step.lower(params, jax.eval_shape(optax.sgd(0.1).init, params), tokens,
                      tokens).compile().as_text()
    found = Counter()
    for op in collectives(text):
        found[op.kind, op.mesh_axes(dict(mesh.shape)), op.elements] += op.count
    return found


def _local_elements(program, mesh, expert):
    """Per-rank elements of the parameters that are (or are not) split over ``expert``."""
    shapes = jax.eval_shape(program.init, jax.random.PRNGKey(0))
    total = 0
    for leaf, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(
            program.param_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))):
        if ("expert" in spec_axes(spec)) == expert:
            local = math.prod(leaf.shape) // math.prod(mesh.shape[a] for a in spec_axes(spec))
            total += local
    return total


@pytest.mark.parametrize("dtd", [pytest.param(False, marks=pytest.mark.slow), True])
def test_moe_step_moves_two_all_to_alls_each_way_per_moe_layer(dtd):
    """The compiled training step on data=2,expert=2,model=2 with two MoE blocks (scan trip counts
    applied): 4 all-to-alls per MoE layer over ``expert``, each of one capacity buffer E C h (with
    DTD, E C h / p: the bytes fall by G_tensor = 2); the experts' gradients all-reduced over
    ``data`` only and every other gradient over ``data`` and ``expert``, plus one all-reduce of
    2E router statistics per MoE layer and two scalars (the reported loss, and the backward of
    the batch-wide load-balancing loss: the transpose of its broadcast to every rank)."""
    program, mesh = _program("tensor", "data=2,expert=2,model=2", dtd, layers=4)
    found = _step_collectives(program, mesh)
    tokens = BATCH * SEQ // 4
    buffer = EXPERTS * _config(layers=4).moe.capacity(tokens) * HIDDEN
    a2a = {(axes, n): c for (kind, axes, n), c in found.items() if kind == "all-to-all"}
    assert a2a == {(("expert",), buffer // 2 if dtd else buffer): 4 * 2}
    reduced = Counter()
    for (kind, axes, n), c in found.items():
        if kind == "all-reduce" and "data" in axes:
            reduced[axes] += n * c
    assert reduced == {("data",): _local_elements(program, mesh, expert=True),
                       ("data", "expert"): _local_elements(program, mesh, expert=False)
                       + 2 * EXPERTS * 2 + 2}


@pytest.mark.parametrize("policy, recomputed", [("nothing_saveable", True),
                                                ("collectives_saveable", False)])
def test_cac_in_the_step_keeps_the_all_to_alls_out_of_the_recompute(policy, recomputed):
    """Communication-aware checkpointing (seed 004): every block checkpointed; saving collective
    outputs by name keeps the recompute free of communication. Per MoE layer, all-to-alls 6
    become 4 (dispatch and combine forward, their transposes backward) and the experts' tensor
    all-reduces of E C h 3 become 2 (forward, and the input's gradient backward): two MoE layers
    here. (Seed 004 counts 6 + 6 -> 4 + 4 with the attention's, which behave alike.)"""
    program, mesh = _program("tensor", "data=2,expert=2,model=2", False, layers=4)
    found = _step_collectives(program, mesh, remat=policy)
    buffer = EXPERTS * _config(layers=4).moe.capacity(BATCH * SEQ // 4) * HIDDEN
    per_layer = 3 if recomputed else 2
    assert sum(c for (kind, *_), c in found.items() if kind == "all-to-all") == 2 * 2 * per_layer
    expert_reductions = sum(n * c for (kind, axes, n), c in found.items()
                            if kind == "all-reduce" and axes == ("model",) and n % buffer == 0)
    assert expert_reductions == 2 * per_layer * buffer


@pytest.mark.parametrize("kw, mesh, options, message", [
    ({"moe_every": 0}, "expert=2,model=1", {}, "an 'expert' mesh axis splits the experts"),
    ({}, "expert=2,model=1", {"dtd": True, "strategy": "phantom"}, "dtd"),
    ({}, "stage=2,model=1", {}, "MoE blocks do not run inside pipeline stages"),
    ({}, "data=2,expert=2,model=1", {"zero": 1}, "ZeRO shards over 'data' only"),
    ({"experts": 6}, "expert=4,model=1", {}, "experts=6 is not divisible by the expert axis"),
    ({}, "expert=2,model=2", {"sequence_parallel": True}, "sequence_parallel with moe_every"),
])
def test_moe_programs_that_cannot_run_are_config_errors(kw, mesh, options, message):
    options = dict(options)
    strategy = options.pop("strategy", "tensor")
    with pytest.raises(ConfigError, match=message):
        strategies.get(strategy).program(_config(strategy, **kw), MeshConfig.parse(mesh),
                                         **options)


@pytest.mark.parametrize("kw, message", [
    ({"layers": 3}, "layers=3 is not divisible by moe_every=2"),
    ({"top_k": 9}, "top_k=9 > experts=8"),
    ({"capacity_factor": 0}, "capacity_factor=0"),
    ({"moe_every": -1}, "moe_every=-1"),
])
def test_moe_configs_that_cannot_work_are_config_errors(kw, message):
    with pytest.raises(ConfigError, match=message):
        _config(**kw)


def test_active_parameters_count_k_of_the_experts():
    config = _config(layers=4)
    mlp = 8 * HIDDEN * HIDDEN + 5 * HIDDEN
    assert config.param_count() - config.param_count(active=True) == 2 * (EXPERTS - 2) * mlp
