"""Packed batches on one device: a packed row's logits equal each document run alone (Llama,
Qwen3, Gemma 3 with a sliding window shorter than a document, GPT-2), the fused Pallas kernel
with segment ids equals XLA's masked path, the kernel choice names what it picks for packed
batches, and what cannot carry segment ids is refused by name."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jphantom.errors import ConfigError
from jphantom.models import gpt2, hf, llama, packed_lm_loss
from jphantom.nn.attention import choose, kernels_of
from jphantom.nn.attention.core import causal_attention

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
LENGTHS = (6, 9, 5)  # three documents, then 4 pads: S = 24
S = 24


def packed_row(vocab, seed=0):
    """tokens, segment ids, positions [1, S] of LENGTHS laid end to end, padded with 0s."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros(S, np.int32)
    tokens[:sum(LENGTHS)] = rng.integers(1, vocab, sum(LENGTHS))
    segments, positions = np.zeros(S, np.int32), np.zeros(S, np.int32)
    start = 0
    for i, n in enumerate(LENGTHS):
        segments[start:start + n], positions[start:start + n] = i + 1, np.arange(n)
        start += n
    return tokens[None], segments[None], positions[None]


def _models():
    return {
        "llama": lambda: llama.Llama(llama.LlamaConfig(
            vocab_size=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
            max_positions=S), rngs=nnx.Rngs(0)),
        "qwen3": lambda: hf.load(FIXTURES / "qwen3"),
        "gemma3": lambda: hf.load(FIXTURES / "gemma3_text"),  # local layer: window 4 < 5
        "gpt2": lambda: gpt2.GPT2(gpt2.TransformerConfig(
            vocab_size=64, seq_len=S, hidden=32, heads=4, layers=2), rngs=nnx.Rngs(0)),
    }


@nnx.jit
def _logits(model, *batch):
    return model(*batch)


@pytest.mark.parametrize("name", [pytest.param("llama", marks=pytest.mark.slow), "qwen3", "gemma3",
                                  "gpt2"])  # make test: Qwen3's rotary positions, as Llama's
def test_a_packed_rows_logits_equal_each_document_alone(name):
    """Each document alone is a row of its own tokens followed by pads: a causal model's logits
    of its tokens are those of the document alone (nothing attends a later token). The packed
    row's own tokens without segment ids, the last row, attend across documents: the check can
    fail."""
    model = _models()[name]()
    if name == "gemma3":
        assert model.config.sliding_window < min(LENGTHS)  # the window must stop at boundaries
    tokens, segments, positions = packed_row(model.config.vocab_size)
    packed = np.asarray(_logits(model, tokens, segments, positions))[0]
    rows = np.zeros((len(LENGTHS) + 1, S), np.int32)
    starts = np.cumsum((0,) + LENGTHS)
    for i, n in enumerate(LENGTHS):
        rows[i, :n] = tokens[0, starts[i]:starts[i] + n]
    rows[-1] = tokens[0]
    alone = np.asarray(_logits(model, rows))
    for i, n in enumerate(LENGTHS):
        np.testing.assert_allclose(packed[starts[i]:starts[i] + n], alone[i, :n], rtol=1e-5,
                                   atol=1e-5)
    across = slice(starts[1], starts[2])
    assert not np.allclose(alone[-1, across], packed[across], atol=1e-3)


def test_packed_lm_loss_counts_only_the_targets_given():
    model = _models()["llama"]()  # the logits test's shapes: _logits compiled already
    tokens, segments, positions = packed_row(64)
    targets = np.full_like(tokens, -100)
    targets[0, :5] = tokens[0, 1:6]  # document 1's next tokens; its last has none
    total, weight, _ = nnx.jit(packed_lm_loss)(model, tokens, targets, segments, positions)
    assert float(weight) == 5
    logits = _logits(model, tokens[:, :6])[0, :5]
    expected = -jnp.sum(jax.nn.log_softmax(logits)[jnp.arange(5), tokens[0, 1:6]])
    assert abs(float(total) - float(expected)) < 1e-4


def test_flash_kernel_with_segment_ids_equals_the_masked_xla_path():
    """jax's Pallas Triton kernel (through Pallas' interpreter on CPU): the packed core's fused
    path, forward and gradients."""
    from jphantom.nn import flash

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 16, 2, 8)), jnp.float32)  # two query heads a group
    k, v = (jnp.asarray(rng.normal(size=(2, 16, 1, 8)), jnp.float32) for _ in range(2))
    segments = jnp.asarray([[1] * 5 + [2] * 7 + [3] * 2 + [0] * 2, [1] * 16], jnp.int32)
    fused = jax.jit(lambda q, k, v: flash.packed_attention(q, k, v, segments, interpret=True))
    masked = jax.jit(lambda q, k, v: causal_attention(q, k, v, segment_ids=segments))
    np.testing.assert_allclose(fused(q, k, v), masked(q, k, v), atol=1e-5)
    square = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    for a, b in zip(jax.jit(jax.grad(square(fused), (0, 1, 2)))(q, k, v),
                    jax.jit(jax.grad(square(masked), (0, 1, 2)))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # ignoring the segments would differ
    assert not np.allclose(masked(q, k, v), causal_attention(q, k, v), atol=1e-3)


def test_the_kernel_choice_names_what_it_picks_for_packed_batches():
    bf16 = jnp.bfloat16
    assert choose("auto", "nvidia", bf16, 128)[0] == "cudnn"
    kernel, why = choose("auto", "nvidia", bf16, 128, packed=True)
    assert kernel == "pallas" and "segment ids" in why
    kernel, why = choose("auto", "nvidia", bf16, 128, packed=True, window=64)
    assert kernel == "xla" and "window" in why
    assert choose("auto", "cpu", jnp.float32, 64, packed=True)[0] == "xla"
    with pytest.raises(ConfigError, match="sliding window"):
        choose("cudnn", "nvidia", bf16, 128, packed=True, window=64)
    model = _models()["llama"]()
    assert kernels_of(model, "auto", "nvidia", bf16, 8, packed=True)["CausalAttention"] \
        .startswith("pallas (")
    gemma = nnx.eval_shape(lambda: hf.load(FIXTURES / "gemma3_text"))  # local and global cores
    assert len(kernels_of(gemma, "auto", "nvidia", bf16, 8)) == 1  # both cuDNN unpacked
    kernels = kernels_of(gemma, "auto", "nvidia", bf16, 8, packed=True)
    assert kernels["CausalAttention"].startswith("pallas (")
    assert kernels["CausalAttention (window 4)"].startswith("xla (")


def test_what_cannot_carry_segment_ids_is_refused_by_name():
    tokens, segments, positions = packed_row(64)
    model = _models()["llama"]()
    with pytest.raises(ConfigError, match="both segment_ids and positions"):
        model(tokens, segments)

    class PlainCore(nnx.Module):  # a user's core that takes no segment ids
        def __call__(self, q, k, v):
            return causal_attention(q, k, v)

    model.layers.block.self_attn.attend = PlainCore()
    with pytest.raises(ConfigError, match="PlainCore cannot attend a packed batch"):
        _logits(model, tokens, segments, positions)  # refused as it traces
    moe = nnx.eval_shape(lambda: gpt2.GPT2(gpt2.TransformerConfig(
        vocab_size=64, seq_len=S, hidden=32, heads=4, layers=2, moe_every=2, experts=2,
        top_k=1), rngs=nnx.Rngs(0)))
    with pytest.raises(ConfigError, match="routed MoE blocks with a packed batch"):
        packed_lm_loss(moe, tokens, tokens, segments, positions)


@pytest.mark.slow  # two compiled steps and a few timed ones: ~20 s
def test_packed_vs_padded_benchmark_runs_at_tiny_shapes(tmp_path):
    """benchmarks/packed_vs_padded.py's CPU smoke check: both modes train the same documents and
    count only real tokens; packing leaves fewer pads."""
    import importlib.util
    import json

    script = Path(__file__).parents[2] / "benchmarks" / "packed_vs_padded.py"
    spec = importlib.util.spec_from_file_location("packed_vs_padded", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = bench.main(["--quick", "--devices", "2", "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text())["packed"]["mode"] == "packed"
    assert report["packed"]["pad_fraction"] < report["padded"]["pad_fraction"]
    for mode in ("packed", "padded"):
        assert report[mode]["real_tokens_per_second"] > 0
        assert np.isfinite(report[mode]["final_loss"])
