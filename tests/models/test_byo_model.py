"""Bring your own model: a small transformer written here with plain Flax NNX layers (the library
never imports it), made parallel by ``jphantom.parallelize`` and trained by
``jphantom.make_train_step``: loss and every gradient equal its single-device run; the compiled
step holds exactly the collectives Megatron's formulas give; bad plans are refused by name."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jphantom
from jphantom.analysis import hlo
from jphantom.errors import ConfigError

V, S, H, HEADS, L, BATCH = 64, 16, 32, 4, 2, 8


class Attention(nnx.Module):
    def __init__(self, rngs):
        self.q = nnx.Linear(H, H, rngs=rngs)
        self.k = nnx.Linear(H, H, rngs=rngs)
        self.v = nnx.Linear(H, H, rngs=rngs)
        self.out = nnx.Linear(H, H, rngs=rngs)

    def __call__(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, s, _ = q.shape  # the projections' shape: whole sequence, this rank's heads
        q, k, v = (a.reshape(b, s, -1, H // HEADS) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (H // HEADS) ** 0.5
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e30)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return self.out(out.reshape(b, s, -1))


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(H, rngs=rngs)
        self.attn = Attention(rngs)
        self.ln2 = nnx.LayerNorm(H, rngs=rngs)
        self.up = nnx.Linear(H, 4 * H, rngs=rngs)
        self.down = nnx.Linear(4 * H, H, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class TinyLM(nnx.Module):
    def __init__(self, stacked: bool = False, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.tok = nnx.Embed(V, H, rngs=rngs)
        self.pos = nnx.Embed(S, H, rngs=rngs)
        if stacked:
            self.blocks = jphantom.nn.Stacked(lambda r: Block(r), L, rngs=rngs)
        else:
            self.blocks = nnx.List([Block(rngs) for _ in range(L)])
        self.ln_f = nnx.LayerNorm(H, rngs=rngs)
        self.head = nnx.Linear(H, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))
        if isinstance(self.blocks, jphantom.nn.Stacked):
            x = self.blocks(x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model, tokens, targets):  # as written for one device
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()


def _batch():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.integers(0, V, (BATCH, S)), jnp.int32),
            jnp.asarray(rng.integers(0, V, (BATCH, S)), jnp.int32))


def _mesh(shape: str):
    sizes = dict(item.split("=") for item in shape.split(","))
    count = int(np.prod([int(v) for v in sizes.values()]))
    if jax.device_count() < count:
        pytest.skip(f"needs {count} devices")
    return jax.make_mesh(tuple(int(v) for v in sizes.values()), tuple(sizes),
                         devices=jax.devices()[:count])


def rel_error(tree, reference) -> float:
    diff = sum(float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
               for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference)))
    norm = sum(float(np.sum(np.asarray(b, np.float64) ** 2)) for b in jax.tree.leaves(reference))
    return float(np.sqrt(diff / norm))


@functools.lru_cache(maxsize=None)
def one_device(stacked: bool = False):
    model = TinyLM(stacked)
    step = jphantom.make_train_step(model, _mesh("data=1"), optax.sgd(0.1), loss_fn)
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *_batch())
    return float(loss), jax.device_get(grads)


def _parallel(plan_of, mesh="data=2,model=4", stacked=False, **options):
    model = TinyLM(stacked)
    mesh = _mesh(mesh)
    jphantom.parallelize(model, mesh, plan_of(model))
    return jphantom.make_train_step(model, mesh, optax.sgd(0.1), loss_fn, **options), model


CASES = {
    "tensor": (lambda m: jphantom.plans.megatron(m), {}),
    "tensor-sp": (lambda m: jphantom.plans.megatron(m, sequence_parallel=True), {}),
    "tensor-zero3": (lambda m: jphantom.plans.megatron(m), {"zero": 3}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow_cells("tensor", "tensor-zero3")
def test_user_model_equals_one_device(case):
    plan_of, options = CASES[case]
    step, _ = _parallel(plan_of, **options)
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *_batch())
    ref_loss, ref_grads = one_device()
    assert abs(float(loss) - ref_loss) < 1e-5 * abs(ref_loss)
    if options.get("zero") == 3:  # gradients come as data shards: the step's own shardings
        grads = jax.device_get(grads)
    assert rel_error(grads, ref_grads) < 1e-5


@pytest.mark.slow  # make test: test_user_model_equals_one_device[tensor-sp]
def test_stacked_user_model_under_sequence_parallelism_equals_one_device():
    step, _ = _parallel(lambda m: jphantom.plans.megatron(m, sequence_parallel=True),
                        stacked=True, remat="nothing_saveable")
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *_batch())
    ref_loss, ref_grads = one_device(stacked=True)
    assert abs(float(loss) - ref_loss) < 1e-5 * abs(ref_loss)
    assert rel_error(grads, ref_grads) < 1e-5


def test_forward_fn_gives_the_models_logits():
    model = TinyLM()
    tokens, _ = _batch()
    expected = np.asarray(model(tokens))
    mesh = _mesh("data=2,model=4")
    jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))
    logits = jphantom.make_forward_fn(model, mesh)(tokens)
    np.testing.assert_allclose(np.asarray(logits), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("zero", [pytest.param(0, marks=pytest.mark.slow), 1])
@pytest.mark.slow_cells("1")
def test_non_elementwise_optax_updates_equal_one_device(zero):
    """Global-norm clipping and LAMB (per-parameter trust ratios: norms over whole tensors) run on
    the global gradient arrays, so one step equals one device's."""
    optimizer = optax.chain(optax.clip_by_global_norm(0.05), optax.lamb(1e-2))
    reference = TinyLM()
    one = jphantom.make_train_step(reference, _mesh("data=1"), optimizer, loss_fn)
    expected, ref_loss = one(one.init(), *_batch())
    model = TinyLM()
    mesh = _mesh("data=2,model=4")
    jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))
    step = jphantom.make_train_step(model, mesh, optimizer, loss_fn, zero=zero)
    state, loss = step(step.init(), *_batch())
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    before = jax.device_get(one.init().params)
    moved = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b),
                         jax.device_get(state.params), before)
    moved_ref = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b),
                             jax.device_get(expected.params), before)
    assert rel_error(moved, moved_ref) < 1e-4  # the update itself, not the weights, compared


def test_megatron_step_compiles_to_exactly_the_formulas_collectives():
    """Per step on data=2,model=4 (B = 4 sequences per data rank): all-reduces over ``model`` of
    B S h, 1 (embedding) + 2 L forward (g after attention output and MLP down) + 2 L + 1 backward
    (f once per norm: ln1, ln2, ln_f; not once per q, k, v); one all-gather of the logits B S V
    (the user's optax loss needs them whole); over ``data``, the gradients' all-reduce (the
    parameters' local bytes) and the loss."""
    step, model = _parallel(lambda m: jphantom.plans.megatron(m))
    state = step.init()
    text = step.lower(state, *_batch()).compile().as_text()
    axes = {"data": 2, "model": 4}
    rows = {(r["kind"], r["axes"]): r for r in
            hlo.summarize([c for c in hlo.collectives(text) if not c.trivial], axes)}
    b = BATCH // 2
    assert rows[("all-reduce", ("model",))]["count"] == 4 * L + 2
    assert rows[("all-reduce", ("model",))]["bytes"] == (4 * L + 2) * b * S * H * 4
    assert rows[("all-gather", ("model",))]["count"] == 1
    assert rows[("all-gather", ("model",))]["bytes"] == b * S * V * 4
    local = sum(int(np.prod(s.shape)) // int(np.prod([4 if "model" in str(spec) else 1]))
                for s, spec in zip(step.layout.shapes, step.layout.specs))
    assert rows[("all-reduce", ("data",))]["bytes"] == local * 4 + 4  # gradients + the loss
    assert set(rows) == {("all-reduce", ("model",)), ("all-gather", ("model",)),
                         ("all-reduce", ("data",))}


# --- bad plans are refused by name, before anything compiles ----------------------------------


def test_a_pattern_that_matches_nothing_is_refused():
    model = TinyLM()
    with pytest.raises(ConfigError, match="blocks.*.attn.query.*matches no module"):
        jphantom.parallelize(model, {"model": 4}, {"blocks.*.attn.query": "column"})


def test_a_style_that_does_not_fit_is_refused_with_the_path():
    with pytest.raises(ConfigError, match=r"tok: style 'row' does not fit Embed"):
        jphantom.parallelize(TinyLM(), {"model": 4}, {"tok": "row"})


def test_a_dimension_the_axis_does_not_divide_is_refused_with_the_path():
    with pytest.raises(ConfigError, match=r"blocks.0.attn.q: out_features=32 is not divisible"):
        jphantom.parallelize(TinyLM(), {"model": 3}, {"blocks.0.attn.q": "column"})


def test_two_styles_for_one_module_are_refused_and_nothing_changes():
    model = TinyLM()
    with pytest.raises(ConfigError, match="two styles"):
        jphantom.parallelize(model, {"model": 4}, {"blocks.*.up": "column", "*.up": "row"})
    assert isinstance(model.blocks[0].up, nnx.Linear)


def test_plans_refuse_a_linear_they_cannot_place():
    class Odd(nnx.Module):
        def __init__(self):
            self.mystery = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    with pytest.raises(ConfigError, match="mystery"):
        jphantom.plans.megatron(Odd())


def test_phantom_style_needs_a_ghost_width_and_the_mesh_needs_the_axis():
    with pytest.raises(ConfigError, match="ghost width"):
        jphantom.parallelize(TinyLM(), {"model": 4}, {"blocks.0.up": "phantom"})
    with pytest.raises(ConfigError, match="has no 'model' axis"):
        jphantom.parallelize(TinyLM(), {"data": 8}, {"blocks.0.up": "column"})


def test_step_options_are_checked_before_compiling():
    model = TinyLM()
    mesh = _mesh("data=2,model=4")
    with pytest.raises(ConfigError, match="remat"):
        jphantom.make_train_step(model, mesh, optax.sgd(0.1), loss_fn, remat="nothing_saveable")
    with pytest.raises(ConfigError, match="zero"):
        jphantom.make_train_step(model, mesh, optax.sgd(0.1), loss_fn, zero=4)
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), loss_fn)
    tokens, targets = _batch()
    with pytest.raises(ConfigError, match=r"multiple of 2 \(mesh axes data"):
        step(step.init(), tokens[:3], targets[:3])


PIPELINES = {"1f1b-tensor": ("stage=2,data=2,model=2", "1f1b", False),
             "gpipe": ("stage=2,data=4", "gpipe", None),
             "1f1b-tensor-sp": ("stage=2,data=2,model=2", "1f1b", True)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[] if c == "1f1b-tensor"
                                               else [pytest.mark.slow]) for c in PIPELINES])
@pytest.mark.slow_cells("1f1b-tensor")
def test_stacked_user_model_pipelined_equals_one_device(case):
    """A ``stage`` axis cuts the model at its Stacked blocks: the part of the user's loss before
    them runs on the first stage, the blocks' layers split over ``stage``, the rest on the last."""
    from jphantom.pipeline.runner import PipelineConfig

    shape, schedule, sequence_parallel = PIPELINES[case]
    model = TinyLM(stacked=True)
    mesh = _mesh(shape)
    if sequence_parallel is not None:
        jphantom.parallelize(model, mesh, jphantom.plans.megatron(
            model, sequence_parallel=sequence_parallel))
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), loss_fn,
                                    pipeline=PipelineConfig(schedule, microbatches=2))
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *_batch())
    ref_loss, ref_grads = one_device(stacked=True)
    assert abs(float(loss) - ref_loss) < 1e-5 * abs(ref_loss)
    assert rel_error(jax.device_get(grads), ref_grads) < 1e-5


def test_a_pipeline_needs_one_stacked_module():
    with pytest.raises(ConfigError, match="exactly one jphantom.nn.Stacked"):
        jphantom.make_train_step(TinyLM(), _mesh("stage=2,data=4"), optax.sgd(0.1), loss_fn)


@pytest.mark.slow  # make test: test_user_models.py's GSPMD annotation of a user's einsum layers
def test_gspmd_baseline_of_the_same_plan_equals_one_device():
    """GSPMD, what a JAX user writes: the plain model with the plan's sharding annotations,
    ``jax.jit`` choosing the collectives; with ZeRO-3's data split as annotations too (FSDP)."""
    for zero in (0, 3):
        model = TinyLM()
        mesh = _mesh("data=2,model=4")
        jphantom.plans.annotate(model, mesh, jphantom.plans.megatron(model))
        assert isinstance(model.blocks[0].attn.q, nnx.Linear)  # still the plain layer
        step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), loss_fn, spmd="gspmd",
                                        zero=zero)
        state = step.init()
        assert state.params["blocks"][0]["attn"]["q"]["kernel"].sharding.spec[-1] == "model"
        loss, grads = jax.jit(step.value_and_grad())(state.params, *_batch())
        ref_loss, ref_grads = one_device()
        assert abs(float(loss) - ref_loss) < 1e-5 * abs(ref_loss)
        assert rel_error(jax.device_get(grads), ref_grads) < 1e-5
        state, loss = step(state, *_batch())
        assert np.isfinite(float(loss))


def test_gspmd_refuses_a_parallelised_model():
    model = TinyLM()
    mesh = _mesh("data=2,model=4")
    jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))
    with pytest.raises(ConfigError, match="annotate a plain model"):
        jphantom.make_train_step(model, mesh, optax.sgd(0.1), loss_fn, spmd="gspmd")
