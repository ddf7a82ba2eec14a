"""The causal attention core of a whole sequence and its positions: :func:`causal_attention`
through ``jax.nn.dot_product_attention`` (XLA's path or cuDNN's flash attention; GQA, sliding
windows), the parameterless :class:`CausalAttention` a model hands q, k and v to, and
:class:`Positions`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jphantom.step import remat
from jphantom.errors import ConfigError
from jphantom.nn.attention.kernel_choice import check_implementation, choose, platform_of
from jphantom.nn.attention.packing import segment_mask


def _window_size(window: int | None):
    """``jax.nn.dot_product_attention``'s ``local_window_size`` of a causal sliding window of
    ``window`` tokens (a query attends itself and the window-1 before it)."""
    return None if window is None else (window - 1, 0)


def causal_attention(q, k, v, mask=None, *, window: int | None = None,
                     implementation: str = "xla", segment_ids=None) -> jax.Array:
    """Causal softmax attention, q [B, S, Hq, d], k and v [B, Sk, Hk, d] (Hq a multiple of Hk:
    each key/value head serves Hq/Hk query heads, never repeated) -> [B, S, Hq, d], through
    ``jax.nn.dot_product_attention``: ``implementation`` ``xla`` (XLA's path: scores
    [B, Hq, S, Sk] in float32, softmax in float32; exact, every platform) or ``cudnn`` (cuDNN's
    flash attention: memory linear in S). ``window``: a causal sliding window of that many tokens
    (Mistral's, Gemma's local layers). ``mask`` [S, Sk] (True: attend; XLA's path) replaces the
    causal mask of S = Sk positions 0..S-1; a [B, S, Sk] mask is each row's.
    ``segment_ids`` [B, S] (a packed batch, :mod:`~jphantom.nn.attention.packing`): a query
    attends only to keys of its own segment, on XLA's path under that mask or (``pallas``,
    ``pallas-interpret``) in jax's Pallas Triton flash kernel, which takes segment ids."""
    local = _window_size(window)
    if segment_ids is not None:
        if implementation in ("pallas", "pallas-interpret"):
            from jphantom.nn import flash
            if window is not None:
                raise ConfigError(f"a sliding window ({window} tokens) on jax's Pallas flash "
                                  "kernel, which has none: use implementation='xla'")
            return flash.packed_attention(q, k, v, segment_ids,
                                          interpret=implementation == "pallas-interpret")
        mask = _causal_mask(q.shape[1], window)[None] & segment_mask(segment_ids, segment_ids)
        implementation, local = "xla", None  # the mask (window included) is XLA's path's
    if implementation == "xla" and jnp.dtype(q.dtype) == jnp.float16:
        return _float16_attention(q, k, v, mask, window)
    if mask is not None:
        mask = mask[None, None] if mask.ndim == 2 else mask[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, local_window_size=local,
                                            implementation="xla")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                        implementation=implementation)


def _float16_attention(q, k, v, mask, window):
    """XLA's path for float16 inputs, written out: ``jax.nn.dot_product_attention`` pins the
    F16_F16_F32 dot algorithm there, which XLA:CPU refuses at compile time. The same arithmetic:
    scores in float32, softmax in float32, GQA by grouping the query heads."""
    b, s, hq, d = q.shape
    hk = k.shape[2]
    grouped = q.reshape(b, s, hk, hq // hk, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, k,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    if mask is None:
        pos = jnp.arange(s)
        mask = pos[:, None] >= jnp.arange(k.shape[1])[None, :]
        if window is not None:
            mask &= pos[:, None] - jnp.arange(k.shape[1])[None, :] < window
    elif mask.ndim == 3:  # each row's [B, S, Sk] over [B, Hk, G, S, Sk] scores
        mask = mask[:, None, None]
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(v.dtype), v)
    return out.reshape(b, s, hq, d)


def _causal_mask(seq: int, window: int | None) -> jax.Array:
    """[S, S]: key j <= query i (and i - j < ``window``)."""
    pos = jnp.arange(seq)
    mask = pos[:, None] >= pos[None, :]
    if window is not None:
        mask &= pos[:, None] - pos[None, :] < window
    return mask


class Positions(nnx.Module):
    """The positions 0..S-1 of a whole sequence of S tokens (``length(S)``: S)."""

    def __call__(self, seq: int) -> jax.Array:
        return jnp.arange(seq)

    def length(self, seq: int) -> int:
        return seq


class CausalAttention(nnx.Module):
    """The attention core of a whole sequence: :func:`causal_attention` with the kernel
    :func:`choose` picks for ``implementation`` (``auto``: cuDNN's flash attention on NVIDIA GPUs
    in bf16/fp16, XLA's path elsewhere) on ``platform`` (set by the training step from its mesh's
    devices, :func:`configure`; ``None``: the process's default backend). ``window``: a causal
    sliding window of that many tokens. ``recompute`` (set by :func:`jphantom.nn.set_remat` under
    ``remat="all_but_attention_core_saveable"``, Megatron's selective recompute): on XLA's path,
    whose backward keeps the S x S probabilities, the core runs under ``jax.checkpoint`` saving
    only q, k and v (:func:`jphantom.step.remat.recomputed`); a fused kernel keeps O(S) residuals and
    runs as it is."""

    recompute = False

    def __init__(self, *, window: int | None = None, implementation: str = "auto"):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ConfigError(f"window={window!r} must be a whole number of tokens >= 1")
        self.window, self.implementation = window, check_implementation(implementation)
        self.platform = None

    takes_segments = True  # packed batches: segment ids (jphantom.nn.attention.packing)

    def kernel(self, dtype, head_dim: int, *, packed: bool = False) -> tuple[str, str]:
        """The kernel this core runs for ``dtype`` inputs of ``head_dim`` (``packed``: with
        segment ids) and why (:func:`choose`)."""
        platform = self.platform or platform_of(jax.devices()[0])
        return choose(self.implementation, platform, dtype, head_dim, packed=packed,
                      window=self.window)

    def __call__(self, q, k, v, segment_ids=None) -> jax.Array:
        kernel, _ = self.kernel(q.dtype, q.shape[-1], packed=segment_ids is not None)
        core = functools.partial(causal_attention, window=self.window, implementation=kernel)
        if self.recompute and keeps_scores(kernel):
            core = remat.recomputed(core)
        if segment_ids is None:
            return core(q, k, v)
        return core(q, k, v, segment_ids=segment_ids)


def keeps_scores(kernel: str) -> bool:
    """Whether the core on ``kernel`` keeps an S x S array for its backward: XLA's path does
    (its probabilities), a fused flash kernel (cuDNN's, Pallas') keeps its output and log-sum-exp
    only."""
    return kernel not in ("cudnn", "pallas", "pallas-interpret")
