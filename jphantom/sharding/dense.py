"""The unsharded dense FFN: the single-device oracle every parallel FFN strategy is tested against.

Parameters are stacked over depth: ``{"weight": [L, n, n], "bias": [L, n]}`` with ``y = x W^T + b``;
ReLU between layers, none after the last (seed 000's FFN). :func:`stack` applies them: layer 0 on
its own, layers 1..L-1 under ``lax.scan`` (compile time independent of depth), each taking the ReLU
of the previous output; the parallel strategies keep this structure, which lets XLA drop the first
layer's dead dL/dx collective.

:func:`gspmd_forward` runs the same weights with ``NamedSharding`` annotations and lets ``jax.jit``
(GSPMD) choose the collectives: the baseline a JAX user would write without hand-written layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom import remat
from jphantom.sharding._common import check_depth, check_width, normal

Params = dict[str, jax.Array]


def init(key: jax.Array, *, width: int, depth: int, dtype=jnp.float32) -> Params:
    """He-initialised dense layers, W ~ N(0, 2/n), zero biases: weight [L, n, n], bias [L, n]."""
    check_width(width, 1)
    check_depth(depth)
    weight = normal(key, (depth, width, width), dtype, math.sqrt(2.0 / width))
    return {"weight": weight, "bias": jnp.zeros((depth, width), dtype)}


def stack(layer: Callable, params, y: jax.Array) -> jax.Array:
    """``layer(p_0, y)``, then ``layer(p_l, relu(y))`` for l = 1..L-1 under ``lax.scan``.

    ``params`` is any pytree stacked over a leading depth axis; ``layer(p, y)`` maps one layer's
    slice and its input to the pre-activation. No activation after the last layer. Each layer is
    checkpointed with the step's activation-checkpointing policy (:mod:`jphantom.remat`).
    """
    y = remat.layer(layer)(jax.tree.map(lambda a: a[0], params), y)
    rest = jax.tree.map(lambda a: a[1:], params)
    if jax.tree.leaves(rest)[0].shape[0] == 0:
        return y
    after_relu = remat.layer(lambda p, h: layer(p, jax.nn.relu(h)))
    y, _ = lax.scan(lambda h, p: (after_relu(p, h), None), y, rest)
    return y


def forward(params: Params, x: jax.Array) -> jax.Array:
    """Plain MLP on whatever devices ``x`` and ``params`` live on: x [B, n] -> [B, n]."""
    return stack(lambda p, y: y @ p["weight"].T + p["bias"], params, x)


def param_count(width: int, depth: int, *, include_bias: bool = False) -> int:
    """L n^2 weights (Table I's TP model size), plus L n biases if asked."""
    return depth * width * width + (depth * width if include_bias else 0)


def gspmd_specs(axis: str = "model") -> dict[str, P]:
    """Row-sharded weights (output features over ``axis``), sharded biases: the layout GSPMD is given."""
    return {"weight": P(None, axis, None), "bias": P(None, axis)}


def gspmd_forward(params: Params, x: jax.Array, mesh: Mesh, activation_spec: P) -> jax.Array:
    """The dense FFN with the activations' layout pinned at every layer boundary (as one would in a
    MaxText-style model); ``jax.jit`` inserts whatever collectives the annotations imply."""
    sharding = NamedSharding(mesh, activation_spec)

    def layer(p, y):
        y = lax.with_sharding_constraint(y, sharding)
        return lax.with_sharding_constraint(y @ p["weight"].T + p["bias"], sharding)

    return stack(layer, params, x)


# --------------------------------------------------------------------------------------------------
# The transformer's layers on one device (``dense``) or under GSPMD annotations (``gspmd``)
# --------------------------------------------------------------------------------------------------


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (all features present): :func:`jphantom.nn.norm.normalize`."""
    from jphantom.nn.norm import normalize
    return normalize(x, "layer", eps, scale, bias, dtype=jnp.result_type(x, scale))


def _linear(p, x):
    weight = p["weight"].reshape(p["weight"].shape[0], -1)
    return x @ weight + p["bias"].reshape(-1)


class TransformerLayers:
    """:class:`jphantom.models.transformer.Layers` for global arrays: no collective. With
    ``constrain`` (GSPMD) the residual stream's layout is pinned at every block boundary and jit
    inserts the collectives the weights' ``NamedSharding`` imply."""

    def __init__(self, eps: float, constrain=lambda h: h):
        self.eps, self.constrain = eps, constrain

    def prepare(self, params):
        return params

    def embed(self, params, tokens):
        seq = tokens.shape[1]
        return self.constrain(jnp.take(params["wte"], tokens, axis=0) + params["wpe"][:seq])

    def norm(self, p, h):
        return layer_norm(h, p["scale"], p["bias"], self.eps)

    def column(self, p, x):
        return _linear(p, x)

    def row(self, p, x):
        return self.constrain(_linear(p, x))

    def moe(self, p, x, config):
        """Every expert on every token, combined by the router's gates (the oracle)."""
        from jphantom.sharding import expert

        y, aux = expert.dense_moe(p, x.reshape(-1, x.shape[-1]), config)
        return self.constrain(y.reshape(x.shape)), {**aux, "dropped": jnp.zeros((), jnp.int32)}

    def logits(self, params, h):
        if "head" in params:
            return h @ params["head"]["weight"] + params["head"]["bias"]
        return h @ params["wte"].T

    def loss(self, params, h, targets):
        logits = self.logits(params, h)
        logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
        log_z = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(log_z - picked)
