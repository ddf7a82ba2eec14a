"""Mixtures of experts as plain Flax NNX layers (no communication): the building blocks a model
uses, which a plan makes parallel (:mod:`jphantom.nn.expert_parallel`, :class:`jphantom.nn.tensor.
TensorParallelExperts`).

:class:`Experts` holds E feed-forward experts stacked over E, of one of two kinds:

- ``activation="swiglu"`` (Mixtral, Llama): ``(silu(x W_gate[e]) * (x W_up[e])) W_down[e]``;
  W_gate, W_up [E, h, f], W_down [E, f, h];
- ``activation="gelu"`` (GPT-2's MLP, the Switch Transformer's experts):
  ``gelu_tanh(x W_up[e] + b_up[e]) W_down[e] + b_down[e]``; W_up [E, h, f], b_up [E, f],
  W_down [E, f, h], b_down [E, h] (``use_bias=True``).

Called with dense gates [..., E] it runs every expert on every token and weights the results by
the gates (zero for experts a token did not choose): exact, E/k times the FLOPs of a dispatching
layer, the single-device oracle of the parallel ones. Mixtral's router
(:func:`top_k_gates`: softmax, top k, renormalised) drops no token.

:class:`SwitchMoE` is the routed layer with a capacity (Switch Transformer, Fedus et al. 2021;
GShard, Lepikhin et al. 2020), on the T tokens it is given, x [T, h]:

1. **Router** ``W_r`` [h, E]: logits ``x W_r``, probabilities ``softmax`` (in at least float32),
   the top-k experts of each token, their probabilities as gates (not renormalised).
2. **Capacity** ``C = min(ceil(capacity_factor * T * k / E), T)`` per expert (an expert takes a
   token at most once); assignments are served choice rank by choice rank, tokens in order within
   each (all first choices before any second choice); the rest are dropped and counted exactly.
   ``capacity_factor=None``: dropless, every assignment served (tokens sorted by expert, grouped
   matmuls ``lax.ragged_dot``).
3. **Dispatch** each kept (token, choice) to its row of the buffer [E, C, h], the experts on
   their C rows, **combine** ``y[t] = sum_j gate[t, j] * out[slot of (t, j)]``.
4. **Auxiliary losses**: load balance ``E sum_e f_e P_e`` (``f_e``: fraction of the tokens whose
   first choice is e, ``P_e``: mean router probability of e) and router z-loss
   ``mean_t logsumexp(logits_t)^2`` (ST-MoE, Zoph et al. 2022); and the dropped count.

``moe(x) -> (y, {"load_balance", "z_loss", "dropped"})``. The parallel layers compute the same
with the load-balancing statistics summed over the batch's ranks, so the loss does not depend on
the mesh (:class:`jphantom.nn.expert_parallel.ExpertParallelMoE`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom.step import fp8 as fp8_ops
from jphantom.errors import ConfigError
from jphantom.nn import routing as expert_ops

ACTIVATIONS = ("swiglu", "gelu")
# parameter name -> its dimensions' roles: e (experts), h (model width), f (expert width)
ROLES = {"w_gate": "ehf", "w_up": "ehf", "w_down": "efh", "b_gate": "ef", "b_up": "ef",
         "b_down": "eh"}


def top_k_gates(logits: jax.Array, top_k: int, *, renormalise: bool = True) -> jax.Array:
    """Dense gates [..., E]: softmax probabilities of the top-k experts, renormalised to sum to one
    (Mixtral; ``renormalise=False``: the probabilities themselves, Switch/GShard); zero elsewhere.
    Computed in at least float32."""
    probs = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    weights, chosen = jax.lax.top_k(probs, top_k)
    if renormalise:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(chosen, probs.shape[-1], dtype=probs.dtype)  # [..., k, E]
    return jnp.einsum("...k,...ke->...e", weights, one_hot)


def _hidden(project, activation: str):
    """The experts' hidden layer from ``project(name)`` = x W_name (+ b_name)."""
    if activation == "swiglu":
        return jax.nn.silu(project("gate")) * project("up")
    return jax.nn.gelu(project("up"), approximate=True)


def _fp8_operands(rows, weights: dict, fp8: bool):
    """``rows`` and the weight matrices rounded to FP8 (:func:`jphantom.step.fp8.quantized`) when
    ``fp8``, else as they are: the grouped GEMMs' operands (``lax.ragged_dot`` takes no FP8)."""
    if not fp8:
        return rows, weights
    return fp8_ops.quantized(rows), {k: fp8_ops.quantized(v) if k.startswith("w_") else v
                                     for k, v in weights.items()}


def _fp8_output(y, fp8: bool):
    return fp8_ops.quantized_gradient(y) if fp8 else y


def expert_ffn(rows: jax.Array, weights: dict, activation: str, reduce=None,
               fp8: bool = False) -> jax.Array:
    """Each expert on its rows: ``rows`` [E', N, h] -> [E', N', h]. ``weights``: this rank's
    ``w_up``, ``w_down`` (and ``w_gate``, ``b_*``) of E' experts. ``reduce`` sums the partial
    outputs of tensor-parallel experts (f split over ranks) before ``b_down``; it may also
    scatter them (N' < N, duplicate token dropping). ``fp8``: the GEMMs on FP8 operands."""
    dtype = jnp.result_type(rows, weights["w_up"])
    rows = rows.astype(dtype)
    gemm = fp8_ops.batched_matmul if fp8 else partial(jnp.einsum, "enh,ehf->enf")

    def project(name):
        y = gemm(rows, weights["w_" + name].astype(dtype))
        bias = weights.get("b_" + name)
        return y if bias is None else y + bias.astype(dtype)[:, None, :]

    out = gemm(_hidden(project, activation), weights["w_down"].astype(dtype))
    if reduce is not None:
        out = reduce(out)
    bias = weights.get("b_down")
    return out if bias is None else out + bias.astype(dtype)[:, None, :]


def grouped_ffn(rows: jax.Array, sizes: jax.Array, weights: dict, activation: str,
                reduce=None, fp8: bool = False) -> jax.Array:
    """Rows [N, h] sorted by expert (``sizes`` [E'] of them each, the rest padding) through their
    experts with grouped matmuls (``lax.ragged_dot``): [N, h], padding rows zero. ``reduce`` and
    ``fp8`` as in :func:`expert_ffn`."""
    group = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows.shape[0]),
                                      side="right"), 0, sizes.shape[0] - 1)
    dtype = jnp.result_type(rows, weights["w_up"])
    rows, weights = _fp8_operands(rows.astype(dtype), weights, fp8)

    def project(name):
        y = _fp8_output(lax.ragged_dot(rows, weights["w_" + name].astype(dtype), sizes), fp8)
        bias = weights.get("b_" + name)
        return y if bias is None else y + bias.astype(dtype)[group]

    hidden = _hidden(project, activation)
    out = _fp8_output(lax.ragged_dot(fp8_ops.quantized(hidden) if fp8 else hidden,
                                     weights["w_down"].astype(dtype), sizes), fp8)
    if reduce is not None:
        out = reduce(out)
    bias = weights.get("b_down")
    if bias is not None:
        out = out + bias.astype(dtype)[group]
    valid = jnp.arange(rows.shape[0]) < jnp.sum(sizes)
    return jnp.where(valid[:, None], out, 0)


class Experts(nnx.Module):
    """E experts (module docstring), every one applied to every token and weighted by ``gates``."""

    fp8 = False  # the experts' GEMMs on FP8 operands (precision='fp8'; every layer using them)

    def __init__(self, hidden: int, width: int, experts: int, *, rngs: nnx.Rngs,
                 top_k: int | None = None, param_dtype=jnp.float32, activation: str = "swiglu",
                 use_bias: bool = False, kernel_init=None):
        if activation not in ACTIVATIONS:
            raise ConfigError(f"activation={activation!r}: use one of {ACTIVATIONS}")
        self.top_k = top_k  # the router's k (expert-parallel layers dispatch that many per token)
        self.activation, self.use_bias = activation, bool(use_bias)
        init = kernel_init or nnx.initializers.lecun_normal()
        if activation == "swiglu":
            self.w_gate = nnx.Param(init(rngs.params(), (experts, hidden, width), param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (experts, hidden, width), param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (experts, width, hidden), param_dtype))
        if use_bias:
            zeros = nnx.initializers.zeros_init()
            if activation == "swiglu":
                self.b_gate = nnx.Param(zeros(rngs.params(), (experts, width), param_dtype))
            self.b_up = nnx.Param(zeros(rngs.params(), (experts, width), param_dtype))
            self.b_down = nnx.Param(zeros(rngs.params(), (experts, hidden), param_dtype))

    @property
    def names(self) -> tuple[str, ...]:
        """The parameters this kind of experts holds."""
        gate = ("w_gate",) if self.activation == "swiglu" else ()
        bias = (("b_gate",) if self.activation == "swiglu" else ()) + ("b_up", "b_down")
        return gate + ("w_up", "w_down") + (bias if self.use_bias else ())

    def weights(self) -> dict:
        """``{name: array}`` of the parameters (this rank's shards inside a ``shard_map``)."""
        return {name: getattr(self, name)[...] for name in self.names}

    @classmethod
    def from_weights(cls, weights: dict, *, activation: str = "swiglu",
                     top_k: int | None = None, axes: dict | None = None) -> "Experts":
        """Experts holding ``weights`` (``{name: array}``, module docstring); ``axes``: the mesh
        axis of each role (``{"e": "expert", "f": "model"}``) recorded as the parameters'
        sharding metadata (:mod:`jphantom.nn.metadata`)."""
        from jphantom.nn import metadata

        use_bias = "b_up" in weights
        experts = nnx.eval_shape(lambda: cls(1, 1, 1, rngs=nnx.Rngs(0), top_k=top_k,
                                             activation=activation, use_bias=use_bias))
        for name in experts.names:
            value = weights[name]
            if axes is None:
                setattr(experts, name, nnx.Param(value))
            else:
                setattr(experts, name, metadata.param(
                    value, tuple(axes.get(role) for role in ROLES[name])))
        return experts

    @classmethod
    def of(cls, w_gate, w_up, w_down, top_k: int | None = None) -> "Experts":
        """SwiGLU experts holding ``w_gate``, ``w_up``, ``w_down``."""
        return cls.from_weights({"w_gate": w_gate, "w_up": w_up, "w_down": w_down}, top_k=top_k)

    @staticmethod
    def apply(x, gates, w_gate, w_up, w_down, fp8: bool = False):
        """sum_e gates[..., e] * swiglu_e(x): x [..., h], gates [..., E] -> [..., h]."""
        return Experts.mix(x, gates, {"w_gate": w_gate, "w_up": w_up, "w_down": w_down},
                           "swiglu", fp8=fp8)

    @staticmethod
    def mix(x, gates, weights: dict, activation: str, reduce=None, fp8: bool = False):
        """sum_e gates[..., e] * expert_e(x): every expert on every token, x [..., h], gates
        [..., E] -> [..., h]. ``reduce``: as in :func:`expert_ffn`, before the biases."""
        lead, h = x.shape[:-1], x.shape[-1]
        experts = weights["w_up"].shape[0]
        rows = jnp.broadcast_to(x.reshape(1, -1, h), (experts, x.size // h, h))
        if fp8:  # only the tokens routed to an expert in its FP8 scales, as when dispatched
            rows = rows * (gates.reshape(-1, experts).T != 0)[..., None].astype(rows.dtype)
        out = expert_ffn(rows, weights, activation, reduce, fp8)  # [E, N, h]
        mixed = jnp.einsum("enh,ne->nh", out, gates.reshape(-1, experts).astype(out.dtype))
        return mixed.reshape(*lead, h)

    def __call__(self, x: jax.Array, gates: jax.Array) -> jax.Array:
        return self.mix(x, gates, self.weights(), self.activation, fp8=self.fp8)


# -------------------------------------------------------------------------------------------------
# Switch / GShard routing with a capacity
# -------------------------------------------------------------------------------------------------


def route(tokens: jax.Array, logits: jax.Array, top_k: int):
    """Probabilities (at least float32), the top-k experts [T, k] and their gates [T, k]."""
    logits = logits.astype(jnp.promote_types(tokens.dtype, jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    gates, chosen = lax.top_k(probs, top_k)
    return logits, probs, chosen, gates


def router_statistics(probs: jax.Array, chosen: jax.Array) -> jax.Array:
    """[2E]: how many tokens chose each expert first, and the sum of each expert's probability;
    summed over the batch's ranks they give the batch-wide load-balancing loss."""
    experts = probs.shape[-1]
    first = jax.nn.one_hot(chosen[:, 0], experts, dtype=probs.dtype)
    return jnp.concatenate([first.sum(axis=0), probs.sum(axis=0)])


def router_losses(logits: jax.Array, statistics: jax.Array, tokens: int,
                  fraction: jax.Array | None = None) -> dict:
    """Load balance ``E sum_e f_e P_e`` from :func:`router_statistics` of ``tokens`` tokens, and
    the router z-loss ``mean(logsumexp(logits)^2)`` of the tokens ``logits`` [T, E] holds.

    ``fraction`` [E]: the fractions ``f_e`` of a larger batch this one is a micro-batch of (from
    the statistics of all its micro-batches, gradient-free as ``f`` always is): then the mean of
    the micro-batches' losses is the whole batch's, ``E sum_e f_e mean_m P_e^(m)``, exactly."""
    experts = logits.shape[-1]
    mean_prob = statistics[experts:] / tokens
    if fraction is None:
        fraction = statistics[:experts] / tokens
    fraction = lax.stop_gradient(fraction).astype(mean_prob.dtype)
    return {"load_balance": experts * jnp.sum(fraction * mean_prob),
            "z_loss": jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))}


def sort_by_expert(chosen: jax.Array, experts: int):
    """The order [T k] of the (token, choice) assignments grouped by expert (stable), and how
    many each expert got [E]."""
    flat = chosen.reshape(-1)  # token-major
    return (jnp.argsort(flat, stable=True),
            jnp.bincount(flat, length=experts).astype(jnp.int32))


class SwitchMoE(nnx.Module):
    """Top-k mixture of ``experts`` with a capacity (module docstring): the router ``router``
    [h, E] and :class:`Experts` (GELU experts of width ``width`` with biases by default).
    ``moe(x)`` -> (y, aux) for x [..., h]."""

    def __init__(self, hidden: int, width: int, experts: int, *, rngs: nnx.Rngs, top_k: int = 2,
                 capacity_factor: float | None = 1.25, param_dtype=jnp.float32,
                 activation: str = "gelu", use_bias: bool = True, router_init=None,
                 kernel_init=None):
        self.config = expert_ops.MoEConfig(hidden, experts, top_k, capacity_factor, ffn=width)
        init = router_init or nnx.initializers.normal(0.02)
        self.router = nnx.Param(init(rngs.params(), (hidden, experts), param_dtype))
        self.experts = Experts(hidden, width, experts, rngs=rngs, top_k=top_k,
                               param_dtype=param_dtype, activation=activation, use_bias=use_bias,
                               kernel_init=kernel_init)

    @classmethod
    def of(cls, router, experts: Experts, config: expert_ops.MoEConfig) -> "SwitchMoE":
        """The layer holding ``router`` [h, E] and ``experts``."""
        moe = nnx.eval_shape(lambda: cls(1, 1, 1, top_k=1, rngs=nnx.Rngs(0)))
        moe.config, moe.router, moe.experts = config, nnx.Param(router), experts
        return moe

    def dense_gates(self, x: jax.Array) -> jax.Array:
        """The gates [..., E] this layer gives each token (zero for the experts it did not pick)."""
        return top_k_gates(x @ self.router[...], self.config.top_k, renormalise=False)

    def __call__(self, x: jax.Array, fraction: jax.Array | None = None):
        """``(y, aux)``; ``fraction`` [E]: the whole batch's routing fractions when ``x`` is a
        micro-batch (:func:`router_losses`). ``aux["statistics"]``: :func:`router_statistics`."""
        config = self.config
        lead, h = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, h)
        count = tokens.shape[0]
        logits, probs, chosen, gates = route(tokens, tokens @ self.router[...], config.top_k)
        statistics = router_statistics(probs, chosen)
        aux = {**router_losses(logits, statistics, count, fraction), "statistics": statistics}
        weights, activation = self.experts.weights(), self.experts.activation
        if config.dropless:
            order, sizes = sort_by_expert(chosen, config.experts)
            out = grouped_ffn(tokens[order // config.top_k], sizes, weights, activation,
                              fp8=self.experts.fp8)
            y = combine_sorted(out, order, gates)
            dropped = jnp.zeros((), jnp.int32)
        else:
            capacity = config.capacity(count)
            position, dropped = expert_ops.dispatch_plan(chosen, config, capacity)
            buffers = expert_ops.dispatch(tokens, position, config.experts * capacity)
            out = expert_ffn(buffers.reshape(config.experts, capacity, h), weights, activation,
                             fp8=self.experts.fp8)
            y = expert_ops.combine(out.reshape(-1, out.shape[-1]), position, gates)
        return y.reshape(*lead, y.shape[-1]), {**aux, "dropped": dropped.astype(jnp.int32)}


def combine_sorted(out: jax.Array, order: jax.Array, gates: jax.Array) -> jax.Array:
    """``y[t] = sum_j gates[t, j] * out[row of (t, j)]`` for rows sorted by ``order``."""
    tokens, k = gates.shape
    unsorted = jnp.zeros_like(out).at[order].set(out).reshape(tokens, k, -1)
    return jnp.einsum("tk,tkh->th", gates.astype(out.dtype), unsorted)


__all__ = ["Experts", "SwitchMoE", "top_k_gates", "expert_ffn", "grouped_ffn", "route",
           "router_statistics", "router_losses", "sort_by_expert", "combine_sorted"]
