"""Zero-bubble pipelines executed (:mod:`jphantom.pipeline.split`): ZB-H1 and ZB-V equal the
unpipelined model, never let a bubble leak (every idle slot sends NaN), run the stage body once per
micro-batch and chunk (B and W replay residuals), hold exactly the schedule's collective-permutes,
and split each backward into B and W without recomputing anything."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jphantom.registry import program as program_module
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.models.ffn import FFNConfig
from jphantom.nn.stack import apply_blocks
from jphantom.pipeline import runner, split
from jphantom.pipeline import table as table_module
from jphantom.pipeline.buffers import rebuilder, vjp_residuals
from jphantom.pipeline.runner import PipelineConfig
from jphantom.pipeline.schedule import lockstep

from conftest import require_devices
from helpers import abstract_state, assert_every_task_once
from test_pipeline import WIDTH, _check_ffn, _ffn_batch, _ffn_case, stage_body_counts


def _depth(schedule, stages):
    return 2 * stages * (2 if schedule == "zb-v" else 1)  # one Megatron pair per model chunk


@pytest.mark.parametrize("schedule, stages, factor", [
    ("zb-h1", 2, 1), ("zb-v", 2, 2), ("zb-h1", 4, 2),
    pytest.param("zb-v", 4, 1, marks=pytest.mark.slow),
    pytest.param("zb-h1", 2, 4, marks=pytest.mark.slow),
    pytest.param("zb-v", 2, 4, marks=pytest.mark.slow),
    pytest.param("zb-h1", 4, 4, marks=pytest.mark.slow),
    pytest.param("zb-v", 4, 4, marks=pytest.mark.slow),
    pytest.param("zb-h1", 8, 1, marks=pytest.mark.slow),
    pytest.param("zb-v", 8, 2, marks=pytest.mark.slow),
    pytest.param("zb-h1", 8, 4, marks=pytest.mark.slow)])
@pytest.mark.slow_cells("zb-h1-4-2")
def test_zero_bubble_equals_unpipelined(schedule, stages, factor):
    """ZB-H1 and ZB-V on 2, 4 and 8 stages, M in {P, 2P, 4P}: the loss and every gradient of the
    unpipelined FFN (float32, 1e-5), with NaN sent by every idle slot."""
    _check_ffn("tensor", f"stage={stages}", schedule, stages * factor,
               depth=_depth(schedule, stages))


@pytest.mark.parametrize("strategy, schedule", [  # make test-all only (test budget); make test
    pytest.param("phantom", "zb-h1", marks=pytest.mark.slow),  # runs ZB-H1/ZB-V on stages alone
    pytest.param("tensor", "zb-v", marks=pytest.mark.slow),
    pytest.param("tensor", "zb-h1", marks=pytest.mark.slow),
    pytest.param("phantom", "zb-v", marks=pytest.mark.slow)])
def test_zero_bubble_with_data_and_model_parallelism(strategy, schedule):
    """stage=2,data=2,model=2: Megatron pairs or phantom layers inside each stage (their
    collectives inside F, B and W); the pipelined evaluation (F slots only) gives the same loss."""
    step, stored, batch, want = _check_ffn(strategy, "stage=2,data=2,model=2", schedule, 4,
                                           depth=_depth(schedule, 2))
    assert float(step.loss()(stored, *batch)) == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_zero_bubble_transformer_equals_dense():
    """The GPT transformer (attention, norms, biases, tied head) under ZB-V beside data and tensor
    parallelism with sequence parallelism."""

    from helpers import assert_tree_close, oracle_loss_and_grads, random_params
    from test_pipeline import NAN, SEQ, VOCAB, _transformer

    program = program_module.build(_transformer("tensor", 4), "tensor", "stage=2,data=2,model=2",
                                   sequence_parallel=True)
    require_devices(8)
    mesh = program.mesh.build(jax.devices()[:8])
    step = program.train_step(mesh, optax.sgd(0.1), donate=False,
                              pipeline=PipelineConfig("zb-v", 4, bubble_fill=NAN))
    params = random_params(program)
    rng = np.random.default_rng(1)
    tokens, targets = (rng.integers(0, VOCAB, (8, SEQ)) for _ in range(2))
    loss, grads = jax.jit(step.value_and_grad())(step.init(params).params, tokens, targets)
    want_loss, want_grads = oracle_loss_and_grads(step, params, tokens, targets)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert_tree_close(jax.device_get(step.to_model_order(grads)), want_grads, 1e-5, floor=1e-2)


@pytest.mark.parametrize("schedule, microbatches", [
    pytest.param("zb-h1", 8, marks=pytest.mark.slow), ("zb-v", 4)])
def test_stage_body_runs_once_per_microbatch_and_chunk(schedule, microbatches):
    """Praxis's check (a host callback in the stacked unit): each device runs the body M times
    per local chunk -- the forwards; B and W replay the stashed residuals, never the body."""
    counts, pipeline = stage_body_counts(schedule, _depth(schedule, 4), microbatches)
    np.testing.assert_array_equal(counts, microbatches * pipeline.local_chunks)


@pytest.mark.parametrize("strategy, schedule", [
    pytest.param("phantom", "zb-h1", marks=pytest.mark.slow), ("tensor", "zb-v")])
def test_zero_bubble_step_holds_exactly_the_schedules_permutes(strategy, schedule):
    """One collective-permute per slot and direction that moves something (trip counts
    applied), each one micro-batch's activation, all over ``stage``; over ``data`` only the
    gradient all-reduce; nothing else over ``stage`` but scalars."""
    mesh_text, microbatches = "stage=2,data=2,model=2", 4
    program, mesh, step, value_and_grad = _ffn_case(strategy, mesh_text, schedule, microbatches,
                                                    depth=_depth(schedule, 2))
    x, t = _ffn_batch(mesh)
    state = abstract_state(step)
    batch = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, s))
             for a, s in zip((x, t), step.specs_of_batch(2))]
    hlo = value_and_grad.lower(state.params, *batch).compile().as_text()
    axes = dict(mesh.shape)
    found = collectives(hlo)
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert {c.mesh_axes(axes) for c in permutes} == {("stage",)}
    schedule_plan = runner.schedule_table(step.pipeline, 2)
    assert sum(c.count for c in permutes) == schedule_plan.permutes
    features = WIDTH if strategy == "tensor" else WIDTH // mesh.shape["model"]
    assert {c.bytes for c in permutes} == {(x.shape[0] // 2 // microbatches) * features * 4}
    over_data = [c for c in found if c.mesh_axes(axes) == ("data",)]
    local = sum(int(np.prod(jax.sharding.NamedSharding(mesh, s).shard_shape(a.shape)))
                for a, s in zip(step.layout.shapes, step.param_specs))
    assert {c.kind for c in over_data} == {"all-reduce"}
    assert sum(c.elements * c.count for c in over_data) == local
    others = [c for c in found if "stage" in c.mesh_axes(axes) and c.kind != "collective-permute"]
    assert all(c.elements == 1 for c in others), others


def test_b_and_w_split_the_backward_without_recomputing():
    """The split of a Llama block pair's pullback (module docstring): B + W cost exactly the
    pullback's FLOPs (nothing recomputed), W is the weight gradients' share, and together they
    give the pullback's gradients."""
    from jphantom.models.llama import Llama, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden=32, intermediate=64, layers=2, heads=4,
                         kv_heads=2, max_positions=16)
    graph, state = nnx.split(Llama(config, rngs=nnx.Rngs(0)).layers.block)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 32))
    g = jax.random.normal(jax.random.PRNGKey(2), (2, 16, 32))
    body = lambda st, x: apply_blocks(graph, st, x)  # noqa: E731
    _, pullback = jax.vjp(body, state, x)
    treedef, stash, is_param = vjp_residuals(pullback, jax.tree.leaves(state))

    rebuild = rebuilder(treedef, is_param)
    how = split.weight_only_residuals(rebuild(state), stash, state, g)
    assert any(how.weight_only) and not all(how.weight_only)
    known = split.pick(stash, how.weight_only, False)
    weight_only = split.pick(stash, how.weight_only, True)

    def b(st, known, g):
        dx, b_leaves, linear = split.backward_input(rebuild(st), how, known, g, weight_only)
        return dx, b_leaves, jax.tree.leaves(linear)

    dx, b_leaves, linear = split.backward_input(rebuild(state), how, known, g, weight_only)
    leaves, linear_tree = jax.tree.flatten(linear)

    def w(leaves, weight_only):
        return split.backward_weight(jax.tree.unflatten(linear_tree, leaves), weight_only)

    def flops(f, *args):
        return jax.jit(f).lower(*args).compile().cost_analysis()["flops"]

    full = flops(lambda st, res, g: rebuild(st)(res)(g), state, stash, g)
    b_flops, w_flops = flops(b, state, known, g), flops(w, leaves, weight_only)
    assert b_flops + w_flops == pytest.approx(full, rel=1e-3)
    assert 0.3 * full < w_flops < 0.6 * full  # the weight GEMMs: about half the backward
    want_chunk, want_dx = pullback(g)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
    got = split.merge([not m for m in how.weight_leaves], b_leaves, w(leaves, weight_only))
    for a, e in zip(got, jax.tree.leaves(want_chunk)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("schedule, stages, microbatches", [("zb-h1", 4, 16), ("zb-v", 4, 8)])
def test_the_table_runs_every_task_once_within_1f1bs_memory(schedule, stages, microbatches):
    config = PipelineConfig(schedule, microbatches)
    table = runner.schedule_table(config, stages)
    steps = lockstep(schedule, stages, microbatches)
    assert table.table.shape[:2] == (len(steps.slots), stages)
    assert_every_task_once(table, ("F", "B", "W"), config.local_chunks, microbatches)
    # a micro-batch's weight-only residuals live from F to W: at most 1F1B's P in flight
    # (zb-v: 2P chunks of half a stage)
    assert table.stash_w_slots <= stages * config.local_chunks
    # the weight-only buffers are freed at W, the others at B: B's stash is never larger
    assert table.stash_b_slots <= table.stash_w_slots
    eval_table = runner.schedule_table(config, stages, train=False)
    assert_every_task_once(eval_table, ("F",), config.local_chunks, microbatches)
    kinds = eval_table.table[:, :, table_module.FIELDS.index("kind")]
    assert set(np.unique(kinds)) <= {table_module.KINDS.index(k) for k in ("idle", "F")}


def test_unit_order_gives_zb_v_devices_their_v_chunks():
    order = runner.unit_order(8, 2, schedule="zb-v")  # 4 chunks of 2 layers; device 0: 0 and 3
    np.testing.assert_array_equal(order, [0, 1, 6, 7, 2, 3, 4, 5])


def test_zero_bubble_pipelines_refuse_bad_shapes_before_compiling():
    require_devices(4)
    with pytest.raises(ConfigError, match=r"2 x stages = 2 x 4 \(zb-v's chunks\)"):
        program = program_module.build(FFNConfig(8, 8), "tensor", "stage=4")
        program.train_step(program.mesh.build(jax.devices()[:4]), optax.sgd(0.1),
                           pipeline=PipelineConfig("zb-v", 4))
    with pytest.raises(ConfigError, match="applies to 'interleaved-1f1b' only"):
        PipelineConfig("zb-h1", 4, 2)


@pytest.mark.parametrize("schedule, dropless", [
    pytest.param("zb-h1", False, marks=pytest.mark.slow),
    pytest.param("zb-v", True, marks=pytest.mark.slow),
    pytest.param("gpipe", False, marks=pytest.mark.slow),
    pytest.param("1f1b", True, marks=pytest.mark.slow),
    pytest.param("interleaved-1f1b", False, marks=pytest.mark.slow),
    pytest.param("zb-h1", True, marks=pytest.mark.slow),
    pytest.param("zb-v", False, marks=pytest.mark.slow),
])
def test_every_schedule_with_gpt2_mixtures_of_experts_on_an_expert_axis_equals_one_device(
        schedule, dropless):
    """GPT-2's routed MoE (capacity with nothing dropped, or dropless) over ``expert`` in a
    pipeline of 2 stages, load-balancing and z losses on: every schedule equals one device
    (jphantom.verify). ZB-H1 used to differ from 1F1B here: its pullbacks were rebuilt from a
    probe whose input carry was typed invariant over ``expert``, so the rebuilt pullback summed
    the z-loss' cotangent over the expert ranks before sending it to the stage before."""
    from helpers import random_params
    from jphantom.step.exactness import verify_step
    from jphantom.models.gpt2 import TransformerConfig, moe_fields

    require_devices(4)
    chunks = 2 if schedule in ("zb-v", "interleaved-1f1b") else 1  # model chunks per stage
    config = TransformerConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2 * chunks,
                               **moe_fields(1, 4, 2, 100.0, dropless))
    program = program_module.build(config, "tensor", "stage=2,expert=2")
    mesh = program.mesh.build(jax.devices()[:4])
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    step = program.train_step(mesh, optax.sgd(0.1), donate=False,
                              pipeline=PipelineConfig(schedule, 4, virtual))
    rng = np.random.default_rng(1)
    tokens, targets = (rng.integers(0, 64, (8, 16)).astype(np.int32) for _ in range(2))
    report = verify_step(step, step.init(random_params(program)).params, tokens, targets)
    assert report.ok, str(report)
