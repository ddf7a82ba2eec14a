"""Expert parallelism: a mixture-of-experts FFN with all-to-all dispatch (issue 10; GShard /
Switch Transformer routing, DeepSpeed-TED from seed 004 ch. 7).

Per rank, inside the step's ``shard_map``, with ``E`` experts split over the ``expert`` axis
(``G`` ranks, ``E / G`` experts each) and this rank's ``T`` tokens ``x [T, h]``:

1. **Router** (replicated ``w_router [h, E]``): logits ``x w_router``, softmax probabilities, the
   top-``k`` experts of each token with their probabilities as gates (not renormalised).
2. **Capacity**: each expert takes at most ``C = ceil(capacity_factor * T * k / E)`` tokens from
   this rank; assignments are served in order of choice rank then token (all first choices before
   any second choice, as GShard does); the rest are dropped and counted.
3. **Dispatch**: each kept (token, choice) is scattered to its row of the capacity buffer
   ``[E, C, h]`` (GShard's one-hot ``[T, E, C]`` einsum computes the same with ``T E C h``
   multiply-adds; the scatter moves ``T k h`` numbers); one ``lax.all_to_all`` over ``expert``
   sends each expert's buffer to the rank holding it: every rank receives ``[G, E/G, C, h]`` (its
   experts' tokens from every rank).
4. **Experts**: ``gelu(x w_in + b_in) w_out + b_out`` per local expert (``w_in [E/G, h, f]``).
5. **Combine**: the all-to-all back, then ``y[t] = sum_j gate[t, j] * out[slot of (t, j)]``, a
   gather.

Collectives per MoE layer: two all-to-alls forward (dispatch, combine) of ``E C h`` elements each,
two backward (their transposes), and one all-reduce of ``2E`` numbers over the batch axes for the
load-balancing loss. Auxiliary losses (Switch Transformer, Fedus et al. 2021): load balance
``E * sum_e f_e P_e`` over the whole batch (``f_e``: fraction of tokens whose first choice is
``e``; ``P_e``: mean router probability of ``e``; their sums all-reduced, so the loss does not
depend on the mesh) and router z-loss ``mean(logsumexp(logits)^2)`` of the rank's tokens (the
model averages it over ranks).

**TED** (``model_axis``, seed 004 Eq. 7.1): the experts are also tensor-parallel (``w_in`` split on
``f``, column; ``w_out`` on ``f``, row) and ``x`` is replicated over ``model_axis``; their partial
outputs are all-reduced over it. **DTD** (``dtd``): each tensor rank sends only its ``1/p`` slice
of the (identical) capacity buffer, all-gathers the slices after the all-to-all, and
reduce-scatters the experts' partial outputs instead of all-reducing them: the all-to-all bytes
fall by ``p``. **CAC**: every collective output is named (:func:`jphantom.remat.name_collective`),
so the ``collectives_saveable`` policy keeps them and a recompute repeats no all-to-all.

**Phantom-parallel experts** (``router_axis`` and ``run_experts``, used by
:mod:`jphantom.sharding.phantom_transformer`): ``x`` is feature-sharded ``[T, h/p]``; the router's
logits are all-reduced over the feature axis, each rank dispatches its ``h/p`` features of every
token (the all-to-all carries ``1/p`` of the bytes, as DTD does) and the experts are phantom
FFNs whose ranks exchange only ``k`` ghosts per token.

**Dropless** (``capacity_factor=None``): assignments sorted by expert, grouped matmuls
(``lax.ragged_dot``) on exactly the tokens each expert got, and ``lax.ragged_all_to_all`` over the
expert axis where the backend implements it (:func:`ragged_all_to_all_supported`, detected by
compiling one). XLA:CPU does not: there the same exchange runs as a padded ``all_to_all`` of
worst-case chunks (:func:`ragged_exchange`), exact but ``G``-fold larger.

:func:`dense_moe` is the single-device oracle: every expert on every token, combined by the same
gates; with a capacity that drops nothing, :func:`moe_per_rank` equals it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from collections.abc import Callable

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
    capacity_factor: float | None = 1.25  # None: dropless
    ffn: int | None = None

    def __post_init__(self):
        check_int("hidden", self.hidden)
        check_int("experts", self.experts)
        check_int("top_k", self.top_k)
        if self.top_k > self.experts:
            raise ConfigError(f"top_k={self.top_k} > experts={self.experts}: a token cannot pick "
                              "more experts than exist; use top_k <= experts")
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not factor > 0 or not math.isfinite(factor)):
            raise ConfigError(f"capacity_factor={factor!r} must be a positive number, e.g. "
                              "1.25 (or None for the dropless path)")
        if self.ffn is not None:
            check_int("ffn", self.ffn)

    @property
    def width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def capacity(self, tokens: int, multiple: int = 1) -> int:
        """Per expert, the tokens one rank may send: ceil(factor * T * k / E), rounded up to a
        ``multiple`` (DTD splits the capacity over the tensor-parallel ranks)."""
        if self.dropless:
            raise ConfigError("a dropless MoE has no capacity")
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


def route(router: jax.Array, x: jax.Array, config: MoEConfig, reduce=None):
    """Logits [T, E], probabilities, the top-k experts [T, k] and their gates [T, k]. ``reduce``
    sums partial logits (a router on feature-sharded tokens)."""
    logits = x @ router
    if reduce is not None:
        logits = reduce(logits)
    logits = logits.astype(jnp.promote_types(x.dtype, jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    gates, experts = lax.top_k(probs, config.top_k)
    return logits, probs, experts, gates


def aux_losses(logits, probs, experts, config: MoEConfig, batch_axes: tuple[str, ...] = ()):
    """Load balancing ``E sum_e f_e P_e`` over the tokens of every rank of ``batch_axes`` (one
    all-reduce of ``2E`` numbers) and router z-loss ``mean(logsumexp(logits)^2)`` of this rank's
    tokens."""
    first = jax.nn.one_hot(experts[:, 0], config.experts, dtype=probs.dtype)
    stats = jnp.concatenate([first.sum(axis=0), probs.sum(axis=0)])
    total = logits.shape[0]
    if batch_axes:
        stats = lax.psum(stats, batch_axes)
        total *= math.prod(lax.axis_size(a) for a in batch_axes)
    fraction, mean_prob = stats[:config.experts] / total, stats[config.experts:] / total
    balance = config.experts * jnp.sum(fraction * mean_prob)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    return {"load_balance": balance, "z_loss": z}


def dispatch_plan(experts: jax.Array, config: MoEConfig, capacity: int):
    """Where each token's choices go: ``position`` [T, k], the row of the flat capacity buffer
    [E C] (``E C`` when dropped), and the dropped count.

    Assignments are served choice rank by choice rank, tokens in order within each: a token's slot
    in expert e is the number of earlier assignments to e; slots past ``capacity`` are dropped."""
    tokens, k = experts.shape
    onehot = jax.nn.one_hot(experts.T.reshape(-1), config.experts, dtype=jnp.int32)  # [k T, E]
    earlier = jnp.cumsum(onehot, axis=0) - onehot  # earlier assignments to the same expert
    slot = jnp.sum(earlier * onehot, axis=-1).reshape(k, tokens).T  # [T, k]
    kept = slot < capacity
    position = jnp.where(kept, experts * capacity + slot, config.experts * capacity)
    return position, jnp.sum(~kept)


def dispatch(x: jax.Array, position: jax.Array, rows: int) -> jax.Array:
    """The capacity buffer [rows, h]: token t's copy at ``position[t, j]`` for each choice j that
    was kept (a scatter: every kept assignment owns its row; dropped ones fall off the end)."""
    k = position.shape[1]
    copies = jnp.repeat(x, k, axis=0)  # [T k, h], token-major like position.reshape(-1)
    return jnp.zeros((rows, x.shape[1]), x.dtype).at[position.reshape(-1)].set(
        copies, mode="drop", unique_indices=True)


def combine(buffer: jax.Array, position: jax.Array, gates: jax.Array) -> jax.Array:
    """``y[t] = sum_j gates[t, j] * buffer[position[t, j]]`` (dropped choices add nothing)."""
    rows = buffer.shape[0]
    picked = jnp.take(buffer, jnp.minimum(position, rows - 1), axis=0)  # [T, k, h]
    weights = jnp.where(position < rows, gates, 0).astype(buffer.dtype)
    return jnp.einsum("tk,tkh->th", weights, picked)


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


def _exchange(buffers, axis):
    """The dispatch (or combine) all-to-all of [G, E/G, C, h] over the expert axis."""
    if axis is None:
        return buffers
    return remat.name_collective(lax.all_to_all(buffers, axis, 0, 0, tiled=False))


def moe_per_rank(params: dict, x: jax.Array, config: MoEConfig, *,
                 axis: str | None = EXPERT_AXIS, model_axis: str | None = None,
                 dtd: bool = False, batch_axes: tuple[str, ...] = (),
                 router_axis: str | None = None, run_experts: Callable | None = None):
    """The expert-parallel MoE on one rank: x [T, h] -> (y [T, h], aux dict with ``dropped``).

    ``params``: the router replicated; the experts' leaves this rank's E/G experts. ``axis=None``:
    every expert on this rank, no all-to-all. ``batch_axes``: the axes whose ranks hold other
    tokens of the batch (the load-balancing statistics are summed over them). With ``model_axis``
    (TED) the experts are also tensor-parallel over it and ``x`` is replicated over it; ``dtd``
    (duplicate token dropping) sends each tensor rank's 1/p slice of the capacity buffer through
    the all-to-all (its bytes fall by p) and all-gathers the slices over ``model_axis`` on arrival,
    and on the way back reduce-scatters the experts' partial outputs instead of all-reducing them,
    all-to-alls the slices, all-gathers them. ``router_axis``/``run_experts``: a router on
    feature-sharded tokens and another expert FFN ``(params, x [E/G, N, h']) -> [E/G, N, h']``
    (phantom-parallel experts)."""
    ranks = lax.axis_size(axis) if axis is not None else 1
    config.check_axis(ranks)
    tensor = lax.axis_size(model_axis) if model_axis is not None else 1
    if dtd and model_axis is None:
        raise ConfigError("dtd (duplicate token dropping) needs a tensor-parallel model_axis")
    reduce_logits = None if router_axis is None else (lambda z: lax.psum(z, router_axis))
    logits, probs, experts, gates = route(params["router"], x, config, reduce_logits)
    aux = aux_losses(logits, probs, experts, config, batch_axes)
    if config.dropless:
        if dtd or run_experts is not None:
            raise ConfigError("the dropless MoE runs dense (or TED) experts without dtd; use a "
                              "capacity factor for dtd or phantom-parallel experts")
        y = _dropless(params, x, experts, gates, config, axis, model_axis)
        return y, {**aux, "dropped": jnp.zeros((), jnp.int32)}
    tokens, h = x.shape
    capacity = config.capacity(tokens, tensor if dtd else 1)
    position, dropped = dispatch_plan(experts, config, capacity)
    buffers = dispatch(x, position, config.experts * capacity)  # [E C, h]
    local = config.experts // ranks
    slots = capacity // tensor if dtd else capacity  # what each tensor rank sends per expert
    buffers = buffers.reshape(ranks, local, capacity, h)
    if dtd:  # this tensor rank's slice of the (identical) buffers: no duplicate crosses the network
        buffers = lax.dynamic_slice_in_dim(buffers, lax.axis_index(model_axis) * slots, slots, 2)
    # Collective outputs are named: remat's collectives_saveable keeps them, so a recompute
    # repeats no all-to-all (seed 004's communication-aware checkpointing, CAC).
    received = _exchange(buffers, axis)
    if dtd:
        received = remat.name_collective(lax.all_gather(received, model_axis, axis=2,
                                                        tiled=True))  # [G, E/G, C, h]
    if run_experts is None:
        if model_axis is None:
            reduce = None
        elif dtd:  # reduce-scatter over the tensor ranks, each keeping its C/p slots of a block
            reduce = lambda o: lax.psum_scatter(o.reshape(local, ranks, capacity, h), model_axis,
                                                scatter_dimension=2, tiled=True).reshape(
                                                    local, ranks * slots, h)
        else:
            reduce = lambda o: remat.name_collective(lax.psum(o, model_axis))
        run_experts = functools.partial(_experts, reduce=reduce)
    out = run_experts(params, received.transpose(1, 0, 2, 3).reshape(local, ranks * capacity, h))
    out = out.reshape(local, ranks, slots, h).transpose(1, 0, 2, 3)
    returned = _exchange(out, axis)  # back home
    if dtd:
        returned = remat.name_collective(
            lax.all_gather(returned, model_axis, axis=2, tiled=True, to="invarying"))
    y = combine(returned.reshape(config.experts * capacity, h), position, gates)
    return y, {**aux, "dropped": dropped}


def ragged_all_to_all_supported(platform: str | None = None) -> bool:
    """:func:`jphantom.nn.expert.ragged_all_to_all_supported` (one definition)."""
    from jphantom.nn import expert as nn_expert

    return nn_expert.ragged_all_to_all_supported(platform)


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                    axis: str):
    """:func:`jphantom.nn.expert.ragged_exchange` (one definition)."""
    from jphantom.nn import expert as nn_expert

    return nn_expert.ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis)


def _grouped_experts(params, rows, sizes, reduce):
    """Rows [N, h] sorted by local expert (``sizes`` [E'] of them each, the rest padding) through
    their experts with grouped matmuls (``lax.ragged_dot``)."""
    group = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows.shape[0]),
                                      side="right"), 0, sizes.shape[0] - 1)
    hidden = jax.nn.gelu(lax.ragged_dot(rows, params["w_in"], sizes) + params["b_in"][group],
                         approximate=True)
    out = lax.ragged_dot(hidden, params["w_out"], sizes)
    if reduce is not None:
        out = reduce(out)
    valid = jnp.arange(rows.shape[0]) < jnp.sum(sizes)
    return jnp.where(valid[:, None], out + params["b_out"][group], 0)


def _dropless(params, x, experts, gates, config: MoEConfig, axis, model_axis):
    """Every assignment served: sort by expert, exchange exactly the rows each expert rank gets
    (ragged), grouped matmuls, exchange back, combine by the gates."""
    tokens, h = x.shape
    k, ranks = config.top_k, (lax.axis_size(axis) if axis is not None else 1)
    local = config.experts // ranks
    flat = experts.reshape(-1)  # [T k], token-major
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]  # [T k, h], grouped by expert
    sizes = jnp.bincount(flat, length=config.experts).astype(jnp.int32)
    reduce = None if model_axis is None else (lambda o: remat.name_collective(
        lax.psum(o, model_axis)))
    if ranks == 1:
        out = _grouped_experts(params, rows, sizes, reduce)
    else:
        me = lax.axis_index(axis)
        counts = lax.all_gather(sizes.reshape(ranks, local), axis)  # [G_src, G_dst, E/G]
        to_dst = counts.sum(axis=2)  # [G_src, G_dst]
        send, recv = to_dst[me], to_dst[:, me]
        send_offsets = jnp.cumsum(send) - send
        recv_offsets = jnp.cumsum(recv) - recv
        landing = (jnp.cumsum(to_dst, axis=0) - to_dst)[me]  # my chunk's offset in each receiver
        buffer = jnp.zeros((ranks * tokens * k, h), x.dtype)  # the worst case: all tokens here
        got = ragged_exchange(rows, buffer, send_offsets, send, landing, recv, axis)
        # received rows: source by source, each sorted by local expert; regroup by local expert
        mine = counts[:, me, :]  # [G_src, E/G]
        position = jnp.arange(buffer.shape[0])
        source = jnp.clip(jnp.searchsorted(jnp.cumsum(recv), position, side="right"), 0,
                          ranks - 1)
        within = position - recv_offsets[source]
        expert_of = jnp.sum(within[:, None] >= jnp.cumsum(mine[source], axis=1), axis=1)
        expert_of = jnp.where(position < jnp.sum(recv), expert_of, local)  # padding last
        regroup = jnp.argsort(expert_of, stable=True)
        grouped = _grouped_experts(params, got[regroup], mine.sum(axis=0), reduce)
        back = jnp.zeros_like(grouped).at[regroup].set(grouped)
        home = (jnp.cumsum(to_dst, axis=1) - to_dst)[:, me]  # where each source's rows came from
        out = ragged_exchange(back, jnp.zeros_like(rows), recv_offsets, recv, home, send, axis)
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(tokens, k, h)
    return jnp.einsum("tk,tkh->th", gates.astype(x.dtype), unsorted)


def dense_moe(params: dict, x: jax.Array, config: MoEConfig):
    """Single-device oracle: every expert on every token, combined by the router's top-k gates."""
    logits, probs, experts, gates = route(params["router"], x, config)
    everything = _experts(params, jnp.broadcast_to(x, (config.experts, *x.shape)))  # [E, T, h]
    weights = jnp.sum(jax.nn.one_hot(experts, config.experts) * gates[..., None], axis=1)  # [T, E]
    y = jnp.einsum("te,eth->th", weights.astype(x.dtype), everything)
    return y, aux_losses(logits, probs, experts, config)
