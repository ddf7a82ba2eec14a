"""Pipelines executed in the one SPMD step (:mod:`jphantom.pipeline.runner`) equal the unpipelined
model, never let a bubble leak, run the stage body exactly as often as the schedule says and move
exactly the activations and cotangents the schedule needs.

Every oracle test runs with ``bubble_fill=NaN``: whatever an idle slot sends is NaN, so a bubble
that reached the loss or a gradient would fail the comparison (Praxis's check).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphantom import strategies
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig, first_devices
from jphantom.models.ffn import FFNConfig
from jphantom.pipeline.runner import PipelineConfig, plan, unit_order
from jphantom.step import make_loss_fn, make_value_and_grad

from conftest import require_devices
from helpers import assert_tree_close, oracle_loss_and_grads, random_params

NAN = float("nan")
WIDTH = 8


def _program(strategy, model_config, mesh_text, pipeline, **kw):
    config = MeshConfig.parse(mesh_text)
    require_devices(config.device_count)
    program = strategies.get(strategy).program(model_config, config, pipeline=pipeline, **kw)
    return program, program.mesh.build(first_devices(program.mesh.device_count))


def _ffn(strategy, depth):
    return FFNConfig(WIDTH, depth, 2 if strategy.startswith("phantom") else None, "float32")


def _ffn_batch(mesh, per_rank=8, seed=0):
    rng = np.random.default_rng(seed)
    size = per_rank * mesh.shape.get("data", 1)
    return tuple(rng.standard_normal((size, WIDTH)).astype(np.float32) for _ in range(2))


@functools.lru_cache(maxsize=None)
def _ffn_case(strategy, mesh_text, schedule, microbatches, virtual_stages=1, depth=None):
    stages = MeshConfig.parse(mesh_text).size("stage")
    depth = depth or 2 * stages * virtual_stages
    pipeline = PipelineConfig(schedule, microbatches, virtual_stages, bubble_fill=NAN)
    program, mesh = _program(strategy, _ffn(strategy, depth), mesh_text, pipeline)
    return program, mesh, make_value_and_grad(program, mesh)


def _check_ffn(strategy, mesh_text, schedule, microbatches, virtual_stages=1, depth=None):
    program, mesh, value_and_grad = _ffn_case(strategy, mesh_text, schedule, microbatches,
                                              virtual_stages, depth)
    params = random_params(program)
    x, t = _ffn_batch(mesh, per_rank=max(8, microbatches))
    placed = jax.device_put(params, program.shardings(mesh))
    batch = [jax.device_put(a, s) for a, s in zip((x, t), program.batch_shardings(mesh))]
    loss, grads = value_and_grad(placed, *batch)
    want_loss, want_grads = oracle_loss_and_grads(program.dense_equivalent, params, x, t)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert_tree_close(grads, want_grads, 1e-5)
    return program, mesh, placed, batch, float(want_loss)


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("schedule, virtual_stages", [("gpipe", 1), ("1f1b", 1),
                                                      ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("factor", [pytest.param(0, marks=pytest.mark.slow), 1,
                                    pytest.param(4, marks=pytest.mark.slow)])  # M = 1, P, 4P
def test_ffn_pipeline_equals_unpipelined(stages, schedule, virtual_stages, factor):
    """Every schedule on 2, 4 and 8 stages, M in {1, P, 4P}: the loss and every gradient of the
    unpipelined FFN (float32, 1e-5), with NaN sent by every idle slot."""
    microbatches = stages * factor or 1
    if schedule == "interleaved-1f1b" and microbatches % stages:
        pytest.skip("interleaved 1F1B needs M divisible by P")
    _check_ffn("tensor", f"stage={stages}", schedule, microbatches, virtual_stages)


@pytest.mark.parametrize("strategy, schedule, virtual_stages", [
    ("tensor", "gpipe", 1), ("tensor", "1f1b", 1), ("tensor", "interleaved-1f1b", 2),
    ("phantom", "1f1b", 1), pytest.param("phantom", "gpipe", 1, marks=pytest.mark.slow),
    pytest.param("phantom", "interleaved-1f1b", 2, marks=pytest.mark.slow)])
def test_ffn_pipeline_with_data_and_model_parallelism(strategy, schedule, virtual_stages):
    """stage=2,data=2,model=2: tensor (Megatron pairs) or phantom inside each stage."""
    program, mesh, placed, batch, want = _check_ffn(strategy, "stage=2,data=2,model=2", schedule,
                                                    4, virtual_stages)
    assert float(make_loss_fn(program, mesh)(placed, *batch)) == pytest.approx(want, rel=1e-5)


def test_ffn_pipeline_with_tensor_t1_inside_stages():
    _check_ffn("tensor-t1", "stage=4,model=2", "1f1b", 8)


# --------------------------------------------------------------------------------------------------
# The transformer
# --------------------------------------------------------------------------------------------------

VOCAB, SEQ, HIDDEN, HEADS = 32, 8, 16, 4


def _transformer(strategy, layers):
    from jphantom.models.transformer import TransformerConfig

    phantom = strategy.startswith("phantom")
    return TransformerConfig(VOCAB, SEQ, HIDDEN, HEADS, layers, 3 if phantom else None, "float32",
                             tied_head=not phantom)


@functools.lru_cache(maxsize=None)
def _dense_oracle(model_config, dense_equivalent):
    dense_config = dataclasses.replace(model_config, dtype="float64", ghost_width=None)
    dense = strategies.get("dense").program(dense_config, MeshConfig.parse("model=1"))
    loss = dense.global_loss(dense.mesh.build(first_devices(1)))
    return jax.jit(jax.value_and_grad(lambda p, a, b: loss(dense_equivalent(p), a, b)))


@pytest.mark.parametrize("strategy, mesh, schedule, microbatches, virtual_stages, sp", [
    pytest.param("tensor", "stage=4", "1f1b", 4, 1, False, marks=pytest.mark.slow),
    pytest.param("tensor", "stage=2", "gpipe", 1, 1, False, marks=pytest.mark.slow),
    pytest.param("tensor", "stage=2,data=2,model=2", "1f1b", 4, 1, False, marks=pytest.mark.slow),
    ("tensor", "stage=2,data=2,model=2", "interleaved-1f1b", 2, 2, True),
    pytest.param("phantom", "stage=2,data=2,model=2", "gpipe", 2, 1, False,
                 marks=pytest.mark.slow),
    pytest.param("phantom", "stage=2,data=2,model=2", "1f1b", 4, 1, False,
                 marks=pytest.mark.slow),
])
def test_transformer_pipeline_equals_dense(strategy, mesh, schedule, microbatches, virtual_stages,
                                           sp):
    """The GPT transformer pipelined, alone and composed with data and tensor (with or without
    sequence parallelism) or phantom parallelism: loss and every gradient of the dense model."""
    stages = MeshConfig.parse(mesh).size("stage")
    model_config = _transformer(strategy, stages * virtual_stages)
    pipeline = PipelineConfig(schedule, microbatches, virtual_stages, bubble_fill=NAN)
    program, mesh_obj = _program(strategy, model_config, mesh, pipeline, sequence_parallel=sp)
    params = random_params(program)
    for name in ("ln1", "ln2"):
        params["blocks"][name]["scale"] += 1.0
    params["ln_f"]["scale"] += 1.0
    rng = np.random.default_rng(1)
    tokens, targets = (rng.integers(0, VOCAB, (4 * mesh_obj.shape.get("data", 1), SEQ))
                       for _ in range(2))
    shardings = program.batch_shardings(mesh_obj)
    loss, grads = make_value_and_grad(program, mesh_obj)(
        jax.device_put(params, program.shardings(mesh_obj)),
        jax.device_put(tokens, shardings[0]), jax.device_put(targets, shardings[1]))
    host = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    want_loss, want_grads = _dense_oracle(model_config, program.dense_equivalent)(
        jax.device_put(host, jax.devices()[0]), tokens, targets)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert_tree_close(grads, want_grads, 1e-5)


# --------------------------------------------------------------------------------------------------
# What runs: body executions and collective-permutes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, microbatches, virtual_stages", [
    ("1f1b", 8, 1), ("gpipe", 4, 1), ("interleaved-1f1b", 4, 2)])
def test_stage_body_runs_as_often_as_the_schedule_says(schedule, microbatches, virtual_stages):
    """Praxis's check: count, per device, the forward and backward executions of the stage body
    (a host callback in the body). Each device runs each of its V chunks once forward and once
    backward per micro-batch: 2 M V, never a bubble."""
    stages = 4
    pipeline = PipelineConfig(schedule, microbatches, virtual_stages)
    program, mesh = _program("tensor", _ffn("tensor", 2 * stages * virtual_stages),
                             f"stage={stages}", pipeline)
    counts = np.zeros((stages,), int)

    def count(stage):
        counts[int(stage)] += 1

    def counting_body(chunk, x, c):
        jax.debug.callback(count, jax.lax.axis_index("stage"))
        return body(chunk, x, c)

    from jphantom.pipeline.runner import pipelined

    base = strategies.get("tensor")._ffn_program(_ffn("tensor", 2 * stages * virtual_stages),
                                                 program.mesh)
    body = base.stages.body
    counted = pipelined(dataclasses.replace(
        base, stages=dataclasses.replace(base.stages, body=counting_body)), pipeline)
    params = jax.device_put(random_params(counted), counted.shardings(mesh))
    x, t = _ffn_batch(mesh)
    batch = [jax.device_put(a, s) for a, s in zip((x, t), counted.batch_shardings(mesh))]
    jax.block_until_ready(make_value_and_grad(counted, mesh)(params, *batch))
    # jax.vjp runs the body forward once; the backward replays its residuals, not the body.
    np.testing.assert_array_equal(counts, microbatches * virtual_stages)


@pytest.mark.parametrize("strategy, schedule, microbatches, virtual_stages", [
    ("phantom", "1f1b", 4, 1), ("phantom", "gpipe", 4, 1), ("tensor", "interleaved-1f1b", 4, 2)])
def test_pipelined_step_moves_what_the_schedule_needs(strategy, schedule, microbatches,
                                                      virtual_stages):
    """The compiled step holds one collective-permute per tick that moves an activation and one
    per tick that moves a cotangent (loop trip counts applied), each of one micro-batch's
    activation; over ``data`` only the gradient all-reduce; over ``stage`` besides the permutes
    only the replicated parameters' all-reduce and the loss."""
    mesh_text = "stage=2,data=2,model=2"
    program, mesh, value_and_grad = _ffn_case(strategy, mesh_text, schedule, microbatches,
                                              virtual_stages)
    x, t = _ffn_batch(mesh)
    params = jax.eval_shape(program.init, jax.random.PRNGKey(0))
    shardings = program.shardings(mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            params, shardings)
    batch = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
             for a, s in zip((x, t), program.batch_shardings(mesh))]
    hlo = value_and_grad.lower(abstract, *batch).compile().as_text()
    axes = dict(mesh.shape)
    found = collectives(hlo)
    schedule_plan = plan(program_pipeline(program), 2)
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert {c.mesh_axes(axes) for c in permutes} == {("stage",)}
    assert sum(c.count for c in permutes) == (schedule_plan.forward_permutes
                                              + schedule_plan.backward_permutes)
    p = mesh.shape["model"]
    features = WIDTH if strategy == "tensor" else WIDTH // p  # Megatron: replicated between stages
    activation_bytes = (x.shape[0] // 2 // microbatches) * features * 4
    assert {c.bytes for c in permutes} == {activation_bytes}
    # Data parallelism: one reduction of every local gradient, nothing else over data alone.
    over_data = [c for c in found if c.mesh_axes(axes) == ("data",)]
    local_param_elements = sum(
        int(np.prod(s.shard_shape(a.shape))) for a, s in
        zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))
    assert {c.kind for c in over_data} == {"all-reduce"}
    assert sum(c.elements * c.count for c in over_data) == local_param_elements
    # Whatever else runs over stage is the loss (a scalar), never an activation.
    others = [c for c in found if "stage" in c.mesh_axes(axes) and c.kind != "collective-permute"]
    assert all(c.elements == 1 for c in others), others


def program_pipeline(program):
    return PipelineConfig(**program.options["pipeline"])


# --------------------------------------------------------------------------------------------------
# Plans, permutations and errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 4])
def test_residual_slots_stay_bounded_for_1f1b_and_grow_for_gpipe(stages):
    for factor in (1, 2, 4, 8):
        m = factor * stages
        assert plan(PipelineConfig("gpipe", m), stages).stash_slots == m
        assert plan(PipelineConfig("1f1b", m), stages).stash_slots == min(m, 2 * stages - 1)


def test_permutes_skip_ticks_that_move_nothing():
    gpipe = plan(PipelineConfig("gpipe", 8), 4)  # M + P - 1 ticks each way; the last sends nothing
    assert (gpipe.forward_permutes, gpipe.backward_permutes) == (8 + 4 - 2, 8 + 4 - 2)
    onefoneb = plan(PipelineConfig("1f1b", 8), 4)
    assert (onefoneb.forward_permutes, onefoneb.backward_permutes) == (8 + 4 - 2, 8 + 4 - 2)


def test_unit_order_gives_each_device_its_round_robin_chunks():
    order = unit_order(8, 2, 2)  # 4 chunks of 2 units: device 0 holds chunks 0 and 2
    np.testing.assert_array_equal(order, [0, 1, 4, 5, 2, 3, 6, 7])
    np.testing.assert_array_equal(unit_order(6, 3, 1), np.arange(6))


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="zero"), "unknown pipeline schedule"),
    (dict(microbatches=0), "microbatches"),
    (dict(schedule="1f1b", virtual_stages=2), "interleaved-1f1b"),
])
def test_pipeline_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PipelineConfig(**kwargs)


def test_bad_pipelines_fail_before_compiling():
    require_devices(4)
    with pytest.raises(ConfigError, match="depth=6 is not divisible by stages x virtual stages"):
        strategies.get("phantom").program(FFNConfig(8, 6, 2), MeshConfig.parse("stage=4"))
    with pytest.raises(ConfigError, match="microbatches divisible by the 4 stages"):
        strategies.get("tensor").program(FFNConfig(8, 16), MeshConfig.parse("stage=4"),
                                         pipeline=PipelineConfig("interleaved-1f1b", 6, 2))
    with pytest.raises(ConfigError, match="does not run inside pipeline stages"):
        strategies.get("gspmd").program(FFNConfig(8, 8), MeshConfig.parse("stage=4"))
    with pytest.raises(ConfigError, match="needs a 'stage' axis"):
        strategies.get("tensor").program(FFNConfig(8, 8), MeshConfig.parse("model=4"),
                                         pipeline=PipelineConfig())
    with pytest.raises(ConfigError, match="not divisible by microbatches=3"):
        PipelineConfig("gpipe", 3).check_batch(8)
