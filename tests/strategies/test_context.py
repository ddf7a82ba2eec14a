"""Context parallelism (jphantom.nn.attention): the sequence split over a ``context`` axis, ring
and all-gather attention, the load-balanced layout; exact against one device, composed with
data, model (tensor, sequence parallelism), stage and ZeRO; its collective-permutes counted from
the compiled HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_tree_close, compiled_hlo, oracle_loss_and_grads, random_params
from jphantom import plans
from jphantom.registry import program as program_module
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import first_devices
from jphantom.models.gpt2 import TransformerConfig
from jphantom.models.llama import LlamaConfig
from jphantom.nn import attention
from jphantom.pipeline.runner import PipelineConfig

SEQ, VOCAB, BATCH = 32, 64, 4
LLAMA = LlamaConfig(vocab_size=VOCAB, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                    max_positions=SEQ)
MIXTRAL = LlamaConfig(vocab_size=VOCAB, hidden=32, intermediate=32, layers=2, heads=4, kv_heads=2,
                      max_positions=SEQ, experts=4, top_k=2)
GPT2 = TransformerConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=2)


def _step(config, strategy, mesh, *, options=None, **step_options):
    program = program_module.build(config, strategy, mesh, **(options or {}))
    mesh_obj = program.mesh.build(first_devices(program.mesh.device_count))
    step = program.train_step(mesh_obj, optax.sgd(0.1), donate=False, **step_options)
    return program, step


def _batch(rows):
    rng = np.random.default_rng(3)
    return tuple(rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32) for _ in range(2))


CASES = [  # (model, strategy, mesh, program options, step options)
    ("llama", "tensor", "context=2", {}, {}),
    ("llama", "tensor", "context=4", {"load_balance": False}, {}),
    ("llama", "tensor", "context=8", {}, {}),
    ("gpt2", "tensor", "data=2,context=2,model=2", {}, {}),
    pytest.param("llama", "tensor", "data=2,context=2,model=2", {}, {}, marks=pytest.mark.slow),
    ("mixtral", "tensor", "expert=2,context=2,model=2", {}, {}),
    pytest.param("llama", "tensor", "context=2,model=2",
                 {"sequence_parallel": True, "load_balance": False}, {}, marks=pytest.mark.slow),
    ("llama", "tensor", "context=4,model=2", {"context_attention": "all-gather"}, {}),
    pytest.param("llama", "tensor", "data=2,context=4", {}, {"zero": 3}, marks=pytest.mark.slow),
    pytest.param("gpt2", "tensor", "data=2,context=4", {}, {}, marks=pytest.mark.slow),
    pytest.param("gpt2", "phantom", "context=2,model=4", {"ghost_width": 4}, {},
                 marks=pytest.mark.slow),
    pytest.param("llama", "tensor", "stage=2,data=2,context=2", {"context_attention": "all-gather"},
                 {"pipeline": "1f1b"},
                 marks=pytest.mark.slow),
    pytest.param("gpt2", "tensor", "context=8", {"context_attention": "all-gather",
                                                 "load_balance": False}, {},
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("model, strategy, mesh, options, step_options", CASES)
@pytest.mark.slow_cells(
    "llama-tensor-context=2-options0-step_options0",
    "llama-tensor-context=4,model=2-options7-step_options7",
    "llama-tensor-context=4-options1-step_options1",
    "llama-tensor-context=8-options2-step_options2",
    "mixtral-tensor-expert=2,context=2,model=2-options5-step_options5")
def test_context_parallel_step_equals_one_device(model, strategy, mesh, options, step_options):
    """Loss and every gradient of the step with the sequence split over ``context`` equal the
    plain model's on one device (float32 against float64, 1e-5)."""
    config = {"llama": LLAMA, "gpt2": GPT2, "mixtral": MIXTRAL}[model]
    if step_options.get("pipeline"):
        step_options = {**step_options, "pipeline": PipelineConfig(step_options["pipeline"], 2)}
    program, step = _step(config, strategy, mesh, options=options, **step_options)
    params = random_params(program)
    tokens, targets = _batch(BATCH)
    loss, grads = jax.jit(step.value_and_grad())(step.init(params).params,
                                                 *step.context_order((tokens, targets)))
    want_loss, want_grads = oracle_loss_and_grads(step, params, tokens, targets)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    if step.pipeline is not None:
        grads = step.to_model_order(grads)
    assert_tree_close(jax.device_get(grads), want_grads, 1e-5, floor=1e-2)


@pytest.mark.parametrize("mesh, balanced", [("context=4", True), ("data=2,context=2,model=2",
                                                                     False)])
@pytest.mark.slow_cells("context=4-True")
def test_ring_moves_c_minus_1_kv_chunks_each_way(mesh, balanced):
    """The compiled step's collective-permutes, all over ``context``, each one K or V chunk
    [B, S/C, Hk, d]: per layer C-1 K and C-1 V forward; backward C-1 of each again (passed
    around the ring, not stored) and C-1 of each of dK and dV; nothing else over ``context``
    but the gradient all-reduce."""
    _, step = _step(LLAMA, "tensor", mesh, options={"load_balance": balanced})
    axes = dict(step.mesh.shape)
    c, rows = axes["context"], BATCH // axes.get("data", 1)
    found = collectives(compiled_hlo(step, ((BATCH, SEQ), np.int32), ((BATCH, SEQ), np.int32)))
    permutes = [x for x in found if x.kind == "collective-permute"]
    assert {x.mesh_axes(axes) for x in permutes} == {("context",)}
    kv_heads = LLAMA.kv_heads // axes.get("model", 1)
    chunk = rows * (SEQ // c) * kv_heads * LLAMA.dim * 4
    assert {x.bytes for x in permutes} == {chunk}
    assert sum(x.count for x in permutes) == LLAMA.layers * (c - 1) * 2 * 3
    over_context = [x for x in found if "context" in x.mesh_axes(axes)
                    and x.kind != "collective-permute"]
    assert [x.kind for x in over_context] == ["all-reduce"]  # gradients and the loss, once


def test_all_gather_attention_gathers_kv_and_reduce_scatters_their_gradients():
    _, step = _step(LLAMA, "tensor", "context=4", options={"context_attention": "all-gather"})
    axes = dict(step.mesh.shape)
    found = collectives(compiled_hlo(step, ((BATCH, SEQ), np.int32), ((BATCH, SEQ), np.int32)))
    kinds = sorted((x.kind, x.count) for x in found if x.mesh_axes(axes) == ("context",)
                   and x.kind != "all-reduce")
    assert kinds == [("all-gather", LLAMA.layers)] * 2 + [("reduce-scatter", LLAMA.layers)] * 2
    gathered = [x for x in found if x.kind == "all-gather"]
    assert {x.bytes for x in gathered} == {BATCH * SEQ * LLAMA.kv_heads * LLAMA.dim * 4}
    scattered = [x for x in found if x.kind == "reduce-scatter"]  # dK, dV: this rank's chunk
    assert {x.bytes for x in scattered} == {BATCH * (SEQ // 4) * LLAMA.kv_heads * LLAMA.dim * 4}


@pytest.mark.parametrize("size", [2, 4, 8])
def test_balanced_layout_gives_every_rank_the_same_attention_work(size):
    local = 16
    balanced = attention.attention_work(size, True, local)
    assert max(balanced) - min(balanced) <= (local // 2) ** 2  # within one chunk's block
    contiguous = attention.attention_work(size, False, local)
    assert contiguous[-1] - contiguous[0] == (size - 1) * local * local  # rank C-1 does C times
    assert sum(balanced) == sum(contiguous)  # the same work in all, spread evenly


def test_context_order_round_trips_and_gives_each_rank_its_two_chunks():
    x = np.arange(2 * 16).reshape(2, 16)
    y = attention.to_context_order(x, 4)
    assert y[0, :4].tolist() == [0, 1, 14, 15]  # rank 0: chunks 0 and 7 of 8
    assert (attention.from_context_order(y, 4) == x).all()
    for rank in range(4):
        want = attention.layout_positions(rank, 4, 4, True)
        assert y[0, 4 * rank:4 * rank + 4].tolist() == np.asarray(want).tolist()


def test_context_plan_for_a_users_model():
    """plans.context swaps every attention core and positions module; a model without one is
    refused by name."""
    from flax import nnx

    from jphantom.models.llama import Llama

    model = nnx.eval_shape(lambda: Llama(LLAMA, rngs=nnx.Rngs(0)))
    plan = plans.context(model, algorithm="all-gather")
    assert set(plan) == {"layers.block.self_attn.attend", "layers.block.self_attn.positions"}
    plans.parallelize(model, {"context": 2}, plan)
    assert isinstance(model.layers.block.self_attn.attend, attention.GatheredAttention)
    with pytest.raises(ConfigError, match="no jphantom.nn.CausalAttention"):
        plans.context(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("config, strategy, mesh, options, message", [
    (GPT2, "gspmd", "context=2", {}, "shard_map strategies"),
    (GPT2, "tensor", "context=8,model=1", {"load_balance": True}, None),
    (TransformerConfig(vocab_size=VOCAB, seq_len=24, hidden=32, heads=4, layers=2), "tensor",
     "context=8", {}, "does not split into 16 chunks"),
    (TransformerConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=2, moe_every=2),
     "tensor", "context=2", {}, "routed MoE"),
    (GPT2, "tensor", "context=2", {"context_attention": "ulysses"}, "ring, all-gather"),
])
def test_context_refusals_before_building(config, strategy, mesh, options, message):
    if message is None:
        program_module.build(config, strategy, mesh, **options)
        return
    with pytest.raises(ConfigError, match=message):
        program_module.build(config, strategy, mesh, **options)


def test_planner_prices_the_context_axis_from_the_ring_formula():
    """``jphantom plan`` ranks data x context layouts (alone and with ZeRO-3); their bytes over
    ``context`` are the ring's: per layer and pass (forward, backward, recompute) 2 (C-1) K/V
    chunks, plus 2 (C-1) float32 dK/dV chunks."""
    from jphantom import planner
    from jphantom.perf.axonn_model import GPTShape

    shape = GPTShape(family="llama", vocab_size=1024, seq_len=4096, hidden=256, heads=8,
                     layers=4, intermediate=512, kv_heads=2)
    rows = [r for r in planner.plan(shape, 8, batch=8).rows if r.layout == "context"]
    assert {(r.mesh, r.options.get("zero", 0)) for r in rows} >= {
        ("data=2,context=4,model=1", 0), ("data=2,context=4,model=1", 3),
        ("data=1,context=8,model=1", 0)}
    row = next(r for r in rows if r.mesh == "data=2,context=4,model=1" and not r.options.get("zero"))
    c, per_rank = 4, 8 // 2
    chunk = per_rank * (4096 // c) * 2 * (256 // 8)
    want = 4 * (c - 1) * (2 * 3 * chunk * 2 + 2 * chunk * 4)  # bf16 K/V, float32 dK/dV
    assert row.bytes_by_axis["context"] == want


@pytest.mark.parametrize("window, keeps_scores", [(None, False), (4, True)])
@pytest.mark.slow_cells("4-True")
def test_all_gather_attention_keeps_no_probabilities_for_the_backward(window, keeps_scores):
    """All-gather context attention on the ring's blocks (``jphantom.nn.attention.gathered``)
    saves q, the gathered K and V, the output and the log-sum-exp for the backward, never a
    [S/C, S] score or probability block; a sliding window takes XLA's masked path, which does."""
    from jax.sharding import PartitionSpec as P

    c, b, s, h, d = 2, 1, 16, 4, 8
    mesh = jax.sharding.Mesh(np.array(first_devices(c)), ("context",))
    spec = P(None, "context")
    layer = attention.GatheredAttention(size=c, window=window)
    core = jax.shard_map(lambda q, k, v: layer(q, k, v), mesh=mesh, in_specs=(spec,) * 3,
                         out_specs=spec)
    q, k, v = (np.ones((b, s, h, d), np.float32) for _ in range(3))
    residuals = jax.eval_shape(lambda *qkv: jax.tree.leaves(jax.vjp(core, *qkv)[1]), q, k, v)
    shapes = [x.shape for x in residuals]  # what the backward keeps (traced, not run)
    scores = [x for x in shapes if x[-2:] == (s // c, s) or x[-1:] == (s,) and len(x) >= 4]
    assert bool(scores) == keeps_scores, shapes


# make test: ZeRO-2 over data x context in test_gradient_sink.py, ZeRO's collectives in test_zero.py
@pytest.mark.slow
def test_zero_shards_the_optimizer_over_data_and_context():
    """ZeRO over the ranks that hold the same weights: ``data`` and ``context`` (Megatron-LM's
    distributed optimizer shards over its data-parallel group with context parallelism). With
    ZeRO-2 on ``data=2,context=2``: each Adam moment is split over both axes (1/4 a rank), the
    compiled step reduce-scatters each split gradient over data x context once (P/4 out) and
    all-gathers the updated slices (P), with no gradient all-reduce left over ``context``; two
    Adam steps equal float64 Adam on one device (1e-5)."""
    from jax.sharding import NamedSharding

    program = program_module.build(LLAMA, "tensor", "data=2,context=2")
    mesh = program.mesh.build(first_devices(program.mesh.device_count))
    adam = optax.adam(1e-2, eps=1e-4)  # an eps above float32's rounding of tiny gradients
    step = program.train_step(mesh, adam, zero=2, donate=False)
    params = random_params(program)
    tokens, targets = _batch(BATCH)
    state = step.init(params)
    reference = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    moments = adam.init(reference)

    @jax.jit  # one compile for the reference's Adam, not one per operation and shape
    def reference_update(grads, moments, reference):
        updates, moments = adam.update(grads, moments, reference)
        return optax.apply_updates(reference, updates), moments

    for _ in range(2):
        state, loss = step(state, tokens, targets)
        want_loss, grads = oracle_loss_and_grads(step, reference, tokens, targets)
        reference, moments = reference_update(grads, moments, reference)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert_tree_close(jax.device_get(state.params), jax.device_get(reference), 1e-5, floor=1e-2)
    mu = jax.tree.leaves(state.opt_state[0].mu)
    split = [(leaf, spec) for leaf, spec in zip(mu, step.opt_param_specs)
             if "data" in str(spec)]
    assert split and all("context" in str(spec) for _, spec in split)
    for leaf, spec in split:
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)
    axes = dict(mesh.shape)
    found = collectives(compiled_hlo(step, ((BATCH, SEQ), np.int32), ((BATCH, SEQ), np.int32)))
    sizes = {i: int(np.prod(a.shape)) for i, a in enumerate(step.layout.shapes)}
    whole = sum(n for i, n in sizes.items() if step.layout.zero_dims[i] >= 0)
    moved = {}
    for x in found:
        key = (x.kind, x.mesh_axes(axes))
        moved[key] = moved.get(key, 0) + x.elements * x.count
    assert moved[("reduce-scatter", ("data", "context"))] == whole // 4
    assert moved[("all-gather", ("data", "context"))] == whole
    assert moved.get(("all-reduce", ("context",)), 0) == 0
