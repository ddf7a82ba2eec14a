"""The next-token loss in chunks of tokens (jphantom.nn.vocab.chunked_sum): equal to the
unchunked loss, value and every gradient, on one device and under the vocabulary-parallel
heads; and the compiled step never holds the [tokens, V] float32 logits."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import assert_tree_close, compiled_hlo, oracle_loss_and_grads, random_params
from jphantom.registry import program as program_module
from jphantom.runtime.mesh import first_devices
from jphantom.models.gpt2 import TransformerConfig
from jphantom.models.llama import LlamaConfig
from jphantom.nn import loss
from jphantom.nn import vocab

SEQ, VOCAB = 16, 64
LLAMA = LlamaConfig(vocab_size=VOCAB, hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2,
                    max_positions=SEQ)
GPT2 = TransformerConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=1)


@pytest.fixture
def chunk_limit(monkeypatch):
    """``chunk_limit(n)``: chunks of at most n logits while the fixture lives."""
    return lambda n: monkeypatch.setattr(vocab, "LOGITS_CHUNK_ELEMENTS", n)


def test_token_chunks_divide_the_tokens_and_fit_the_limit():
    assert vocab.token_chunks(24, 50, 2**26) == 1
    assert vocab.token_chunks(24, 50, 300) == 4  # 6 tokens x 50 = 300
    assert vocab.token_chunks(24, 50, 250) == 6  # 5 would not divide 24
    assert vocab.token_chunks(24, 50, 10) == 24  # one token a chunk at the least
    assert vocab.token_chunks(64 * 1024, 16032, 2**26) == 16  # the V/8 = 16k head


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("limit", [300, 50])
@pytest.mark.slow_cells("300-True", "50-False", "300-False")
def test_chunked_loss_equals_the_whole_loss_on_one_device(chunk_limit, tied, limit):
    head = (nnx.Embed(50, 16, rngs=nnx.Rngs(3)) if tied
            else nnx.Linear(16, 50, rngs=nnx.Rngs(0)))
    h = jax.random.normal(jax.random.PRNGKey(1), (2, 12, 16))
    t = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, 50)

    def whole(m, h):
        logits = m.attend(h) if tied else m(h)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).mean()

    want, want_grads = nnx.jit(nnx.value_and_grad(whole, argnums=(0, 1)))(head, h)
    chunk_limit(limit)
    got, grads = jax.jit(nnx.value_and_grad(
        lambda m, h: loss.cross_entropy(m, h, t, tied=tied), argnums=(0, 1)))(head, h)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert_tree_close(jax.tree.leaves(grads), jax.tree.leaves(want_grads), 1e-6)


@pytest.mark.parametrize("config, strategy, mesh, sp", [
    (LLAMA, "tensor", "data=2,model=2", False),  # VocabParallelHead
    (GPT2, "tensor", "data=2,model=2", True),  # tied VocabParallelEmbed, sequence parallel
    (LLAMA, "tensor", "data=2,context=2", False),  # the plain head on context chunks
], ids=["llama-vocab-parallel", "gpt2-tied-sp", "llama-data-context"])
@pytest.mark.slow_cells("llama-data-context")
def test_chunked_loss_under_strategies_equals_one_device(chunk_limit, config, strategy, mesh, sp):
    program = program_module.build(config, strategy, mesh,
                                   **({"sequence_parallel": True} if sp else {}))
    mesh_obj = program.mesh.build(first_devices(program.mesh.device_count))
    step = program.train_step(mesh_obj, optax.sgd(0.1), donate=False)
    params = random_params(program)
    rng = np.random.default_rng(0)
    batch = tuple(rng.integers(0, VOCAB, (8, SEQ)).astype(np.int32) for _ in range(2))
    want, want_grads = oracle_loss_and_grads(step, params, *batch)  # unchunked, float64
    chunk_limit(4 * VOCAB)  # a few tokens a chunk: 16 and more chunks per rank
    got, grads = jax.jit(step.value_and_grad())(params, *step.context_order(batch))
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert_tree_close(jax.device_get(grads), jax.device_get(want_grads), 1e-5)


def test_the_compiled_step_holds_no_whole_float32_logits(chunk_limit):
    """One device, 8 x 16 tokens: with chunks of 16 tokens no f32 [.., V] array has more rows
    than a chunk's tokens or the head's [h, V] weight (h = 32); unchunked, the [128, V] logits
    are in the optimised HLO."""
    vocab_size = 96  # no other dimension of the model is 96

    def logits_rows(text):
        rows = [int(np.prod([int(d) for d in dims.split(",")][:-1]))
                for dims in re.findall(rf"f32\[([0-9,]*,{vocab_size})\]", text)]
        return max(rows, default=0)

    def hlo():
        config = dataclasses.replace(LLAMA, vocab_size=vocab_size)
        program = program_module.build(config, "dense", "model=1")
        step = program.train_step(program.mesh.build(first_devices(1)), optax.sgd(0.1),
                                  donate=False)
        return compiled_hlo(step, ((8, SEQ), jnp.int32), ((8, SEQ), jnp.int32))

    assert logits_rows(hlo()) == 8 * SEQ
    chunk_limit(16 * vocab_size)
    assert logits_rows(hlo()) <= LLAMA.hidden
