"""Mistral, Qwen2, Qwen3, Qwen3-MoE and Gemma 3 checkpoints made by transformers (tests/fixtures/make_hf_families.py,
committed with torch's logits, loss and gradients): logits equal transformers' on one device and
under tensor parallelism, the one-device step's loss and every gradient equal torch's, a load then
a save writes the file's tensors back byte for byte, and ``train --from-hf`` runs on them. Qwen3's
per-head q/k norms stay replicated under the plans; Mistral's window changes the logits."""

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jphantom
from jphantom.cli import main
from jphantom.runtime.mesh import MeshConfig, first_devices
from jphantom.models import hf, llama

from conftest import require_devices

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
FAMILIES = ("mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text")


@functools.lru_cache(maxsize=None)
def _reference(family):
    return dict(np.load(FIXTURES / family / "reference.npz"))


def _mesh(text):
    config = MeshConfig.parse(text)
    require_devices(config.device_count)
    return config.build(first_devices(config.device_count))


def _close(ours, theirs, tolerance=1e-4):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max()) <= tolerance


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow_cells("qwen2")
def test_logits_loss_and_gradients_equal_transformers(family):
    ref = _reference(family)
    model = hf.load(FIXTURES / family)
    assert model.config.model_type == family
    tokens, targets = jnp.asarray(ref["tokens"], jnp.int32), jnp.asarray(ref["targets"], jnp.int32)
    assert _close(model(tokens), ref["logits"])
    mesh = _mesh("data=1")
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), llama.lm_loss, donate=False)
    params = step.init().params
    loss, grads = jax.jit(step.value_and_grad())(params, tokens, targets)
    assert abs(float(loss) - float(ref["loss"])) <= 1e-5 * float(ref["loss"])
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)  # the gradients, named as HF does
    nnx.replace_by_pure_dict(state, grads)
    ours = llama.to_hf_tensors(nnx.merge(graphdef, state, rest))
    theirs = {k[len("grad/"):]: v for k, v in ref.items() if k.startswith("grad/")}
    theirs.pop("lm_head.weight", None) if model.config.tie_word_embeddings else None
    assert set(ours) == set(theirs)
    for name in theirs:
        assert _close(ours[name], theirs[name]), name


@pytest.mark.parametrize("family, mesh", [("qwen3", "model=4"), ("qwen3_moe", "model=2"),
                                          ("gemma3_text", "model=4"),
                                          pytest.param("mistral", "model=8",
                                                       marks=pytest.mark.slow),
                                          pytest.param("qwen2", "model=4",
                                                       marks=pytest.mark.slow)])
def test_tensor_parallel_logits_equal_transformers(family, mesh):
    """More tensor ranks than the 2 key/value heads; Qwen3's q/k norms replicated."""
    ref = _reference(family)
    model, mesh = hf.load(FIXTURES / family), _mesh(mesh)
    plan = jphantom.plans.megatron(model)
    if family == "qwen3":
        assert plan["layers.block.self_attn.q_norm"] == "replicate"
    jphantom.parallelize(model, mesh, plan)
    logits = jphantom.make_forward_fn(model, mesh)(jnp.asarray(ref["tokens"], jnp.int32))
    assert _close(logits, ref["logits"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_load_then_a_save_writes_the_files_tensors_back(tmp_path, family):
    from safetensors.numpy import load_file

    hf.save(tmp_path, hf.load(FIXTURES / family))
    theirs = load_file(str(FIXTURES / family / "model.safetensors"))
    ours = load_file(str(tmp_path / "model.safetensors"))
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].tobytes() == value.tobytes(), name
    assert hf.model_type(tmp_path) == family


def test_gemma3_under_context_parallelism_is_refused_by_name():
    model = hf.load(FIXTURES / "gemma3_text")
    ref = _reference("gemma3_text")
    batch = (np.tile(ref["tokens"], (2, 1)).astype(np.int32),
             np.tile(ref["targets"], (2, 1)).astype(np.int32))
    with pytest.raises(jphantom.ConfigError, match="local and global layers"):
        jphantom.verify(model, _mesh("data=2,context=2"),
                        jphantom.plans.context(model, algorithm="all-gather"), llama.lm_loss,
                        *batch)


def test_the_sliding_window_changes_the_result():
    ref = _reference("mistral")
    model = hf.load(FIXTURES / "mistral")
    assert model.config.sliding_window == 4
    tokens = jnp.asarray(ref["tokens"], jnp.int32)
    from safetensors.numpy import load_file
    import dataclasses

    full = llama.from_hf_tensors(dataclasses.replace(model.config, sliding_window=None),
                                 load_file(str(FIXTURES / "mistral" / "model.safetensors")))
    assert not _close(full(tokens), ref["logits"], 1e-2)


@pytest.mark.parametrize("family, mesh, plan, options", [
    ("qwen3", "data=2,model=2", "sp", {}),
    pytest.param("qwen3", "data=2,model=2", "phantom", {}, marks=pytest.mark.slow),
    pytest.param("qwen2", "data=4,model=2", "tensor", {"zero": 3}, marks=pytest.mark.slow),
    pytest.param("mistral", "data=2,stage=2", None, {"pipeline": "1f1b"},
                 marks=pytest.mark.slow),
    pytest.param("mistral", "data=2,context=2", "context", {}, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "data=2,expert=2,model=2", "sp", {}, marks=pytest.mark.slow),
    ("gemma3_text", "data=2,model=2", "sp", {}),
    pytest.param("gemma3_text", "data=2,model=2", "phantom", {}, marks=pytest.mark.slow),
    pytest.param("gemma3_text", "data=2,stage=2", None, {"pipeline": "zb-h1"},
                 marks=pytest.mark.slow),
], ids=["qwen3-sp", "qwen3-phantom", "qwen2-zero3", "mistral-1f1b", "mistral-context",
        "qwen3moe-expert-sp", "gemma3-sp", "gemma3-phantom", "gemma3-zb-h1"])
@pytest.mark.slow_cells("gemma3-sp")
def test_families_under_the_strategies_equal_one_device(family, mesh, plan, options):
    """The new families' layers under sequence parallelism (Qwen3's q/k norms on the gathered
    sequence's heads), phantom, ZeRO-3, a pipeline and all-gather context attention (Mistral's
    window over the gathered keys)."""
    from jphantom.pipeline.runner import PipelineConfig

    model = hf.load(FIXTURES / family)
    ref = _reference(family)
    batch = (np.tile(ref["tokens"], (2, 1)).astype(np.int32),
             np.tile(ref["targets"], (2, 1)).astype(np.int32))
    plans = {"sp": lambda: jphantom.plans.megatron(model, sequence_parallel=True),
             "tensor": lambda: jphantom.plans.megatron(model),
             "phantom": lambda: jphantom.plans.phantom(model, ghost_width=2),
             "context": lambda: jphantom.plans.context(model, algorithm="all-gather"),
             None: lambda: None}
    if "pipeline" in options:
        options = {"pipeline": PipelineConfig(microbatches=2, schedule=options["pipeline"])}
    report = jphantom.verify(model, _mesh(mesh), plans[plan](), llama.lm_loss, *batch,
                             **options)
    assert report.ok, str(report)


@pytest.mark.parametrize("family, model", [
    ("qwen3", "qwen3"), pytest.param("mistral", "mistral", marks=pytest.mark.slow),
    pytest.param("qwen2", "qwen2", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "qwen3_moe", marks=pytest.mark.slow),
    pytest.param("gemma3_text", "gemma3", marks=pytest.mark.slow)])
def test_train_from_hf_runs_two_steps_on_data_and_model(tmp_path, family, model):
    """`jphantom train --model M --from-hf DIR` on data=2,model=2 for every family, and its
    --save-hf is the same family's checkpoint."""
    assert main(["train", "--model", model, "--strategy", "tensor", "--mesh", "data=2,model=2",
                 "--from-hf", str(FIXTURES / family), "--seq-len", "16", "--batch", "4",
                 "--steps", "2", "--eval-every", "2", "--eval-batches", "1", "--out",
                 str(tmp_path / "run"), "--save-hf", str(tmp_path / "hf"), "--no-progress"]) == 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert np.isfinite(results["final_validation_loss"]) and results["model"]["name"] == model
    assert results["config"]["hidden"] == results["model"]["hidden"] != 256  # not the default
    again = hf.load(tmp_path / "hf")
    assert again.config.model_type == family == hf.model_type(tmp_path / "hf")


# make test: Gemma 3 with its pad id in the inputs against transformers (below); this file's
# three cells: make test-all
@pytest.mark.parametrize("mesh, sp", [("data=1", False), ("model=2", False), ("model=2", True)])
@pytest.mark.slow_cells("data=1-False", "model=2-False", "model=2-True")
def test_the_pad_rows_lookups_give_it_no_gradient(mesh, sp):
    """transformers' nn.Embedding(padding_idx=pad_token_id) (Gemma 3 and the Llama-like
    families): with the pad id in the inputs, the pad row's gradient is the tied head's alone.
    Tied against the same model untied (head = table): the tied row is the untied head's row,
    the untied table's pad row is zero, every other row is the sum of the two; the same on a
    vocabulary-sharded table."""
    config = llama.LlamaConfig(vocab_size=32, hidden=16, intermediate=24, layers=1, heads=2,
                               kv_heads=1, tie_word_embeddings=True, pad_token_id=3)
    tokens = jnp.asarray(np.arange(16).reshape(2, 8) % 5, jnp.int32)  # pad (3) in every row
    targets = jnp.asarray((np.arange(16).reshape(2, 8) * 7) % 32, jnp.int32)

    def grads(config, head=None):
        model = llama.Llama(config, rngs=nnx.Rngs(0))
        if head is not None:  # untied, the head a copy of the tied table
            model.lm_head.kernel.set_value(head.T)
        if mesh != "data=1":
            jphantom.parallelize(model, _mesh(mesh),
                                 jphantom.plans.megatron(model, sequence_parallel=sp))
        step = jphantom.make_train_step(model, _mesh(mesh), optax.sgd(0.1), llama.lm_loss,
                                        donate=False)
        return jax.jit(step.value_and_grad())(step.init().params, tokens, targets)[1]

    table = llama.Llama(config, rngs=nnx.Rngs(0)).embed_tokens.embedding.get_value()
    tied = np.asarray(grads(config)["embed_tokens"]["embedding"])
    untied = grads(dataclasses.replace(config, tie_word_embeddings=False), head=table)
    lookup = np.asarray(untied["embed_tokens"]["embedding"])
    head = np.asarray(untied["lm_head"]["kernel"]).T
    assert np.all(lookup[3] == 0) and np.abs(lookup).max() > 0
    np.testing.assert_allclose(tied, lookup + head, atol=1e-6)
    assert np.abs(tied[3]).max() > 0  # the head's part stays
    without = np.asarray(grads(dataclasses.replace(config, pad_token_id=None))[
        "embed_tokens"]["embedding"])
    assert np.abs(without[3] - tied[3]).max() > 1e-3  # the lookups' part is gone


def test_gemma_with_its_pad_id_in_the_inputs_equals_transformers():
    """Gemma 3's pad id (0) in every third position: the loss and every gradient equal
    transformers' (``pad_reference.npz``, made by tests/fixtures/make_pad_reference.py with
    nn.Embedding's padding_idx), the tied table's pad row included (the head's part alone)."""
    ref = dict(np.load(FIXTURES / "gemma3_text" / "pad_reference.npz"))
    model = hf.load(FIXTURES / "gemma3_text")
    tokens, targets = jnp.asarray(ref["tokens"], jnp.int32), jnp.asarray(ref["targets"], jnp.int32)
    assert int((ref["tokens"] == 0).sum()) == 12
    step = jphantom.make_train_step(model, _mesh("data=1"), optax.sgd(0.1), llama.lm_loss,
                                    donate=False)
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, tokens, targets)
    assert abs(float(loss) - float(ref["loss"])) <= 1e-5 * float(ref["loss"])
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    nnx.replace_by_pure_dict(state, grads)
    ours = llama.to_hf_tensors(nnx.merge(graphdef, state, rest))
    theirs = {k[len("grad/"):]: v for k, v in ref.items() if k.startswith("grad/")}
    theirs.pop("lm_head.weight", None)
    assert set(ours) == set(theirs)
    for name in theirs:
        assert _close(ours[name], theirs[name]), name


def test_the_pad_id_comes_from_the_checkpoint():
    assert hf.load(FIXTURES / "gemma3_text").config.pad_token_id == 0  # Gemma's
    assert hf.load(FIXTURES / "qwen3").config.pad_token_id is None
    with pytest.raises(jphantom.ConfigError, match="pad_token_id=40"):
        llama.LlamaConfig(vocab_size=32, pad_token_id=40)
