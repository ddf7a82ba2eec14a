"""The collectives every per-rank layer calls: ``jax.lax``'s, over the mesh axes that split something.

A mesh axis of size 1 splits nothing: a psum, all-gather, reduce-scatter, all-to-all or permute
over it moves no byte, yet XLA keeps it (a copy over a one-device group, listed by ``jphantom
inspect`` with no axes). The step never lets a value vary over a size-1 axis (parameter and batch
specs leave such axes out, :func:`live_axes`), so each function here drops those axes and, when none
is left, returns what the collective would give on one device, without emitting anything:

- ``psum``/``pmean``/``pmax``: the value; ``all_gather`` (tiled) and ``psum_scatter`` (tiled): the
  value (untiled: the new or scattered dimension of size 1 added or removed); ``all_to_all``: the
  split dimension moved to the concatenation dimension; ``ppermute``: the value when the rank sends
  to itself, zeros otherwise; ``pcast(..., to="varying")``: the value; ``axis_index``: the
  constant 0.

An axis the value does vary over is kept even at size 1 (only a collective makes it invariant);
``tests/strategies/test_singleton_axes.py`` asserts that no compiled step has one. Call these inside a
``shard_map`` (they read ``lax.axis_size``), with the same arguments as ``jax.lax``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax



def varying_axes(x) -> frozenset[str]:
    """The mesh axes ``x`` (inside a ``shard_map`` with ``check_vma=True``; an array, or a
    ``jax.ShapeDtypeStruct`` from ``jax.eval_shape`` there) varies over."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def _names(axes) -> tuple:
    if axes is None:
        return ()
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def live_axes(axes, x=None) -> tuple:
    """``axes`` (a name or a tuple of names) without those of size 1 that ``x``'s leaves do not vary
    over."""
    names = _names(axes)
    varying = frozenset().union(*(varying_axes(leaf) for leaf in jax.tree.leaves(x)))
    return tuple(a for a in names if lax.axis_size(a) > 1 or a in varying)


def _one(axes):
    return axes[0] if len(axes) == 1 else axes


def psum(x, axes):
    live = live_axes(axes, x)
    return lax.psum(x, _one(live)) if live else x


def pmean(x, axes):
    live = live_axes(axes, x)
    return lax.pmean(x, _one(live)) if live else x


def pmax(x, axes):
    live = live_axes(axes, x)
    return lax.pmax(x, _one(live)) if live else x


def all_gather(x, axes, *, axis: int = 0, tiled: bool = False, **kwargs):
    live = live_axes(axes, x)
    if live:
        return lax.all_gather(x, _one(live), axis=axis, tiled=tiled, **kwargs)
    return x if tiled else jnp.expand_dims(x, axis)


def psum_scatter(x, axes, *, scatter_dimension: int = 0, tiled: bool = False):
    live = live_axes(axes, x)
    if live:
        return lax.psum_scatter(x, _one(live), scatter_dimension=scatter_dimension, tiled=tiled)
    return x if tiled else jnp.squeeze(x, scatter_dimension)


def all_to_all(x, axes, split_axis: int, concat_axis: int, *, tiled: bool = False):
    live = live_axes(axes, x)
    if live:
        return lax.all_to_all(x, _one(live), split_axis, concat_axis, tiled=tiled)
    return x if tiled else jnp.moveaxis(x, split_axis, concat_axis)


def ppermute(x, axes, perm):
    live = live_axes(axes, x)
    if live:
        return lax.ppermute(x, _one(live), perm)
    stays = any(tuple(pair) == (0, 0) for pair in perm)
    return x if stays else jax.tree.map(jnp.zeros_like, x)


def axis_index(axis):
    """``lax.axis_index``; on an axis of size 1 the constant 0 (the same on every rank, so not
    varying over the axis)."""
    return lax.axis_index(axis) if lax.axis_size(axis) > 1 else jnp.int32(0)


def pcast(x, axes, *, to: str):
    """``lax.pcast``; to ``"varying"`` only over the axes of size > 1 (nothing varies over the
    others)."""
    names = _names(axes)
    if to == "varying":
        names = tuple(a for a in names if lax.axis_size(a) > 1)
    return lax.pcast(x, _one(names), to=to) if names else x


__all__ = ["varying_axes", "live_axes", "axis_index", "psum", "pmean", "pmax", "all_gather",
           "psum_scatter", "all_to_all", "ppermute", "pcast"]
