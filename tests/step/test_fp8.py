"""FP8 GEMMs (jphantom.step.fp8, --precision fp8): the GEMMs are TransformerEngine's recipe exactly
(E4M3 operands forward, the output gradient in E5M2 for dgrad and wgrad, per-tensor current
scales), one scale per tensor however it is split (an FP8 step under tensor parallelism equals
the one-device FP8 step), only the blocks' linear layers are FP8, and training follows bf16's
loss within the tolerance experiments/fp8.py measures."""

import dataclasses
import functools
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import assert_tree_close, jit_exact, random_params
from jphantom.step import fp8
from jphantom.errors import ConfigError
from jphantom.registry import program as program_module
from jphantom.runtime.mesh import first_devices
from jphantom.models.gpt2.config import TransformerConfig
from jphantom.models.llama import Llama, LlamaConfig
from jphantom.nn.stack import set_fp8
from jphantom.step.precision import Precision

LLAMA = LlamaConfig(vocab_size=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                    max_positions=16)


def reference_qdq(x, fmt):
    """x rounded to ``fmt`` with the per-tensor scale, the power of two at or above
    amax / max_format, in float32."""
    x = np.asarray(x, np.float32)
    scale = 2.0 ** np.ceil(np.log2(np.max(np.abs(x)) / float(jnp.finfo(fmt).max)))
    return np.asarray(jnp.asarray(x / scale).astype(fmt).astype(jnp.float32)) * scale


def test_the_scale_is_the_power_of_two_at_or_above_amax_over_the_format_s_largest():
    for v, expected in ((1.0, 1.0), (0.75, 1.0), (3.0, 4.0), (448.0, 512.0), (2.0**-126, 2.0**-126),
                        (1.0000001, 2.0), (0.99999994, 1.0)):
        assert float(fp8.power_of_two_at_least(jnp.float32(v))) == expected, v
    x = jnp.asarray([0.5, -300.0, 2.0], jnp.float32)  # amax 300 / 448 -> 1
    assert float(fp8.scale_of(x, fp8.E4M3)) == 1.0
    assert float(fp8.scale_of(jnp.zeros(3), fp8.E4M3)) == float(jnp.finfo(jnp.float32).tiny)
    x8, scale = fp8.quantize(x * 3, fp8.E4M3)  # amax 900 / 448 -> 4: x / 4 exactly
    assert float(scale) == 4.0 and np.array_equal(np.asarray(x8, np.float32), [0.375, -224, 1.5])


def test_in_bf16_an_fp8_gemm_is_the_once_rounded_product():
    """With power-of-two scales the GEMM's bf16 result is its float32 product rounded once, what
    cuBLAS-LT's epilogue computes (``benchmarks/fp8_gemm_forms.py``): bit for bit on CPU."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(64, 48)) * 5, jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(48, 32)) * 0.02, jnp.bfloat16)
    y = fp8.matmul(x, w)
    assert y.dtype == jnp.bfloat16
    x8, sx = fp8.quantize(x, fp8.E4M3)
    w8, sw = fp8.quantize(w, fp8.E4M3)
    exact = (np.asarray(x8, np.float64) @ np.asarray(w8, np.float64)) * float(sx) * float(sw)
    assert np.array_equal(np.asarray(y), np.asarray(jnp.asarray(exact, jnp.bfloat16)))


@pytest.mark.parametrize("family", ["ocp", "fnuz"])
def test_fp8_matmul_is_the_recipe_forward_and_backward(family):
    """In either format family: OCP (NVIDIA, MI350X) and FNUZ (MI300X's, largest E4M3 240)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, 8, 16)), jnp.float32)
    e4m3, e5m2 = fp8.FAMILIES[family]
    with fp8.using(family):
        y, pullback = jax.vjp(fp8.matmul, x, w)
        dx, dw = pullback(g)
    xq, wq, gq = (reference_qdq(a, f) for a, f in ((x, e4m3), (w, e4m3), (g, e5m2)))
    np.testing.assert_allclose(y, xq @ wq, rtol=1e-5, atol=1e-5)
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


MIXTRAL = dataclasses.replace(LLAMA, experts=4, top_k=2)
GPT2 = TransformerConfig(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=2)


@functools.lru_cache(maxsize=None)
def _fp8_step(config, strategy, mesh, precision=Precision("float32", fp8=True), family="ocp",
              **options):
    """The loss and gradients of one step of ``config`` under ``strategy`` on ``mesh`` (random
    parameters, the same for every layout of a shape), float32 compute with FP8 GEMMs in
    ``family``'s formats unless ``precision`` says otherwise."""
    program = program_module.build(config, strategy, mesh, **options)
    step = program.train_step(program.mesh.build(first_devices(program.mesh.device_count)),
                              optax.sgd(0.1), donate=False, precision=precision)
    rng = np.random.default_rng(0)
    batch = tuple(rng.integers(0, 64, (8, 16)).astype(np.int32) for _ in range(2))
    jit = jit_exact if family == "fnuz" else jax.jit
    with fp8.using(family):
        loss, grads = jit(step.value_and_grad())(random_params(program), *batch)
    return float(loss), jax.device_get(grads)


@pytest.mark.parametrize("config, strategy, mesh, options", [
    (LLAMA, "tensor", "model=2", {}),
    (MIXTRAL, "tensor", "expert=2", {}),
    pytest.param(LLAMA, "tensor", "model=2", {"sequence_parallel": True}, marks=pytest.mark.slow),
    (GPT2, "pmm3d", "x=2,y=2", {}),
    (LLAMA, "tensor", "model=2", {"family": "fnuz"}),
], ids=["tensor", "expert", "sequence-parallel", "pmm3d", "tensor-fnuz"])
@pytest.mark.slow_cells("tensor", "tensor-fnuz", "expert")
def test_an_fp8_step_under_a_layout_equals_the_one_device_fp8_step(config, strategy, mesh,
                                                                   options):
    """Every tensor split over ``model``, ``context``, ``x``, ``y`` or ``expert`` is quantised
    with the scale of the whole tensor (its ranks' amax reduced), so with float32 elsewhere the
    FP8 step of tensor, sequence, expert and pmm3d parallelism is the one-device FP8 step (under
    pmm3d the FP8 GEMM's backward sums the gradient of an operand replicated over an axis, as
    autodiff does for a plain product). FNUZ formats (MI300X's) likewise."""
    want_loss, want = _fp8_step(config, "dense", "model=1", family=options.get("family", "ocp"))
    loss, grads = _fp8_step(config, strategy, mesh, **options)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert_tree_close(grads, want, 1e-5)


def _relative_difference(grads, want) -> float:
    """||g - g_ref|| / ||g_ref|| over the whole gradient."""
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64))
             for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want))]
    return float(np.sqrt(sum(((a - b) ** 2).sum() for a, b in pairs))
                 / np.sqrt(sum((b ** 2).sum() for _, b in pairs)))


@pytest.mark.slow
def test_in_bf16_an_fp8_tensor_parallel_step_differs_by_bf16_s_difference_amplified():
    """With bf16 compute the tensor-parallel step's sums round differently (its partial sums are
    bf16 before the all-reduce), and FP8 rounding amplifies that: an input moved by d (relative)
    crosses a rounding boundary of a format with unit roundoff U with probability about d / U,
    and then moves by about U, so the RMS change is about sqrt(d U), sqrt(U / d) times d. With
    d at bf16's level and U = 2^-3 (E5M2), that is sqrt(2^5) ~ 5.7: docs/gpu.md's bound is 8x
    the bf16 step's own difference (measured 6.2x on GPT-2: 7.8e-3 in bf16, 4.8e-2 in FP8)."""
    bf16, fp8_policy = Precision.named("bf16"), Precision.named("fp8")
    differences = {}
    for name, policy in (("bf16", bf16), ("fp8", fp8_policy)):
        _, want = _fp8_step(GPT2, "dense", "model=1", policy)
        _, grads = _fp8_step(GPT2, "tensor", "model=2", policy)
        differences[name] = _relative_difference(grads, want)
    assert 0 < differences["bf16"] < 2e-2
    assert differences["fp8"] < 8 * differences["bf16"]


@pytest.mark.slow
def test_fp8_training_follows_bf16_within_the_measured_tolerance():
    """experiments/fp8.py's quick case (a tiny Llama, 20 steps on data=2,model=2), against the
    tolerance docs/gpu.md gives from the 300-step run: 2% at every evaluation (that run: at most
    1.94%, final 0.35%; this case: 0.03%)."""
    path = Path(__file__).resolve().parents[2] / "experiments" / "fp8.py"
    spec = importlib.util.spec_from_file_location("fp8_experiment", path)
    experiment = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(experiment)
    result = experiment.curves(experiment.QUICK, steps=20, every=5)
    gaps = experiment.gaps(result)
    assert gaps["validation_max_relative_gap"] < 0.02
    assert gaps["train_window_max_relative_gap"] < 0.02
    assert result["fp8"]["validation"] != result["bf16"]["validation"]  # FP8 did round


class _Device:  # what fp8.family_of reads of a jax device
    def __init__(self, platform, device_kind, compute_capability=None):
        self.platform, self.device_kind = platform, device_kind
        self.compute_capability = compute_capability


def test_the_fp8_formats_are_the_device_s_and_gfx90a_is_refused_by_name():
    """OCP on CPU, NVIDIA and gfx950; FNUZ on gfx942 (by architecture on a real GPU, by kind on an
    ahead-of-time target, whose devices say 'MI300X'); MI250X refused before anything traces."""
    cases = [(_Device("cpu", "cpu"), "ocp"),
             (_Device("gpu", "NVIDIA H100 80GB HBM3", "9.0"), "ocp"),
             (_Device("rocm", "AMD Instinct MI300X", "gfx942"), "fnuz"),
             (_Device("gpu", "MI300X"), "fnuz"),
             (_Device("rocm", "AMD Instinct MI355X", "gfx950"), "ocp"),
             (_Device("gpu", "MI350X"), "ocp")]
    for device, family in cases:
        assert fp8.family_of(device) == family, device.device_kind
    for device in (_Device("rocm", "AMD Instinct MI250X", "gfx90a"), _Device("gpu", "MI250")):
        with pytest.raises(ConfigError, match="no FP8 GEMMs.*--precision bf16"):
            fp8.family_of(device)
    with pytest.raises(ConfigError, match="different FP8 formats"):
        fp8.select([cases[2][0], cases[4][0]])
    assert fp8.formats() == fp8.FAMILIES["ocp"]  # a refused selection changed nothing


def test_the_api_step_selects_the_mesh_devices_formats():
    """make_train_step(precision="fp8") picks the formats of its mesh's devices, as the CLI's
    build does: OCP on the CPU, whatever was selected before."""
    import jphantom

    mesh = program_module.build(LLAMA, "dense", "model=1").mesh.build(first_devices(1))
    model = Llama(LLAMA, rngs=nnx.Rngs(0))
    with fp8.using("fnuz"):
        jphantom.make_train_step(model, mesh, optax.sgd(0.1), program_module.lm_loss,
                                 precision="fp8")
        assert fp8.formats() == fp8.FAMILIES["ocp"]
