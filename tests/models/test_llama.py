"""The Llama family (and Mixtral's MoE) as an NNX model: under Megatron tensor, sequence and
phantom parallelism it equals its single-device run (phantom: its dense equivalent); Hugging Face
checkpoints round-trip tensor for tensor."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import jphantom
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import MeshConfig, first_devices
from jphantom.models import hf, llama
from test_byo_model import rel_error

V, S, BATCH = 64, 8, 8


def config(experts: int = 0, **extra) -> llama.LlamaConfig:
    return llama.LlamaConfig(vocab_size=V, hidden=32, intermediate=48, layers=2, heads=4,
                             kv_heads=2, experts=experts, **extra)


def _batch():
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.integers(0, V, (BATCH, S)), jnp.int32),
            jnp.asarray(rng.integers(0, V, (BATCH, S)), jnp.int32))


def _mesh(data, model):
    if jax.device_count() < data * model:
        pytest.skip("needs more devices")
    return jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[:data * model])


@functools.lru_cache(maxsize=None)
def one_device(experts):
    model = llama.Llama(config(experts), rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), llama.lm_loss)
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *_batch())
    return float(loss), jax.device_get(grads)


@pytest.mark.parametrize("experts, sequence_parallel", [
    (0, False), pytest.param(4, False, marks=pytest.mark.slow), (0, True),
    pytest.param(4, True, marks=pytest.mark.slow)],  # Mixtral: the expert-parallel test
    ids=["llama-tensor", "mixtral-tensor", "llama-tensor-sp", "mixtral-tensor-sp"])
@pytest.mark.slow_cells("llama-tensor")
def test_llama_under_megatron_equals_one_device(experts, sequence_parallel):
    model = llama.Llama(config(experts), rngs=nnx.Rngs(0))
    mesh = _mesh(4, 2)
    jphantom.parallelize(model, mesh,
                         jphantom.plans.megatron(model, sequence_parallel=sequence_parallel))
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), llama.lm_loss)
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *_batch())
    ref_loss, ref_grads = one_device(experts)
    assert abs(float(loss) - ref_loss) < 1e-5 * ref_loss
    assert rel_error(grads, ref_grads) < 1e-5


@pytest.mark.parametrize("remat", ["dots_saveable",
                                   pytest.param("nothing_saveable", marks=pytest.mark.slow)])
@pytest.mark.slow_cells("dots_saveable")
def test_llama_pipeline_with_remat_equals_one_device(remat):
    """A pipelined Llama under activation checkpointing: the stage body's residuals (a rotary
    table among them, computed from constants) live in stage-varying slots (NaN in the bubbles)."""
    from jphantom.pipeline.runner import PipelineConfig

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    model = llama.Llama(config(), rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
    jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))
    step = jphantom.make_train_step(
        model, mesh, optax.sgd(0.1), llama.lm_loss, remat=remat,
        pipeline=PipelineConfig("1f1b", microbatches=2, bubble_fill=float("nan")))
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *_batch())
    ref_loss, ref_grads = one_device(0)
    assert abs(float(loss) - ref_loss) < 1e-5 * ref_loss
    assert rel_error(step.to_model_order(grads), ref_grads) < 1e-5


@pytest.mark.parametrize("experts", [pytest.param(0, marks=pytest.mark.slow),
                                     pytest.param(4, marks=pytest.mark.slow)],
                         ids=["llama", "mixtral"])
def test_phantom_llama_equals_its_dense_equivalent(experts):
    """Every linear a phantom layer (k = 4): loss and gradients equal, on one device, those of the
    dense model the phantom layers are, differentiated through ``dense_equivalent``."""
    model = llama.Llama(config(experts), rngs=nnx.Rngs(0))
    mesh = _mesh(4, 2)
    jphantom.parallelize(model, mesh, jphantom.plans.phantom(model, ghost_width=4))
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), llama.lm_loss)
    params = step.init().params
    loss, grads = jax.jit(step.value_and_grad())(params, *_batch())

    def oracle(pure):
        dense = jphantom.dense_equivalent(step.layout.model_of(jax.tree.leaves(pure)))
        return llama.lm_loss(dense, *_batch())

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(oracle))(jax.device_get(params))
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * float(ref_loss)
    assert rel_error(grads, ref_grads) < 1e-5


def test_heads_that_do_not_divide_are_refused_before_anything_runs():
    model = llama.Llama(config(), rngs=nnx.Rngs(0))  # 4 query heads, 2 key/value heads
    with pytest.raises(ConfigError, match="kv_heads=2 is not divisible by the 4 ranks"):
        jphantom.parallelize(model, {"data": 2, "model": 4},  # by hand: plain column k and v
                             {**jphantom.plans.megatron(model), "layers.block.self_attn.k_proj":
                              "column", "layers.block.self_attn.v_proj": "column"})
    with pytest.raises(ConfigError, match="heads=4 do not divide among the 8 ranks"):
        jphantom.parallelize(model, {"model": 8}, jphantom.plans.megatron(model))
    with pytest.raises(ConfigError, match="multiple of the heads"):
        jphantom.parallelize(nnx.Sequential(nnx.Linear(8, 6, rngs=nnx.Rngs(0))), {"model": 3},
                             {"layers.0": jphantom.Style("column", kv_heads=2)})


@pytest.mark.parametrize("kv_heads, mesh, sequence_parallel", [
    (2, "data=2,model=4", True), (1, "model=8", False), (2, "model=8", False)])
@pytest.mark.slow_cells("2-model=8-False", "2-data=2,model=4-True")
def test_fewer_key_value_heads_than_tensor_ranks_equals_one_device(kv_heads, mesh,
                                                                   sequence_parallel):
    """Qwen2.5-7B's case (4 KV heads on TP=8): each rank computes the key/value head its query
    heads share (SharedHeadsLinear), the projection replicated, its gradient summed over the
    ranks that share a head; exact, with sequence parallelism too."""
    model = llama.Llama(llama.LlamaConfig(vocab_size=64, hidden=64, intermediate=64, layers=1,
                                          heads=8, kv_heads=kv_heads, max_positions=16),
                        rngs=nnx.Rngs(0))
    plan = jphantom.plans.megatron(model, sequence_parallel=sequence_parallel)
    assert plan["layers.block.self_attn.k_proj"] == jphantom.Style("column", kv_heads=kv_heads)
    built = MeshConfig.parse(mesh)
    tokens = np.random.default_rng(0).integers(0, 64, (8, 16)).astype(np.int32)
    report = jphantom.verify(model, built.build(first_devices(built.device_count)), plan,
                             llama.lm_loss, tokens, np.roll(tokens, -1, 1))
    assert report.ok, str(report)


def test_config_is_validated():
    with pytest.raises(ConfigError, match="kv_heads"):
        llama.LlamaConfig(heads=4, kv_heads=3)
    with pytest.raises(ConfigError, match="top_k"):
        llama.LlamaConfig(experts=2, top_k=3)


# --- Hugging Face checkpoints ----------------------------------------------------------------


def _hf_directory(tmp_path, experts: int, dtype):
    """A tiny random checkpoint in Hugging Face's layout (names, [out, in] weights, config)."""
    c = config(experts)
    rng = np.random.default_rng(3)
    h, f, d = c.hidden, c.intermediate, c.dim

    def w(*shape):
        return rng.standard_normal(shape).astype(dtype)

    tensors = {"model.embed_tokens.weight": w(V, h), "model.norm.weight": w(h),
               "lm_head.weight": w(V, h)}
    for i in range(c.layers):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": w(h),
                        p + "post_attention_layernorm.weight": w(h),
                        p + "self_attn.q_proj.weight": w(c.heads * d, h),
                        p + "self_attn.k_proj.weight": w(c.kv_heads * d, h),
                        p + "self_attn.v_proj.weight": w(c.kv_heads * d, h),
                        p + "self_attn.o_proj.weight": w(h, c.heads * d)})
        if experts:
            tensors[p + "block_sparse_moe.gate.weight"] = w(experts, h)
            for e in range(experts):
                q = p + f"block_sparse_moe.experts.{e}."
                tensors.update({q + "w1.weight": w(f, h), q + "w2.weight": w(h, f),
                                q + "w3.weight": w(f, h)})
        else:
            tensors.update({p + "mlp.gate_proj.weight": w(f, h), p + "mlp.up_proj.weight": w(f, h),
                            p + "mlp.down_proj.weight": w(h, f)})
    kind = "mixtral" if experts else "llama"
    hf = {"model_type": kind, "architectures": [llama.ARCHITECTURES[kind]], "vocab_size": V,
          "hidden_size": h, "intermediate_size": f, "num_hidden_layers": c.layers,
          "num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
          "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1,
          "torch_dtype": "bfloat16" if dtype == ml_dtypes.bfloat16 else "float32"}
    if experts:
        hf.update(num_local_experts=experts, num_experts_per_tok=2, router_aux_loss_coef=0.02)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    return tensors, hf


@pytest.mark.parametrize("experts", [0, 4], ids=["llama", "mixtral"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bf16"])
def test_hf_checkpoint_round_trips_tensor_for_tensor(tmp_path, experts, dtype):
    tensors, config_json = _hf_directory(tmp_path / "in", experts, dtype)
    model = hf.load(tmp_path / "in")
    assert isinstance(model, llama.Llama) and model.config.experts == experts
    hf.save(tmp_path / "out", model)
    again = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(again) == sorted(tensors)
    for name, value in tensors.items():
        assert again[name].dtype == value.dtype and again[name].shape == value.shape, name
        assert again[name].tobytes() == value.tobytes(), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: written[k] for k in config_json} == config_json  # every field of the file kept


def test_loaded_checkpoint_gives_logits_on_token_ids(tmp_path):
    _hf_directory(tmp_path, 0, np.float32)
    model = hf.load(tmp_path)
    tokens, _ = _batch()
    logits = model(tokens)
    assert logits.shape == (BATCH, S, V) and np.isfinite(np.asarray(logits)).all()
    # the causal model: changing the last token leaves earlier positions' logits unchanged
    changed = model(tokens.at[:, -1].set((tokens[:, -1] + 1) % V))
    np.testing.assert_array_equal(np.asarray(changed[:, :-1]), np.asarray(logits[:, :-1]))


def test_unsupported_checkpoints_are_refused_by_name(tmp_path):
    _, config_json = _hf_directory(tmp_path, 0, np.float32)
    (tmp_path / "config.json").write_text(json.dumps({**config_json, "rope_scaling": {"type": "llama3"}}))
    with pytest.raises(ConfigError, match="rope_scaling"):
        hf.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config_json, "model_type": "bert"}))
    with pytest.raises(ConfigError, match="bert"):
        hf.load(tmp_path)


# --- jphantom train --model llama ---------------------------------------------------------------


def _run_config(tmp_path, **overrides):
    from jphantom.config import RunConfig

    settings = dict(model="llama", strategy="tensor", mesh="data=2,model=2", layers=2, hidden=32,
                    heads=4, kv_heads=2, seq_len=16, batch=4, steps=3, eval_every=3,
                    eval_batches=1, out=str(tmp_path / "run"), progress=False)
    settings.update(overrides)
    return RunConfig.from_flags(**settings)


@pytest.mark.slow  # make test: the README trains Llama; test_hf_families.py covers --save-hf
def test_train_llama_writes_results_and_a_hf_checkpoint(tmp_path):
    from jphantom.loop.trainer import run

    results = run(_run_config(tmp_path, save_hf=str(tmp_path / "hf"), clip_norm=1.0))
    assert np.isfinite(results.final_validation_loss)
    assert results.model["kv_heads"] == 2 and results.params > 0
    again = hf.load(tmp_path / "hf")
    assert again.config.layers == 2 and again.config.hidden == 32


@pytest.mark.parametrize("overrides, message", [
    ({"strategy": "tensor-t1"}, "does not run the model family"),
    ({"strategy": "pmm3d"}, "runs on the axes data, stage, expert, z, y, x"),
    ({"mesh": "data=2,x=2"}, "pmm3d's"),
    ({"moe_every": 2}, "Mixtral"),
    ({"strategy": "phantom"}, "ghost-width"),
    ({"mesh": "data=1,model=8"}, "heads=4 do not divide among the 8 ranks"),
    ({"from_hf": "/nonexistent"}, "config.json not found"),
    ({"kv_heads": 3}, "heads=4 is not a multiple of kv_heads=3"),
])
def test_train_llama_refuses_bad_settings_before_building(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):  # on construction, or at the explicit build
        _run_config(tmp_path, **overrides).build()


@pytest.mark.slow
def test_train_llama_resumes_from_a_checkpoint_on_another_mesh(tmp_path):
    """Orbax checkpoints of the module step's state (parameters in the dense layout, Adam's
    moments): written on data=2,model=2, restored onto data=4,model=1 and continued."""
    from jphantom.loop.trainer import run

    directory = str(tmp_path / "ckpt")
    first = run(_run_config(tmp_path, steps=2, eval_every=2, checkpoint_dir=directory,
                            optimizer="adam"))
    resumed = run(_run_config(tmp_path, steps=3, eval_every=3, checkpoint_dir=directory,
                              optimizer="adam", resume=True, mesh="data=4,model=1",
                              out=str(tmp_path / "again")))
    assert resumed.checkpoints["resumed_from"] == 2
    assert resumed.history["train_loss"][:2] == first.history["train_loss"]
    assert np.isfinite(resumed.final_validation_loss)


@pytest.mark.parametrize("axes, sequence_parallel", [
    ((("data", 2), ("expert", 2), ("model", 2)), False),
    pytest.param((("expert", 4), ("model", 2)), True, marks=pytest.mark.slow),
], ids=["data2-expert2-model2", "expert4-model2-sp"])
@pytest.mark.slow_cells("data2-expert2-model2")
def test_mixtral_expert_parallel_equals_one_device(axes, sequence_parallel):
    """Experts split over ``expert`` (all-to-all dispatch, no token dropped) and their width over
    ``model`` (TED), with and without sequence parallelism."""
    names, sizes = zip(*axes)
    mesh = jax.make_mesh(sizes, names, devices=jax.devices()[:int(np.prod(sizes))])
    model = llama.Llama(config(4), rngs=nnx.Rngs(0))
    jphantom.parallelize(model, mesh,
                         jphantom.plans.megatron(model, sequence_parallel=sequence_parallel))
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), llama.lm_loss)
    state = step.init()
    loss, grads = jax.jit(step.value_and_grad())(state.params, *_batch())
    ref_loss, ref_grads = one_device(4)
    assert abs(float(loss) - ref_loss) < 1e-5 * ref_loss
    assert rel_error(jax.device_get(grads), ref_grads) < 1e-5
    if not sequence_parallel:  # 4 all-to-alls of E C h per MoE layer (C = T: none dropped)
        from jphantom.analysis import hlo

        text = step.lower(state, *_batch()).compile().as_text()
        found = [c for c in hlo.collectives(text) if c.kind == "all-to-all"]
        tokens = BATCH // 4 * S  # per data x expert rank
        c = config(4)
        assert sum(x.count for x in found) == 4 * c.layers
        assert sum(x.total_bytes for x in found) == 4 * c.layers * c.experts * tokens * c.hidden * 4
        assert all(x.mesh_axes(dict(mesh.shape)) == ("expert",) for x in found)


@pytest.mark.slow
def test_train_llama_with_an_expert_axis(tmp_path):
    from jphantom.loop.trainer import run

    results = run(_run_config(tmp_path, mesh="expert=2,model=2", moe_every=1, experts=4,
                              steps=2, eval_every=2))
    assert results.model["experts"] == 4 and np.isfinite(results.final_validation_loss)


@pytest.mark.slow  # make test: test_user_models.py's GSPMD annotation of a user's einsum layers
def test_llama_gspmd_baseline_equals_one_device():
    model = llama.Llama(config(4), rngs=nnx.Rngs(0))
    mesh = _mesh(4, 2)
    jphantom.plans.annotate(model, mesh, jphantom.plans.megatron(model))
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), llama.lm_loss, spmd="gspmd")
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *_batch())
    ref_loss, ref_grads = one_device(4)
    assert abs(float(loss) - ref_loss) < 1e-5 * ref_loss
    assert rel_error(jax.device_get(grads), ref_grads) < 1e-5


def test_parameters_are_created_in_their_shards_from_an_abstract_model():
    """``step.init(create=...)`` builds the parallelised model under ``jax.jit`` with the
    parameters' shardings as outputs: the same values as building it on the host, each array
    born split (the step was made from ``nnx.eval_shape`` of the same function)."""
    mesh = _mesh(4, 2)

    def create():
        model = llama.Llama(config(), rngs=nnx.Rngs(0))
        return jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))

    abstract = nnx.eval_shape(create)
    step = jphantom.make_train_step(abstract, mesh, optax.adam(1e-3), llama.lm_loss)
    with pytest.raises(ConfigError, match="abstract"):
        step.init()
    state = step.init(create=create)
    q = state.params["layers"]["block"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    host = jphantom.make_train_step(create(), mesh, optax.adam(1e-3), llama.lm_loss).init()
    assert rel_error(jax.device_get(state.params), jax.device_get(host.params)) < 1e-6  # jit vs eager rounding
    state, loss = step(state, *_batch())
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("sizes", [pytest.param((1, 2, 2, 2), marks=pytest.mark.slow), (2, 1, 1, 4)],
                         ids=["z2-y2-x2", "data2-x4"])  # make test: test_pmm3d.py's GPT on z, y, x
def test_llama_under_pmm3d_equals_one_device(sizes):
    """AxoNN's 3D matmul (Algorithm 3) on data, z, y, x: q/k/v and gate/up normal layers,
    o and down transposed, norms over y, the vocabulary over x."""
    mesh = jax.make_mesh(sizes, ("data", "z", "y", "x"), devices=jax.devices()[:8])
    model = llama.Llama(config(), rngs=nnx.Rngs(0))
    if sizes[3] > config().kv_heads:
        with pytest.raises(ConfigError, match="kv_heads=2 is not divisible by the 4 ranks"):
            jphantom.parallelize(model, mesh, jphantom.plans.pmm3d(model))
        return
    jphantom.parallelize(model, mesh, jphantom.plans.pmm3d(model))
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), llama.lm_loss)
    loss, grads = jax.jit(step.value_and_grad())(step.init().params, *_batch())
    ref_loss, ref_grads = one_device(0)
    assert abs(float(loss) - ref_loss) < 1e-5 * ref_loss
    assert rel_error(jax.device_get(grads), ref_grads) < 1e-5


def test_transformers_5_rope_parameters_are_read_and_written_back(tmp_path):
    """transformers 5 keeps rope_theta in rope_parameters (Mixtral's is 1e6, not the default)."""
    _, config_json = _hf_directory(tmp_path, 0, np.float32)
    config_json.pop("rope_theta")
    config_json["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    model = hf.load(tmp_path)
    assert model.config.rope_theta == 1e6
    hf.save(tmp_path / "out", model)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_parameters"]["rope_theta"] == 1e6 and "rope_theta" not in written
    config_json["rope_parameters"]["rope_type"] = "llama3"
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(ConfigError, match="rope_type='llama3'"):
        hf.load(tmp_path)
