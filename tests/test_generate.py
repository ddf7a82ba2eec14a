"""Generation (jphantom.generation): the configuration's validation, the sampling filters, the
cache against running the whole sequence (float32, 1e-5), stop tokens, prompt buckets sharing
one program, a user's model without jphantom's attention, and decode on a mesh (Megatron tensor
parallelism over ``model`` with rows over ``data``, phantom, pmm3d, experts) equal to one
device. Greedy tokens against transformers: tests/test_generate_hf.py."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jphantom
from jphantom.errors import ConfigError
from jphantom.generation import GenerationConfig, api, bucket_of, loop, sampling
from jphantom.models import hf, llama

FIXTURES = Path(__file__).parent / "fixtures"
PROMPTS = [[5, 17, 59, 3, 8], [60, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [42, 43, 44, 45, 46, 47, 48]]


def _family(name):
    made = FIXTURES / "generate" / name
    return hf.load(made if made.is_dir() else FIXTURES / "hf" / name)


def _tiny(**overrides):
    shape = dict(vocab_size=64, hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2)
    config = llama.LlamaConfig(**{**shape, **overrides})
    return llama.Llama(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("field, value, named", [
    ("max_new_tokens", 0, "max_new_tokens=0"), ("temperature", -1.0, "temperature=-1.0"),
    ("top_k", -2, "top_k=-2"), ("top_p", 0.0, "top_p=0.0"), ("top_p", 1.5, "top_p=1.5"),
    ("seed", -1, "seed=-1"), ("stop_tokens", "eos", "stop_tokens='eos'"),
    ("stop_tokens", (1, -3), "stop_tokens=-3"), ("bucket", 0, "bucket=0"),
    ("return_logits", 1, "return_logits=1")])
def test_a_bad_generation_config_is_refused_by_name(field, value, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        GenerationConfig(**{field: value})


def test_the_filters_keep_top_k_then_the_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    kept = np.isfinite(np.asarray(sampling.filtered_logits(
        logits, GenerationConfig(temperature=1.0, top_k=3))))
    assert kept.tolist() == [[True, True, True, False]]
    kept = np.isfinite(np.asarray(sampling.filtered_logits(
        logits, GenerationConfig(temperature=1.0, top_p=0.7))))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7: the next one joins
    kept = np.isfinite(np.asarray(sampling.filtered_logits(
        logits, GenerationConfig(temperature=1.0, top_p=0.1))))
    assert kept.tolist() == [[True, False, False, False]]  # the most probable always stays


def test_buckets_are_powers_of_two_times_the_unit():
    assert [bucket_of(n, 16) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]


def test_sampling_is_seeded_and_one_bucket_compiles_once():
    model = _tiny()
    hot = GenerationConfig(max_new_tokens=6, bucket=8, temperature=5.0, top_k=40, top_p=0.95,
                           seed=3)
    first, again = jphantom.generate(model, PROMPTS, hot), jphantom.generate(model, PROMPTS, hot)
    assert first.completions == again.completions
    assert len(set(map(tuple, first.completions))) == 3  # hot: the rows differ
    programs, executables = loop.compiled.cache_info().currsize, len(api._EXECUTABLES)
    jphantom.generate(model, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7], [3, 4]], hot)
    assert loop.compiled.cache_info().currsize == programs  # the same bucket: no new program
    assert len(api._EXECUTABLES) == executables


def test_a_stop_token_ends_its_row_and_pads_after_it():
    model = _tiny()
    free = jphantom.generate(model, PROMPTS, GenerationConfig(max_new_tokens=6, bucket=8))
    stop = free.completions[1][2]
    out = jphantom.generate(model, PROMPTS, GenerationConfig(max_new_tokens=6, bucket=8,
                                                             stop_tokens=(stop,)))
    row = free.completions[1]
    assert out.completions[1] == row[:row.index(stop) + 1]
    assert (out.tokens[1, row.index(stop) + 1:] == loop.PAD).all()
    for free_row, stopped in zip(free.completions, out.completions):
        assert stopped == free_row[:len(stopped)]


@pytest.mark.parametrize("family", ["gemma3_text", pytest.param("gpt2", marks=pytest.mark.slow),
                                    pytest.param("mistral", marks=pytest.mark.slow),
                                    pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_the_cache_gives_the_logits_of_the_whole_sequence(family):
    """Gemma 3: a local layer (window 4) and a global one, prompts past the window."""
    model = _family(family)
    config = GenerationConfig(max_new_tokens=8, bucket=8, return_logits=True)
    cached = jphantom.generate(model, PROMPTS, config)
    whole = jphantom.generate(model, PROMPTS, config, cache=False)
    assert cached.cached and not whole.cached
    assert cached.completions == whole.completions
    assert np.abs(cached.logits - whole.logits).max() <= 1e-5 * np.abs(whole.logits).max()


class NoAttentionLM(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        return self.head(jnp.cumsum(self.embed(tokens), axis=1))


def test_a_model_without_jphantom_attention_runs_without_a_cache_and_cannot_ask_for_one():
    model = NoAttentionLM()
    out = jphantom.generate(model, [[1, 2, 3], [4]], GenerationConfig(max_new_tokens=3, bucket=4))
    assert not out.cached and [len(c) for c in out.completions] == [3, 3]
    h = np.cumsum(np.asarray(model.embed(jnp.asarray([[1, 2, 3]]))), axis=1)
    assert out.completions[0][0] == int(np.argmax(np.asarray(model.head(jnp.asarray(h)))[0, -1]))
    with pytest.raises(ConfigError, match="NoAttentionLM has no jphantom attention core"):
        jphantom.generate(model, [[1, 2]], cache=True)


@pytest.mark.parametrize("prompts, named", [([], "non-empty list"), ([[1], []], "prompt 1 is empty"),
                                            ([[1, 300]], "token id 300 outside")])
def test_bad_prompts_are_refused_by_name(prompts, named):
    with pytest.raises(ConfigError, match=named):
        jphantom.generate(_tiny(vocab_size=256), prompts)


def test_too_long_for_the_models_positions_is_refused():
    with pytest.raises(ConfigError, match="exceed the model's 16 positions"):
        jphantom.generate(_tiny(max_positions=16), [[1] * 10], GenerationConfig(max_new_tokens=8))


def _on_mesh(mesh_of, family, shape, plan, *args, **options):
    """Greedy tokens and logits on the mesh, and on one device of the model's dense
    equivalent (the plan's single-device oracle)."""
    model = _family(family)
    mesh = mesh_of(shape)
    if plan is not None:
        jphantom.parallelize(model, mesh, getattr(jphantom.plans, plan)(model, *args, **options))
    config = GenerationConfig(max_new_tokens=6, bucket=8, return_logits=True)
    out = jphantom.generate(model, PROMPTS, config, mesh=mesh)
    one = jphantom.generate(jphantom.dense_equivalent(model), PROMPTS, config)
    assert out.completions == one.completions
    assert np.abs(out.logits - one.logits).max() <= 1e-5 * np.abs(one.logits).max()


@pytest.mark.parametrize("family, shape, plan, args", [
    ("qwen2", "model=2,data=2", "megatron", ()),
    pytest.param("gemma3_text", "model=4,data=2", "megatron", (), marks=pytest.mark.slow),
    pytest.param("gpt2", "model=4,data=2", "megatron", (), marks=pytest.mark.slow),
    pytest.param("mixtral", "model=2,data=2", "megatron", (), marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "expert=2,model=2,data=2", "megatron", (),
                 marks=pytest.mark.slow),
    pytest.param("qwen2", "model=2,data=2", "phantom", (2,), marks=pytest.mark.slow),
    pytest.param("llama", "x=2,y=2,z=2", "pmm3d", (), marks=pytest.mark.slow),
    pytest.param("qwen3", "data=8", None, (), marks=pytest.mark.slow)])
def test_decode_on_a_mesh_equals_one_device(mesh_of, family, shape, plan, args):
    _on_mesh(mesh_of, family, shape, plan, *args)


def test_a_context_axis_is_refused_by_name(mesh_of):
    model = _tiny()
    with pytest.raises(ConfigError, match="mesh axis context=2"):
        jphantom.generate(model, [[1, 2]], mesh=mesh_of("context=2"))


def _switch_gpt2(capacity_factor):
    from jphantom.models.gpt2 import GPT2, TransformerConfig
    config = TransformerConfig(vocab_size=64, hidden=32, layers=2, heads=4, seq_len=32,
                               moe_every=1, experts=4, capacity_factor=capacity_factor)
    return GPT2(config, rngs=nnx.Rngs(0))


def test_a_capacity_limited_mixture_of_experts_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"blocks.block.moe_block.moe, capacity_factor=1.25"):
        jphantom.generate(_switch_gpt2(1.25), [[1, 2]])


@pytest.mark.slow
def test_gpt2s_dropless_switch_blocks_decode_as_the_whole_sequence():
    model = _switch_gpt2(None)
    config = GenerationConfig(max_new_tokens=4, bucket=4, return_logits=True)
    cached = jphantom.generate(model, PROMPTS, config)
    whole = jphantom.generate(model, PROMPTS, config, cache=False)
    assert cached.cached and cached.completions == whole.completions
    assert np.abs(cached.logits - whole.logits).max() <= 1e-5 * np.abs(whole.logits).max()
