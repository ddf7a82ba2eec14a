"""Expert parallelism as Flax NNX layers: mixtures of experts split over the ``expert`` mesh axis,
tokens exchanged by all-to-all (GShard / Switch routing; DeepSpeed-TED, Singh's thesis ch. 7, with the
experts also split over ``model``).

Per rank, inside the step's ``shard_map``, with E experts over G ``expert`` ranks (E/G each) and
this rank's T tokens x [T, h] (the batch is split over ``data`` and ``expert``):

1. the top-k experts of each token and their gates (the router, replicated);
2. capacity C per expert and rank (``capacity_factor``: min(ceil(c T k / E), T)); first
   choices served first, the rest dropped and counted;
3. dispatch: each kept (token, choice) scattered into its row of [G, E/G, C, h]; one all-to-all
   over ``expert`` (E C h elements): every rank receives its experts' rows from every rank;
4. the E/G local experts on the G C rows each received;
5. the all-to-all back (E C h), the gate-weighted combine.

Backward: the two all-to-alls' transposes (two more of E C h).

Two layers:

- :class:`ExpertParallelExperts` (Mixtral, :mod:`jphantom.models.llama`): the model's router
  gives dense gates; no capacity by default (C = T, nothing dropped). With ``model``: f before
  the dispatch and g after the combine, on T h.
- :class:`ExpertParallelMoE` (the GPT-2 MoE blocks, :class:`jphantom.nn.moe.SwitchMoE`): the
  router inside, capacity and dropless dispatch, and the auxiliary losses with the
  load-balancing statistics summed over the batch's ranks (one all-reduce of 2E numbers), so the
  loss is the same on every mesh. **TED** (``model_axis``, Singh's thesis Eq. 7.1): each expert also
  tensor-parallel (W_up split on f, column; W_down on f, row) on the stream replicated over
  ``model``; the received buffers go through f (backward all-reduce of E C h) and the experts'
  partial outputs through g (all-reduce of E C h). **DTD** (``dtd``, duplicate token dropping):
  each tensor rank sends only its 1/p slice of the (identical) capacity buffer, all-gathers the
  slices over ``model`` after the all-to-all, and reduce-scatters the partial outputs instead of
  all-reducing them: the all-to-all bytes fall by p. **Dropless** (``capacity_factor=None``):
  assignments sorted by expert, grouped matmuls (``lax.ragged_dot``) on exactly the rows each
  expert got, ``lax.ragged_all_to_all`` over ``expert`` where the backend implements it
  (:func:`jphantom.runtime.mesh.has_ragged_all_to_all`: its GPU and TPU backends); XLA:CPU does not, and there
  the same exchange runs as a padded ``all_to_all`` of worst-case chunks (:func:`ragged_exchange`,
  exact, G-fold larger).
- :class:`PhantomMoE`: phantom-parallel experts (Seal et al. in every expert) on the feature-split
  stream [T, h/p]: the router's logits all-reduced over the feature axis (T E), each rank
  dispatching its h/p features of every token (the all-to-all carries 1/p of the bytes, as DTD
  does), every expert a phantom FFN whose ranks exchange k ghosts per token.

**CAC** (Singh's communication-aware checkpointing): every all-to-all and tensor all-reduce
output is named (:func:`jphantom.step.remat.name_collective`), so ``remat="collectives_saveable"``
keeps them and a recompute repeats no collective (per MoE layer 6 all-to-alls become 4, the
experts' 3 all-reduces of E C h become 2).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom.runtime import comm
from jphantom.step import remat
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import has_ragged_all_to_all
from jphantom.nn import metadata
from jphantom.nn.moe import (Experts, SwitchMoE, combine_sorted, expert_ffn, grouped_ffn,
                                 route, router_losses, router_statistics, sort_by_expert)
from jphantom.nn.phantom import PhantomLinear
from jphantom.nn.tensor import plain_linear, promote_dtypes, reduce_from_model, to_full_sequence
from jphantom.nn import routing as expert_ops
from jphantom.nn.phantom import ops as phantom_ops


class ExpertParallelExperts(nnx.Module):
    """E SwiGLU experts split over ``expert_axis`` (and their width over ``model_axis``, TED).
    w_gate, w_up [E, h, f], w_down [E, f, h]: E split over ``expert_axis``, f over ``model_axis``.
    The router is a plain replicated ``nnx.Linear`` in the model; this layer replaces
    :class:`Experts` only."""

    fp8 = False  # the experts' GEMMs on FP8 operands (precision='fp8')

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
        if experts.activation != "swiglu" or experts.use_bias:
            raise ConfigError("ExpertParallelExperts splits SwiGLU experts without biases "
                              "(Mixtral); route GELU experts with biases through a SwitchMoE "
                              "(ExpertParallelMoE)")
        return cls(experts.w_gate.get_value(), experts.w_up.get_value(),
                   experts.w_down.get_value(), top_k=top_k, expert_axis=expert_axis,
                   model_axis=model_axis, capacity_factor=capacity_factor,
                   sequence_parallel=sequence_parallel)

    def dense_equivalent(self) -> Experts:
        return Experts.of(self.w_gate[...], self.w_up[...], self.w_down[...], top_k=self.top_k)

    def __call__(self, x: jax.Array, gates: jax.Array) -> jax.Array:
        if self.model_axis is not None:
            x = to_full_sequence(x, self.model_axis, self.sequence_parallel)
        lead, h = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, h)
        weights, chosen = lax.top_k(gates.reshape(-1, gates.shape[-1]), self.top_k)
        w = {"w_gate": self.w_gate[...], "w_up": self.w_up[...], "w_down": self.w_down[...]}
        dtype = jnp.result_type(x, w["w_gate"])
        local = w["w_gate"].shape[0]
        ranks = lax.axis_size(self.expert_axis)
        experts = local * ranks
        count = tokens.shape[0]
        capacity = count if self.capacity_factor is None else min(count, max(  # <= T: no drop
            1, -(-int(self.capacity_factor * count * self.top_k) // experts)))
        config = expert_ops.MoEConfig(h, experts, self.top_k)
        position, _ = expert_ops.dispatch_plan(chosen, config, capacity)
        buffers = expert_ops.dispatch(tokens.astype(dtype), position, experts * capacity)
        buffers = buffers.reshape(ranks, local, capacity, h)
        received = remat.name_collective(  # all-to-all of E C h: each expert's tokens to its rank
            comm.all_to_all(buffers, self.expert_axis, 0, 0, tiled=False))
        rows = received.transpose(1, 0, 2, 3).reshape(local, -1, h)  # [E/G, G (p) slots, h]
        out = expert_ffn(rows, w, "swiglu", fp8=self.fp8)
        out = out.reshape(local, ranks, capacity, h).transpose(1, 0, 2, 3)
        returned = remat.name_collective(  # all-to-all of E C h back home
            comm.all_to_all(out, self.expert_axis, 0, 0, tiled=False))
        y = expert_ops.combine(returned.reshape(experts * capacity, h), position, weights)
        y = y.reshape(*lead, h)
        if self.model_axis is not None:  # g over the experts' split width (TED)
            y = reduce_from_model(y, self.model_axis, self.sequence_parallel)
        return y


def _ranks(axes) -> int:
    return math.prod(lax.axis_size(a) for a in axes)


class ExpertParallelMoE(nnx.Module):
    """A :class:`~jphantom.nn.moe.SwitchMoE` split over ``expert_axis`` (E/G experts per
    rank; ``None``: every expert on every rank, no all-to-all), its experts' width over
    ``model_axis`` (TED; ``dtd``: duplicate token dropping), its load-balancing statistics summed
    over ``batch_axes`` (the axes whose ranks hold other tokens of the batch). Module docstring.

    Parameters: ``router`` [h, E] replicated; ``experts`` (:class:`Experts`) with E split over
    ``expert_axis`` and f over ``model_axis``. Input x [..., h] replicated over ``model_axis``
    (invariant: the router runs on it, and its backward all-reduce happens on the received buffers,
    E C h); output (y [..., h], aux)."""

    def __init__(self, router, experts: Experts, config: expert_ops.MoEConfig, *,
                 expert_axis: str | None = "expert", model_axis: str | None = None,
                 dtd: bool = False, batch_axes: tuple[str, ...] = (),
                 sequence_parallel: bool = False):
        if dtd and sequence_parallel:
            raise ConfigError("dtd (duplicate token dropping) keeps each tensor rank from sending "
                              "the same tokens; under sequence parallelism every tensor rank "
                              "dispatches its own S/p tokens already: leave dtd out")
        if dtd and model_axis is None:
            raise ConfigError("dtd (duplicate token dropping) splits the capacity buffers over "
                              "the experts' tensor-parallel ranks: it needs a model axis")
        if dtd and config.dropless:
            raise ConfigError("the dropless MoE exchanges exactly the rows each expert gets; dtd "
                              "slices fixed capacity buffers: give a capacity factor for dtd")
        self.config, self.expert_axis, self.model_axis = config, expert_axis, model_axis
        self.dtd, self.batch_axes = bool(dtd), tuple(batch_axes)
        self.sequence_parallel = bool(sequence_parallel) and model_axis is not None
        self.router = metadata.param(router, (None, None))
        self.experts = experts

    @classmethod
    def from_module(cls, moe: SwitchMoE, *, expert_axis: str | None = "expert",
                    model_axis: str | None = None, dtd: bool = False,
                    batch_axes: tuple[str, ...] = (),
                    sequence_parallel: bool = False) -> "ExpertParallelMoE":
        experts = Experts.from_weights(
            {name: getattr(moe.experts, name).get_value() for name in moe.experts.names},
            activation=moe.experts.activation, top_k=moe.experts.top_k,
            axes={"e": expert_axis, "f": model_axis})
        return cls(moe.router.get_value(), experts, moe.config, expert_axis=expert_axis,
                   model_axis=model_axis, dtd=dtd, batch_axes=batch_axes,
                   sequence_parallel=sequence_parallel)

    def dense_equivalent(self) -> SwitchMoE:
        experts = Experts.from_weights(self.experts.weights(), activation=self.experts.activation,
                                       top_k=self.experts.top_k)
        return SwitchMoE.of(self.router[...], experts, self.config)

    # -- the parts a phantom layer replaces ------------------------------------------------------

    def logits(self, tokens: jax.Array) -> jax.Array:
        """Router logits [T, E] (replicated router, no communication)."""
        tokens, router = promote_dtypes(tokens, self.router[...])
        return tokens @ router

    def run_experts(self, rows: jax.Array, reduce=None) -> jax.Array:
        """This rank's E/G experts on their received rows [E/G, N, h] (``reduce``: TED's g)."""
        return expert_ffn(rows, self.experts.weights(), self.experts.activation, reduce,
                          self.experts.fp8)

    # -- the layer ---------------------------------------------------------------------------------

    def __call__(self, x: jax.Array, fraction: jax.Array | None = None):
        config, model = self.config, self.model_axis
        gathered = self.sequence_parallel and config.dropless
        if gathered:  # the whole sequence (all-gather of B S h over model; backward reduce-scatter)
            x = comm.all_gather(x, model, axis=x.ndim - 2, tiled=True)
        lead, h = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, h)
        count = tokens.shape[0]
        logits, probs, chosen, gates = route(tokens, self.logits(tokens), config.top_k)
        statistics = router_statistics(probs, chosen)
        # the ranks holding other tokens: the batch's, and under SP (capacity path) the tensor ranks
        axes = self.batch_axes + ((model,) if self.sequence_parallel and not gathered else ())
        if axes:  # all-reduce of 2E numbers: the load balance of the whole batch
            statistics = comm.psum(statistics, axes)
        aux = {**router_losses(logits, statistics, count * _ranks(axes), fraction),
               "statistics": statistics}
        if config.dropless:
            y, dropped = self._dropless(tokens, chosen, gates), jnp.zeros((), jnp.int32)
        else:
            y, dropped = self._dispatched(tokens, chosen, gates)
        y = y.reshape(*lead, y.shape[-1])
        if gathered:  # the experts' partial sums, reduce-scattered back to S/p (B S h)
            y = remat.name_collective(comm.psum_scatter(y, model, scatter_dimension=y.ndim - 2,
                                                        tiled=True))
        return y, {**aux, "dropped": dropped.astype(jnp.int32)}

    def _exchange(self, buffers):
        """The dispatch (or combine) all-to-all of [G, E/G, C, h] over the expert axis."""
        if self.expert_axis is None:
            return buffers
        return remat.name_collective(comm.all_to_all(buffers, self.expert_axis, 0, 0,
                                                    tiled=False))

    def _dispatched(self, tokens, chosen, gates):
        config, model, dtd = self.config, self.model_axis, self.dtd
        sp = self.sequence_parallel  # each tensor rank dispatches its own S/p tokens
        split = dtd or sp  # the tensor ranks send different rows, gathered over model after
        count, h = tokens.shape
        ranks = lax.axis_size(self.expert_axis) if self.expert_axis is not None else 1
        tensor = lax.axis_size(model) if model is not None else 1
        local = config.experts // ranks
        capacity = config.capacity(count, tensor if dtd else 1)
        slots = capacity // tensor if dtd else capacity  # what each tensor rank sends per expert
        position, dropped = expert_ops.dispatch_plan(chosen, config, capacity)
        buffers = expert_ops.dispatch(tokens, position, config.experts * capacity)  # [E C, h]
        buffers = buffers.reshape(ranks, local, capacity, h)
        if dtd:  # this tensor rank's slice of the (identical) buffers: no duplicate crosses
            buffers = lax.dynamic_slice_in_dim(buffers, comm.axis_index(model) * slots, slots, 2)
        received = self._exchange(buffers)  # all-to-all of E C h (DTD: E C h / p)
        if split:  # all-gather of the tensor ranks' rows over model: [G, E/G, p slots, h]
            received = remat.name_collective(comm.all_gather(received, model, axis=2, tiled=True))
        if model is None:
            reduce = None
        elif split:  # reduce-scatter: each tensor rank keeps the partial sums of its own rows
            reduce = lambda o: comm.psum_scatter(
                o.reshape(local, ranks, tensor * slots, -1), model, scatter_dimension=2,
                tiled=True).reshape(local, ranks * slots, -1)
        else:  # g: all-reduce of E C h (f's backward, on the received buffers, is another)
            reduce = lambda o: remat.name_collective(comm.psum(o, model))
        rows = received.transpose(1, 0, 2, 3).reshape(local, -1, h)  # [E/G, G (p) slots, h]
        out = self.run_experts(rows, reduce)
        out = out.reshape(local, ranks, slots, -1).transpose(1, 0, 2, 3)
        returned = self._exchange(out)  # all-to-all of E C h back home
        if dtd:  # all-gather of the returned slices over model, replicated again
            returned = remat.name_collective(
                comm.all_gather(returned, model, axis=2, tiled=True, to="invarying"))
        y = expert_ops.combine(returned.reshape(config.experts * capacity, -1), position, gates)
        return y, dropped

    def _dropless(self, tokens, chosen, gates):
        """Every assignment served: sort by expert, exchange exactly the rows each expert rank
        gets (ragged), grouped matmuls, exchange back, combine by the gates."""
        config, axis, model = self.config, self.expert_axis, self.model_axis
        count, h = tokens.shape
        k = config.top_k
        ranks = lax.axis_size(axis) if axis is not None else 1
        local = config.experts // ranks
        order, sizes = sort_by_expert(chosen, config.experts)
        rows = tokens[order // k]  # [T k, h], grouped by expert
        weights, activation = self.experts.weights(), self.experts.activation
        reduce = None if model is None else (
            lambda o: remat.name_collective(comm.psum(o, model)))  # g: all-reduce of the rows
        if self.sequence_parallel:  # partial sums, reduce-scattered after the combine: each
            reduce = None           # tensor rank adds 1/p of the output bias
            if weights.get("b_down") is not None:
                weights = {**weights, "b_down": weights["b_down"] / lax.axis_size(model)}
        if ranks == 1:
            return combine_sorted(grouped_ffn(rows, sizes, weights, activation, reduce,
                                              self.experts.fp8), order, gates)
        me = comm.axis_index(axis)
        counts = comm.all_gather(sizes.reshape(ranks, local), axis)  # [G_src, G_dst, E/G]
        to_dst = counts.sum(axis=2)  # [G_src, G_dst]
        send, recv = to_dst[me], to_dst[:, me]
        send_offsets = jnp.cumsum(send) - send
        recv_offsets = jnp.cumsum(recv) - recv
        landing = (jnp.cumsum(to_dst, axis=0) - to_dst)[me]  # my chunk's offset in each receiver
        buffer = jnp.zeros((ranks * count * k, h), tokens.dtype)  # the worst case: all here
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
        grouped = grouped_ffn(got[regroup], mine.sum(axis=0), weights, activation, reduce,
                              self.experts.fp8)
        back = jnp.zeros_like(grouped).at[regroup].set(grouped)
        home = (jnp.cumsum(to_dst, axis=1) - to_dst)[:, me]  # where each source's rows came from
        out = ragged_exchange(back, jnp.zeros((count * k, back.shape[-1]), back.dtype),
                              recv_offsets, recv, home, send, axis)
        return combine_sorted(out, order, gates)


class PhantomMoE(ExpertParallelMoE):
    """Phantom-parallel experts (module docstring) on the feature-split stream x [..., h/p]: the
    router [h, E] split on its input features over ``axis`` (logits all-reduced: T E), experts
    split over ``expert_axis``, every expert's W_up (h -> f) and W_down (f -> h) a phantom linear
    (:class:`~jphantom.nn.phantom.PhantomLinear` stacked over E: ``up``, ``down``) whose ranks
    exchange k ghosts per token (all-gather of N p k forward, reduce-scatter of N k backward).
    GELU experts with a capacity (no dropless, no DTD: each rank already sends 1/p of a row)."""

    def __init__(self, router, up: PhantomLinear, down: PhantomLinear,
                 config: expert_ops.MoEConfig, *, axis: str = "model",
                 expert_axis: str | None = "expert", batch_axes: tuple[str, ...] = (),
                 top_k: int | None = None):
        if config.dropless:
            raise ConfigError("phantom-parallel experts dispatch fixed capacity buffers: give a "
                              "capacity factor (the dropless MoE runs under 'tensor')")
        self.config, self.expert_axis, self.model_axis, self.dtd = config, expert_axis, None, False
        self.sequence_parallel = False
        self.axis, self.batch_axes, self.top_k = axis, tuple(batch_axes), top_k
        self.router = metadata.param(router, (axis, None))
        self.up, self.down = up, down
        if expert_axis is not None:  # the expert dimension sits just before the shard dimension
            for layer in (up, down):
                for _, variable in nnx.iter_graph(layer):
                    if isinstance(variable, nnx.Param):
                        axes = list(metadata.axes_of(variable))
                        axes[axes.index(axis) - 1] = expert_axis
                        variable.set_metadata("out_sharding", tuple(axes))

    @classmethod
    def from_module(cls, moe: SwitchMoE, *, ghost_width: int, num_shards: int,
                    axis: str = "model", fused: bool = True, expert_axis: str | None = "expert",
                    batch_axes: tuple[str, ...] = ()) -> "PhantomMoE":
        experts = moe.experts
        if experts.activation != "gelu":
            raise ConfigError("phantom-parallel experts are GELU FFNs (a SwitchMoE's default); "
                              f"got activation={experts.activation!r}")
        value = lambda name: (getattr(experts, name).get_value() if experts.use_bias else None)
        linear = lambda w, b: PhantomLinear.from_module(
            plain_linear(w, b, None), ghost_width=ghost_width, num_shards=num_shards, axis=axis,
            fused=fused)
        up = linear(experts.w_up.get_value(), value("b_up"))
        down = linear(experts.w_down.get_value(), value("b_down"))
        return cls(moe.router.get_value(), up, down, moe.config, axis=axis,
                   expert_axis=expert_axis, batch_axes=batch_axes, top_k=experts.top_k)

    def dense_equivalent(self) -> SwitchMoE:
        up, down = self.up.dense_equivalent(), self.down.dense_equivalent()
        weights = {"w_up": up.kernel[...], "w_down": down.kernel[...]}
        if self.up.use_bias:
            weights.update(b_up=up.bias[...], b_down=down.bias[...])
        experts = Experts.from_weights(weights, activation="gelu", top_k=self.top_k)
        return SwitchMoE.of(self.router[...], experts, self.config)

    def logits(self, tokens: jax.Array) -> jax.Array:
        """Partial logits of this rank's h/p features, all-reduced over ``axis``: T E."""
        tokens, router = promote_dtypes(tokens, self.router[...])
        return comm.psum(tokens @ router, self.axis)

    def run_experts(self, rows: jax.Array, reduce=None) -> jax.Array:
        """rows [E', N, h/p] through this rank's E' phantom expert FFNs."""
        up = jax.nn.gelu(_phantom_experts(self.up, rows), approximate=True)
        return _phantom_experts(self.down, up)


def _phantom_experts(layer: PhantomLinear, rows: jax.Array) -> jax.Array:
    """A phantom linear stacked over E' experts on rows [E', N, n_in/p] -> [E', N, n_out/p]
    (Eq. 11 per expert; one all-gather of N p k per expert forward)."""
    local, compress, decompress = layer.local[...], layer.compress[...], layer.decompress[...]
    if layer.use_bias:
        bias = layer.bias[...]
    else:  # no bias: a constant zero, varying as the custom backward's gradient is
        bias = jnp.zeros(local.shape[:-1], local.dtype)
        bias = comm.pcast(bias, tuple(sorted(metadata.varying_axes(rows) | {layer.axis})),
                         to="varying")
    rows, local, compress, decompress, bias = promote_dtypes(rows, local, compress, decompress, bias)

    def one(local, compress, decompress, bias, x):  # the shard dimension of size 1 dropped
        return phantom_ops.phantom_layer(layer.axis, layer.num_shards, layer.fused, x, local[0],
                                         compress[0], decompress[0], bias[0])

    z = jax.vmap(one)(local, compress, decompress, bias, rows)
    return remat.name_collective(z)  # holds the ghosts' all-gather


# -------------------------------------------------------------------------------------------------
# The ragged exchange of the dropless path
# -------------------------------------------------------------------------------------------------


def ragged_exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                    axis: str):
    """``lax.ragged_all_to_all`` semantics: rows ``[input_offsets[d], + send_sizes[d])`` of
    ``operand`` land in rank ``d``'s ``output`` at ``output_offsets[d]``; ``recv_sizes[s]`` rows
    arrive from rank ``s``. The primitive where the backend has it; elsewhere a padded
    ``all_to_all`` of every chunk at ``operand``'s length, then a scatter (exact, G-fold bytes)."""
    if has_ragged_all_to_all():
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                     recv_sizes, axis_name=axis)
    rows = operand.shape[0]
    index = input_offsets[:, None] + jnp.arange(rows)[None, :]  # [G, rows]
    valid = jnp.arange(rows)[None, :] < send_sizes[:, None]
    chunks = jnp.where(valid[..., None], operand[jnp.clip(index, 0, rows - 1)], 0)
    got = remat.name_collective(comm.all_to_all(chunks, axis, 0, 0, tiled=False))  # [G_src, ...]
    offsets = comm.all_to_all(output_offsets[:, None], axis, 0, 0, tiled=False)[:, 0]
    target = offsets[:, None] + jnp.arange(rows)[None, :]
    target = jnp.where(jnp.arange(rows)[None, :] < recv_sizes[:, None], target, output.shape[0])
    return output.at[target.reshape(-1)].set(got.reshape(-1, *got.shape[2:]), mode="drop")


__all__ = ["ExpertParallelExperts", "ExpertParallelMoE", "PhantomMoE", "ragged_exchange"]
