"""Blockwise attention with flash attention's online softmax (Dao et al. 2022): one block's
normalised output and log-sum-exp, its gradients given the final log-sum-exp, the merge of two
blocks

    lse = logaddexp(lse, lse_s),   o = o exp(lse_old - lse) + o_s exp(lse_s - lse)

the blocks on XLA's einsums or :mod:`jphantom.nn.flash`'s Pallas kernels, and what a ring step
does with a chunk in each layout (the branches of :func:`~jphantom.nn.attention.schedule`)."""

from __future__ import annotations

import jax.numpy as jnp

from jphantom.runtime import comm
from jphantom.errors import ConfigError
from jphantom.nn.attention.packing import segment_mask


def vary_like(x, like):
    """``x`` varying over the mesh axes ``like`` varies over (a branch's constant output)."""
    axes = tuple(sorted(comm.varying_axes(like)))
    return comm.pcast(x, axes, to="varying") if axes else x


def _spread(mask):
    """A [Sq, Sk] or each row's [B, Sq, Sk] mask over [B, Sq, Hk, G, Sk] scores."""
    return mask[None, :, None, None, :] if mask.ndim == 2 else mask[:, :, None, None, :]


def block(q, k, v, mask, scale):
    """Attention of q [B, Sq, Hk, G, d] over k, v [B, Sk, Hk, d] under ``mask`` [Sq, Sk] or
    [B, Sq, Sk] (None: all): the normalised output [B, Sq, Hk, G, d] and log-sum-exp
    [B, Sq, Hk, G], float32. Rows with every key masked give output 0 and log-sum-exp -inf."""
    s = jnp.einsum("bqhgd,bkhd->bqhgk", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        s = jnp.where(_spread(mask), s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    total = jnp.sum(p, axis=-1)
    lse = m + jnp.log(total)
    p = p / jnp.where(total > 0, total, 1.0)[..., None]
    o = jnp.einsum("bqhgk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, lse


def block_grads(q, k, v, do, lse, delta, mask, scale):
    """dq, dk, dv of one block given the final log-sum-exp ``lse`` and ``delta`` = sum(do o)
    [B, Sq, Hk, G] (flash attention's backward), float32."""
    f32 = jnp.float32
    s = jnp.einsum("bqhgd,bkhd->bqhgk", q, k, preferred_element_type=f32) * scale
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(_spread(mask), p, 0.0)
    dv = jnp.einsum("bqhgk,bqhgd->bkhd", p, do, preferred_element_type=f32)
    dp = jnp.einsum("bqhgd,bkhd->bqhgk", do, v.astype(f32), preferred_element_type=f32)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bqhgk,bkhd->bqhgd", ds, k.astype(f32), preferred_element_type=f32) * scale
    dk = jnp.einsum("bqhgk,bqhgd->bkhd", ds, q.astype(f32), preferred_element_type=f32) * scale
    return dq, dk, dv


def merge(o, lse, o_s, lse_s):
    new = jnp.logaddexp(lse, lse_s)  # lse is finite: every query attends itself at step 0
    return o * jnp.exp(lse - new)[..., None] + o_s * jnp.exp(lse_s - new)[..., None], new


def block_kernels(kernel: str, scale: float):
    """``(forward, backward)`` of one block for ``kernel`` (``xla``: the einsum blocks above;
    ``pallas`` / ``pallas-interpret``: :mod:`jphantom.nn.flash`'s Triton kernels, the latter
    through Pallas' interpreter on any platform, for tests): ``forward(q, k, v, causal,
    segments=None) -> (o, lse)`` and ``backward(q, k, v, o, lse, delta, do, causal,
    segments=None) -> (dq, dk, dv)`` given the final ``o``, ``lse`` and ``delta`` = sum(do o),
    float32. ``causal``: query i of the block attends keys 0..i (the diagonal step's mask in
    both layouts); ``segments``: the queries' and keys' segment ids ([B, Sq], [B, Sk]) of a
    packed batch, a query attending only keys of its segment (XLA's blocks only)."""
    if kernel == "xla":
        def mask(q, causal, segments):
            out = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool)) if causal else None
            if segments is None:
                return out
            same = segment_mask(*segments)
            return same if out is None else out[None] & same
        return (lambda q, k, v, causal, segments=None: block(q, k, v, mask(q, causal, segments),
                                                             scale),
                lambda q, k, v, o, lse, delta, do, causal, segments=None: block_grads(
                    q, k, v, do, lse, delta, mask(q, causal, segments), scale))
    from jphantom.nn import flash

    interpret = kernel == "pallas-interpret"
    def unpacked(segments):
        if segments is not None:
            raise ConfigError("the ring's Pallas blocks take no segment ids (their queries and "
                              "keys are different chunks): packed batches run XLA's blocks")

    def forward(q, k, v, causal, segments=None):
        unpacked(segments)
        return flash.block(q, k, v, causal=causal, scale=scale, interpret=interpret)

    def backward(q, k, v, o, lse, delta, do, causal, segments=None):
        unpacked(segments)
        return flash.block_grads(q, k, v, o, lse, do, causal=causal, scale=scale,
                                 interpret=interpret)
    return forward, backward


def _halves(segments, q_half=None, k_half=None):
    """The segments (None, or the queries' and keys' [B, S]) of a block's halves."""
    if segments is None:
        return None
    qs, ks = segments
    return (qs if q_half is None else qs[:, q_half], ks if k_half is None else ks[:, k_half])


def forward_branches(balanced, forward):
    """What a ring step does with a received chunk: ``branch(q, k, v, segments)`` (``segments``:
    ``None``, or the queries' and the chunk's segment ids)."""
    if not balanced:
        def full(q, k, v, segments):
            return forward(q, k, v, False, segments)

        def skip(q, k, v, segments):
            o = jnp.zeros(q.shape, jnp.float32)
            return vary_like(o, q), vary_like(jnp.full(q.shape[:-1], -jnp.inf, jnp.float32), q)
        return [full, skip]

    def early(q, k, v, segments):
        c = k.shape[1] // 2
        return forward(q, k[:, :c], v[:, :c], False, _halves(segments, k_half=slice(None, c)))

    def late(q, k, v, segments):
        c = q.shape[1] // 2
        o, lse = forward(q[:, c:], k, v, False, _halves(segments, q_half=slice(c, None)))
        zeros = vary_like(jnp.zeros(o.shape, jnp.float32), o)
        none = vary_like(jnp.full(lse.shape, -jnp.inf, lse.dtype), lse)
        return jnp.concatenate([zeros, o], 1), jnp.concatenate([none, lse], 1)
    return [early, late]


def backward_branches(balanced, backward):
    """The gradients of :func:`forward_branches`: ``branch(q, k, v, o, do, lse, delta,
    segments)``."""
    if not balanced:
        def full(q, k, v, o, do, lse, delta, segments):
            return backward(q, k, v, o, lse, delta, do, False, segments)

        def skip(q, k, v, o, do, lse, delta, segments):
            zq = vary_like(jnp.zeros(q.shape, jnp.float32), q)
            zk = vary_like(jnp.zeros(k.shape, jnp.float32), k)
            return zq, zk, vary_like(jnp.zeros(v.shape, jnp.float32), v)
        return [full, skip]

    def early(q, k, v, o, do, lse, delta, segments):
        c = k.shape[1] // 2
        dq, dk, dv = backward(q, k[:, :c], v[:, :c], o, lse, delta, do, False,
                              _halves(segments, k_half=slice(None, c)))
        pad = lambda g: jnp.concatenate([g, vary_like(jnp.zeros(g.shape, g.dtype), g)], 1)
        return dq, pad(dk), pad(dv)

    def late(q, k, v, o, do, lse, delta, segments):
        c = q.shape[1] // 2
        dq, dk, dv = backward(q[:, c:], k, v, o[:, c:], lse[:, c:], delta[:, c:], do[:, c:],
                              False, _halves(segments, q_half=slice(c, None)))
        dq = jnp.concatenate([vary_like(jnp.zeros(dq.shape, dq.dtype), dq), dq], 1)
        return dq, dk, dv
    return [early, late]
