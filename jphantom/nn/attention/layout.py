"""Context parallelism's layouts: S tokens on the C ranks of the ``context`` mesh axis.
*Contiguous*: rank r holds tokens [rS/C, (r+1)S/C). *Balanced* (Megatron-LM's and MaxText's
load-balanced causal layout): 2C chunks of c = S/(2C), rank r holding chunks r and 2C-1-r, so that
every rank does the same causal attention work (:func:`to_context_order`,
:func:`from_context_order`, :func:`layout_positions`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jphantom.errors import ConfigError
from jphantom.runtime.mesh import CONTEXT


AXIS = CONTEXT


def _order(size: int, balanced: bool) -> list[int]:
    """The 2C (balanced) or C chunks of the natural sequence in the order the ranks hold them."""
    if not balanced:
        return list(range(size))
    return [i for r in range(size) for i in (r, 2 * size - 1 - r)]


def _index(length: int, size: int, balanced: bool) -> np.ndarray:
    parts = len(_order(size, balanced))
    if length % parts:
        raise ConfigError(f"a sequence of {length} tokens does not split into {parts} equal "
                          f"chunks for context={size}" + (" (load-balanced: 2 per rank)"
                                                          if balanced else ""))
    c = length // parts
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in _order(size, balanced)])


def to_context_order(x, size: int, *, axis: int = 1, balanced: bool = True):
    """``x`` (numpy or jax) with its sequence dimension ``axis`` in the balanced layout's order
    (rank r's chunks r and 2C-1-r contiguous, rank by rank); the identity when not ``balanced``
    or ``size`` is 1."""
    if size == 1 or not balanced:
        return x
    index = _index(x.shape[axis], size, balanced)
    return np.take(x, index, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, index, axis)


def from_context_order(x, size: int, *, axis: int = 1, balanced: bool = True):
    """The inverse of :func:`to_context_order`."""
    if size == 1 or not balanced:
        return x
    index = np.argsort(_index(x.shape[axis], size, balanced))
    return np.take(x, index, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, index, axis)


def layout_positions(rank, size: int, local: int, balanced: bool) -> jax.Array:
    """The global positions [local] of the tokens rank ``rank`` (traced or not) holds."""
    if size == 1:
        return jnp.arange(local)
    if balanced:
        c = local // 2
        return jnp.concatenate([rank * c + jnp.arange(c),
                                (2 * size - 1 - rank) * c + jnp.arange(c)])
    return rank * local + jnp.arange(local)
