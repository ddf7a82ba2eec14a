"""Expert parallelism as a Flax NNX layer: a mixture of SwiGLU experts split over the ``expert``
mesh axis, tokens exchanged by all-to-all (GShard / Switch routing; DeepSpeed-TED, seed 004
ch. 7, with the experts also split over ``model``).

Per rank, inside the step's ``shard_map``, with E experts over G ``expert`` ranks (E/G each) and
this rank's T tokens x [T, h] (the batch is split over ``data`` and ``expert``):

1. the top-k experts of each token and their weights, read off the model's dense gates [T, E]
   (Mixtral's renormalised softmax, :func:`jphantom.nn.experts.top_k_gates`);
2. capacity C per expert and rank (``capacity_factor``: ceil(c T k / E); ``None``: C = T, which
   drops nothing, so the layer equals its dense equivalent exactly); first choices served first;
3. dispatch: each kept (token, choice) scattered into its row of [E, C, h]; one all-to-all over
   ``expert`` (E C h elements);
4. the E/G local experts on the G C rows each received (with ``model``: each expert's width f
   split, column then row, TED);
5. the all-to-all back (E C h), the gate-weighted combine; with ``model``, g: one all-reduce of
   T h (SP: reduce-scatter) of the partial outputs, after the combine (the combine is linear).

Backward: the two all-to-alls' transposes, and f's all-reduce with ``model``. The router stays a
plain replicated ``nnx.Linear`` in the model; this layer replaces :class:`Experts` only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom import remat
from jphantom.nn import metadata
from jphantom.nn.experts import Experts
from jphantom.nn.tensor import reduce_from_model, to_full_sequence
from jphantom.sharding import expert as expert_ops


class ExpertParallelExperts(nnx.Module):
    """E SwiGLU experts split over ``expert_axis`` (and their width over ``model_axis``, TED).
    w_gate, w_up [E, h, f], w_down [E, f, h]: E split over ``expert_axis``, f over ``model_axis``."""

    def __init__(self, w_gate, w_up, w_down, *, top_k: int, expert_axis: str = "expert",
                 model_axis: str | None = None, capacity_factor: float | None = None,
                 sequence_parallel: bool = False):
        self.top_k, self.expert_axis, self.model_axis = top_k, expert_axis, model_axis
        self.capacity_factor, self.sequence_parallel = capacity_factor, sequence_parallel
        self.w_gate = metadata.param(w_gate, (expert_axis, None, model_axis))
        self.w_up = metadata.param(w_up, (expert_axis, None, model_axis))
        self.w_down = metadata.param(w_down, (expert_axis, model_axis, None))

    @classmethod
    def from_module(cls, experts: Experts, *, top_k: int, expert_axis: str = "expert",
                    model_axis: str | None = None, capacity_factor: float | None = None,
                    sequence_parallel: bool = False) -> "ExpertParallelExperts":
        return cls(experts.w_gate.get_value(), experts.w_up.get_value(), experts.w_down.get_value(), top_k=top_k,
                   expert_axis=expert_axis, model_axis=model_axis,
                   capacity_factor=capacity_factor, sequence_parallel=sequence_parallel)

    def dense_equivalent(self) -> Experts:
        return Experts.of(self.w_gate[...], self.w_up[...], self.w_down[...], top_k=self.top_k)

    def __call__(self, x: jax.Array, gates: jax.Array) -> jax.Array:
        if self.model_axis is not None:
            x = to_full_sequence(x, self.model_axis, self.sequence_parallel)
        lead, h = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, h)
        weights, chosen = lax.top_k(gates.reshape(-1, gates.shape[-1]), self.top_k)
        w_gate, w_up, w_down = self.w_gate[...], self.w_up[...], self.w_down[...]
        dtype = jnp.result_type(x, w_gate)
        local = w_gate.shape[0]
        ranks = lax.axis_size(self.expert_axis)
        experts = local * ranks
        count = tokens.shape[0]
        capacity = count if self.capacity_factor is None else max(
            1, -(-int(self.capacity_factor * count * self.top_k) // experts))
        config = expert_ops.MoEConfig(h, experts, self.top_k)
        position, _ = expert_ops.dispatch_plan(chosen, config, capacity)
        buffers = expert_ops.dispatch(tokens.astype(dtype), position, experts * capacity)
        buffers = buffers.reshape(ranks, local, capacity, h)
        received = remat.name_collective(  # all-to-all of E C h: each expert's tokens to its rank
            lax.all_to_all(buffers, self.expert_axis, 0, 0, tiled=False))
        rows = received.transpose(1, 0, 2, 3).reshape(local, ranks * capacity, h)
        hidden = jax.nn.silu(jnp.einsum("enh,ehf->enf", rows, w_gate.astype(dtype))) * jnp.einsum(
            "enh,ehf->enf", rows, w_up.astype(dtype))
        out = jnp.einsum("enf,efh->enh", hidden, w_down.astype(dtype))
        out = out.reshape(local, ranks, capacity, h).transpose(1, 0, 2, 3)
        returned = remat.name_collective(  # all-to-all of E C h back home
            lax.all_to_all(out, self.expert_axis, 0, 0, tiled=False))
        y = expert_ops.combine(returned.reshape(experts * capacity, h), position, weights)
        y = y.reshape(*lead, h)
        if self.model_axis is not None:  # g over the experts' split width (TED)
            y = reduce_from_model(y, self.model_axis, self.sequence_parallel)
        return y
