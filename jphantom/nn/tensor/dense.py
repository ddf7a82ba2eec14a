"""What every tensor-parallel layer shares with the dense layer it replaces (Megatron, Shoeybi et
al.): a parameter's value, the operands promoted to one dtype, the GEMM (on FP8 operands when the
layer's ``fp8`` flag is set), and the plain ``nnx.Linear`` / ``nnx.Embed`` a layer gives back with
``dense_equivalent``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jphantom.step import fp8 as fp8_ops


def param_value(p):
    """A parameter's array (or its ShapeDtypeStruct in an abstract model), None for no parameter."""
    return None if p is None else p.get_value()


def promote_dtypes(*arrays):
    dtype = jnp.result_type(*(a for a in arrays if a is not None))
    return tuple(None if a is None else a.astype(dtype) for a in arrays)


def matmul(layer, x: jax.Array, kernel: jax.Array) -> jax.Array:
    """``x @ kernel`` of ``layer``: on FP8 operands when its ``fp8`` flag is set
    (``precision='fp8'``, :func:`jphantom.nn.stack.set_fp8`)."""
    return fp8_ops.matmul(x, kernel) if layer.fp8 else x @ kernel


def plain_linear(kernel, bias, dtype) -> nnx.Linear:
    """A plain ``nnx.Linear`` holding ``kernel`` [..., in, out] and ``bias``."""
    linear = nnx.Linear(kernel.shape[-2], kernel.shape[-1], use_bias=bias is not None,
                        dtype=dtype, param_dtype=kernel.dtype, rngs=nnx.Rngs(0))
    linear.kernel = nnx.Param(kernel)
    if bias is not None:
        linear.bias = nnx.Param(bias)
    return linear


def plain_embed(embedding, dtype) -> nnx.Embed:
    embed = nnx.Embed(embedding.shape[-2], embedding.shape[-1], dtype=dtype,
                      param_dtype=embedding.dtype, rngs=nnx.Rngs(0))
    embed.embedding = nnx.Param(embedding)
    return embed
