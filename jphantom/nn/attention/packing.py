"""Packed and padded batches: documents laid end to end in a row, attention stopping at their
boundaries (MaxText's and Pallas' segment-id convention; Krell et al. 2021, "Efficient Sequence
Packing without Cross-contamination").

A packed row carries ``segment_ids`` [B, S] (documents numbered 1, 2, ... in order, 0 for
padding) and ``positions`` [B, S] (each token's position within its document, from 0). A token
attends only to earlier tokens of its own segment:

    mask[b, i, j] = (j <= i) and seg[b, i] == seg[b, j]   (and i - j < window on sliding layers)

Segments are contiguous, so within one the row's index and the document's position differ by a
constant: the causal order and a sliding window measured on the row are the document's. Every
token attends at least itself, so no row of the mask is empty (a pad attends the pads before it,
and nothing real attends a pad).

A model's blocks receive the packing with their activation: the carry through
:class:`jphantom.nn.Stacked` becomes ``(h, Packing)`` (:func:`join`, :func:`split`), so it
reaches every block, and every pipeline stage, as the MoE blocks' statistics do; the attention
core takes the segment ids (:func:`attend`), the model's rotary phases or position table the
positions.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.step import remat
from jphantom.errors import ConfigError


class Packing(NamedTuple):
    """The packed rows' ``segment_ids`` and ``positions`` [B, S] (int32) riding with the
    activation through a model's blocks."""
    segment_ids: jax.Array
    positions: jax.Array


def packing_of(segment_ids, positions) -> Packing | None:
    """The :class:`Packing` of a batch, or ``None`` when neither array is given."""
    if segment_ids is None and positions is None:
        return None
    if segment_ids is None or positions is None:
        raise ConfigError("a packed batch needs both segment_ids and positions [B, S]; give "
                          "both (the data side's packer writes them) or neither")
    if jnp.shape(segment_ids) != jnp.shape(positions) or jnp.ndim(segment_ids) != 2:
        raise ConfigError(f"segment_ids {jnp.shape(segment_ids)} and positions "
                          f"{jnp.shape(positions)} must both be [B, S]")
    return Packing(jnp.asarray(segment_ids, jnp.int32), jnp.asarray(positions, jnp.int32))


def join(h, packing: Packing | None):
    """The blocks' carry: ``h`` alone, or ``(h, packing)``."""
    return h if packing is None else (h, packing)


def split(carry):
    """``(h, packing or None)`` of a blocks' carry (:func:`join`)."""
    if isinstance(carry, tuple) and len(carry) == 2 and isinstance(carry[1], Packing):
        return carry
    return carry, None


def segment_mask(q_segments, k_segments) -> jax.Array:
    """[B, Sq, Sk]: query i and key j are in the same segment."""
    return q_segments[:, :, None] == k_segments[:, None, :]


def attend(core, q, k, v, packing: Packing | None, *, local=None, full=None):
    """``core(q, k, v)``, with the packing's segment ids where there is one: a core that cannot
    take them is refused by name (never silently attending across documents). ``local`` and
    ``full``: a second core and a traced flag, ``core`` where it is true, ``local`` where not
    (Gemma 3's local and global layers in one stack, under ``lax.cond``; a core with
    ``selects_window``, generation's :class:`jphantom.generation.cache.CachedAttention`, is handed
    ``full`` and the local window and picks itself).

    Every model's attention goes through here, so the names the remat policies read are given
    here: q, k and v as the core gets them (:func:`jphantom.step.remat.name_qkv`) and the core's
    output (:func:`jphantom.step.remat.name_attention`)."""
    q, k, v = remat.name_qkv(q, k, v)
    if local is None:
        out = _attend(core, q, k, v, packing)
    elif getattr(core, "selects_window", False):  # generation's cached core (one cache a layer)
        out = core(q, k, v, full=full, local_window=local.window)
    else:
        out = lax.cond(full, lambda *a: _attend(core, *a, packing),
                       lambda *a: _attend(local, *a, packing), q, k, v)
    return remat.name_attention(out)


def _attend(core, q, k, v, packing: Packing | None):
    if packing is None:
        return core(q, k, v)
    if not getattr(core, "takes_segments", False):
        raise ConfigError(f"{type(core).__name__} cannot attend a packed batch (segment ids): "
                          "use jphantom.nn.CausalAttention, RingAttention or GatheredAttention, "
                          "or feed unpacked (tokens, targets) batches")
    return core(q, k, v, segment_ids=packing.segment_ids)
