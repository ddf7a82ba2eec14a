"""Hugging Face GPT-2 checkpoints (jphantom.models.gpt2): name and layout mapping, bit-exact round
trips in float32/float16/bfloat16, forward parity of the NNX GPT-2 (``gpt2.from_dense``) with
an independent numpy GPT-2 and under Megatron's plan, and the errors for bad inputs.

The checkpoints are written here with numpy + safetensors in the exact layout that
``GPT2LMHeadModel.save_pretrained`` produces (no torch in the tests). Parity with torch itself was
checked outside the test suite (see the module docstring of jphantom.models.gpt2)."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

import jphantom
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import first_devices, make_mesh
from jphantom.models import gpt2

V, S, H, A, L = 64, 32, 32, 4, 2  # vocab, n_positions, n_embd, n_head, n_layer
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def hf_config(**over) -> dict:
    """config.json as transformers writes it for a tiny GPT-2 (dropout fields included)."""
    return {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
            "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "layer_norm_epsilon": 1e-5,
            "model_type": "gpt2", "n_embd": H, "n_head": A, "n_inner": None, "n_layer": L,
            "n_positions": S, "vocab_size": V, "tie_word_embeddings": True, **over}


def hf_shapes(vocab=V, positions=S, h=H, layers=L) -> dict:
    shapes = {"wte.weight": (vocab, h), "wpe.weight": (positions, h),
              "ln_f.weight": (h,), "ln_f.bias": (h,)}
    for i in range(layers):
        shapes.update({f"h.{i}.ln_1.weight": (h,), f"h.{i}.ln_1.bias": (h,),
                       f"h.{i}.attn.c_attn.weight": (h, 3 * h), f"h.{i}.attn.c_attn.bias": (3 * h,),
                       f"h.{i}.attn.c_proj.weight": (h, h), f"h.{i}.attn.c_proj.bias": (h,),
                       f"h.{i}.ln_2.weight": (h,), f"h.{i}.ln_2.bias": (h,),
                       f"h.{i}.mlp.c_fc.weight": (h, 4 * h), f"h.{i}.mlp.c_fc.bias": (4 * h,),
                       f"h.{i}.mlp.c_proj.weight": (4 * h, h), f"h.{i}.mlp.c_proj.bias": (h,)})
    return shapes


def random_tensors(seed=0, dtype="float32", bits=False, **dims) -> dict:
    """HF-named tensors (no prefix). ``bits``: arbitrary bit patterns (NaN payloads, infinities,
    -0.0, subnormals) to prove that nothing converts; otherwise a well-behaved model."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_shapes(**dims).items():
        if bits:
            width = np.dtype(DTYPES[dtype]).itemsize
            raw = rng.integers(0, 2 ** (8 * width), size=shape, dtype=f"u{width}")
            out[name] = raw.view(DTYPES[dtype])
            continue
        value = rng.normal(size=shape) * (0.3 if name.startswith(("wte", "wpe")) else 0.1)
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            value = 1 + value
        out[name] = value.astype(DTYPES[dtype])
    return out


def write_hf(directory, tensors, *, prefix="transformer.", config=None, extras=()):
    """A directory as save_pretrained writes it; ``extras`` adds the causal-mask buffers and the
    tied lm_head.weight that older checkpoints carry."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or hf_config()))
    stored = {prefix + name: value for name, value in tensors.items()}
    if "buffers" in extras:
        for i in range(L):
            stored[f"{prefix}h.{i}.attn.bias"] = np.tril(np.ones((1, 1, S, S), np.float32))
            stored[f"{prefix}h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    if "lm_head" in extras:
        stored["lm_head.weight"] = tensors["wte.weight"].copy()
    save_file(stored, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def read(directory) -> tuple[dict, dict]:
    with safe_open(str(directory / "model.safetensors"), framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def numpy_gpt2(t: dict, tokens: np.ndarray, heads=A, eps=1e-5, head=None) -> np.ndarray:
    """An independent float64 GPT-2 forward on HF-named tensors (HF's GPT2LMHeadModel maths);
    ``head``: an untied head's (weight [h, V], bias [V]) instead of the tied embedding."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    layers = sum(1 for k in t if k.endswith("ln_1.weight"))

    def norm(x, w, b):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * w + b

    gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    batch, seq = tokens.shape
    x = t["wte.weight"][tokens] + t["wpe.weight"][:seq]
    for i in range(layers):
        p = lambda n: t[f"h.{i}.{n}"]
        y = norm(x, p("ln_1.weight"), p("ln_1.bias")) @ p("attn.c_attn.weight") + p("attn.c_attn.bias")
        q, k, v = (z.reshape(batch, seq, heads, -1).transpose(0, 2, 1, 3) for z in np.split(y, 3, -1))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        o = (w @ v).transpose(0, 2, 1, 3).reshape(batch, seq, -1)
        x = x + o @ p("attn.c_proj.weight") + p("attn.c_proj.bias")
        y = norm(x, p("ln_2.weight"), p("ln_2.bias")) @ p("mlp.c_fc.weight") + p("mlp.c_fc.bias")
        x = x + gelu(y) @ p("mlp.c_proj.weight") + p("mlp.c_proj.bias")
    x = norm(x, t["ln_f.weight"], t["ln_f.bias"])
    if head is not None:
        return x @ np.asarray(head[0], np.float64) + np.asarray(head[1], np.float64)
    return x @ t["wte.weight"].T


def zeros_like_init(config):
    """numpy zeros in the dense dictionary's layout (``gpt2.to_dense`` of the module), without
    running (and compiling) an initialiser: the abstract module filled with zeros."""
    graphdef, state, rest = nnx.split(nnx.eval_shape(lambda: gpt2.GPT2(config,
                                                                           rngs=nnx.Rngs(0))),
                                      nnx.Param, ...)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: np.zeros(a.shape, a.dtype),
                                                 nnx.to_pure_dict(state)))
    return gpt2.to_dense(nnx.merge(graphdef, state, rest))


def model_mesh(shards: int):
    """A ``model`` axis over the first ``shards`` of the 8 simulated devices."""
    return make_mesh({"model": shards}, first_devices(shards))


def tokens_for(vocab=V, shape=(2, 8), seed=1):
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


# --------------------------------------------------------------------------- load


@pytest.mark.parametrize("prefix, extras", [("transformer.", ()),
                                            ("", ("buffers", "lm_head"))])
def test_load_maps_every_tensor_to_the_dense_layout(tmp_path, prefix, extras):
    t = random_tensors()
    config, params = gpt2.load(write_hf(tmp_path / "m", t, prefix=prefix, extras=extras))
    assert config == gpt2.TransformerConfig(vocab_size=V, seq_len=S, hidden=H, heads=A, layers=L,
                                          dtype="float32", layer_norm_eps=1e-5)
    want_shapes = jax.tree.map(lambda a: a.shape, zeros_like_init(config))
    assert jax.tree.map(lambda a: a.shape, params) == want_shapes
    assert same_bits(params["wte"], t["wte.weight"]) and same_bits(params["wpe"], t["wpe.weight"])
    assert same_bits(params["ln_f"]["scale"], t["ln_f.weight"])
    assert same_bits(params["ln_f"]["bias"], t["ln_f.bias"])
    b, d = params["blocks"], H // A
    for i in range(L):
        c_attn, c_bias = t[f"h.{i}.attn.c_attn.weight"], t[f"h.{i}.attn.c_attn.bias"]
        for part in range(3):  # q | k | v, then the heads inside each, contiguous
            for head in range(A):
                cols = slice(part * H + head * d, part * H + (head + 1) * d)
                assert same_bits(b["qkv"]["weight"][i, :, part, head * d:(head + 1) * d], c_attn[:, cols])
                assert same_bits(b["qkv"]["bias"][i, part, head * d:(head + 1) * d], c_bias[cols])
        for group, leaf, name in [("ln1", "scale", "ln_1.weight"), ("ln1", "bias", "ln_1.bias"),
                                  ("ln2", "scale", "ln_2.weight"), ("ln2", "bias", "ln_2.bias"),
                                  ("attn_out", "weight", "attn.c_proj.weight"),
                                  ("attn_out", "bias", "attn.c_proj.bias"),
                                  ("mlp_up", "weight", "mlp.c_fc.weight"),
                                  ("mlp_up", "bias", "mlp.c_fc.bias"),
                                  ("mlp_down", "weight", "mlp.c_proj.weight"),
                                  ("mlp_down", "bias", "mlp.c_proj.bias")]:
            assert same_bits(b[group][leaf][i], t[f"h.{i}.{name}"]), (group, leaf, i)


def test_dense_logits_match_an_independent_numpy_gpt2(tmp_path):
    t = random_tensors(seed=2)
    config, params = gpt2.load(write_hf(tmp_path / "m", t))
    tokens = tokens_for()
    got = np.asarray(gpt2.from_dense(config, params)(tokens))
    np.testing.assert_allclose(got, numpy_gpt2(t, tokens), atol=1e-4, rtol=0)


def _megatron_logits(model, shards, sequence_parallel=False, **plan):
    """Logits of ``model`` under Megatron's plan (with ``plan``'s entries over it) on a ``model``
    axis of ``shards`` devices, as global arrays."""
    mesh = model_mesh(shards)
    jphantom.parallelize(model, mesh, {**jphantom.plans.megatron(
        model, sequence_parallel=sequence_parallel), **plan})
    return np.asarray(jphantom.make_forward_fn(model, mesh)(tokens_for(model.config.vocab_size,
                                                                       shape=(2, 16))))


@pytest.mark.parametrize("shards, sequence_parallel", [(2, False), (2, True), (4, False), (4, True)])
@pytest.mark.slow_cells("4-False", "4-True")  # make test: two shards, with and without SP
def test_tensor_parallel_logits_equal_dense(tmp_path, shards, sequence_parallel):
    config, params = gpt2.load(write_hf(tmp_path / "m", random_tensors(seed=3)))
    tokens = tokens_for(shape=(2, 16))
    dense = np.asarray(gpt2.from_dense(config, params)(tokens))
    got = _megatron_logits(gpt2.from_dense(config, params), shards, sequence_parallel)
    assert got.shape == (2, 16, V)
    np.testing.assert_allclose(got, dense, atol=1e-5, rtol=0)


def test_gpt2_vocabulary_over_four_shards(tmp_path):
    """50257 = GPT-2's vocabulary = 29 x 1733 splits over no power of two: a vocabulary-parallel
    embedding on 4 shards is refused naming the module and the sizes; with the (tied) embedding
    replicated, the blocks run tensor-parallel and the logits equal one device's and numpy's.
    (``jphantom.registry.program``'s tensor strategy replicates them by itself, with a warning.)"""
    t = random_tensors(seed=4, vocab=50257, positions=16)
    config, params = gpt2.load(write_hf(tmp_path / "m", t, config=hf_config(vocab_size=50257,
                                                                            n_positions=16)))
    tokens = tokens_for(vocab=50257, shape=(2, 16))
    dense = np.asarray(gpt2.from_dense(config, params)(tokens))
    np.testing.assert_allclose(dense, numpy_gpt2(t, tokens), atol=1e-4, rtol=0)
    with pytest.raises(ConfigError, match=r"wte.*50257.*4"):
        _megatron_logits(gpt2.from_dense(config, params), 4)
    got = _megatron_logits(gpt2.from_dense(config, params), 4, wte="replicate",
                           ln_f="replicate")  # the norm before the (replicated) head
    assert got.shape == (2, 16, 50257)
    np.testing.assert_allclose(got, dense, atol=1e-5, rtol=0)


def test_load_reads_a_sharded_checkpoint(tmp_path):
    t = random_tensors(seed=5)
    d = write_hf(tmp_path / "m", t)
    (d / "model.safetensors").unlink()
    names = sorted(t)
    halves = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    weight_map = {}
    for file, part in halves.items():
        save_file({"transformer." + n: t[n] for n in part}, str(d / file), metadata={"format": "pt"})
        weight_map.update({"transformer." + n: file for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, params = gpt2.load(d)
    assert same_bits(params["blocks"]["mlp_down"]["weight"][1], t["h.1.mlp.c_proj.weight"])


# --------------------------------------------------------------------------- save


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_save_writes_what_transformers_writes_and_round_trips_bit_exactly(tmp_path, dtype):
    """Random bit patterns (NaNs with payloads, infinities, -0.0) survive load -> save -> load, and
    an old-style file (no prefix, mask buffers, lm_head) comes back under today's names."""
    t = random_tensors(seed=6, dtype=dtype, bits=True)
    config, params = gpt2.load(write_hf(tmp_path / "old", t, prefix="", extras=("buffers", "lm_head")))
    assert config.dtype == dtype
    gpt2.save(tmp_path / "saved", config, params)
    stored, metadata = read(tmp_path / "saved")
    assert metadata == {"format": "pt"}
    assert sorted(stored) == sorted("transformer." + n for n in t)  # no lm_head, no buffers
    for name, value in t.items():
        assert same_bits(stored["transformer." + name], value), name
    config2, params2 = gpt2.load(tmp_path / "saved")
    assert config2 == config
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)))

    hf = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert hf["architectures"] == ["GPT2LMHeadModel"] and hf["model_type"] == "gpt2"
    assert (hf["vocab_size"], hf["n_positions"], hf["n_embd"], hf["n_head"], hf["n_layer"]) == (V, S, H, A, L)
    assert hf["activation_function"] == "gelu_new" and hf["tie_word_embeddings"] is True
    assert hf["layer_norm_epsilon"] == 1e-5 and hf["dtype"] == dtype
    assert hf["attn_pdrop"] == hf["embd_pdrop"] == hf["resid_pdrop"] == 0.0


def test_a_transformers_file_is_rewritten_byte_for_byte(tmp_path):
    """Same names, dtypes, bytes and metadata: the whole model.safetensors is identical."""
    d = write_hf(tmp_path / "hf", random_tensors(seed=7, dtype="bfloat16", bits=True))
    gpt2.save(tmp_path / "ours", *gpt2.load(d))
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == \
        (d / "model.safetensors").read_bytes()


def test_save_takes_jax_params(tmp_path):
    config = gpt2.TransformerConfig(vocab_size=V, seq_len=S, hidden=H, heads=A, layers=L, dtype="bfloat16")
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype),
                          zeros_like_init(config))
    gpt2.save(tmp_path / "m", config, params)
    config2, params2 = gpt2.load(tmp_path / "m")
    assert config2 == config
    assert all(same_bits(a, b) for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)))


def test_save_rejects_an_untied_head(tmp_path):
    config = gpt2.TransformerConfig(vocab_size=V, seq_len=S, hidden=H, heads=A, layers=L, tied_head=False)
    params = zeros_like_init(config)
    with pytest.raises(ConfigError, match="tied"):
        gpt2.save(tmp_path / "m", config, params)
    tied = gpt2.TransformerConfig(vocab_size=V, seq_len=S, hidden=H, heads=A, layers=L)
    three = zeros_like_init(gpt2.TransformerConfig(V, S, H, A, layers=3))
    with pytest.raises(ConfigError, match=r"'blocks.ln1.scale' have shape \[3, 32\]"):
        gpt2.save(tmp_path / "m", tied, three)

# --------------------------------------------------------------------------- bad inputs


def _drop(name):
    def edit(d):
        stored, _ = read(d)
        del stored[name]
        save_file(stored, str(d / "model.safetensors"), metadata={"format": "pt"})
    return edit


def _reshape(name, shape):
    def edit(d):
        stored, _ = read(d)
        stored[name] = np.zeros(shape, np.float32)
        save_file(stored, str(d / "model.safetensors"), metadata={"format": "pt"})
    return edit


def _config(**over):
    return lambda d: (d / "config.json").write_text(json.dumps(hf_config(**over)))


@pytest.mark.parametrize("edit, match", [
    (lambda d: (d / "model.safetensors").unlink(), "has no model.safetensors"),
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
    (lambda d: (d / "config.json").write_text("{not json"), "cannot read .*config.json"),
    (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "cannot read .* as safetensors"),
    (_config(activation_function="relu"), "activation_function='relu'"),
    (_config(tie_word_embeddings=False), "tie_word_embeddings=False"),
    (_config(n_inner=100), "n_inner=100"),
    (_config(scale_attn_weights=False), "scale_attn_weights=False"),
    (_config(model_type="gpt_neo"), "model_type='gpt_neo'"),
    (_config(n_head=5), "n_embd=32 is not divisible by n_head=5"),
    (_config(n_layer=3), r"tensor 'transformer.h.2.ln_1.weight' is missing"),
    (_config(n_layer=1), r"unexpected tensor 'transformer.h.1"),
    (_drop("transformer.h.1.mlp.c_fc.bias"), r"tensor 'transformer.h.1.mlp.c_fc.bias' is missing"),
    (_drop("transformer.wte.weight"), r"'wte.weight' \(nor transformer.wte.weight\) is missing"),
    (_reshape("transformer.h.0.attn.c_attn.weight", (32, 95)), r"c_attn.weight' has shape \[32, 95\]"),
    (_reshape("transformer.ln_f.bias", (32,)), r"'transformer.ln_f.bias' is float32 but"),
])
def test_bad_checkpoints_raise_config_error_naming_the_problem(tmp_path, edit, match):
    d = write_hf(tmp_path / "m", random_tensors(dtype="float16"))
    edit(d)
    with pytest.raises(ConfigError, match=match):
        gpt2.load(d)


def test_untied_lm_head_and_missing_directory_raise(tmp_path):
    t = random_tensors()
    d = write_hf(tmp_path / "m", t, extras=("lm_head",))
    stored, _ = read(d)
    stored["lm_head.weight"] = stored["lm_head.weight"] + 1
    save_file(stored, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lm_head.weight' differs"):
        gpt2.load(d)
    with pytest.raises(ConfigError, match="is not a directory"):
        gpt2.load(tmp_path / "nowhere")
