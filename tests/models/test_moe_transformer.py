"""GPT-2 with MoE blocks (the NNX model, ``programs.build``) under every strategy and mesh
equals the single-device model: loss and every gradient, with TED (experts tensor-parallel over
``model``), duplicate token dropping, phantom-parallel experts and the dropless path; the
load-balancing loss is the whole batch's on every mesh; gradients are reduced over the right
groups (experts' over data only, the rest over data and expert)."""

import dataclasses
import functools
import math
from collections import Counter

import jax
import numpy as np
import optax
import pytest

import jphantom
from jphantom.registry import program as programs
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import first_devices
from jphantom.models.gpt2 import GPT2
from jphantom.models.gpt2 import TransformerConfig
from jphantom.step.zero import spec_axes

from conftest import require_devices
from helpers import assert_tree_close

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH, EXPERTS = 32, 8, 16, 8, 2, 8, 8


def _config(strategy="tensor", **kw):
    phantom = strategy.startswith("phantom")
    base = dict(vocab_size=VOCAB, seq_len=SEQ, hidden=HIDDEN, heads=HEADS, layers=LAYERS,
                tied_head=not phantom, ghost_width=3 if phantom else None, moe_every=2,
                experts=EXPERTS, top_k=2, capacity_factor=float(EXPERTS))  # drops nothing
    return TransformerConfig(**{**base, **kw})


def _batch(seed=1):
    keys = jax.random.split(jax.random.PRNGKey(seed))
    return (np.asarray(jax.random.randint(keys[0], (BATCH, SEQ), 0, VOCAB)),
            np.asarray(jax.random.randint(keys[1], (BATCH, SEQ), 0, VOCAB)))


def _random(params, seed=7):
    """Numpy random values of ``params``' shapes (arrays or ShapeDtypeStructs) (no jax compilation): weights N(0, 1/n) (n the
    last dimension: decisive routing, varied gates), biases N(0, 0.01), norm scales 1 + N(0, 0.01).
    Phantom's own decompressor slot gets a random value too, which must have no effect."""
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        noise = rng.standard_normal(leaf.shape)
        if name == "scale":
            return (1.0 + 0.1 * noise).astype(leaf.dtype)
        scale = 0.1 if name == "bias" or name.startswith("b_") else 1.0 / np.sqrt(leaf.shape[-1])
        return (scale * noise).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, params)


@functools.lru_cache(maxsize=None)
def _built(strategy, mesh_text, dtd=False, kw=()):
    """The program, its mesh, its step and random parameters in their shards (shared by every
    test of the same model, strategy and mesh)."""
    model_kw = dict(kw)
    sequence_parallel = model_kw.pop("sequence_parallel", False)
    program = programs.build(_config(strategy, **model_kw), strategy, mesh_text, dtd=dtd,
                             sequence_parallel=sequence_parallel)
    require_devices(program.mesh.device_count)
    mesh = program.mesh.build(first_devices(program.mesh.device_count))
    step = program.train_step(mesh, optax.sgd(0.1), donate=False)
    host = _random(jax.eval_shape(lambda: program.init(step)).params)
    return program, mesh, step, host, jax.device_put(host, step.param_shardings())


@functools.lru_cache(maxsize=None)
def _one_device(kw=()):
    """value_and_grad of the float64 single-device model (every expert on every token: the
    capacity drops nothing)."""
    model_kw = {k: v for k, v in kw if k != "sequence_parallel"}
    config = dataclasses.replace(_config(**model_kw), dtype="float64")
    program = programs.build(config, "dense", "model=1")
    step = program.train_step(program.mesh.build(first_devices(1)), optax.sgd(0.1))
    return jax.jit(step.value_and_grad())


@functools.lru_cache(maxsize=None)
def _dense_equivalent_fn(strategy, mesh_text, kw=()):
    """value_and_grad, on one device in float64, of the dense model a phantom model *is*
    (``jphantom.dense_equivalent``), with respect to the phantom parameters."""
    _, _, step, _, _ = _built(strategy, mesh_text, False, kw)

    def loss(pure, tokens, targets):
        model = step.layout.model_of(jax.tree.leaves(pure))
        return jphantom.dense_equivalent(model).loss(tokens, targets)

    return jax.jit(jax.value_and_grad(loss))


def _assert_grads_close(actual, expected, rtol):
    """Every gradient to ``rtol`` of its own scale; the key projection's bias, whose exact
    gradient is zero (a softmax ignores a shift of one query's scores), to ``rtol`` of the largest
    gradient (it is rounding noise of the others)."""
    floor = max(float(np.max(np.abs(e))) for e in jax.tree.leaves(expected))
    keys = lambda path: "['k']['bias']" in jax.tree_util.keystr(path)
    zero = {jax.tree_util.keystr(p): e for p, e in
            jax.tree_util.tree_flatten_with_path(expected)[0] if keys(p)}
    for path, a in jax.tree_util.tree_flatten_with_path(actual)[0]:
        if keys(path):
            assert np.max(np.abs(zero[jax.tree_util.keystr(path)])) <= 1e-12 * floor
            assert np.max(np.abs(a)) <= rtol * floor
    strip = lambda tree: jax.tree_util.tree_map_with_path(
        lambda p, a: np.zeros_like(a) if keys(p) else a, tree)
    assert_tree_close(strip(actual), strip(expected), rtol)


def _check(strategy, mesh_text, dtd=False, rtol=1e-5, **kw):
    kw = tuple(sorted(kw.items()))
    program, mesh, step, host, placed = _built(strategy, mesh_text, dtd, kw)
    tokens, targets = _batch()
    loss, grads = jax.jit(step.value_and_grad())(placed, tokens, targets)
    wide = jax.device_put(jax.tree.map(lambda a: np.asarray(a, np.float64), host),
                          jax.devices()[0])
    if strategy.startswith("phantom"):
        want_loss, want_grads = _dense_equivalent_fn(strategy, mesh_text, kw)(wide, tokens,
                                                                              targets)
    else:
        want_loss, want_grads = _one_device(tuple(i for i in kw if i[0] != "sequence_parallel"))(
            wide, tokens, targets)
    assert abs(float(loss) - float(want_loss)) <= rtol * abs(float(want_loss))
    _assert_grads_close(jax.device_get(grads), jax.device_get(want_grads), rtol)
    metrics = step.metrics(GPT2.metrics_fn)(placed, tokens, targets)
    assert float(metrics["dropped"]) == 0
    moe_layers = _config(strategy, **{k: v for k, v in kw if k != "sequence_parallel"}).moe_layers
    assert float(metrics["assignments"]) * BATCH * SEQ == BATCH * SEQ * 2 * moe_layers


SLOW = pytest.mark.slow  # the longer half of the grid: make test-all


@pytest.mark.parametrize("strategy, mesh, dtd, kw", [
    pytest.param("tensor", "data=8,model=1", False, {}, marks=SLOW),  # every expert everywhere
    pytest.param("tensor", "expert=2,model=2", False, {"moe_every": 1}, marks=SLOW),
    pytest.param("tensor", "expert=4,model=2", False, {}, marks=SLOW),
    pytest.param("tensor", "expert=8,model=1", False, {}, marks=SLOW),
    pytest.param("tensor", "data=2,expert=2,model=2", False, {}, marks=SLOW),
    ("tensor", "data=2,expert=2,model=2", True, {}),
    pytest.param("phantom", "data=2,expert=2,model=2", False, {}, marks=SLOW),
    pytest.param("tensor", "expert=4,model=2", False, {"capacity_factor": None},
                 marks=SLOW),  # dropless (its layer test runs in make test)
    # Megatron-SP: each tensor rank dispatches its own S/p tokens (capacity path), or the
    # dropless path gathers the sequence and reduce-scatters the experts' partial sums
    ("tensor", "data=2,expert=2,model=2", False, {"sequence_parallel": True}),
    pytest.param("tensor", "expert=2,model=4", False,
                 {"sequence_parallel": True, "capacity_factor": None}, marks=SLOW),
])
@pytest.mark.slow_cells("tensor-data=2,expert=2,model=2-True-kw5")
def test_moe_transformer_equals_the_single_device_model(strategy, mesh, dtd, kw):
    """Loss and every gradient equal the single-device MoE GPT-2 (float64, every expert on every
    token; phantom: its dense equivalent), float32 1e-5: expert parallelism on 1, 2, 4 and 8
    ranks, TED meshes with DTD on and off, phantom-parallel experts, the dropless path; the
    load-balancing loss is the whole batch's on every mesh; nothing dropped, assignments
    counted."""
    _check(strategy, mesh, dtd, **kw)


@functools.lru_cache(maxsize=None)
def _step_collectives(mesh_text, dtd=False, remat="none"):
    """Collectives of the compiled training step (two MoE blocks), by (kind, mesh axes, elements),
    lowered for abstract parameters in their shards. A fresh program per remat policy: the step
    sets the policy on the model it is given."""
    program = programs.build(_config(layers=4), "tensor", mesh_text, dtd=dtd)
    require_devices(program.mesh.device_count)
    mesh = program.mesh.build(first_devices(program.mesh.device_count))
    step = program.train_step(mesh, optax.sgd(0.1), donate=False, remat=remat)
    state = jax.eval_shape(lambda: program.init(step))
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), np.int32)
    text = step.lower(state, tokens, tokens).compile().as_text()
    found = Counter()
    for op in collectives(text):
        found[op.kind, op.mesh_axes(dict(mesh.shape)), op.elements] += op.count
    return found, step, mesh


def _local_elements(step, mesh, expert):
    """Per-rank elements of the parameters that are (or are not) split over ``expert``."""
    total = 0
    for shape, spec in zip(step.layout.shapes, step.layout.specs):
        if ("expert" in spec_axes(spec)) == expert:
            total += math.prod(shape.shape) // math.prod(mesh.shape[a] for a in spec_axes(spec))
    return total


@pytest.mark.parametrize("dtd", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.slow_cells("True")
def test_moe_step_moves_two_all_to_alls_each_way_per_moe_layer(dtd):
    """The compiled training step on data=2,expert=2,model=2 with two MoE blocks (loop trip counts
    applied): 4 all-to-alls per MoE layer over ``expert``, each of one capacity buffer E C h (with
    DTD, E C h / p: the bytes fall by G_tensor = 2); the experts' gradients all-reduced over
    ``data`` only and every other gradient over ``data`` and ``expert``, plus one all-reduce of
    2E router statistics per MoE layer and two scalars (the reported loss, and the backward of
    the batch-wide load-balancing loss: the transpose of its broadcast to every rank)."""
    found, step, mesh = _step_collectives("data=2,expert=2,model=2", dtd)
    tokens = BATCH * SEQ // 4
    buffer = EXPERTS * _config(layers=4).moe.capacity(tokens) * HIDDEN
    a2a = {(axes, n): c for (kind, axes, n), c in found.items() if kind == "all-to-all"}
    assert a2a == {(("expert",), buffer // 2 if dtd else buffer): 4 * 2}
    reduced = Counter()
    for (kind, axes, n), c in found.items():
        if kind == "all-reduce" and "data" in axes:
            reduced[axes] += n * c
    assert reduced == {("data",): _local_elements(step, mesh, expert=True),
                       ("data", "expert"): _local_elements(step, mesh, expert=False)
                       + 2 * EXPERTS * 2 + 2}


@pytest.mark.parametrize("policy, recomputed", [pytest.param("nothing_saveable", True,
                                                             marks=pytest.mark.slow),
                                                pytest.param("collectives_saveable", False,
                                                             marks=pytest.mark.slow)])
def test_cac_in_the_step_keeps_the_all_to_alls_out_of_the_recompute(policy, recomputed):
    """Communication-aware checkpointing (Singh's thesis): every block group checkpointed; saving
    collective outputs by name keeps the recompute free of communication. Per MoE layer,
    all-to-alls 6 become 4 (dispatch and combine forward, their transposes backward) and the
    experts' tensor all-reduces of E C h 3 become 2 (forward, and the input's gradient backward):
    two MoE layers here. (Singh's thesis counts 6 + 6 -> 4 + 4 with the attention's, which behave
    alike.)"""
    found, _, _ = _step_collectives("data=2,expert=2,model=2", remat=policy)
    buffer = EXPERTS * _config(layers=4).moe.capacity(BATCH * SEQ // 4) * HIDDEN
    per_layer = 3 if recomputed else 2
    assert sum(c for (kind, *_), c in found.items() if kind == "all-to-all") == 2 * 2 * per_layer
    expert_reductions = sum(n * c for (kind, axes, n), c in found.items()
                            if kind == "all-reduce" and axes == ("model",) and n % buffer == 0)
    assert expert_reductions == 2 * per_layer * buffer


@pytest.mark.parametrize("kw, mesh, options, message", [
    ({"moe_every": 0}, "expert=2,model=1", {}, "an 'expert' mesh axis splits the experts"),
    ({}, "expert=2,model=1", {"dtd": True, "strategy": "phantom"}, "dtd"),
    ({}, "expert=2,model=1", {"dtd": True}, "dtd .* 'model' axis, which has size 1"),
    ({"experts": 6}, "expert=4,model=1", {}, "experts=6 is not divisible by the expert axis"),
    ({}, "expert=2,model=2", {"sequence_parallel": True, "dtd": True},
     "every tensor rank dispatches its own"),
    ({"capacity_factor": None}, "expert=2,model=2", {"strategy": "phantom"}, "dropless"),
])
def test_moe_programs_that_cannot_run_are_config_errors(kw, mesh, options, message):
    options = dict(options)
    strategy = options.pop("strategy", "tensor")
    zero = options.pop("zero", 0)
    with pytest.raises(ConfigError, match=message):
        program = programs.build(_config(strategy, **kw), strategy, mesh, **options)
        program.train_step(program.mesh.build(first_devices(program.mesh.device_count)),
                           optax.sgd(0.1), zero=zero)


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
    model = programs.build(config, "dense", "model=1")
    assert model.param_count == config.param_count()  # the NNX model has the dense layout's


@pytest.mark.parametrize("zero", [pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])
def test_zero_beside_an_expert_axis_shards_each_parameter_over_its_replicas(zero):
    """DeepSpeed-MoE's expert-data parallelism: with ZeRO beside an ``expert`` axis, a dense
    parameter is sharded over data x expert (its replicas) and an expert's over data alone; the
    gradients equal ZeRO-0's, and the compiled step's reduce-scatters run over exactly those
    groups (with ZeRO-3 the all-gathers too)."""
    config = _config(layers=2, capacity_factor=8.0)  # no token dropped on any layout
    mesh_text = "data=2,expert=2,model=2"
    reference = programs.build(config, "tensor", mesh_text)
    require_devices(reference.mesh.device_count)
    mesh = reference.mesh.build(first_devices(reference.mesh.device_count))
    tokens, targets = _batch()
    plain = reference.train_step(mesh, optax.sgd(0.1), donate=False)
    state = reference.init(plain)
    want_loss, want = jax.jit(plain.value_and_grad())(state.params, tokens, targets)
    sharded = programs.build(config, "tensor", mesh_text)
    step = sharded.train_step(mesh, optax.sgd(0.1), donate=False, zero=zero)
    state = sharded.init(step)
    loss, grads = jax.jit(step.value_and_grad())(state.params, tokens, targets)
    assert abs(float(loss) - float(want_loss)) < 1e-6 * abs(float(want_loss))
    assert_tree_close(jax.device_get(grads), jax.device_get(want), 1e-5)
    axes_of = {}
    for spec, z in zip(step.layout.specs, step.layout.zero_axes):
        axes_of.setdefault("expert" in spec_axes(spec), set()).add(z)
    assert axes_of == {True: {("data",)}, False: {("data", "expert")}}
    text = step.lower(state, tokens, targets).compile().as_text()
    groups = {op.mesh_axes(dict(mesh.shape)) for op in collectives(text)
              if op.kind == "reduce-scatter"}
    assert {("data",), ("data", "expert")} <= groups


@pytest.mark.parametrize("mesh_text, schedule, microbatches, virtual, layers", [
    pytest.param("stage=2,expert=2,model=2", "1f1b", 2, 1, 4,
                 marks=pytest.mark.slow),  # make test: tests/strategies/test_composition.py, balance loss on
    pytest.param("stage=2,data=2,model=2", "gpipe", 4, 1, 4, marks=pytest.mark.slow),
    pytest.param("stage=2,data=2,expert=2", "interleaved-1f1b", 2, 2, 8,
                 marks=pytest.mark.slow),
])
def test_moe_blocks_run_inside_pipeline_stages(mesh_text, schedule, microbatches, virtual,
                                              layers):
    """MoE blocks inside pipeline stages: the blocks' carry (h, the router statistics) flows
    between stages, the experts' all-to-alls run inside a stage's slot, and the step equals the
    unpipelined one, load-balancing loss included (its routing fractions are the whole batch's:
    the schedule's forward slots sum the router statistics first)."""
    from jphantom.pipeline.runner import PipelineConfig

    config = _config(layers=layers, capacity_factor=8.0)
    tokens, targets = _batch()
    results = []
    for mesh_text_, pipeline in (("data=2,expert=2,model=2", None),
                                 (mesh_text, PipelineConfig(schedule, microbatches, virtual))):
        program = programs.build(config, "tensor", mesh_text_)
        require_devices(program.mesh.device_count)
        mesh = program.mesh.build(first_devices(program.mesh.device_count))
        step = program.train_step(mesh, optax.sgd(0.1), donate=False, pipeline=pipeline)
        state = program.init(step)
        loss, grads = jax.jit(step.value_and_grad())(state.params, tokens, targets)
        results.append((float(loss), jax.device_get(step.to_model_order(grads))))
    (want_loss, want), (loss, grads) = results
    assert abs(loss - want_loss) < 1e-6 * abs(want_loss)
    assert_tree_close(grads, want, 1e-5)
