"""GPT-2 as an NNX module (``jphantom.models.gpt2``): the logits of an independent numpy GPT-2,
the dense dictionary (``jphantom.models.gpt2``'s layout) and Hugging Face directories in and out
bit for bit (``from_dense`` / ``to_dense``, ``jphantom.models.hf``), and Megatron plans equal to
one device."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jphantom
from jphantom.models import gpt2, hf
from test_byo_model import rel_error
from test_gpt2 import (hf_config, numpy_gpt2, random_tensors, read, same_bits, tokens_for,
                             write_hf, zeros_like_init)


def random_dense(config, seed=0):
    """A dense dictionary of ``config``'s shapes filled with N(0, 0.1^2) (no initialiser run)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (0.1 * rng.standard_normal(a.shape)).astype(a.dtype),
                        zeros_like_init(config))


def test_hf_gpt2_loads_as_a_module_with_the_numpy_logits(tmp_path):
    t = random_tensors(seed=2)
    directory = write_hf(tmp_path / "m", t)
    model = hf.load(directory)
    assert isinstance(model, gpt2.GPT2)
    tokens = tokens_for()
    logits = np.asarray(model(tokens))
    np.testing.assert_allclose(logits, numpy_gpt2(t, tokens), atol=1e-4, rtol=0)
    assert float(model.loss(tokens[:, :-1], tokens[:, 1:])) == pytest.approx(float(
        optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]),
                                                        tokens[:, 1:]).mean()), rel=1e-6)


def test_hf_gpt2_round_trips_bit_for_bit(tmp_path):
    directory = write_hf(tmp_path / "m", random_tensors(seed=4))
    hf.save(tmp_path / "out", hf.load(directory))
    before, _ = read(directory)
    after, _ = read(tmp_path / "out")
    assert sorted(before) == sorted(after)
    assert all(same_bits(before[k], after[k]) for k in before)


def test_dense_dictionary_round_trips_bit_for_bit():
    config = gpt2.TransformerConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2,
                                  tied_head=False)
    params = random_dense(config)
    back = gpt2.to_dense(gpt2.from_dense(config, params))
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))


@pytest.mark.slow  # make test: test_transformer.py's SP cases of the same GPT-2 module
@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_gpt2_module_under_megatron_sp_equals_one_device():
    config = gpt2.TransformerConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)
    rng = np.random.default_rng(0)
    batch = (rng.integers(0, 64, (8, 16)).astype(np.int32),
             rng.integers(0, 64, (8, 16)).astype(np.int32))
    loss_fn = lambda model, tokens, targets: model.loss(tokens, targets)
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    reference = jphantom.make_train_step(gpt2.GPT2(config, rngs=nnx.Rngs(0)), one,
                                         optax.sgd(0.1), loss_fn)
    ref_loss, ref_grads = jax.jit(reference.value_and_grad())(reference.init().params, *batch)
    model = gpt2.GPT2(config, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    jphantom.parallelize(model, mesh, jphantom.plans.megatron(model, sequence_parallel=True))
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), loss_fn)
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *batch)
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * float(ref_loss)
    assert rel_error(jax.device_get(grads), jax.device_get(ref_grads)) < 1e-5


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_train_gpt2_module_from_and_to_a_hf_directory(tmp_path):
    """``jphantom train --model gpt2``: the NNX GPT-2 through the module step, started from a
    Hugging Face directory (--from-gpt2) and saved back (--save-gpt2)."""
    from jphantom.config import RunConfig
    from jphantom.loop.trainer import run

    directory = write_hf(tmp_path / "m", random_tensors(seed=5, vocab=256),
                         config=hf_config(vocab_size=256))  # the byte corpus's vocabulary
    results = run(RunConfig.from_flags(model="gpt2", strategy="tensor", mesh="data=2,model=2",
                            from_gpt2=str(directory),
                            save_gpt2=str(tmp_path / "out"), seq_len=16, batch=4, steps=2,
                            eval_every=2, eval_batches=1, out=str(tmp_path / "run"),
                            progress=False))
    assert results.model["name"] == "gpt2" and np.isfinite(results.final_validation_loss)
    assert isinstance(hf.load(tmp_path / "out"), gpt2.GPT2)


@pytest.mark.parametrize("tied", [True, False])
def test_dense_params_give_the_numpy_logits_and_loss_tied_and_untied(tied, tmp_path):
    """from_dense of a Hugging Face checkpoint's dense dictionary (an untied head added at
    random): the logits of the independent numpy GPT-2 to 1e-4 (float32 against float64), the loss
    optax's mean cross-entropy of those logits, and to_dense back bit for bit."""
    import dataclasses

    t = random_tensors(seed=3, vocab=64, positions=16)
    config, params = jphantom.models.gpt2.load(write_hf(
        tmp_path / "m", t, config=hf_config(vocab_size=64, n_positions=16)))
    head = None
    if not tied:
        config = dataclasses.replace(config, tied_head=False)
        rng = np.random.default_rng(4)
        head = (0.1 * rng.standard_normal((32, 64))).astype(np.float32), \
            (0.1 * rng.standard_normal(64)).astype(np.float32)
        params = {**params, "head": {"weight": head[0], "bias": head[1]}}
    model = gpt2.from_dense(config, params)
    assert hasattr(model, "head") != tied
    tokens = np.random.default_rng(0).integers(0, 64, (2, 16)).astype(np.int32)
    logits = np.asarray(model(tokens))
    assert logits.shape == (2, 16, 64)
    np.testing.assert_allclose(logits, numpy_gpt2(t, tokens, head=head), atol=1e-4, rtol=0)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    expected = optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()
    assert float(model.loss(inputs, targets)) == pytest.approx(float(expected), rel=1e-6)
    back = gpt2.to_dense(model)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))
