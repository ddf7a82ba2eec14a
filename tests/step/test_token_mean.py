"""Global token means: a loss_fn returning (total, weight[, mean]) trains on
sum(total) / sum(weight) over every rank and micro-batch, exactly the one-device loss with ragged
masks, under data + accumulation, tensor, context, pipelines (1F1B, zero-bubble) and GSPMD; the
weight costs no GEMM and one scalar all-reduce; a mean of per-rank means differs (the bug)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jphantom
from jphantom.registry import program as programs
from jphantom.step import token_mean
from jphantom.analysis.hlo import collectives, dot_flops
from jphantom.errors import ConfigError
from jphantom.step.exactness import verify_step
from jphantom.runtime.mesh import MeshConfig, first_devices
from jphantom.models import llama
from jphantom.models.gpt2 import TransformerConfig
from jphantom.pipeline.runner import PipelineConfig

from conftest import require_devices

V, S, B = 64, 8, 8


def _batch():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, (B, S)).astype(np.int32)
    targets = rng.integers(0, V, (B, S)).astype(np.int32)
    mask = np.zeros((B, S), bool)
    for row, length in enumerate([8, 1, 3, 8, 2, 5, 7, 4]):  # ragged: no two ranks count alike
        mask[row, :length] = True
    return jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(mask)


TOKENS, TARGETS, MASK = _batch()
IGNORED = jnp.where(MASK, TARGETS, -100)  # Hugging Face's ignore index: a pipeline's form


def _mesh(text):
    config = MeshConfig.parse(text)
    require_devices(config.device_count)
    return config.build(first_devices(config.device_count))


def _llama():
    return llama.Llama(llama.LlamaConfig(vocab_size=V, hidden=32, intermediate=48, layers=2,
                                         heads=4, kv_heads=2), rngs=nnx.Rngs(0))


def _verify(mesh_text, plan, loss_fn, *batch, **options):
    model, mesh = _llama(), _mesh(mesh_text)
    plan = plan(model) if plan is not None else None
    return jphantom.verify(model, mesh, plan, loss_fn, *batch, **options)


@pytest.mark.parametrize("mesh, plan, batch, options", [
    ("data=4", None, "mask", {"accumulate": 2}),
    ("data=2,model=2", lambda m: jphantom.plans.megatron(m, sequence_parallel=True), "mask", {}),
    ("data=2,context=2", jphantom.plans.context, "mask", {}),
    ("data=2,stage=2", None, "ignored", {"pipeline": PipelineConfig(microbatches=2)}),
    pytest.param("data=4", None, "mask", {"accumulate": 2, "spmd": "gspmd"},
                 marks=pytest.mark.slow),  # test budget: gspmd accumulation has its own tests
], ids=["data4-accumulate2", "tensor-sp", "context2", "1f1b", "gspmd-accumulate2"])
@pytest.mark.slow_cells("context2", "1f1b", "tensor-sp")
def test_ragged_masks_equal_the_one_device_token_mean(mesh, plan, batch, options):
    arrays = (TOKENS, TARGETS, MASK) if batch == "mask" else (TOKENS, IGNORED)
    loss_fn = llama.lm_loss if batch == "mask" else token_mean.lm_loss_terms
    report = _verify(mesh, plan, loss_fn, *arrays, **options)
    assert report.ok, str(report)
    counted = int(MASK.sum())
    assert counted < MASK.size  # the reference is the token mean, not the mean of row means
    assert abs(report.reference_loss - float(_one_device_mean())) < 1e-6


@functools.lru_cache(maxsize=None)
def _one_device_mean():
    model = _llama()
    return model.loss(TOKENS, TARGETS, MASK)


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_a_mean_of_rank_means_is_not_the_token_mean():
    """The bug the weighted loss fixes: a scalar loss_fn is averaged over ranks."""
    report = _verify("data=4", None, lambda m, x, t, k: m.loss(x, t, k), TOKENS, TARGETS, MASK)
    assert report.loss_error > 1e-4


def test_negative_targets_are_not_counted():
    model = _llama()
    masked = model.loss(TOKENS, TARGETS, MASK)
    ignored = model.loss(TOKENS, IGNORED)
    total, weight, _ = model.loss_terms(TOKENS, IGNORED)
    assert float(weight) == int(MASK.sum())
    np.testing.assert_allclose(float(ignored), float(masked), rtol=1e-6)
    np.testing.assert_allclose(float(total / weight), float(masked), rtol=1e-6)


@functools.lru_cache(maxsize=None)
def _gpt2_moe(mesh_text, loss, layers=4, **options):
    config = TransformerConfig(vocab_size=32, seq_len=S, hidden=16, heads=8, layers=layers,
                               moe_every=2, experts=4, top_k=2, capacity_factor=4.0)
    program = programs.build(config, "tensor", mesh_text)
    require_devices(program.mesh.device_count)
    mesh = program.mesh.build(first_devices(program.mesh.device_count))
    step = jphantom.make_train_step(program.model, mesh, optax.sgd(0.0), loss, donate=False,
                                    **options)
    return step, program.init(step).params


@pytest.mark.parametrize("mesh, options", [
    pytest.param("data=2,expert=2", {"accumulate": 2}, marks=pytest.mark.slow),
    pytest.param("stage=2,expert=2", {"pipeline": PipelineConfig(microbatches=2,
                                                                 schedule="zb-h1")},
                 marks=pytest.mark.slow)], ids=["expert-accumulate", "zb-h1"])
def test_gpt2_moe_token_mean_with_auxiliary_losses(mesh, options):
    """GPT-2's routed experts: (total, weight, mean) with the load-balancing and z-losses as the
    mean term; with accumulation their fractions are the whole batch's."""
    tokens, targets = TOKENS % 32, TARGETS % 32
    if "pipeline" in options:
        step, params = _gpt2_moe(mesh, token_mean.lm_loss_terms, **options)
        batch = (tokens, jnp.where(MASK, targets, -100))
    else:
        step, params = _gpt2_moe(mesh, programs.lm_loss, **options)
        batch = (tokens, targets, MASK)
    report = verify_step(step, params, *batch)
    assert report.ok, str(report)


def _own_loss(model, tokens, targets):  # a user's loss_fn: no parameter for the balance hook
    return model.loss(tokens, targets)


def test_moe_balance_reaches_a_users_loss_through_the_models_hook():
    """jphantom.nn.balance: a loss_fn that only calls the model's loss gets the whole batch's
    routing fractions in every accumulated micro-batch (the step gives them through the hook, no
    signature is read): the step equals the one-device model. Two blocks: one dense, one MoE."""
    step, params = _gpt2_moe("data=2", _own_loss, layers=2, accumulate=2)
    report = verify_step(step, params, TOKENS % 32, TARGETS % 32)
    assert report.ok, str(report)


@pytest.mark.slow  # make test: the weighted step's exactness and its returned weight (this file)
def test_the_weight_costs_no_gemm_and_one_scalar_all_reduce():
    """Accumulating a weighted loss: the pass over the micro-batches that sums the weight is
    reduced by XLA to the mask's sum: the compiled step runs the unweighted step's GEMMs and
    its collectives plus one all-reduce of a scalar."""
    mesh = _mesh("data=4")

    def compiled(loss_fn, *batch):
        step = jphantom.make_train_step(_llama(), mesh, optax.sgd(0.1), loss_fn,
                                        accumulate=2, donate=False)
        state = step.init()
        return step.lower(state, *batch).compile().as_text()

    plain = compiled(llama.lm_loss, TOKENS, TARGETS)
    weighted = compiled(llama.lm_loss, TOKENS, TARGETS, MASK)
    assert dot_flops(weighted) == dot_flops(plain)
    kinds = lambda text: sorted((c.kind, c.elements, c.count) for c in collectives(text))
    extra = list(kinds(weighted))
    for entry in kinds(plain):
        extra.remove(entry)
    assert [(kind, elements) for kind, elements, _ in extra] == [("all-reduce", 1)], extra


def test_refusals():
    mesh = _mesh("data=2,stage=2")

    def by_output(model, tokens, targets):  # a weight the last stage cannot know beforehand
        total = model.loss_terms(tokens, targets).total
        return total, jnp.sum(model(tokens)[..., 0] > 0, dtype=jnp.float32)

    step = jphantom.make_train_step(_llama(), mesh, optax.sgd(0.1), by_output,
                                    pipeline=PipelineConfig(microbatches=2), donate=False)
    with pytest.raises(ConfigError, match="weight depends on the model's output"):
        jax.jit(step.value_and_grad()).lower(step.init().params, TOKENS, TARGETS)
    one = _mesh("data=2")
    for bad, match in [(lambda m, x, t: (1.0, 2.0, 3.0, 4.0), "tuple of 4"),
                       (lambda m, x, t: (m(x).sum(-1), 1.0), "total has shape")]:
        step = jphantom.make_train_step(_llama(), one, optax.sgd(0.1), bad, donate=False)
        with pytest.raises(ConfigError, match=match):
            jax.jit(step.value_and_grad()).lower(step.init().params, TOKENS, TARGETS)


def test_a_weight_of_the_wrong_type_or_value_is_refused_at_the_first_call():
    """A constant weight (a Python or NumPy number, a concrete jax array) that is not positive
    and finite, or a weight that is not a real number, is one line naming the loss_fn, when the
    step is traced."""
    mesh = _mesh("data=2")
    for weight, match in [(0.0, "weight=0.0: .* positive and finite"), (0, "weight=0:"),
                          (float("nan"), "weight=nan"), (-5.0, "weight=-5.0"),
                          ("3", "weight='3' \\(str\\)"),
                          # constant arrays are known at trace as Python numbers are
                          (jnp.float32(0.0), "weight=0.0:"), (jnp.float32(-5.0), "weight=-5.0"),
                          (np.float32(0.0), "weight=0.0:"), (np.array(0), "weight=0:"),
                          (jnp.asarray(float("nan")), "weight=nan")]:
        def my_loss(model, tokens, targets):
            return model.loss_terms(tokens, targets).total, weight

        step = jphantom.make_train_step(_llama(), mesh, optax.sgd(0.1), my_loss, donate=False)
        with pytest.raises(ConfigError, match="loss_fn .*my_loss .*" + match):
            jax.jit(step.value_and_grad()).lower(step.init().params, TOKENS, TARGETS)


def test_a_batch_with_nothing_to_count_is_skipped_and_a_negative_weight_is_an_error():
    """The global weight (over data=2) checked as the step runs: 0 (every target -100) skips
    the update, reported and counted, the loss NaN; a negative one is not applied either and,
    once read (here by ``skipped``, which waits; otherwise when ready, never holding a step
    back), the next call raises it by name; a good batch then trains."""
    mesh = _mesh("data=2")

    def signed(model, tokens, targets, sign):  # per-token weights: -1 makes the sum negative
        terms = model.loss_terms(tokens, targets)
        return terms.total, jnp.sum(jnp.where(targets >= 0, sign, 0.0))

    step = jphantom.make_train_step(_llama(), mesh, optax.adam(1e-2), signed)
    state = step.init()
    first = np.asarray(jax.tree.leaves(state.params)[0])
    ones = jnp.ones(TARGETS.shape)
    unchanged = lambda s: np.array_equal(np.asarray(jax.tree.leaves(s.params)[0]), first)
    state, loss = step(state, TOKENS, jnp.full_like(TARGETS, -100), ones)
    assert np.isnan(float(loss)) and unchanged(state) and step.weight_report.skipped == 1
    state, loss = step(state, TOKENS, TARGETS, -ones)
    assert np.isnan(float(loss)) and unchanged(state)
    assert step.weight_report.skipped == 1  # waits for the weight: the next call raises it
    with pytest.raises(ConfigError, match="signed returned a global weight of -64.0"):
        step(state, TOKENS, TARGETS, ones)
    state, loss = step(state, TOKENS, TARGETS, ones)
    assert np.isfinite(float(loss)) and not unchanged(state)


def test_the_step_returns_its_global_weight_beside_the_loss():
    """step.run gives a StepOutput: a weighted loss_fn's global weight (the tokens counted over
    every rank) beside the loss, skipped when it is 0; a scalar loss_fn's weight is None. The
    weight is an output of the compiled step, read on the host: no host callback in it."""
    step = jphantom.make_train_step(_llama(), _mesh("data=2"), optax.sgd(0.1), llama.lm_loss,
                                    donate=False)
    state = step.init()
    _, out = step.run(state, TOKENS, TARGETS, MASK)
    assert float(out.weight) == int(MASK.sum()) and not out.skipped
    _, out = step.run(state, TOKENS, TARGETS, jnp.zeros_like(MASK))
    assert out.skipped and np.isnan(float(out.loss)) and step.weight_report.skipped == 1
    assert "callback" not in step.lower(state, TOKENS, TARGETS, MASK).compile().as_text()
    _, out = step.run(state, TOKENS, TARGETS)  # llama.lm_loss without a mask: the mean
    assert out.weight is None and not out.skipped and np.isfinite(float(out.loss))
