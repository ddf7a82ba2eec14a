"""FP8 GEMMs for Hopper: operands quantised to 8-bit floats with per-tensor current scaling.

Micikevicius et al. 2022, "FP8 Formats for Deep Learning", defines the two formats; the recipe is
NVIDIA TransformerEngine's (and torchao's ``float8`` "tensorwise" scaling, which torchtitan
trains with): a GEMM's activation and weight in **E4M3** (3 mantissa bits, largest 448) in the
forward, the output's gradient in **E5M2** (2 mantissa bits, largest 57344: the range gradients
need) in the backward, so that

    forward   y  = x_q W_q                   (E4M3 x E4M3)
    backward  dx = dy_q W_q^T                (E5M2 x E4M3, "dgrad")
              dW = x_q^T dy_q                (E4M3 x E5M2, "wgrad")

each accumulated in float32 with its output in the compute dtype (bf16). A tensor x is quantised
with the scale s = amax(|x|) / max_format computed from the tensor itself at every step
(*current* scaling; TransformerEngine's default is *delayed* scaling from an amax history, which
saves the amax reduction but lags the data): x_q = round_format(x / s), dequantised as x_q s.

Written as quantise-dequantise around ``lax.dot_general`` (:func:`dot_general`, the ``dot_general``
of an ``nnx.Linear``; :func:`quantized` and :func:`quantized_gradient` for layers that write their
GEMMs themselves): XLA's GPU GEMM rewriter turns ``dot(convert(x_q) s_x, convert(W_q) s_W)`` into
one cuBLASLt FP8 GEMM taking the scales as operands (Hopper and later); on other platforms the
same program runs the dequantised operands through the compute-dtype GEMM, which is the same
arithmetic up to the accumulation order: an emulation, used on CPU by the tests. The straight-
through estimator carries gradients through the rounding (TransformerEngine's and torchao's).

**One scale per tensor, as on one device.** A tensor split over mesh axes (a weight over
``model``, activations over ``data``, ``context``, or the sequence under sequence parallelism)
takes the maximum of its ranks' amax (``lax.pmax`` over the axes it varies over, ``stage``
excepted: a stage's layers are its own), so every rank quantises with the scale the one-device
model would use: an FP8 step under any strategy equals the one-device FP8 step. The price is one
all-reduce of a scalar per quantised tensor per GEMM (TransformerEngine reduces amax over the
tensor-parallel group the same way).

:class:`jphantom.precision.Precision` ``fp8`` (``--precision fp8``) sets this on the linear layers
of a model's :class:`~jphantom.nn.stack.Stacked` blocks (every linear layer of a model without
them): bf16 elsewhere (embeddings, norms, attention, the LM head and loss), float32 master weights
and optimizer state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jphantom import comm

E4M3 = jnp.float8_e4m3fn  # forward: activations and weights
E5M2 = jnp.float8_e5m2  # backward: output gradients
NO_SCALE_AXES = ("stage",)  # a pipeline stage's tensors are its own, not shards of one tensor


def scale_of(x: jax.Array, fmt) -> jax.Array:
    """The per-tensor scale of ``x`` for ``fmt``: amax(|x|) over the whole tensor (every rank's
    shard, module docstring) / the format's largest value, float32, never zero."""
    amax = jnp.max(jnp.abs(lax.stop_gradient(x))).astype(jnp.float32)
    axes = tuple(sorted(a for a in comm.varying_axes(x) if a not in NO_SCALE_AXES))
    if axes:
        amax = lax.pmax(amax, axes)  # all-reduce (max) of one scalar: the whole tensor's amax
    return jnp.maximum(amax, jnp.finfo(jnp.float32).tiny) / float(jnp.finfo(fmt).max)


def quantize(x: jax.Array, fmt) -> tuple[jax.Array, jax.Array]:
    """``(x_q, s)``: ``x`` in the 8-bit format ``fmt`` and its float32 scale (x ~ x_q s)."""
    scale = scale_of(x, fmt)
    return (x.astype(jnp.float32) / scale).astype(fmt), scale


def round_trip(x: jax.Array, fmt) -> jax.Array:
    """``x`` quantised to ``fmt`` and dequantised back to its dtype: what the GEMM sees."""
    q, scale = quantize(x, fmt)
    return q.astype(x.dtype) * scale.astype(x.dtype)


@jax.custom_vjp
def quantized(x: jax.Array) -> jax.Array:
    """``x`` as an E4M3 forward operand (:func:`round_trip`); gradient straight through."""
    return round_trip(x, E4M3)


quantized.defvjp(lambda x: (round_trip(x, E4M3), None), lambda _, g: (g,))


@jax.custom_vjp
def quantized_gradient(y: jax.Array) -> jax.Array:
    """The identity forward; its gradient quantised to E5M2: a GEMM output's, so that both
    backward GEMMs take it in FP8."""
    return y


quantized_gradient.defvjp(lambda y: (y, None), lambda _, g: (round_trip(g, E5M2),))


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                **options):
    """``lax.dot_general`` on FP8 operands (module docstring): a drop-in ``dot_general`` for
    ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``."""
    out = lax.dot_general(quantized(lhs), quantized(rhs), dimension_numbers, precision=precision,
                          preferred_element_type=preferred_element_type, **options)
    return quantized_gradient(out)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` (``w`` [in, out]) on FP8 operands."""
    return dot_general(x, w, (((x.ndim - 1,), (w.ndim - 2,)), ((), ())))


__all__ = ["E4M3", "E5M2", "dot_general", "matmul", "quantized", "quantized_gradient",
           "quantize", "round_trip", "scale_of"]
