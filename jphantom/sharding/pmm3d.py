"""AxoNN's 3D parallel matrix multiply (seed 004 ch. 5, Algorithm 3), per rank on mesh axes
``x``, ``y``, ``z`` (and ``data``), inside the step's one shard_map.

**Naming** (the dissertation's prose and AxoNN's code put the forward all-reduce over X, Algorithm
3 and Eqs. 5.1-5.7 over Y; digest 1.3). jphantom follows Algorithm 3 and the equations: a layer's
forward all-reduce is over the axis that splits its *contraction* (input-feature) dimension. A
**normal** layer takes its input features split over ``y`` and gives its output features split over
``x``; a **transposed** layer swaps the two, so that consecutive layers chain with no re-layout
(normal, transposed, normal, ...). Rows (tokens) are split over ``data`` and ``z``. The mesh
order puts ``x`` innermost (contiguous ranks), then ``y``, ``z``, ``data``, as the model assumes.

One layer ``O = I W^T + b``, ``W [n, k]`` (``y = x W^T`` as the FFN; the transformer's ``[in, out]``
weights are the same maths), rank (i, j, k) on (x, y, z), normal layer:

    stored   Ŵ  [n/(G_x G_z), k/G_y]   W split: out over (x, z), in over y  -- P((x, z), y)
    forward  W = all-gather_z(Ŵ)  [n/G_x, k/G_y]                            (Eq. 5.1)
             Ô = I W^T, I [m/G_z, k/G_y];  O = all-reduce_y(Ô) + b  [m/G_z, n/G_x]   (Eq. 5.3)
    backward dI = all-reduce_x(dO W)   [m/G_z, k/G_y]                       (Eq. 5.4)
             dŴ = reduce-scatter_z(dO^T I)  [n/(G_x G_z), k/G_y]            (Eq. 5.2)
    step     all-reduce_data(dŴ), once                                      (Eq. 5.5)

Only the forward is written: under ``check_vma=True`` autodiff derives the backward exactly as
Algorithm 3 (the input is invariant over ``x`` while ``W`` varies over it, so the transpose of the
implicit broadcast is the all-reduce over ``x``; an all-gather's transpose is the reduce-scatter).
Storing ``W`` split on its output dimension over ``(x, z)`` (``x`` major) is AxoNN's flat Z shard of
each ``(y, x)`` block up to the order of elements inside the block; it keeps the parameters in
the dense layout, so every model's oracle is its own dense model.

Options (FFN): ``regather=True`` gathers each weight again for the backward instead of keeping
it (AxoNN's default without ``cache_weights``, one more all-gather per layer; through remat's fetch
scope, as ZeRO-3); ``deferred=True``
all-gathers every layer's weights once before the layers' scan, so the reduce-scatters run once
after the backward (the dissertation's deferred reduce-scatter, at the memory of the whole
gathered model). Degenerate grids: ``z`` alone is FSDP / ZeRO-3, ``z`` and ``data`` HSDP, ``x``
alone Megatron (column then row layers).

Non-matmul layers of a transformer (digest 1.4): LayerNorm on features split over ``y`` (two
all-reduces over ``y`` of per-token sums), attention on the heads the rank holds (QKV output
features over ``x``), whole sequences per rank; the residual stream ``[B/(G_data G_z), S, h/G_y]``
is replicated over ``x``. Embedding and tied LM head: the token table ``[V, h]`` is the head's
normal-layer weight (vocabulary over ``(x, z)``, features over ``y``): the lookup is
vocabulary-parallel over ``x`` (an all-reduce over ``x``), the logits ``[B, S, V/G_x]`` an
all-reduce over ``y``, the cross-entropy vocabulary-parallel over ``x``.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jphantom import remat
from jphantom.sharding import vocab

X, Y, Z = "x", "y", "z"
GATHERED = "pmm3d_gathered_weight"
ROLES = {"normal": (Y, X), "transposed": (X, Y)}  # (contraction axis, output axis)


def weight_spec(role: str, *, out_first: bool, lead: int = 1) -> P:
    """The spec of a stacked weight (``lead`` leading layer axes): ``out_first`` for ``[.., out,
    in]`` (FFN), else ``[.., in, out]`` (transformer)."""
    contract, out = ROLES[role]
    dims = ((out, Z), contract) if out_first else (contract, (out, Z))
    return P(*([None] * lead), *dims)


def gather(w_shard: jax.Array, axis: int) -> jax.Array:
    """``W`` from this rank's Z shard: all-gather over ``z`` on the output dimension (Eq. 5.1)."""
    return checkpoint_name(lax.all_gather(w_shard, Z, axis=axis, tiled=True))


def checkpoint_name(w):
    return jax.ad_checkpoint.checkpoint_name(w, GATHERED)


def linear(inputs: jax.Array, w: jax.Array, bias: jax.Array, role: str) -> jax.Array:
    """``O = all-reduce_contract(I W) + b`` with the gathered ``w [in/G_c, out/G_o]``: inputs
    ``[..., in/G_c]`` -> ``[..., out/G_o]`` (Eq. 5.3 forward; Eqs. 5.2, 5.4 by autodiff)."""
    contract, _ = ROLES[role]
    return remat.name_collective(lax.psum(inputs @ w, contract)) + bias


# -- the FFN ----------------------------------------------------------------------------------------


def ffn_split(params: dict) -> dict:
    """Dense FFN parameters (``weight [L, n, n]``, ``bias [L, n]``) as pmm3d's two stacks: even
    layers ``normal``, odd layers ``transposed``."""
    return {role: jax.tree.map(lambda a: a[start::2], params)
            for role, start in (("normal", 0), ("transposed", 1))}


def ffn_dense_equivalent(params: dict) -> dict:
    """The dense FFN parameters: the two stacks interleaved back."""
    normal, transposed = params["normal"], params["transposed"]
    depth = normal["weight"].shape[0] + transposed["weight"].shape[0]

    def interleave(a, b):
        out = jnp.zeros((depth, *a.shape[1:]), a.dtype)
        return out.at[0::2].set(a).at[1::2].set(b)

    return jax.tree.map(interleave, normal, transposed)


def ffn_specs() -> dict:
    """Weights ``[L/2, out, in]``: normal P(None, (x, z), y), transposed P(None, (y, z), x);
    biases split over the output axis."""
    return {role: {"weight": weight_spec(role, out_first=True), "bias": P(None, ROLES[role][1])}
            for role in ROLES}


def ffn_per_rank(params: dict, x: jax.Array, *, regather: bool = False,
                 deferred: bool = False) -> jax.Array:
    """The FFN ``y = W_L relu(... relu(W_1 x + b_1)) + b_L`` on one rank: x ``[B/(G_d G_z), n/G_y]``
    -> ``[B/(G_d G_z), n/G_x]`` (odd depth) or ``n/G_y`` (even). Layers run in pairs (normal,
    transposed) under ``lax.scan``; an odd last layer is normal."""
    normal, transposed = params["normal"], params["transposed"]
    pairs = transposed["weight"].shape[0]
    if deferred:  # every weight gathered once, before the scan: one reduce-scatter after it
        normal = {**normal, "weight": gather(normal["weight"], 1)}
        transposed = {**transposed, "weight": gather(transposed["weight"], 1)}

    gathered = deferred or regather  # the layers receive gathered weights

    def one(role, p, h):
        w = p["weight"] if gathered else gather(p["weight"], 0)
        return linear(h, w.T, p["bias"], role)

    def pair(p, h):
        first, second = p
        h = one("normal", first, h)
        return one("transposed", second, jax.nn.relu(h))

    def fetch(p):  # regather: remat's fetch scope gathers each pair's weights, forward and backward
        return jax.tree.map(lambda q: {**q, "weight": gather(q["weight"], 0)}, p,
                            is_leaf=lambda q: isinstance(q, dict) and "weight" in q)

    with remat.fetch_scope(fetch) if regather else contextlib.nullcontext():
        pair = remat.layer(pair)
    h = x
    if pairs:
        stacked = (jax.tree.map(lambda a: a[:pairs], normal), transposed)
        h = pair(jax.tree.map(lambda a: a[0], stacked), h)
        if pairs > 1:
            rest = jax.tree.map(lambda a: a[1:], stacked)
            h, _ = lax.scan(lambda h, p: (pair(p, jax.nn.relu(h)), None), h, rest)
    if normal["weight"].shape[0] > pairs:  # odd depth: the last layer is normal
        last = jax.tree.map(lambda a: a[pairs], normal)
        if regather:
            last = fetch(last)
        h = one("normal", last, jax.nn.relu(h) if pairs else h)
    return h


def ffn_output_axis(depth: int) -> str:
    """The axis splitting the FFN's output features: x after a normal last layer (odd depth)."""
    return X if depth % 2 else Y


# -- the transformer --------------------------------------------------------------------------------


def transformer_specs(config) -> dict:
    """Specs of the dense GPT layout (:mod:`jphantom.models.transformer`, tied head): QKV and MLP
    up normal (in y, out x: heads over x), attention output and MLP down transposed (in x, out y),
    LayerNorms and the residual-side biases over y, the token table the head's normal weight
    ``[V, h]`` P((x, z), y), positions over y."""
    features = P(None, Y)
    norm = {"scale": features, "bias": features}
    return {
        "wte": P((X, Z), Y), "wpe": features,
        "blocks": {
            "ln1": norm, "ln2": norm,
            "qkv": {"weight": P(None, Y, None, (X, Z)), "bias": P(None, None, X)},
            "attn_out": {"weight": weight_spec("transposed", out_first=False),
                         "bias": P(None, Y)},
            "mlp_up": {"weight": weight_spec("normal", out_first=False), "bias": P(None, X)},
            "mlp_down": {"weight": weight_spec("transposed", out_first=False),
                         "bias": P(None, Y)},
        },
        "ln_f": {"scale": P(Y), "bias": P(Y)},
    }


class TransformerLayers:
    """pmm3d layers on one rank (``jphantom.models.transformer.Layers``); residual
    ``[B/(G_d G_z), S, h/G_y]``, replicated over ``x``."""

    def __init__(self, eps: float, hidden: int):
        self.eps, self.hidden = eps, hidden

    def prepare(self, params):
        return params

    def _vocab(self, params):
        return gather(params["wte"], 0)  # [V/G_x, h/G_y]

    def embed(self, params, tokens):
        seq = tokens.shape[1]
        partial_sum = vocab.embed_partial(self._vocab(params), tokens, X)  # [B, S, h/G_y]
        return lax.psum(partial_sum, X) + params["wpe"][:seq]

    def norm(self, p, h):
        """LayerNorm over features split over y: all-reduces of the per-token sums."""
        mean = lax.psum(h.sum(axis=-1, keepdims=True), Y) / self.hidden
        centred = h - mean
        var = lax.psum((centred * centred).sum(axis=-1, keepdims=True), Y) / self.hidden
        return centred * lax.rsqrt(var + self.eps) * p["scale"] + p["bias"]

    def _linear(self, p, x, role):
        w = gather(p["weight"], p["weight"].ndim - 1)  # [in/G_c, ..., out/G_o]
        return linear(x, w.reshape(w.shape[0], -1), p["bias"].reshape(-1), role)

    def column(self, p, x):
        return self._linear(p, x, "normal")

    def row(self, p, x):
        return self._linear(p, x, "transposed")

    def logits(self, params, h):
        """This rank's vocabulary slice of the logits, ``[B, S, V/G_x]``: the head is the token
        table as a normal layer (all-reduce over y)."""
        return remat.name_collective(lax.psum(h @ self._vocab(params).T, Y))

    def loss(self, params, h, targets):
        return vocab.cross_entropy_sum(self.logits(params, h), targets, X)
