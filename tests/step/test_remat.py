"""Activation checkpointing per layer (the step's ``remat`` option, :mod:`jphantom.step.remat`, applied
to the model's :class:`jphantom.nn.Stacked` blocks): the same gradients under every policy, less
compiled temp memory by what the policy predicts, and ``collectives_saveable`` recomputes no
collective."""

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jphantom.registry import program as program_module
from jphantom.step import remat
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.models import gpt2
from jphantom.models.gpt2 import TransformerConfig
from jphantom.models.llama import LlamaConfig

from conftest import require_devices
from helpers import assert_tree_close, random_params

CONFIG = TransformerConfig(vocab_size=32, seq_len=16, hidden=32, heads=4, layers=4,
                           dtype="float32")
BATCH = 8


@functools.lru_cache(maxsize=None)
def _case(mesh_text):
    program = program_module.build(CONFIG, "tensor", mesh_text)
    require_devices(program.mesh.device_count)
    mesh = program.mesh.build(jax.devices()[:program.mesh.device_count])
    params = random_params(program)
    block = params["blocks"]["block"]
    for norm in (block["ln_1"], block["ln_2"], params["ln_f"]):
        norm["scale"] = 1.0 + norm["scale"]
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len)) for _ in range(2)]
    return program, mesh, params, batch


@functools.lru_cache(maxsize=None)
def _run(mesh_text, policy):
    _, mesh, params, batch = _case(mesh_text)
    program = program_module.build(CONFIG, "tensor", mesh_text)  # the step sets its blocks' remat
    step = program.train_step(mesh, optax.sgd(0.1), remat=policy, donate=False)
    compiled = jax.jit(step.value_and_grad()).lower(params, *batch).compile()
    loss, grads = compiled(params, *batch)
    temp = compiled.memory_analysis().temp_size_in_bytes
    return float(loss), jax.device_get(grads), temp, compiled.as_text()


@pytest.mark.parametrize("policy", [p for p in remat.NAMES if p != "none"])
# make test: Megatron's selective recompute on Llama under SP and ZeRO-3 (the peer policies'
# test below); every policy here: make test-all
@pytest.mark.slow_cells("nothing_saveable", "dots_saveable", "dots_collectives_saveable",
                        "collectives_saveable", "qkv_saveable", "dots_but_mlp_in_saveable",
                        "dots_attention_saveable", "all_but_attention_core_saveable")
def test_every_policy_gives_the_same_gradients(policy):
    loss, grads, _, _ = _run("model=2", policy)
    want_loss, want_grads, _, _ = _run("model=2", "none")
    assert loss == pytest.approx(want_loss, rel=1e-6)
    # the key bias's gradient is zero in exact arithmetic (softmax ignores a constant added to
    # every key's score): compared against 1e-2
    assert_tree_close(grads, want_grads, 1e-5, floor=1e-2)


def _block_residual_bytes(policy):
    """Per block, what the policy keeps for the backward: abstract vjp of one plain block."""
    block = nnx.eval_shape(lambda: gpt2.GPT2Block(CONFIG, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(block)
    h = jax.ShapeDtypeStruct((BATCH, CONFIG.seq_len, CONFIG.hidden), jnp.float32)
    return remat.residual_bytes(lambda s, x: nnx.merge(graphdef, s)(x), state, h, policy)


def test_nothing_saveable_lowers_temp_memory_by_what_it_predicts():
    """One device's model (model=1): the compiled temp bytes drop by about L x (the residuals a
    block keeps without checkpointing - those it keeps under the policy)."""
    _, _, temp_none, _ = _run("model=1", "none")
    _, _, temp_remat, _ = _run("model=1", "nothing_saveable")
    predicted = CONFIG.layers * (_block_residual_bytes("none")
                                 - _block_residual_bytes("nothing_saveable"))
    assert predicted > 0
    assert temp_none - temp_remat == pytest.approx(predicted, rel=0.25)


# make test: the same policy keeps the all-to-alls out of the recompute (test_expert.py's CAC)
@pytest.mark.slow
def test_collectives_saveable_recomputes_no_collective():
    """Megatron on model=2: nothing_saveable repeats, in each block's backward, the attention
    output's all-reduce (the MLP half needs its result again; the MLP-down all-reduce gives the
    block's output, which no backward needs); collectives_saveable (and
    dots_collectives_saveable) keeps the collectives' outputs and runs exactly the collectives of
    the step without checkpointing."""
    count = lambda text: Counter((c.kind, c.elements) for c in collectives(text)
                                 for _ in range(c.count))
    plain = count(_run("model=2", "none")[3])
    assert count(_run("model=2", "collectives_saveable")[3]) == plain
    assert count(_run("model=2", "dots_collectives_saveable")[3]) == plain
    block_output = BATCH * CONFIG.seq_len * CONFIG.hidden  # one all-reduce of B S h per block
    assert count(_run("model=2", "nothing_saveable")[3]) - plain == Counter(
        {("all-reduce", block_output): CONFIG.layers})


def test_unknown_policy_is_a_config_error():
    program, mesh, _, _ = _case("model=1")
    with pytest.raises(ConfigError, match="remat='everything'"):
        program.train_step(mesh, optax.sgd(0.1), remat="everything")


def test_the_step_option_is_the_blocks_policy_even_none():
    """``remat`` is the step's: a model whose blocks carried another policy gets the step's,
    ``"none"`` included (set on the step's own copy of the model: the model given keeps its
    own)."""
    import optax
    from flax import nnx

    from jphantom.registry import program as programs
    from jphantom.runtime.mesh import first_devices
    from jphantom.models.gpt2 import TransformerConfig
    from jphantom.nn import Stacked, set_remat

    program = programs.build(TransformerConfig(vocab_size=32, seq_len=8, hidden=16, heads=2,
                                               layers=2), "tensor", "model=2")
    mesh = program.mesh.build(first_devices(2))
    set_remat(program.model, "nothing_saveable")
    step = program.train_step(mesh, optax.sgd(0.1), remat="none")
    policies = lambda model: {m.remat for _, m in nnx.iter_modules(model)
                              if isinstance(m, Stacked)}
    assert policies(step.model_template) == {"none"}
    assert policies(program.model) == {"nothing_saveable"}


def _block_residuals(policy, config=CONFIG):
    """What one plain GPT-2 block keeps for its backward under ``policy`` (its cores' recompute
    set as the step sets it): ``(shape, dtype)`` of each residual."""
    from jphantom.nn import set_remat

    block = nnx.eval_shape(lambda: gpt2.GPT2Block(config, rngs=nnx.Rngs(0)))
    set_remat(block, policy)
    graphdef, state = nnx.split(block)
    h = jax.ShapeDtypeStruct((BATCH, config.seq_len, config.hidden), jnp.float32)
    return Counter((a.shape, str(a.dtype)) for a in remat.residuals(
        lambda s, x: nnx.merge(graphdef, s)(x), state, h, policy))


HEAD = (BATCH, CONFIG.seq_len, CONFIG.heads, CONFIG.hidden // CONFIG.heads)  # [B, S, H, d]


def _is_scores(shape):
    """An S x S array (the attention core's scores or probabilities)."""
    return list(shape[-2:]) == [CONFIG.seq_len] * 2


def test_qkv_saveable_keeps_exactly_q_k_and_v():
    """MaxText's save_qkv_proj: the three [B, S, H, d] inputs of the attention core, nothing
    else (the MLP, the norms and the core are recomputed)."""
    assert _block_residuals("qkv_saveable") == Counter({(HEAD, "float32"): 3})


def test_dots_but_mlp_in_saveable_keeps_q_k_v_and_the_attention_projection():
    """MaxText's save_dot_except_mlpwi: q, k and v and the attention's output projection
    [B, S, h], which the recomputed norm before the MLP reads. The MLP's output, named too, ends
    the block, so its backward needs nothing of it; its input projections are recomputed."""
    hidden = (BATCH, CONFIG.seq_len, CONFIG.hidden)
    assert _block_residuals(remat.BUT_MLP_IN) == Counter({(HEAD, "float32"): 3,
                                                          (hidden, "float32"): 1})


def test_dots_attention_saveable_keeps_the_matmuls_and_the_attention_output():
    """MaxText's minimal_flash: dots_saveable's matmul outputs and the core's output [B, S, H, d];
    no S x S array (the core's batched matmuls are not among the dots kept)."""
    dots = _block_residuals("dots_saveable")
    assert _block_residuals("dots_attention_saveable") - dots == Counter({(HEAD, "float32"): 1})
    assert not any(_is_scores(shape) for shape, _ in dots)


def test_selective_recompute_keeps_everything_but_the_attention_core():
    """Megatron's selective recompute on XLA's path: ``none`` keeps the S x S scores and
    probabilities (and the causal mask); ``all_but_attention_core_saveable`` keeps none of them,
    and everything ``none`` keeps outside the core (every [B, S, *] array), plus q, k and v, the
    core's inputs, from which its backward recomputes it."""
    kept, everything = _block_residuals(remat.SELECTIVE), _block_residuals("none")
    assert any(_is_scores(shape) for shape, _ in everything)
    assert not any(_is_scores(shape) for shape, _ in kept)
    outside = lambda c: Counter({k: n for k, n in c.items()
                                 if k[0][:2] == (BATCH, CONFIG.seq_len) and len(k[0]) == 3})
    assert outside(kept) == outside(everything)
    assert kept[(HEAD, "float32")] >= 3
    bytes_of = lambda c: sum(np.prod(s) * np.dtype(d).itemsize * n for (s, d), n in c.items())
    assert bytes_of(kept) < bytes_of(everything)


def test_selective_recompute_holds_inside_a_layer_that_keeps_everything_else():
    """Under sequence parallelism the layer's own checkpoint keeps every residual but the
    sequence's gathers (``remat.regathering``): the cores still keep no S x S array (a nested
    ``jax.checkpoint`` in them was overridden by it, keeping the probabilities)."""
    from jphantom.nn import set_remat

    block = nnx.eval_shape(lambda: gpt2.GPT2Block(CONFIG, rngs=nnx.Rngs(0)))
    set_remat(block, remat.SELECTIVE)
    graphdef, state = nnx.split(block)
    layer = remat.checkpointed(lambda s, x: nnx.merge(graphdef, s)(x), remat.SELECTIVE,
                               regather="model")
    h = jax.ShapeDtypeStruct((BATCH, CONFIG.seq_len, CONFIG.hidden), jnp.float32)
    kept = remat.residuals(layer, state, h, "none")
    assert not any(_is_scores(a.shape) for a in kept)
    assert any(_is_scores(shape) for shape, _ in _block_residuals("none"))


def test_selective_recompute_is_set_on_the_cores_by_the_step_only():
    """The step's ``remat`` sets its copy's attention cores' ``recompute``; ``none`` clears it."""
    from jphantom.nn import CausalAttention, set_remat

    program = program_module.build(CONFIG, "tensor", "model=1")
    require_devices(1)
    mesh = program.mesh.build(jax.devices()[:1])
    cores = lambda model: {m.recompute for _, m in nnx.iter_modules(model)
                           if isinstance(m, CausalAttention)}
    step = program.train_step(mesh, optax.sgd(0.1), remat=remat.SELECTIVE)
    assert cores(step.model_template) == {True}
    assert cores(program.model) == {False}
    set_remat(program.model, remat.SELECTIVE)
    assert cores(program.train_step(mesh, optax.sgd(0.1), remat="none").model_template) == {False}


LLAMA = LlamaConfig(vocab_size=32, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                    max_positions=16, dtype="float32")


LAYOUTS = {  # (mesh, build options, step options)
    "sp-zero3": ("data=2,model=2", {"sequence_parallel": True}, {"zero": 3}),
    "all-gather-context": ("context=2,model=2", {"context_attention": "all-gather"}, {}),
}


@functools.lru_cache(maxsize=None)
def _llama_run(policy, layout):
    """Llama (GQA) under ``layout``: TP + SP on data=2,model=2 with ZeRO-3 (each layer's
    parameters fetched, :func:`jphantom.step.remat.checkpointed` with ``fetched``), or context
    parallelism with K and V all-gathered (``GatheredAttention``, whose core recomputes itself
    under selective recompute): loss and gradients under ``policy``."""
    mesh_text, options, step_options = LAYOUTS[layout]
    program = program_module.build(LLAMA, "tensor", mesh_text, **options)
    require_devices(4)
    mesh = program.mesh.build(jax.devices()[:4])
    step = program.train_step(mesh, optax.sgd(0.1), remat=policy, donate=False, **step_options)
    params = random_params(program)
    rng = np.random.default_rng(1)
    batch = [rng.integers(0, LLAMA.vocab_size, (8, 16)).astype(np.int32) for _ in range(2)]
    loss, grads = jax.jit(step.value_and_grad())(params, *batch)
    return float(loss), jax.device_get(grads)


@pytest.mark.parametrize("policy, layout", [
    ("dots_attention_saveable", "sp-zero3"), ("qkv_saveable", "sp-zero3"),
    (remat.BUT_MLP_IN, "sp-zero3"),
    (remat.SELECTIVE, "sp-zero3"), (remat.SELECTIVE, "all-gather-context")])
@pytest.mark.slow_cells(  # make test: Megatron's selective recompute under SP + ZeRO-3
    "dots_attention_saveable-sp-zero3", "qkv_saveable-sp-zero3",
    "dots_but_mlp_in_saveable-sp-zero3",
    "all_but_attention_core_saveable-all-gather-context")
def test_peer_policies_are_exact_on_llama(policy, layout):
    loss, grads = _llama_run(policy, layout)
    want_loss, want_grads = _llama_run("none", layout)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert_tree_close(grads, want_grads, 1e-5)
