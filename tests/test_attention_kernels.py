"""The attention kernels (jphantom.nn.attention, jphantom.nn.flash): the core through
``jax.nn.dot_product_attention`` equals the einsum attention it replaced (GQA without repeated
K/V, sliding windows); the kernel choice is visible and refuses what cannot run; the ring's
blocks on jax's Pallas flash kernels (run by Pallas' interpreter here) equal the einsum blocks,
forward and backward, inside a real ring."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jphantom.errors import ConfigError
from jphantom.runtime.mesh import MeshConfig, first_devices
from jphantom.nn import attention, flash


def einsum_attention(q, k, v, mask=None):
    """The attention jphantom computed before it called jax.nn.dot_product_attention."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    seq, d = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(d, q.dtype))
    if mask is None:
        mask = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), -1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)


def _qkv(seq=16, heads=4, kv_heads=2, d=8, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(batch, seq, heads, d)), jnp.float32),
            jnp.asarray(rng.normal(size=(batch, seq, kv_heads, d)), jnp.float32),
            jnp.asarray(rng.normal(size=(batch, seq, kv_heads, d)), jnp.float32))


@pytest.mark.parametrize("window", [None, 4])
def test_causal_attention_equals_the_einsum_attention(window):
    q, k, v = _qkv()
    mask = None
    if window is not None:
        pos = jnp.arange(q.shape[1])
        mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)
    ours = lambda q, k, v: attention.causal_attention(q, k, v, window=window)
    theirs = lambda q, k, v: einsum_attention(q, k, v, mask)
    np.testing.assert_allclose(ours(q, k, v), theirs(q, k, v), atol=1e-6)
    for a, b in zip(jax.grad(loss(ours), (0, 1, 2))(q, k, v),
                    jax.grad(loss(theirs), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_float16_attention_compiles_on_cpu_and_equals_float32_to_its_rounding(window):
    """jax.nn.dot_product_attention's XLA path pins an F16_F16_F32 dot that XLA:CPU refuses:
    float16 goes through the written-out path (same arithmetic), forward and backward."""
    q, k, v = _qkv()
    half = lambda f: jax.jit(lambda q, k, v: f(q.astype(jnp.float16), k.astype(jnp.float16),
                                              v.astype(jnp.float16)).astype(jnp.float32))
    ours = half(lambda q, k, v: attention.causal_attention(q, k, v, window=window))
    np.testing.assert_allclose(ours(q, k, v), attention.causal_attention(q, k, v, window=window),
                               atol=3e-3)
    grad = jax.jit(jax.grad(lambda q: jnp.sum(ours(q, k, v))))(q)
    assert grad.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(grad)))


def test_the_window_changes_the_result():
    q, k, v = _qkv()
    assert not np.allclose(attention.causal_attention(q, k, v, window=4),
                           attention.causal_attention(q, k, v))


def test_the_kernel_choice_says_why_and_refuses_what_cannot_run(monkeypatch):
    assert attention.choose("auto", "nvidia", jnp.bfloat16, 128)[0] == "cudnn"
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_gpu_deterministic_ops=true")
    kernel, reason = attention.choose("auto", "nvidia", jnp.bfloat16, 128)
    assert kernel == "xla" and "--xla_gpu_deterministic_ops=true" in reason
    with pytest.raises(ConfigError, match="deterministic_ops"):
        attention.choose("cudnn", "nvidia", jnp.bfloat16, 128)
    monkeypatch.delenv("XLA_FLAGS")
    for platform, dtype, d, why in (("cpu", jnp.bfloat16, 128, "no cuDNN"),
                                    ("nvidia", jnp.float32, 128, "float32 compute"),
                                    ("nvidia", jnp.bfloat16, 256, "head dimension 256"),
                                    ("rocm", jnp.bfloat16, 64, "jax offers no fused attention")):
        kernel, reason = attention.choose("auto", platform, dtype, d)
        assert kernel == "xla" and why in reason
        with pytest.raises(ConfigError, match=why):
            attention.choose("cudnn", platform, dtype, d)
    assert attention.choose("xla", "nvidia", jnp.bfloat16, 128)[0] == "xla"
    with pytest.raises(ConfigError, match="attention='flash'"):
        attention.CausalAttention(implementation="flash")
    ring = attention.RingAttention(size=2)
    ring.platform = "nvidia"
    assert ring.kernel(jnp.bfloat16, 64)[0] == "pallas"
    gathered = attention.GatheredAttention(size=2)
    gathered.platform = "nvidia"
    assert gathered.kernel(jnp.bfloat16, 64)[0] == "pallas"
    assert gathered.kernel(jnp.bfloat16, 64, packed=True)[0] == "xla-masked"
    windowed = attention.GatheredAttention(size=2, window=8)
    windowed.platform = "nvidia"
    assert windowed.kernel(jnp.bfloat16, 64)[0] == "xla-masked"
    with pytest.raises(ConfigError, match="all-gather"):
        attention.RingAttention(size=2, window=8)


@pytest.mark.parametrize("causal, keys", [(True, 16), (False, 8), (False, 32)])
@pytest.mark.slow_cells("False-32", "False-8")  # make test: the causal blocks
def test_flash_blocks_equal_the_einsum_blocks(causal, keys):
    """One block, forward (output, log-sum-exp) and backward given the final statistics, with
    GQA (2 query heads per key head) and unequal query and key lengths."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 16, 2, 2, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, keys, 2, 8)), jnp.float32) for _ in range(2))
    do = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    scale = 1 / math.sqrt(8)
    mask = jnp.tril(jnp.ones((16, keys), bool)) if causal else None
    want_o, want_lse = attention.block(q, k, v, mask, scale)
    o, lse = flash.block(q, k, v, causal=causal, scale=scale, interpret=True)
    np.testing.assert_allclose(o, want_o, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)
    delta = jnp.sum(do * want_o, -1)
    want = attention.block_grads(q, k, v, do, want_lse, delta, mask, scale)
    got = flash.block_grads(q, k, v, want_o, want_lse, do, causal=causal, scale=scale,
                            interpret=True)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("size, balanced", [pytest.param(2, True, marks=pytest.mark.slow),
                                           (4, True), (2, False)])
@pytest.mark.slow_cells("2-False")
def test_ring_on_flash_blocks_equals_the_unsplit_attention(size, balanced):
    """The whole ring (forward, custom backward, every branch of the schedule) with its blocks on
    the Pallas kernels equals causal attention of the whole sequence, value and gradients.
    (``check_vma=False``: Pallas' interpreter, not the kernels, trips over varying types; the
    compiled kernels run in the step's ``check_vma=True`` shard_map, tests/compile/test_aot.py.)"""
    mesh = MeshConfig.parse(f"context={size}").build(first_devices(size))
    q, k, v = _qkv(seq=8 * 2 * size, batch=1)
    spec = P(None, "context")

    def ring(q, k, v):
        return jax.shard_map(
            lambda q, k, v: attention.ring_attention(q, k, v, size=size, balanced=balanced,
                                                     kernel="pallas-interpret"),
            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(q, k, v)

    order = lambda x: attention.to_context_order(x, size, balanced=balanced)
    back = lambda x: attention.from_context_order(x, size, balanced=balanced)
    ours = lambda q, k, v: back(ring(order(q), order(k), order(v)))
    theirs = lambda q, k, v: einsum_attention(q, k, v)

    def value_and_grads(q, k, v):  # the gradients of sum(sin(out)): one compile for both
        out, pull = jax.vjp(ours, q, k, v)
        return out, pull(jnp.cos(out))

    out, grads = jax.jit(value_and_grads)(q, k, v)
    np.testing.assert_allclose(out, theirs(q, k, v), atol=2e-5)
    loss = lambda q, k, v: jnp.sum(jnp.sin(theirs(q, k, v)))
    for a, b in zip(grads, jax.grad(loss, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=2e-5)
