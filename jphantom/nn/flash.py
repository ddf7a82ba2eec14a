"""Flash-attention blocks with their softmax statistics: the fused kernel ring attention merges.

Ring attention (:mod:`jphantom.nn.attention`) computes each K/V chunk's attention separately and
merges the blocks by their log-sum-exp, and its backward needs each block's gradients *given the
final* output and log-sum-exp (flash attention's backward, Dao et al. 2022, Alg. 4). What jax
offers for that on NVIDIA GPUs:

- ``jax.nn.dot_product_attention(..., implementation="cudnn", return_residual=True)`` returns
  cuDNN's statistics, but cast to the output's dtype (bf16: the merge weights exp(lse_s - lse)
  then carry errors of up to 2^-8 relative per unit of lse, several percent at the lse of a long
  sequence) and as a stop-gradient, and its backward takes no outside statistics: it cannot be a
  ring's block.
- jax's Pallas Triton flash attention, ``jax.experimental.pallas.ops.gpu.attention``: its forward
  kernel (``mha_forward_kernel``) writes the float32 log-sum-exp (in base 2), and its backward
  kernel (``mha_backward_kernel``) reads the output, log-sum-exp and delta = sum(do o) it is
  given, so the ring hands it the final ones. This module runs the two kernels with its own
  ``pallas_call``s: the module's ``mha`` wrapper declares its statistics' output without the
  mesh axes it varies over, which the step's check of varying axes (``check_vma``) refuses, and
  its backward is a private function. Nothing here opens a ``shard_map``: the blocks run inside
  the training step's one (:func:`jphantom.step.train_step.shard_map`). Tested on every jax version
  the project supports (on CPU through Pallas' interpreter, ``interpret=True``); jax 0.12 marks
  the module deprecated in favour of tokamax, its kernels unchanged there.

So on NVIDIA GPUs (bf16/fp16, head dimension a multiple of 8 up to 128) a ring's blocks run
Pallas' Triton kernels; elsewhere XLA's einsum blocks. K/V heads are repeated to the query heads
for the kernel (it takes one head count), their gradients summed back.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

from jphantom.runtime import comm

LN2 = math.log(2.0)


def _module():
    with warnings.catch_warnings():  # jax 0.12: "deprecated, use tokamax" (module docstring)
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention
    return attention


def _heads(q, k, v):
    """q [B, Sq, Hk, G, d] -> [B, Sq, Hk G, d]; k, v [B, Sk, Hk, d] repeated G times."""
    b, sq, hk, g, d = q.shape
    return (q.reshape(b, sq, hk * g, d), jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2))


def _tile(n: int, most: int) -> int:
    return next(t for t in (most, 64, 32, 16, 8, 4, 2, 1) if t <= n and n % t == 0)


def _like(shape, dtype, *arrays):
    """An array of ``shape`` and ``dtype`` varying over the mesh axes ``arrays`` vary over: a
    ``pallas_call``'s out_shape inside the step (its type is all that is read)."""
    return _vary(jnp.zeros(shape, dtype), *arrays)


def _vary(x, *arrays):
    """``x`` typed as varying over the mesh axes ``arrays`` vary over. A ``pallas_call``'s
    outputs come back typed invariant under the step's ``check_vma`` though each rank
    computed its own: this restores their type (a forward identity; no gradient passes through
    here, the ring's ``custom_vjp`` rules call these blocks)."""
    axes = set().union(*(comm.varying_axes(a) for a in arrays)) - comm.varying_axes(x)
    return comm.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def kernel_name(segment_ids, way: str, causal: bool) -> str:
    """A block kernel's name, which the compiled program keeps in its op_name: what
    :mod:`jphantom.predict.costs` prices it by (``ring_block_forward_causal``,
    ``packed_attention_backward``, ...)."""
    base = "ring_block" if segment_ids is None else "packed_attention"
    return f"{base}_{way}" + ("_causal" if causal else "")


def _forward(q, k, v, *, causal, scale, interpret, segment_ids=None):
    """``mha_forward_kernel`` on [B, S, H, d] q, k, v (``segment_ids`` [B, S]: a query attends
    only to keys of its segment; q and k the same tokens): output and base-2 log-sum-exp
    [B, H, S]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    attention = _module()
    b, sq, h, d = q.shape
    sk = k.shape[1]
    block_q, block_k = _tile(sq, 128), _tile(sk, 128)
    padded = pl.next_power_of_2(d)
    kernel = functools.partial(attention.mha_forward_kernel, sm_scale=scale, block_q=block_q,
                               block_k=block_k, head_dim=d, causal=causal)
    rows = lambda n: pl.BlockSpec((None, n, None, padded), lambda i, j, k: (j, i, k, 0))
    whole = pl.BlockSpec((None, sk, None, padded), lambda _, j, k: (j, 0, k, 0))
    segments = (None if segment_ids is None
                else pl.BlockSpec((None, sk), lambda _, j, k: (j, 0)))
    out = pl.pallas_call(
        kernel, grid=(sq // block_q, b, h),
        in_specs=[rows(block_q), whole, whole, segments],
        out_specs=[rows(block_q), pl.BlockSpec((None, None, block_q), lambda i, j, k: (j, k, i))],
        out_shape=[_like(q.shape, q.dtype, q, k, v), _like((b, h, sq), jnp.float32, q, k, v)],
        compiler_params=plgpu.CompilerParams(num_warps=4 if d <= 64 else 8, num_stages=2),
        interpret=interpret, name=kernel_name(segment_ids, "forward", causal))(q, k, v, segment_ids)
    return [_vary(a, q, k, v) for a in out]


def _backward(q, k, v, out, do, lse2, delta, *, causal, scale, interpret, segment_ids=None):
    """``mha_backward_kernel``: dq, dk, dv of [B, S, H, d] blocks given the final ``out``, base-2
    log-sum-exp and ``delta`` = sum(do out) [B, H, Sq]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    attention = _module()
    b, sq, h, d = q.shape
    sk = k.shape[1]
    count = max(1, min(sq, sk) // _tile(min(sq, sk), 32))  # as many q as kv tiles
    while sq % count or sk % count:
        count -= 1
    block_q, block_kv = sq // count, sk // count
    padded = pl.next_power_of_2(d)
    kernel = functools.partial(attention.mha_backward_kernel, sm_scale=scale, causal=causal,
                               block_q_dkv=block_q, block_kv_dkv=block_kv, block_q_dq=block_q,
                               block_kv_dq=block_kv, head_dim=d)
    rows = lambda n: pl.BlockSpec((None, n, None, padded), lambda i, j, _: (i, 0, j, 0))
    stats = pl.BlockSpec((None, None, sq), lambda i, j, _: (i, j, 0))
    tiles = lambda n: pl.BlockSpec((None, n, None, padded), lambda i, j, k: (i, k, j, 0))
    varying = (q, k, v, out, do)
    segments = (None if segment_ids is None
                else pl.BlockSpec((None, sk), lambda i, j, _: (i, 0)))
    grads = pl.pallas_call(
        kernel, grid=(b, h, count),
        in_specs=[rows(sq), rows(sk), rows(sk), segments, rows(sq), rows(sq), stats, stats],
        out_specs=[tiles(block_q), tiles(block_kv), tiles(block_kv)],
        out_shape=[_like(q.shape, q.dtype, *varying), _like(k.shape, k.dtype, *varying),
                   _like(v.shape, v.dtype, *varying)],
        compiler_params=plgpu.CompilerParams(
            num_warps=4 if block_q * block_kv < 128 * 128 else 8, num_stages=2),
        interpret=interpret, name=kernel_name(segment_ids, "backward", causal))(
            q, k, v, segment_ids, out, do, lse2, delta)
    return [_vary(g, *varying) for g in grads]


def block(q, k, v, *, causal: bool, scale: float, interpret: bool = False, segment_ids=None):
    """One block: q [B, Sq, Hk, G, d] over k, v [B, Sk, Hk, d] (``causal``: query i attends keys
    0..i) -> normalised output [B, Sq, Hk, G, d] and natural log-sum-exp [B, Sq, Hk, G], both
    float32."""
    b, sq, hk, g, d = q.shape
    qh, kh, vh = _heads(q, k, v)
    with jax.enable_x64(False):  # the kernels' index arithmetic is 32-bit
        out, lse2 = _forward(qh, kh, vh, causal=causal, scale=scale, interpret=interpret,
                             segment_ids=segment_ids)
    lse = jnp.transpose(lse2, (0, 2, 1)).reshape(b, sq, hk, g) * LN2
    return out.reshape(q.shape).astype(jnp.float32), lse


def block_grads(q, k, v, out, lse, do, *, causal: bool, scale: float, interpret: bool = False,
                segment_ids=None):
    """dq, dk, dv (float32) of one block given the *final* output ``out`` [B, Sq, Hk, G, d] and
    natural log-sum-exp ``lse`` [B, Sq, Hk, G] of the rows and their gradient ``do``."""
    b, sq, hk, g, d = q.shape
    sk = k.shape[1]
    qh, kh, vh = _heads(q, k, v)
    rows = lambda a: a.reshape(b, sq, hk * g, d).astype(q.dtype)
    per_head = lambda a: jnp.transpose(a.reshape(b, sq, hk * g), (0, 2, 1)).astype(jnp.float32)
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    with jax.enable_x64(False):  # the kernels' index arithmetic is 32-bit
        dq, dk, dv = _backward(qh, kh, vh, rows(out), rows(do), per_head(lse / LN2),
                               per_head(delta), causal=causal, scale=scale, interpret=interpret,
                               segment_ids=segment_ids)
    per_group = lambda a: a.reshape(b, sk, hk, g, d).astype(jnp.float32).sum(axis=3)
    return dq.reshape(q.shape).astype(jnp.float32), per_group(dk), per_group(dv)


def _grouped(q, k):
    b, s, hq, d = q.shape
    return q.reshape(b, s, k.shape[2], hq // k.shape[2], d)


def _packed_forward(q, k, v, segment_ids, interpret):
    o, lse = block(_grouped(q, k), k, v, causal=True, scale=1.0 / math.sqrt(q.shape[-1]),
                   interpret=interpret, segment_ids=segment_ids)
    out = o.reshape(q.shape).astype(q.dtype)
    return out, (q, k, v, segment_ids, out, lse)


def _packed(q, k, v, segment_ids, interpret):
    return _packed_forward(q, k, v, segment_ids, interpret)[0]


def _packed_backward(interpret, residuals, do):
    q, k, v, segment_ids, out, lse = residuals
    dq, dk, dv = block_grads(_grouped(q, k), k, v, _grouped(out, k), lse, _grouped(do, k),
                             causal=True, scale=1.0 / math.sqrt(q.shape[-1]),
                             interpret=interpret, segment_ids=segment_ids)
    return (dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None)


_packed_attention = jax.custom_vjp(_packed, nondiff_argnums=(4,))
_packed_attention.defvjp(_packed_forward, _packed_backward)


def packed_attention(q, k, v, segment_ids, *, interpret: bool = False) -> jax.Array:
    """Causal attention of packed rows, q [B, S, Hq, d], k and v [B, S, Hk, d], ``segment_ids``
    [B, S] (:mod:`jphantom.nn.attention.packing`) -> [B, S, Hq, d], on jax's Pallas Triton flash
    kernels (forward and backward take the segment ids; memory linear in S): the fused kernel of
    packed batches on NVIDIA GPUs, where ``jax.nn.dot_product_attention`` takes no segment ids.
    Stores the output in the compute dtype and the float32 log-sum-exp for the backward."""
    return _packed_attention(q, k, v, jnp.asarray(segment_ids, jnp.int32), interpret)


__all__ = ["block", "block_grads", "packed_attention"]
