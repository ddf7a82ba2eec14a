"""Expert parallelism: a mixture-of-experts FFN with all-to-all dispatch at a fixed capacity
(issue 10, first part; GShard / Switch Transformer routing, seed 004 ch. 7).

Per rank, inside the step's ``shard_map``, with ``E`` experts split over the ``expert`` axis
(``G`` ranks, ``E / G`` experts each) and this rank's ``T`` tokens ``x [T, h]``:

1. **Router** (replicated ``w_router [h, E]``): logits ``x w_router``, softmax probabilities, the
   top-``k`` experts of each token with their probabilities as gates (not renormalised).
2. **Capacity**: each expert takes at most ``C = ceil(capacity_factor * T * k / E)`` tokens from
   this rank; assignments are served in order of choice rank then token (all first choices before
   any second choice, as GShard does); the rest are dropped and counted.
3. **Dispatch**: a one-hot ``[T, E, C]`` mask gathers the tokens into ``[E, C, h]``; one
   ``lax.all_to_all`` over ``expert`` sends each expert's buffer to the rank holding it: every rank
   receives ``[G, E/G, C, h]`` (its experts' tokens from every rank).
4. **Experts**: ``gelu(x w_in + b_in) w_out + b_out`` per local expert (``w_in [E/G, h, f]``).
5. **Combine**: the all-to-all back, then ``sum_{e, c} gate[t, e, c] * y[e, c]``.

Collectives per MoE layer: two all-to-alls forward (dispatch, combine) of ``E C h`` elements each,
and two backward (their transposes). Auxiliary losses (Switch Transformer, Fedus et al. 2021):
load balance ``E * sum_e f_e P_e`` (``f_e``: fraction of the rank's tokens whose first choice is
``e``; ``P_e``: mean router probability of ``e``) and router z-loss ``mean(logsumexp(logits)^2)``.

:func:`dense_moe` is the single-device oracle: every expert on every token, combined by the same
gates; with a capacity that drops nothing, :func:`moe_per_rank` equals it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jphantom import remat
from jphantom.errors import ConfigError, check_int

EXPERT_AXIS = "expert"


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """``experts`` E, ``top_k`` k, ``capacity_factor``, expert hidden width ``ffn`` (default 4h)."""

    hidden: int
    experts: int
    top_k: int = 2
    capacity_factor: float = 1.25
    ffn: int | None = None

    def __post_init__(self):
        check_int("hidden", self.hidden)
        check_int("experts", self.experts)
        check_int("top_k", self.top_k)
        if self.top_k > self.experts:
            raise ConfigError(f"top_k={self.top_k} > experts={self.experts}: a token cannot pick "
                              "more experts than exist; use top_k <= experts")
        if not (isinstance(self.capacity_factor, (int, float)) and self.capacity_factor > 0
                and math.isfinite(self.capacity_factor)):
            raise ConfigError(f"capacity_factor={self.capacity_factor!r} must be a positive "
                              "number, e.g. 1.25")
        if self.ffn is not None:
            check_int("ffn", self.ffn)

    @property
    def width(self) -> int:
        return self.ffn or 4 * self.hidden

    def capacity(self, tokens: int, multiple: int = 1) -> int:
        """Per expert, the tokens one rank may send: ceil(factor * T * k / E), rounded up to a
        ``multiple`` (DTD splits the capacity over the tensor-parallel ranks)."""
        c = max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.experts))
        return -(-c // multiple) * multiple

    def check_axis(self, expert_ranks: int) -> None:
        if self.experts % expert_ranks:
            raise ConfigError(f"experts={self.experts} is not divisible by the expert axis size "
                              f"{expert_ranks}: every rank holds E / G whole experts")


def init(key: jax.Array, config: MoEConfig, dtype=jnp.float32) -> dict:
    """Router [h, E] and experts stacked over E: w_in [E, h, f], b_in [E, f], w_out [E, f, h],
    b_out [E, h]."""
    h, f, e = config.hidden, config.width, config.experts
    k1, k2, k3 = jax.random.split(key, 3)
    return {"router": jax.random.normal(k1, (h, e), dtype) * 0.02,
            "w_in": jax.random.normal(k2, (e, h, f), dtype) / math.sqrt(h),
            "b_in": jnp.zeros((e, f), dtype),
            "w_out": jax.random.normal(k3, (e, f, h), dtype) / math.sqrt(f),
            "b_out": jnp.zeros((e, h), dtype)}


def route(router: jax.Array, x: jax.Array, config: MoEConfig):
    """Logits [T, E], probabilities, the top-k experts [T, k] and their gates [T, k]."""
    logits = (x @ router).astype(jnp.promote_types(x.dtype, jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = lax.top_k(probs, config.top_k)
    return logits, probs, experts, gates


def aux_losses(logits, probs, experts, config: MoEConfig) -> dict:
    """Load balancing ``E sum_e f_e P_e`` and router z-loss ``mean(logsumexp(logits)^2)``."""
    first = jax.nn.one_hot(experts[:, 0], config.experts, dtype=probs.dtype)
    balance = config.experts * jnp.sum(first.mean(axis=0) * probs.mean(axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return {"load_balance": balance, "z_loss": z}


def dispatch_plan(experts: jax.Array, gates: jax.Array, config: MoEConfig, capacity: int):
    """One-hot dispatch [T, E, C] and combine weights [T, E, C] (gates), and the dropped count.

    Assignments are served choice rank by choice rank, tokens in order within each: a token's slot
    in expert e is the number of earlier assignments to e."""
    tokens, k = experts.shape
    onehot = jax.nn.one_hot(experts.T.reshape(-1), config.experts, dtype=jnp.int32)  # [k T, E]
    position = jnp.cumsum(onehot, axis=0) - onehot  # earlier assignments to the same expert
    slot = jnp.sum(position * onehot, axis=-1).reshape(k, tokens).T  # [T, k]
    kept = slot < capacity
    slot_onehot = jax.nn.one_hot(jnp.where(kept, slot, capacity), capacity + 1)[..., :capacity]
    expert_onehot = jax.nn.one_hot(experts, config.experts)  # [T, k, E]
    dispatch = jnp.einsum("tke,tkc->tec", expert_onehot, slot_onehot * kept[..., None])
    combine = jnp.einsum("tke,tkc->tec", expert_onehot * gates[..., None].astype(jnp.float32),
                         slot_onehot * kept[..., None])
    return dispatch, combine, jnp.sum(~kept)


def _experts(params, x, reduce=None):
    """x [E', N, h] through each of the E' experts: gelu(x w_in + b_in) w_out + b_out. With
    tensor-parallel experts (TED: w_in split on f, column; w_out on f, row) ``reduce`` sums the
    partial outputs over the tensor ranks before the bias."""
    hidden = jax.nn.gelu(jnp.einsum("enh,ehf->enf", x, params["w_in"])
                         + params["b_in"][:, None, :], approximate=True)
    out = jnp.einsum("enf,efh->enh", hidden, params["w_out"])
    if reduce is not None:
        out = reduce(out)
    return out + params["b_out"][:, None, :]


def moe_per_rank(params: dict, x: jax.Array, config: MoEConfig, *, axis: str = EXPERT_AXIS,
                 model_axis: str | None = None, dtd: bool = False):
    """The expert-parallel MoE on one rank: x [T, h] -> (y [T, h], aux dict with ``dropped``).

    ``params``: the router replicated; the experts' leaves this rank's E/G experts. With
    ``model_axis`` (TED, seed 004 Eq. 7.1) the experts are also tensor-parallel over it and ``x``
    is replicated over it; ``dtd`` (duplicate token dropping) sends each tensor rank's 1/p slice
    of the capacity buffer through the all-to-all (its bytes fall by p) and all-gathers the
    slices over ``model_axis`` on arrival, and on the way back reduce-scatters the experts'
    partial outputs instead of all-reducing them, all-to-alls the slices, all-gathers them."""
    ranks = lax.axis_size(axis)
    config.check_axis(ranks)
    tensor = lax.axis_size(model_axis) if model_axis is not None else 1
    if dtd and model_axis is None:
        raise ConfigError("dtd (duplicate token dropping) needs a tensor-parallel model_axis")
    tokens, h = x.shape
    capacity = config.capacity(tokens, tensor if dtd else 1)
    logits, probs, experts, gates = route(params["router"], x, config)
    dispatch, combine, dropped = dispatch_plan(experts, gates, config, capacity)
    buffers = jnp.einsum("tec,th->ech", dispatch.astype(x.dtype), x)  # [E, C, h]
    local = config.experts // ranks
    slots = capacity // tensor if dtd else capacity  # what each tensor rank sends per expert
    buffers = buffers.reshape(ranks, local, capacity, h)
    if dtd:  # this tensor rank's slice of the (identical) buffers: no duplicate crosses the network
        buffers = lax.dynamic_slice_in_dim(buffers, lax.axis_index(model_axis) * slots, slots, 2)
    # Collective outputs are named: remat's collectives_saveable keeps them, so a recompute
    # repeats no all-to-all (seed 004's communication-aware checkpointing, CAC).
    received = remat.name_collective(lax.all_to_all(buffers, axis, 0, 0, tiled=False))
    if dtd:
        received = remat.name_collective(lax.all_gather(received, model_axis, axis=2,
                                                        tiled=True))  # [G, E/G, C, h]
    if model_axis is None:
        reduce = None
    elif dtd:  # reduce-scatter over the tensor ranks, each keeping its C/p slots of every block
        reduce = lambda o: lax.psum_scatter(o.reshape(local, ranks, capacity, h), model_axis,
                                            scatter_dimension=2, tiled=True).reshape(
                                                local, ranks * slots, h)
    else:
        reduce = lambda o: remat.name_collective(lax.psum(o, model_axis))
    out = _experts(params, received.transpose(1, 0, 2, 3).reshape(local, ranks * capacity, h),
                   reduce)
    out = out.reshape(local, ranks, slots, h).transpose(1, 0, 2, 3)
    returned = remat.name_collective(lax.all_to_all(out, axis, 0, 0, tiled=False))  # back home
    if dtd:
        returned = remat.name_collective(
            lax.all_gather(returned, model_axis, axis=2, tiled=True, to="invarying"))
    y = jnp.einsum("tec,ech->th", combine.astype(x.dtype),
                   returned.reshape(config.experts, capacity, h))
    aux = aux_losses(logits, probs, experts, config)
    aux["dropped"] = dropped
    return y, aux


def dense_moe(params: dict, x: jax.Array, config: MoEConfig):
    """Single-device oracle: every expert on every token, combined by the router's top-k gates."""
    logits, probs, experts, gates = route(params["router"], x, config)
    everything = _experts(params, jnp.broadcast_to(x, (config.experts, *x.shape)))  # [E, T, h]
    weights = jnp.sum(jax.nn.one_hot(experts, config.experts) * gates[..., None], axis=1)  # [T, E]
    y = jnp.einsum("te,eth->th", weights.astype(x.dtype), everything)
    return y, aux_losses(logits, probs, experts, config)
