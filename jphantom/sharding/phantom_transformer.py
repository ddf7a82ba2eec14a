"""The phantom-parallel GPT transformer: phantom parallelism (seed 000) across the whole block.

Why it is built this way. Seed 000's Eq. 11 is a map of feature-sharded activations to
feature-sharded activations, z^(j) = L^(j) y^(j) + sum_{i != j} D^(i,j) C^(i) y^(i) + b^(j), and
its conclusion proposes treating attention's t tokens as t column vectors. Every projection of a
transformer is such a map applied to each token alike, so each becomes a phantom linear on
B x S "samples": the residual stream stays feature-sharded [B, S, h/p] between blocks, exactly as
the phantom FFN's activations do, and only k ghost neurons per token ever cross the network.

- QKV (h -> 3h), attention output (h -> h), MLP up (h -> 4h) and MLP down (4h -> h) are phantom
  linears (:func:`jphantom.sharding.phantom.phantom_layer`, rectangular for the MLP): a local
  block, a compressor to k ghosts, one all-gather, decompressors. Rank j's QKV outputs are the q, k
  and v of *its* heads (a/p of them), so attention runs on local heads with no communication.
- LayerNorm over features split across ranks: the mean and the variance are per-token sums over
  the rank's h/p features, all-reduced (a psum of B x S scalars each). Autodiff adds the two
  matching all-reduces backward (the gradients of the mean and variance are sums over features).
- Embedding: the token and position tables are split by features ([V, h/p], [S, h/p]): each rank
  looks up its own features, no communication.
- LM head: a phantom linear h -> V with vocabulary-split output [B, S, V/p] and the
  vocabulary-parallel cross-entropy (:mod:`jphantom.sharding.vocab`). It is *not* tied to the
  embedding: a tied head on feature-sharded activations would need an all-reduce of the full
  [B, S, V] partial logits, the opposite of phantom's point.

Collectives of one block per step (B batch, S sequence, p ranks, k ghosts; per-device result
elements): forward, 4 all-gathers of B S p k (one per projection) and 4 all-reduces of B S (two
per LayerNorm); backward, 4 reduce-scatters to B S k and 4 all-reduces of B S. Plus, once per step:
the final LayerNorm (2 + 2 all-reduces of B S), the head (an all-gather of B S p k, a reduce-scatter
to B S k) and the cross-entropy (3 all-reduces of B S), and the data-parallel gradient all-reduce.

Parameters (only phantom has p in its shapes: p is part of the model): ``wte`` [V, h] and ``wpe``
[S, h] split on features; ``blocks`` stacked over L: ``ln1``, ``ln2`` {scale, bias} [L, h] split
on features, and ``qkv``, ``attn_out``, ``mlp_up``, ``mlp_down`` phantom linears [L, p, ...]
(:func:`jphantom.sharding.phantom.init_linear`); ``ln_f`` [h]; ``head`` a phantom linear h -> V.
:func:`dense_equivalent` gives the identical dense GPT-2 parameters (untied head), the oracle.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jphantom import remat
from jphantom.sharding import phantom, vocab
from jphantom.sharding._common import normal

LINEARS = ("qkv", "attn_out", "mlp_up", "mlp_down")


def _shapes(hidden: int) -> dict[str, tuple[int, int]]:
    return {"qkv": (hidden, 3 * hidden), "attn_out": (hidden, hidden),
            "mlp_up": (hidden, 4 * hidden), "mlp_down": (4 * hidden, hidden)}


def init(key: jax.Array, config, num_shards: int) -> dict:
    """GPT-2-like initialisation: every block of each projection's dense equivalent has the
    variance of GPT-2's N(0, 0.02^2) (residual projections 0.02^2 / 2L). MoE blocks
    (``config.moe_every``): attention as above, a router [h, E] split on features, and each
    expert's FFN two phantom linears (h -> 4h, 4h -> h) stacked over E."""
    h, L, v, s = config.hidden, config.layers, config.vocab_size, config.seq_len
    k, p = config.ghost_width, num_shards
    dtype = jnp.dtype(config.dtype)
    # the first 8 keys as before MoE existed, the MoE blocks' after them
    keys = iter([*jax.random.split(key, 8), *jax.random.split(jax.random.fold_in(key, 1), 8)])
    residual = 0.02 / math.sqrt(2 * L)
    stds = {"qkv": 0.02, "attn_out": residual, "mlp_up": 0.02, "mlp_down": residual}
    norm = lambda *lead: {"scale": jnp.ones((*lead, h), dtype), "bias": jnp.zeros((*lead, h), dtype)}
    linear = lambda key, i, o, std, lead: phantom.init_linear(
        key, in_features=i, out_features=o, ghost_width=k, num_shards=p, layers=lead,
        gain=std ** 2 * i, dtype=dtype)

    def stack(n, names):
        out = {name: linear(next(keys), i, o, stds[name], n)
               for name, (i, o) in _shapes(h).items() if name in names}
        out["ln1"], out["ln2"] = norm(n), norm(n)
        return out

    n_moe = config.moe_layers
    params = {}
    if L - n_moe:
        params["blocks"] = stack(L - n_moe, LINEARS)
    params.update({
        "wte": normal(next(keys), (v, h), dtype, 0.02),
        "wpe": normal(next(keys), (s, h), dtype, 0.01),
        "ln_f": norm(),
        "head": linear(next(keys), h, v, 0.02, None),
    })
    if n_moe:
        moe = config.moe
        f, e = moe.width, moe.experts
        experts = lambda key, i, o, std: jax.vmap(lambda one: linear(one, i, o, std, e))(
            jax.random.split(key, n_moe))  # [L/n, E, p, ...]
        params["moe_blocks"] = {**stack(n_moe, ("qkv", "attn_out")), "moe": {
            "router": normal(next(keys), (n_moe, h, e), dtype, 0.02),
            "w_in": experts(next(keys), h, f, 0.02),
            "w_out": experts(next(keys), f, h, residual)}}
    return params


def specs(axis: str = "model", config=None, expert_axis: str | None = None) -> dict:
    """PartitionSpecs of :func:`init`'s parameters; MoE experts split over ``expert_axis``."""
    features = P(None, axis)
    norm = {"scale": features, "bias": features}
    blocks = {name: phantom.linear_specs(axis) for name in LINEARS}
    blocks["ln1"], blocks["ln2"] = norm, norm
    out = {"wte": features, "wpe": features, "blocks": blocks,
           "ln_f": {"scale": P(axis), "bias": P(axis)},
           "head": phantom.linear_specs(axis, stacked=False)}
    if config is not None and config.moe_every:
        experts = {name: P(None, expert_axis, axis) for name in phantom.linear_specs(axis)}
        out["moe_blocks"] = {"qkv": blocks["qkv"], "attn_out": blocks["attn_out"], "ln1": norm,
                             "ln2": norm, "moe": {"router": P(None, axis, None), "w_in": experts,
                                                  "w_out": experts}}
        if config.moe_every == 1:
            del out["blocks"]
    return out


def dense_equivalent(params: dict) -> dict:
    """The identical dense GPT-2 parameters (layout of :mod:`jphantom.models.transformer`, with an
    untied ``head``). Rank j's QKV outputs (3, h/p) are the q, k, v features of its heads."""
    p = params["head"]["local"].shape[0]
    out = {"wte": params["wte"], "wpe": params["wpe"], "ln_f": params["ln_f"]}
    if "blocks" in params:
        out["blocks"] = _dense_stack(params["blocks"], p, LINEARS)
    if "moe_blocks" in params:
        stack = params["moe_blocks"]
        out["moe_blocks"] = _dense_stack(stack, p, ("qkv", "attn_out"))
        moe = stack["moe"]
        w_in, b_in = jax.vmap(jax.vmap(phantom.linear_dense_equivalent))(moe["w_in"])
        w_out, b_out = jax.vmap(jax.vmap(phantom.linear_dense_equivalent))(moe["w_out"])
        out["moe_blocks"]["moe"] = {"router": moe["router"],
                                    "w_in": w_in.transpose(0, 1, 3, 2), "b_in": b_in,
                                    "w_out": w_out.transpose(0, 1, 3, 2), "b_out": b_out}
    head_w, head_b = phantom.linear_dense_equivalent(params["head"])
    out["head"] = {"weight": head_w.T, "bias": head_b}
    return out


def _dense_stack(blocks: dict, p: int, names: tuple[str, ...]) -> dict:
    def linear(name):
        weight, bias = jax.vmap(phantom.linear_dense_equivalent)(blocks[name])  # [L, out, in]
        return weight.transpose(0, 2, 1), bias  # x W convention: [L, in, out]

    out = {"ln1": blocks["ln1"], "ln2": blocks["ln2"]}
    for name in names:
        weight, bias = linear(name)
        if name == "qkv":  # out index (j, t, c) with t in {q, k, v} -> dense (t, j h/p + c)
            layers, h = weight.shape[0], weight.shape[1]
            weight = weight.reshape(layers, h, p, 3, h // p).transpose(0, 1, 3, 2, 4).reshape(
                layers, h, 3, h)
            bias = bias.reshape(layers, p, 3, h // p).transpose(0, 2, 1, 3).reshape(layers, 3, h)
        out[name] = {"weight": weight, "bias": bias}
    return out


def param_count(config, num_shards: int) -> int:
    """Weights and biases of the phantom transformer."""
    def count(tree):
        return sum(math.prod(a.shape) for a in jax.tree.leaves(tree))
    return count(jax.eval_shape(lambda: init(jax.random.PRNGKey(0), config, num_shards)))


class TransformerLayers:
    """Phantom layers on one rank (``jphantom.models.transformer.Layers``); residual [B, S, h/p]."""

    def __init__(self, axis: str, eps: float, hidden: int, fused: bool = True, *,
                 expert_axis: str | None = None, batch_axes: tuple[str, ...] = ()):
        self.axis, self.eps, self.hidden, self.fused = axis, eps, hidden, fused
        self.expert_axis, self.batch_axes = expert_axis, batch_axes

    def prepare(self, params):
        return params

    def embed(self, params, tokens):
        seq = tokens.shape[1]
        return jnp.take(params["wte"], tokens, axis=0) + params["wpe"][:seq]  # [B, S, h/p], local

    def norm(self, p, h):
        """LayerNorm over features split across ranks: two all-reduces of B x S per-token sums."""
        from jphantom.nn.norm import normalize
        return normalize(h, "layer", self.eps, p["scale"], p["bias"], axis=self.axis,
                         features=self.hidden, dtype=jnp.result_type(h, p["scale"]))

    def _phantom(self, p, x):
        p = jax.tree.map(lambda a: a[0], p)  # drop the shard axis of size 1
        batch, seq, features = x.shape
        z = phantom.phantom_layer(self.axis, lax.axis_size(self.axis), self.fused,
                                  x.reshape(batch * seq, features), p["local"], p["compress"],
                                  p["decompress"], p["bias"])  # all-gather of B*S*p*k
        return remat.name_collective(z.reshape(batch, seq, -1))  # holds the ghosts' all-gather

    def column(self, p, x):
        return self._phantom(p, x)

    def row(self, p, x):
        return self._phantom(p, x)

    def moe(self, p, x, config):
        """Phantom-parallel experts: the router's logits all-reduced over the feature axis (T x E),
        each rank dispatching its h/p features of every token (1/p of the all-to-all bytes), and
        every expert a phantom FFN (h -> 4h -> h) whose ranks exchange k ghosts per token."""
        from jphantom.sharding import expert

        y, aux = expert.moe_per_rank(p, x.reshape(-1, x.shape[-1]), config,
                                     axis=self.expert_axis, batch_axes=self.batch_axes,
                                     router_axis=self.axis, run_experts=self._experts)
        return y.reshape(x.shape), aux

    def _experts(self, p, x):
        """x [E', N, h/p] through this rank's E' phantom expert FFNs."""
        def one(w_in, w_out, rows):
            up = jax.nn.gelu(self._phantom(w_in, rows[None]), approximate=True)
            return self._phantom(w_out, up)[0]

        return jax.vmap(one)(p["w_in"], p["w_out"], x)

    def logits(self, params, h):
        """This rank's vocabulary slice of the logits, [B, S, V/p]."""
        return self._phantom(params["head"], h)

    def loss(self, params, h, targets):
        return vocab.cross_entropy_sum(self.logits(params, h), targets, self.axis)
