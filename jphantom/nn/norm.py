"""LayerNorm and RMSNorm arithmetic shared by the norm layers (no module of its own holds this
twice): the per-token statistics in at least float32, summed over a mesh axis when the features
are split across it.

    LayerNorm: y = (x - mean) / sqrt(var + eps) * scale + bias      (two sums per token)
    RMSNorm:   y = x / sqrt(mean(x^2) + eps) * scale                 (one sum per token)
    Gemma's:   y = x / sqrt(mean(x^2) + eps) * (1 + scale)           (OffsetRMSNorm)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom.runtime import comm
from jphantom.step import remat

KINDS = ("layer", "rms", "rms1")


class OffsetRMSNorm(nnx.RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)``, ``w`` (``scale``) initialised to zero and
    the product taken in float32 (kind ``"rms1"``)."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype=None,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(num_features, epsilon=epsilon, dtype=dtype, param_dtype=param_dtype,
                         scale_init=nnx.initializers.zeros_init(), rngs=rngs)

    def __call__(self, x, mask=None):
        return normalize(x, "rms1", self.epsilon, self.scale[...], dtype=self.dtype)


class RMSNorm(nnx.RMSNorm):
    """``nnx.RMSNorm`` (its parameters and names); under 16-bit compute through
    :func:`normalize`, whose backward keeps the 16-bit input, not float32 copies (kind
    ``"rms"``); in float32 ``nnx.RMSNorm``'s own call."""

    def __call__(self, x, mask=None):
        if jnp.dtype(x.dtype).itemsize >= 4 or mask is not None:
            return super().__call__(x, mask=mask)
        return normalize(x, "rms", self.epsilon, self.scale[...] if self.use_scale else None,
                         dtype=self.dtype)


def kind_of(norm) -> str:
    """``"rms1"`` for an :class:`OffsetRMSNorm`, ``"rms"`` for an ``nnx.RMSNorm``,
    ``"layer"`` for an ``nnx.LayerNorm``."""
    if isinstance(norm, OffsetRMSNorm):
        return "rms1"
    return "rms" if isinstance(norm, nnx.RMSNorm) else "layer"


def normalize(x: jax.Array, kind: str, epsilon: float, scale=None, bias=None, *,
              axis: str | None = None, features: int | None = None, dtype=None) -> jax.Array:
    """The norm of ``x`` over its last dimension. ``axis``: the features are split over this mesh
    axis (``features`` in all): each per-token sum is all-reduced over it (B S scalars).

    For ``x`` narrower than float32 (bf16 compute) the backward keeps ``x`` itself and runs the
    float32 arithmetic again (:func:`jphantom.step.remat.inputs_kept`): autodiff would keep the
    float32 copy of ``x`` and the float32 normalised ``y``, 8 bytes per element where ``x`` is 2
    (Korthikanti et al.'s count keeps the norm's 16-bit input); with ``axis`` the backward repeats
    the per-token all-reduce (B S scalars)."""
    arithmetic = functools.partial(_normalize, kind=kind, epsilon=epsilon, axis=axis,
                                   features=features, dtype=dtype)
    if jnp.dtype(x.dtype).itemsize < 4 and jnp.issubdtype(x.dtype, jnp.floating):
        return remat.inputs_kept(arithmetic)(x, scale, bias)
    return arithmetic(x, scale, bias)


def _normalize(x, scale, bias, *, kind, epsilon, axis, features, dtype):
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    count = features or x.shape[-1]

    def mean(values):
        total = jnp.sum(values, -1, keepdims=True)
        return (comm.psum(total, axis) if axis is not None else total) / count

    if kind in ("rms", "rms1"):
        y = wide * lax.rsqrt(mean(wide * wide) + epsilon)
    else:
        centred = wide - mean(wide)
        y = centred * lax.rsqrt(mean(centred * centred) + epsilon)
    if scale is not None:
        y = y * (1 + scale.astype(y.dtype)) if kind == "rms1" else y * scale
    if bias is not None:
        y = y + bias
    return y.astype(dtype or x.dtype)


def plain(kind: str, epsilon: float, dtype, scale=None, bias=None):
    """The plain ``nnx.RMSNorm`` / ``nnx.LayerNorm`` holding ``scale`` and ``bias``."""
    n = (scale if scale is not None else bias).shape[-1]
    if kind == "rms1":
        norm = OffsetRMSNorm(n, epsilon=epsilon, dtype=dtype, rngs=nnx.Rngs(0))
    elif kind == "rms":
        norm = nnx.RMSNorm(n, epsilon=epsilon, dtype=dtype, use_scale=scale is not None,
                           rngs=nnx.Rngs(0))
    else:
        norm = nnx.LayerNorm(n, epsilon=epsilon, dtype=dtype, use_scale=scale is not None,
                             use_bias=bias is not None, rngs=nnx.Rngs(0))
    if scale is not None:
        norm.scale = nnx.Param(scale)
    if bias is not None:
        norm.bias = nnx.Param(bias)
    return norm
