"""FP8 GEMMs (jphantom.fp8, --precision fp8): the GEMMs are TransformerEngine's recipe exactly
(E4M3 operands forward, the output gradient in E5M2 for dgrad and wgrad, per-tensor current
scales), one scale per tensor however it is split (an FP8 step under tensor parallelism equals
the one-device FP8 step), only the blocks' linear layers are FP8, and training follows bf16's
loss within the tolerance experiments/fp8.py measures."""

import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_tree_close, random_params, step_loss_and_grads
from jphantom import fp8
from jphantom import program as program_module
from jphantom.models.llama import Llama, LlamaConfig
from jphantom.nn.stack import set_fp8
from jphantom.precision import Precision

LLAMA = LlamaConfig(vocab_size=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                    max_positions=16)


def reference_qdq(x, fmt):
    """x rounded to ``fmt`` with the per-tensor scale amax / max_format, in float32."""
    x = np.asarray(x, np.float32)
    scale = np.max(np.abs(x)) / float(jnp.finfo(fmt).max)
    return np.asarray(jnp.asarray(x / scale).astype(fmt).astype(jnp.float32)) * scale


def test_fp8_matmul_is_the_recipe_forward_and_backward():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    y, pullback = jax.vjp(fp8.matmul, x, w)
    xq, wq, gq = (reference_qdq(a, f) for a, f in ((x, fp8.E4M3), (w, fp8.E4M3), (g, fp8.E5M2)))
    np.testing.assert_allclose(y, xq @ wq, rtol=1e-5, atol=1e-5)
    dx, dw = pullback(g)
    np.testing.assert_allclose(dx, gq @ wq.T, rtol=1e-5, atol=1e-5)  # dgrad: E5M2 x E4M3
    np.testing.assert_allclose(dw, np.einsum("bni,bno->io", xq, gq), rtol=1e-5, atol=1e-4)
    assert 0.01 < float(jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w)) < 0.1  # it rounds


def test_batched_matmul_is_the_experts_einsum_on_fp8_operands():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 8, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 16, 4)), jnp.float32)
    want = np.einsum("enh,ehf->enf", reference_qdq(x, fp8.E4M3), reference_qdq(w, fp8.E4M3))
    np.testing.assert_allclose(fp8.batched_matmul(x, w), want, rtol=1e-5, atol=1e-5)


def test_the_fp8_policy_is_bf16_with_the_blocks_linear_layers_on_fp8():
    policy = Precision.named("fp8")
    assert (policy.compute, policy.fp8, policy.name) == ("bfloat16", True, "fp8")
    config = LlamaConfig(vocab_size=64, hidden=32, intermediate=32, layers=1, heads=4,
                         kv_heads=4, max_positions=16, experts=4, top_k=2)
    model = set_fp8(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    fp8_paths = {".".join(map(str, path)) for path, m in nnx.iter_modules(model)
                 if getattr(m, "dot_general", None) is fp8.dot_general or getattr(m, "fp8", False)}
    block = "layers.block."
    assert fp8_paths == {f"{block}self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj",
                                                            "o_proj")} | {f"{block}moe.experts"}
    # not the router (layers.block.moe.router), nor the embedding or head outside the blocks


@functools.lru_cache(maxsize=None)
def _fp8_float32(mesh):
    program = program_module.build(LLAMA, "dense" if mesh == "model=1" else "tensor", mesh)
    params = random_params(program)
    rng = np.random.default_rng(0)
    batch = tuple(rng.integers(0, 64, (8, 16)).astype(np.int32) for _ in range(2))
    loss, grads = step_loss_and_grads("dense" if mesh == "model=1" else "tensor", LLAMA, mesh,
                                      params, *batch, precision=Precision("float32", fp8=True))
    return float(loss), jax.device_get(grads)


def test_an_fp8_step_under_tensor_parallelism_equals_the_one_device_fp8_step():
    """Every tensor split over ``model`` is quantised with the scale of the whole tensor (its
    ranks' amax reduced), so with float32 elsewhere the tensor-parallel FP8 step is the
    one-device FP8 step."""
    want_loss, want = _fp8_float32("model=1")
    loss, grads = _fp8_float32("model=2")
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert_tree_close(grads, want, 1e-5)


@pytest.mark.slow
def test_fp8_training_follows_bf16_within_the_measured_tolerance():
    """experiments/fp8.py's quick case (a tiny Llama, 20 steps on data=2,model=2), against the
    tolerance docs/gpu.md gives from the 300-step run: 2% at every evaluation (that run: at most
    1.94%, final 0.35%; this case: 0.03%)."""
    path = Path(__file__).resolve().parents[1] / "experiments" / "fp8.py"
    spec = importlib.util.spec_from_file_location("fp8_experiment", path)
    experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiment)
    result = experiment.curves(experiment.QUICK, steps=20, every=5)
    gaps = experiment.gaps(result)
    assert gaps["validation_max_relative_gap"] < 0.02
    assert gaps["train_window_max_relative_gap"] < 0.02
    assert result["fp8"]["validation"] != result["bf16"]["validation"]  # FP8 did round
