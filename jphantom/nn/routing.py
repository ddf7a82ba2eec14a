"""Routing arithmetic of the mixture-of-experts layers (GShard / Switch Transformer; Singh's thesis
ch. 7), shared by :mod:`jphantom.nn.moe` (the single-device :class:`~jphantom.nn.moe.SwitchMoE`)
and :mod:`jphantom.nn.expert_parallel` (expert parallelism over the ``expert`` axis, TED, DTD, dropless,
phantom-parallel experts): no collective here.

- :class:`MoEConfig`: hidden width, experts E, top-k, capacity factor (``None``: dropless).
- **Capacity** (:func:`dispatch_plan`): each expert takes at most ``C = min(ceil(capacity_factor
  * T * k / E), T)`` of a rank's T tokens (it takes a token at most once); assignments are
  served in order of choice rank then token (all first choices before any second choice, as
  GShard does); the rest are dropped and counted.
- **Dispatch** (:func:`dispatch`): each kept (token, choice) scattered to its row of the capacity
  buffer ``[E, C, h]`` (GShard's one-hot ``[T, E, C]`` einsum computes the same with ``T E C h``
  multiply-adds; the scatter moves ``T k h`` numbers).
- **Combine** (:func:`combine`): ``y[t] = sum_j gate[t, j] * out[slot of (t, j)]``, a gather.
"""

from __future__ import annotations

import dataclasses
import math


import jax
import jax.numpy as jnp

from jphantom.errors import ConfigError, check_int
from jphantom.runtime.mesh import EXPERT

EXPERT_AXIS = EXPERT


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
        """Per expert, the tokens one rank may send: min(ceil(factor * T * k / E), T), rounded up
        to a ``multiple`` (DTD splits the capacity over the tensor-parallel ranks)."""
        if self.dropless:
            raise ConfigError("a dropless MoE has no capacity")
        c = max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.experts))
        c = min(c, tokens)  # an expert receives each token at most once: more drops nothing
        return -(-c // multiple) * multiple


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


