"""A mixture of SwiGLU experts as a plain Flax NNX layer (Mixtral's sparse MoE block, no
communication): the building block a model uses, which a plan makes parallel
(:class:`jphantom.nn.tensor.TensorParallelExperts`).

Router (Mixtral, Jiang et al. 2024): ``probs = softmax(x W_r)`` over E experts, the top k kept and
renormalised to sum to one; no capacity, so no token is dropped. Expert e is a SwiGLU FFN,
``(silu(x W_gate[e]) * (x W_up[e])) W_down[e]``, W_gate, W_up [E, h, f], W_down [E, f, h].

This reference layer runs every expert on every token and weights the results by the gates
(zero for experts a token did not choose): exact, E/k times the FLOPs of a dispatching layer, and
the single-device oracle of the parallel ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def top_k_gates(logits: jax.Array, top_k: int) -> jax.Array:
    """Dense gates [..., E]: softmax probabilities of the top-k experts, renormalised to sum to one
    (Mixtral); zero elsewhere. Computed in at least float32."""
    probs = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    weights, chosen = jax.lax.top_k(probs, top_k)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(chosen, probs.shape[-1], dtype=probs.dtype)  # [..., k, E]
    return jnp.einsum("...k,...ke->...e", weights, one_hot)


class Experts(nnx.Module):
    """E SwiGLU experts, every one applied to every token and weighted by ``gates``."""

    def __init__(self, hidden: int, width: int, experts: int, *, rngs: nnx.Rngs,
                 top_k: int | None = None, param_dtype=jnp.float32):
        self.top_k = top_k  # the router's k (expert-parallel layers dispatch that many per token)
        init = nnx.initializers.lecun_normal()
        self.w_gate = nnx.Param(init(rngs.params(), (experts, hidden, width), param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (experts, hidden, width), param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (experts, width, hidden), param_dtype))

    @classmethod
    def of(cls, w_gate, w_up, w_down, top_k: int | None = None) -> "Experts":
        experts = nnx.eval_shape(lambda: cls(1, 1, 1, rngs=nnx.Rngs(0), top_k=top_k))
        experts.w_gate, experts.w_up, experts.w_down = (
            nnx.Param(w_gate), nnx.Param(w_up), nnx.Param(w_down))
        return experts

    @staticmethod
    def apply(x, gates, w_gate, w_up, w_down):
        """sum_e gates[..., e] * expert_e(x): x [..., h], gates [..., E] -> [..., h]."""
        dtype = jnp.result_type(x, w_gate)
        x = x.astype(dtype)
        hidden = jax.nn.silu(jnp.einsum("...h,ehf->...ef", x, w_gate.astype(dtype))) * jnp.einsum(
            "...h,ehf->...ef", x, w_up.astype(dtype))
        out = jnp.einsum("...ef,efh->...eh", hidden, w_down.astype(dtype))
        return jnp.einsum("...eh,...e->...h", out, gates.astype(dtype))

    def __call__(self, x: jax.Array, gates: jax.Array) -> jax.Array:
        return self.apply(x, gates, self.w_gate[...], self.w_up[...], self.w_down[...])
