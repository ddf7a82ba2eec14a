"""Pipelines executed in the one SPMD step (:mod:`jphantom.pipeline.runner`, driven by the module
step :mod:`jphantom.step.train_step`) equal the unpipelined model, never let a bubble leak, run the
stage body exactly as often as the schedule says and move exactly the activations and cotangents
the schedule needs.

Every oracle test runs with ``bubble_fill=NaN``: whatever an idle slot sends is NaN, so a bubble
that reached the loss or a gradient would fail the comparison (Praxis's check).
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jphantom.registry import program as program_module
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.models.ffn import FFN, FFNConfig, Pair
from jphantom.nn.stack import Stacked
from jphantom.pipeline.runner import PipelineConfig, schedule_table, unit_order
from jphantom.pipeline.schedule import lockstep
from jphantom.pipeline.table import FIELDS, KINDS

from conftest import require_devices
from helpers import (abstract_state, assert_every_task_once, assert_tree_close, gradient_step,
                     oracle_loss_and_grads, random_params)

NAN = float("nan")
WIDTH = 8


def _ffn(strategy, depth):
    return FFNConfig(WIDTH, depth, 2 if strategy.startswith("phantom") else None, "float32")


def _ffn_batch(mesh, per_rank=8, seed=0):
    rng = np.random.default_rng(seed)
    size = per_rank * mesh.shape.get("data", 1)
    return tuple(rng.standard_normal((size, WIDTH)).astype(np.float32) for _ in range(2))


def _depth(strategy, stages, virtual_stages):
    """Two layers per model chunk: one Megatron (column, row) pair, two phantom or T1 layers."""
    return 2 * stages * virtual_stages


def _ffn_case(strategy, mesh_text, schedule, microbatches, virtual_stages=1, depth=None):
    stages = int(dict(item.split("=") for item in mesh_text.split(","))["stage"])
    depth = depth or _depth(strategy, stages, virtual_stages)
    pipeline = PipelineConfig(schedule, microbatches, virtual_stages, bubble_fill=NAN)
    program, mesh, step, value_and_grad = gradient_step(strategy, _ffn(strategy, depth),
                                                        mesh_text, pipeline=pipeline)
    require_devices(program.mesh.device_count)
    return program, mesh, step, value_and_grad


def _check_ffn(strategy, mesh_text, schedule, microbatches, virtual_stages=1, depth=None):
    program, mesh, step, value_and_grad = _ffn_case(strategy, mesh_text, schedule, microbatches,
                                                    virtual_stages, depth)
    params = random_params(program)
    x, t = _ffn_batch(mesh, per_rank=max(8, microbatches))
    stored = step.init(params).params  # interleaved stages: the layers in storage order
    loss, grads = value_and_grad(stored, x, t)
    want_loss, want_grads = oracle_loss_and_grads(step, params, x, t)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert_tree_close(jax.device_get(step.to_model_order(grads)), want_grads, 1e-5)
    return step, stored, (x, t), float(want_loss)


@pytest.mark.parametrize("stages", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("schedule, virtual_stages", [("gpipe", 1), ("1f1b", 1),
                                                      ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("factor", [pytest.param(0, marks=pytest.mark.slow), 1,
                                    pytest.param(4, marks=pytest.mark.slow)])  # M = 1, P, 4P
# make test: 1F1B on 2 stages here; interleaved 1F1B in the data x model test below
@pytest.mark.slow_cells("1-interleaved-1f1b-2-4", "1-gpipe-1-2", "1-1f1b-1-4", "1-gpipe-1-4",
                        "1-interleaved-1f1b-2-2")
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
@pytest.mark.slow_cells("tensor-1f1b-1", "phantom-1f1b-1", "tensor-gpipe-1")
def test_ffn_pipeline_with_data_and_model_parallelism(strategy, schedule, virtual_stages):
    """stage=2,data=2,model=2: tensor (Megatron pairs) or phantom inside each stage; the step's
    pipelined evaluation (forward slots only) gives the same loss."""
    step, stored, batch, want = _check_ffn(strategy, "stage=2,data=2,model=2", schedule, 4,
                                           virtual_stages)
    assert float(step.loss()(stored, *batch)) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("mesh_text, microbatches", [
    ("stage=2,data=2,model=2", 4), pytest.param("stage=4,data=2", 8, marks=pytest.mark.slow)])
def test_gspmd_pipeline_equals_unpipelined_and_keeps_each_stage_s_layers(mesh_text, microbatches):
    """The GSPMD baseline's pipeline (vmap over stages, a rotated state buffer, autodiff for the
    backward: GPipe): the unpipelined loss and gradients and the same evaluation loss; the
    partitioner moves activations between stages (collective-permutes over ``stage``, of one
    micro-batch's rows per data rank) and never gathers a stage's layers elsewhere. How many
    permutes and all-reduces it adds around them is the partitioner's choice, not asserted:
    this is the baseline a JAX user writes, not a program jphantom spells out."""
    step, stored, batch, want = _check_ffn("gspmd", mesh_text, "gpipe", microbatches)
    assert float(step.loss()(stored, *batch)) == pytest.approx(want, rel=1e-5)
    mesh = dict(step.mesh.shape)
    value_and_grad = _ffn_case("gspmd", mesh_text, "gpipe", microbatches)[3]  # cached, compiled
    text = value_and_grad.lower(stored, *batch).compile().as_text()
    over_stage = {(op.kind, op.elements) for op in collectives(text)
                  if "stage" in op.mesh_axes(mesh)}
    rows = batch[0].shape[0] // (microbatches * mesh.get("data", 1))
    # (the column-annotated layers leave the activations split over ``model``)
    assert ("collective-permute", rows * WIDTH // mesh.get("model", 1)) in over_stage
    assert not any(kind == "all-gather" for kind, _ in over_stage)


def test_ffn_pipeline_with_tensor_t1_inside_stages():
    _check_ffn("tensor-t1", "stage=4,model=2", "1f1b", 8)


def test_megatron_ffn_of_odd_depth_keeps_its_last_layer_on_the_last_stage():
    """Depth 5 on 2 stages: the two (column, row) pairs split over the stages, the lone last
    column layer (outside the stack) runs after them on the last stage, with the loss."""
    _check_ffn("tensor", "stage=2,model=2", "1f1b", 2, depth=5)


# --------------------------------------------------------------------------------------------------
# The transformer
# --------------------------------------------------------------------------------------------------

VOCAB, SEQ, HIDDEN, HEADS = 32, 8, 16, 4


def _transformer(strategy, layers):
    from jphantom.models.gpt2 import TransformerConfig

    phantom = strategy.startswith("phantom")
    return TransformerConfig(VOCAB, SEQ, HIDDEN, HEADS, layers, 3 if phantom else None, "float32",
                             tied_head=not phantom)


@pytest.mark.parametrize("strategy, mesh, schedule, microbatches, virtual_stages, sp", [
    pytest.param("tensor", "stage=4", "1f1b", 4, 1, False, marks=pytest.mark.slow),
    pytest.param("tensor", "stage=2", "gpipe", 1, 1, False, marks=pytest.mark.slow),
    pytest.param("tensor", "stage=2,data=2,model=2", "1f1b", 4, 1, False, marks=pytest.mark.slow),
    pytest.param("tensor", "stage=2,data=2,model=2", "interleaved-1f1b", 2, 2, True,
                 marks=pytest.mark.slow),
    pytest.param("phantom", "stage=2,data=2,model=2", "gpipe", 2, 1, False,
                 marks=pytest.mark.slow),
    pytest.param("phantom", "stage=2,data=2,model=2", "1f1b", 4, 1, False,
                 marks=pytest.mark.slow),
])
def test_transformer_pipeline_equals_dense(strategy, mesh, schedule, microbatches, virtual_stages,
                                           sp):
    """The GPT transformer pipelined, alone and composed with data and tensor (with or without
    sequence parallelism) or phantom parallelism: loss and every gradient of the dense model."""
    stages = int(dict(item.split("=") for item in mesh.split(","))["stage"])
    model_config = _transformer(strategy, stages * virtual_stages)
    program = program_module.build(model_config, strategy, mesh, sequence_parallel=sp)
    require_devices(program.mesh.device_count)
    mesh_obj = program.mesh.build(jax.devices()[:program.mesh.device_count])
    pipeline = PipelineConfig(schedule, microbatches, virtual_stages, bubble_fill=NAN)
    step = program.train_step(mesh_obj, optax.sgd(0.1), pipeline=pipeline, donate=False)
    params = random_params(program)
    block = params["blocks"]["block"]
    for norm in (block["ln_1"], block["ln_2"], params["ln_f"]):
        norm["scale"] = 1.0 + norm["scale"]
    rng = np.random.default_rng(1)
    tokens, targets = (rng.integers(0, VOCAB, (4 * mesh_obj.shape.get("data", 1), SEQ))
                       for _ in range(2))
    loss, grads = jax.jit(step.value_and_grad())(step.init(params).params, tokens, targets)
    want_loss, want_grads = oracle_loss_and_grads(step, params, tokens, targets)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    # the key bias's gradient is zero in exact arithmetic (softmax ignores a constant added to
    # every key's score): compared against 1e-2
    assert_tree_close(jax.device_get(step.to_model_order(grads)), want_grads, 1e-5, floor=1e-2)


# --------------------------------------------------------------------------------------------------
# What runs: body executions and collective-permutes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, microbatches, virtual_stages", [
    ("1f1b", 8, 1), ("gpipe", 4, 1), ("interleaved-1f1b", 4, 2)])
@pytest.mark.slow_cells("interleaved-1f1b-4-2", "1f1b-8-1")  # make test: GPipe's count
def test_stage_body_runs_as_often_as_the_schedule_says(schedule, microbatches, virtual_stages):
    """Praxis's check: count, per device, the forward and backward executions of the stage body
    (a host callback in the FFN's stacked unit; one unit per model chunk). Each device runs each
    of its V chunks once forward and once backward per micro-batch: 2 M V, never a bubble."""
    counts, _ = stage_body_counts(schedule, 2 * 4 * virtual_stages, microbatches, virtual_stages)
    # jax.vjp runs the body forward once; the backward replays its residuals, not the body.
    np.testing.assert_array_equal(counts, microbatches * virtual_stages)


@pytest.mark.parametrize("strategy, schedule, microbatches, virtual_stages", [
    ("phantom", "1f1b", 4, 1), ("phantom", "gpipe", 4, 1), ("tensor", "interleaved-1f1b", 4, 2)])
# make test: interleaved 1F1B's permutes; phantom's within stages in test_hlo.py
@pytest.mark.slow_cells("phantom-gpipe-4-1", "phantom-1f1b-4-1")
def test_pipelined_step_moves_what_the_schedule_needs(strategy, schedule, microbatches,
                                                      virtual_stages):
    """The compiled step holds one collective-permute per tick that moves an activation and one
    per tick that moves a cotangent (loop trip counts applied), each of one micro-batch's
    activation; over ``data`` only the gradient all-reduce; over ``stage`` besides the permutes
    only the loss."""
    mesh_text = "stage=2,data=2,model=2"
    program, mesh, step, value_and_grad = _ffn_case(strategy, mesh_text, schedule, microbatches,
                                                    virtual_stages)
    x, t = _ffn_batch(mesh)
    state = abstract_state(step)
    batch = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                  sharding=jax.sharding.NamedSharding(mesh, s))
             for a, s in zip((x, t), step.specs_of_batch(2))]
    hlo = value_and_grad.lower(state.params, *batch).compile().as_text()
    axes = dict(mesh.shape)
    found = collectives(hlo)
    schedule_plan = schedule_table(step.pipeline, 2)
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert {c.mesh_axes(axes) for c in permutes} == {("stage",)}
    assert sum(c.count for c in permutes) == (schedule_plan.permutes_next
                                              + schedule_plan.permutes_prev)
    p = mesh.shape["model"]
    features = WIDTH if strategy == "tensor" else WIDTH // p  # Megatron: replicated between stages
    activation_bytes = (x.shape[0] // 2 // microbatches) * features * 4
    assert {c.bytes for c in permutes} == {activation_bytes}
    # Data parallelism: one reduction of every local gradient, nothing else over data alone.
    over_data = [c for c in found if c.mesh_axes(axes) == ("data",)]
    local_param_elements = sum(
        int(np.prod(jax.sharding.NamedSharding(mesh, s).shard_shape(a.shape)))
        for a, s in zip(step.layout.shapes, step.param_specs))
    assert {c.kind for c in over_data} == {"all-reduce"}
    assert sum(c.elements * c.count for c in over_data) == local_param_elements
    # Whatever else runs over stage is the loss (a scalar), never an activation.
    others = [c for c in found if "stage" in c.mesh_axes(axes) and c.kind != "collective-permute"]
    assert all(c.elements == 1 for c in others), others


# --------------------------------------------------------------------------------------------------
# Plans, permutations and errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 4])
def test_residual_slots_stay_bounded_for_1f1b_and_grow_for_gpipe(stages):
    for factor in (1, 2, 4, 8):
        m = factor * stages
        assert schedule_table(PipelineConfig("gpipe", m), stages).stash_slots == m
        assert schedule_table(PipelineConfig("1f1b", m), stages).stash_slots == min(m, 2 * stages - 1)


def test_permutes_skip_ticks_that_move_nothing():
    gpipe = schedule_table(PipelineConfig("gpipe", 8), 4)  # M + P - 1 ticks each way; the last sends nothing
    assert (gpipe.permutes_next, gpipe.permutes_prev) == (8 + 4 - 2, 8 + 4 - 2)
    onefoneb = schedule_table(PipelineConfig("1f1b", 8), 4)
    assert (onefoneb.permutes_next, onefoneb.permutes_prev) == (8 + 4 - 2, 8 + 4 - 2)


@pytest.mark.parametrize("schedule, stages, microbatches, virtual_stages",
                         [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2)])
def test_one_table_runs_the_lockstep_schedules_as_forward_then_whole_backward_slots(
        schedule, stages, microbatches, virtual_stages):
    """The executor that runs ZB-H1's F, B and W runs these too: each lock-step tick is a slot
    of forwards and then a slot of whole backwards (BW), every task once."""
    config = PipelineConfig(schedule, microbatches, virtual_stages)
    table = schedule_table(config, stages)
    assert (table.phases, table.splits, table.ring) == (2, False, virtual_stages > 1)
    assert table.table.shape[:2] == (2 * len(lockstep(schedule, stages, microbatches,
                                                      virtual_stages).ticks), stages)
    kinds = table.table[:, :, FIELDS.index("kind")]
    assert set(np.unique(kinds[0::2])) == {0, KINDS.index("F")}
    assert set(np.unique(kinds[1::2])) == {0, KINDS.index("BW")}
    assert_every_task_once(table, ("F", "BW"), virtual_stages, microbatches)


def test_unit_order_gives_each_device_its_round_robin_chunks():
    order = unit_order(8, 2, 2)  # 4 chunks of 2 units: device 0 holds chunks 0 and 2
    np.testing.assert_array_equal(order, [0, 1, 4, 5, 2, 3, 6, 7])
    np.testing.assert_array_equal(unit_order(6, 3, 1), np.arange(6))


@pytest.mark.parametrize("kwargs, message", [
    (dict(schedule="zero"), "unknown pipeline schedule"),
    (dict(microbatches=0), "microbatches"),
    (dict(schedule="1f1b", virtual_stages=2), "interleaved-1f1b"),
    (dict(unroll_layers=-1), "unroll_layers"),
])
def test_pipeline_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        PipelineConfig(**kwargs)


def test_bad_pipelines_fail_before_compiling():
    require_devices(4)
    with pytest.raises(ConfigError, match="depth=6 is not divisible by stages x virtual stages"):
        program_module.build(FFNConfig(8, 6, 2), "phantom", "stage=4")
    with pytest.raises(ConfigError, match="microbatches divisible by the 4 stages"):
        program = program_module.build(FFNConfig(8, 16), "tensor", "stage=4")
        program.train_step(program.mesh.build(jax.devices()[:4]), optax.sgd(0.1),
                           pipeline=PipelineConfig("interleaved-1f1b", 6, 2))
    with pytest.raises(ConfigError, match="does not run inside pipeline stages"):
        program_module.build(FFNConfig(8, 8), "dense", "stage=4")
    with pytest.raises(ConfigError, match="its schedule is GPipe, not '1f1b'"):
        program = program_module.build(FFNConfig(8, 8), "gspmd", "stage=4")
        program.train_step(program.mesh.build(jax.devices()[:4]), optax.sgd(0.1),
                           pipeline=PipelineConfig("1f1b", 4))
    with pytest.raises(ConfigError, match="needs a 'stage' axis"):
        program = program_module.build(FFNConfig(8, 8), "tensor", "model=4")
        program.train_step(program.mesh.build(jax.devices()[:4]), optax.sgd(0.1),
                           pipeline=PipelineConfig())
    with pytest.raises(ConfigError, match="not divisible by microbatches=3"):
        PipelineConfig("gpipe", 3).check_batch(8)


def stage_body_counts(schedule: str, depth: int, microbatches: int, virtual_stages: int = 1):
    """Praxis's check's counts: per device of a 4-stage pipeline, how often the FFN's stacked
    unit (a tensor layer pair, a host callback inside) ran in one value-and-grad of ``schedule``;
    and the step's pipeline."""
    stages = 4
    require_devices(stages)
    counts = np.zeros((stages,), int)

    def count(stage):
        counts[int(stage)] += 1

    class CountingPair(Pair):
        def __call__(self, h, index):
            jax.debug.callback(count, jax.lax.axis_index("stage"))
            return super().__call__(h, index)

    config = _ffn("tensor", depth)
    model = FFN(config, pairs=True, rngs=nnx.Rngs(0))
    model.layers = Stacked(lambda r: CountingPair(WIDTH, np.float32, rngs=r),
                           config.depth // 2, rngs=nnx.Rngs(1), with_index=True, peel_first=True)
    program = program_module.build(config, "tensor", f"stage={stages}", model=model)
    mesh = program.mesh.build(jax.devices()[:stages])
    pipeline = PipelineConfig(schedule, microbatches, virtual_stages)
    step = program.train_step(mesh, optax.sgd(0.1), donate=False, pipeline=pipeline)
    x, t = _ffn_batch(mesh)
    jax.block_until_ready(jax.jit(step.value_and_grad())(step.init().params, x, t))
    return counts, pipeline


def _scan_carries(jaxpr):
    """The avals every scan of ``jaxpr`` (and of the jaxprs inside it) carries."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield from (v.aval for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _scan_carries(inner)


@pytest.mark.slow  # make test-all: the fast suite's budget
def test_bf16_pipeline_stashes_activations_not_weight_copies():
    """Under bf16 compute the executor casts a chunk's float32 weights before its ``jax.vjp``
    (``Stages.prepare``), so the residual buffers the schedule carries hold activations only,
    never a bf16 copy of a weight per micro-batch in flight, and the step agrees with the
    float32 oracle to bf16's precision (interleaved, tensor + sequence parallelism). A guard:
    on CPU the traced stash held no weight before either; the copies showed in the H100
    compile of NeMo's 70B layout (``bf16[24, 1, 8192, 7168]`` slot buffers, gone with the cast
    outside the vjp: benchmarks/pipeline_memory.py)."""
    import jax.numpy as jnp

    from jphantom.models.llama import LlamaConfig

    llama = LlamaConfig(vocab_size=VOCAB, hidden=HIDDEN, intermediate=32, layers=4, heads=HEADS,
                        kv_heads=2, max_positions=SEQ)
    program = program_module.build(llama, "tensor", "stage=2,model=2", sequence_parallel=True)
    require_devices(4)
    mesh = program.mesh.build(jax.devices()[:4])
    step = program.train_step(mesh, optax.sgd(0.1),
                              pipeline=PipelineConfig("interleaved-1f1b", 2, 2),
                              precision="bf16", remat="none", donate=False)
    params = random_params(program)
    rng = np.random.default_rng(1)
    tokens, targets = (rng.integers(0, VOCAB, (4, SEQ)) for _ in range(2))
    state = step.init(params).params
    weights = {tuple(np.shape(w)[1:]) for w in jax.tree.leaves(params["layers"])
               if np.ndim(w) >= 3}
    # the schedule's slot buffers: [slots, layers of a chunk, ...] (a layer scan's own
    # residuals inside a task are [layers, ...])
    slots = [a.shape for a in _scan_carries(jax.make_jaxpr(step.value_and_grad())(
        state, tokens, targets).jaxpr) if a.dtype == jnp.bfloat16 and a.ndim >= 4]
    assert slots, "no bf16 slot buffer found"
    assert not [s for s in slots if s[2:] in weights], (slots, weights)
    loss, grads = jax.jit(step.value_and_grad())(state, tokens, targets)
    want_loss, want_grads = oracle_loss_and_grads(step, params, tokens, targets)
    assert abs(float(loss) - float(want_loss)) <= 2e-2 * abs(float(want_loss))
    assert_tree_close(jax.device_get(step.to_model_order(grads)), want_grads, 5e-2, floor=1e-2)


@pytest.mark.parametrize("schedule, stages, microbatches, virtual_stages",
                         [("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 4, 2), ("zb-h1", 2, 4, 1),
                          ("zb-v", 2, 4, 1)])
def test_the_head_and_embedding_branches_say_in_how_many_ticks_they_run(schedule, stages,
                                                                         microbatches,
                                                                         virtual_stages):
    """The executor's head, entry and embedding-gradient conds name, per segment, in how many of
    its ticks some device takes them (runner.ticks_taken: the predictor weights their branches
    by it). Over the whole table each runs in M ticks (one device holds each chunk, one task a
    slot)."""
    from jphantom.pipeline import runner

    table = schedule_table(PipelineConfig(schedule, microbatches, virtual_stages), stages)
    rows = table.table.reshape(-1, table.phases, stages, len(FIELDS))

    def total(when):
        counts = [runner.ticks_taken(rows[start:stop], when) for start, stop, _ in table.segments]
        assert sum(t for _, t in counts) == len(rows)
        return sum(n for n, _ in counts)

    m = microbatches
    assert total(runner._on_head) == m
    assert total(runner._on_embedding) == m
    assert total(runner._on_entry) == m


# make test: the five-chunk test below reads the loops' names from the compiled program
@pytest.mark.slow
def test_the_compiled_pipeline_names_its_conds_shares():
    """The names reach the compiled program (the predictor reads the op_name of the entry's
    conditional and of the head's and embedding's loops). The head and the embedding's backward
    are loops of at most one trip whose state holds the rest's gradient sums, vocabulary-wide:
    updated in place in the ticks that have them (runner.at_most_once), not a conditional's
    zeros added in every tick."""
    import re

    from jphantom.models.llama import LlamaConfig

    llama = LlamaConfig(vocab_size=VOCAB, hidden=HIDDEN, intermediate=32, layers=4, heads=HEADS,
                        kv_heads=2, max_positions=SEQ)
    program = program_module.build(llama, "tensor", "stage=2")
    require_devices(2)
    mesh = program.mesh.build(jax.devices()[:2])
    step = program.train_step(mesh, optax.sgd(0.1),
                              pipeline=PipelineConfig("interleaved-1f1b", 4, 2), donate=False)
    tokens = np.zeros((4, SEQ), np.int32)
    state = step.init(random_params(program)).params
    text = jax.jit(step.value_and_grad()).lower(state, tokens, tokens).compile().as_text()
    named = set(re.findall(r"on_(\w+?)_taken_in_\d+_of_\d+_ticks", text))
    assert {"head", "embedding", "entry"} <= named, named
    vocabulary_sums = {f"f32[{VOCAB},{HIDDEN}]", f"f32[{HIDDEN},{VOCAB}]"}
    for part in ("head", "embedding"):
        loops = [line for line in text.splitlines() if re.search(
            rf" while\(.*op_name=\"[^\"]*on_{part}_taken_in_\d+_of_\d+_ticks/while\"", line)]
        assert loops and all(any(s in line.split(" while(")[0] for s in vocabulary_sums)
                             for line in loops), (part, loops)


@pytest.mark.parametrize("schedule, microbatches, virtual_stages, stages, fill_ticks", [
    ("interleaved-1f1b", 64, 5, 4, 80), ("interleaved-1f1b", 8, 4, 2, 16), ("zb-v", 8, 1, 4, 2)])
def test_a_slot_s_two_copies_hold_each_task_s_chunk_and_are_filled_together(
        schedule, microbatches, virtual_stages, stages, fill_ticks):
    """runner.chunk_copies: replaying its fills, every task reads a copy that holds its chunk;
    the devices fill together, in as many ticks as a device changes chunk (NeMo's 70B table: 80
    of 342 a slot, where a device's own refill would land in 320), never two copies at once;
    zb-v's two chunks are copied once."""
    from jphantom.pipeline import copies

    table = schedule_table(PipelineConfig(schedule, microbatches, virtual_stages), stages)
    rows = copies.with_copies(table.table.reshape(-1, table.phases, stages, len(FIELDS)))
    at = {name: i for i, name in enumerate(FIELDS + copies.COPY_FIELDS)}
    for p in range(table.phases):
        kind, chunk, copy, fill, fill_chunk = (rows[:, p, :, at[f]] for f in (
            "kind", "chunk", "copy", "fill", "fill_chunk"))
        held = np.full((2, stages), -1)
        for t in range(len(rows)):
            filling = fill[t] >= 0
            held[fill[t][filling], np.flatnonzero(filling)] = fill_chunk[t][filling]
            busy = kind[t] > 0
            assert (held[copy[t][busy], np.flatnonzero(busy)] == chunk[t][busy]).all(), (p, t)
        assert (fill >= 0).any(axis=1).sum() == fill_ticks
        assert not ((fill == 0).any(axis=1) & (fill == 1).any(axis=1)).any()


def test_an_interleaved_pipeline_of_five_chunks_reads_them_from_copies():
    """With V > 2 x the slots of a tick (here 5 chunks, F and BW slots) a chunk's layers are
    read from the slot's two copies, filled in loops of at most one trip: the loss and every
    gradient of the unpipelined FFN (1e-5), and the compiled program fills both copies of
    both slots (runner._Step.fill_copies) and names each switch's branch counts."""
    import re

    _check_ffn("tensor", "stage=2", "interleaved-1f1b", 4, 5)
    _, mesh, step, value_and_grad = _ffn_case("tensor", "stage=2", "interleaved-1f1b", 4, 5)
    x, t = _ffn_batch(mesh)
    text = value_and_grad.lower(abstract_state(step).params, x, t).compile().as_text()
    fills = set(re.findall(r'op_name="[^"]*fill_copy_(\d)_taken_in_\d+_of_\d+_ticks/while"',
                           text))
    assert fills == {"0", "1"}, fills
    assert re.search(r"branch_ticks_\d+_\d+_\d+_of_\d+_ticks/cond", text)


@pytest.mark.slow  # make test: every pipeline test above runs its chunks unrolled (the default)
def test_a_chunk_of_few_layers_runs_them_unrolled():
    """A model chunk of at most ``PipelineConfig.unroll_layers`` layers runs them unrolled: no
    layer loop inside the schedule's (each layer's weights sliced from the stage's stack where
    they lie, not from a copy of the chunk); ``unroll_layers=0`` keeps the scan. The same loss
    and gradients either way (the unrolled ones are every other pipeline test's, exact against
    one device)."""
    loops, results = {}, {}
    for unroll in (8, 0):  # 4 Megatron pairs on 2 stages: 2 a chunk
        pipeline = PipelineConfig("1f1b", 2, unroll_layers=unroll, bubble_fill=NAN)
        program, mesh, step, _ = gradient_step("tensor", _ffn("tensor", 8), "stage=2",
                                               pipeline=pipeline)
        require_devices(program.mesh.device_count)
        x, t = _ffn_batch(mesh)
        state = step.init(random_params(program)).params
        compiled = jax.jit(step.value_and_grad()).lower(state, x, t).compile()
        loops[unroll] = compiled.as_text().count(" while(")
        results[unroll] = jax.device_get(compiled(state, x, t))
    assert loops[8] < loops[0], loops
    assert_tree_close(results[8], results[0], 1e-6)
