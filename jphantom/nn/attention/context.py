"""Context parallelism's layers: the sequence of every activation split over the ``context``
mesh axis, the attention core swapped (plan style ``context``, :func:`jphantom.plans.context`) for
:class:`RingAttention` (the default) or :class:`GatheredAttention` (K and V all-gathered,
MaxText's default), the positions for :class:`ContextPositions`; and the kernel their blocks run
on (:func:`context_kernel`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jphantom.runtime import comm
from jphantom.step import remat
from jphantom.registry.attention_choices import ALGORITHMS
from jphantom.errors import ConfigError
from jphantom.nn.attention.core import CausalAttention, Positions, causal_attention
from jphantom.nn.attention.gathered import blockwise_gathered_attention
from jphantom.nn.attention.kernel_choice import check_implementation, choose, platform_of
from jphantom.nn.attention.layout import AXIS, layout_positions
from jphantom.nn.attention.packing import segment_mask
from jphantom.nn.attention.ring import ring_attention


def gathered_attention(q, k, v, *, size: int, balanced: bool = True,
                       window: int | None = None, segment_ids=None,
                       recompute: bool = False, kernel: str | None = "xla") -> jax.Array:
    """Causal attention of this rank's chunk with K and V all-gathered over ``context``. With a
    ``kernel`` (no window, no segments) on flash attention's blocks
    (:func:`~jphantom.nn.attention.gathered.blockwise_gathered_attention`: the backward keeps
    q, K, V, the output and the log-sum-exp); with ``kernel=None``, a sliding ``window`` or
    ``segment_ids`` [B, S/C] (a packed batch, this rank's chunk: gathered with K and V, a query
    attending only keys of its own segment) on XLA's path under the layout's position mask,
    whose [S/C, S] probabilities the backward keeps unless ``recompute`` (the core after the
    gathers under ``jax.checkpoint`` saving its inputs, the gathers not repeated)."""
    local = q.shape[1]
    k_all = comm.all_gather(k, AXIS, axis=1, tiled=True)
    v_all = comm.all_gather(v, AXIS, axis=1, tiled=True)
    if kernel is not None and window is None and segment_ids is None:
        return blockwise_gathered_attention(q, k_all, v_all, size=size, balanced=balanced,
                                            kernel=kernel)
    q_pos = layout_positions(comm.axis_index(AXIS), size, local, balanced)
    k_pos = jnp.concatenate([layout_positions(r, size, local, balanced) for r in range(size)])
    mask = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        mask &= q_pos[:, None] - k_pos[None, :] < window
    if segment_ids is not None:
        k_segments = comm.all_gather(segment_ids, AXIS, axis=1, tiled=True)
        mask = mask[None] & segment_mask(segment_ids, k_segments)
    core = remat.recomputed(causal_attention) if recompute else causal_attention
    return core(q, k_all, v_all, mask)


# -- the context layers ------------------------------------------------------------------------


class ContextPositions(nnx.Module):
    """The global positions of the S/C tokens this rank holds on the ``context`` axis
    (``length``: the whole sequence's S)."""

    def __init__(self, *, size: int, balanced: bool = True):
        self.size, self.balanced = size, balanced

    def __call__(self, seq: int) -> jax.Array:
        return layout_positions(comm.axis_index(AXIS), self.size, seq, self.balanced)

    def length(self, seq: int) -> int:
        return seq * self.size

    def dense_equivalent(self) -> Positions:
        return Positions()


class RingAttention(nnx.Module):
    """Ring attention over ``context`` (module docstring): :func:`ring_attention`, its blocks on
    the kernel :meth:`kernel` picks; ``window`` (a sliding window) is refused by name: use
    :class:`GatheredAttention`. ``recompute`` (Megatron's selective recompute,
    :func:`jphantom.nn.set_remat`) changes nothing here: the ring's backward keeps q, k, v, the
    output and the log-sum-exp and recomputes its blocks already."""

    algorithm = "ring"
    recompute = False
    takes_segments = True  # packed batches: segment ids (jphantom.nn.attention.packing)

    def __init__(self, *, size: int, balanced: bool = True, window: int | None = None,
                 implementation: str = "auto"):
        self.size, self.balanced = size, balanced
        self.window, self.implementation = window, check_implementation(implementation)
        self.platform = None
        if window is not None and self.algorithm == "ring":
            raise ConfigError(f"a sliding window ({window} tokens) with ring attention: its "
                              "blocks skip by whole chunks, not windows; use "
                              "--context-attention all-gather")

    def kernel(self, dtype, head_dim: int, *, packed: bool = False) -> tuple[str, str]:
        """The kernel of the blocks and why (:func:`context_kernel`)."""
        platform = self.platform or platform_of(jax.devices()[0])
        return context_kernel(self.algorithm, self.implementation, platform, dtype, head_dim,
                              packed=packed, window=self.window)

    def __call__(self, q, k, v, segment_ids=None) -> jax.Array:
        if segment_ids is None:
            kernel, _ = self.kernel(q.dtype, q.shape[-1])
            return ring_attention(q, k, v, size=self.size, balanced=self.balanced,
                                  kernel=kernel)
        kernel, _ = self.kernel(q.dtype, q.shape[-1], packed=True)
        return ring_attention(q, k, v, size=self.size, balanced=self.balanced, kernel=kernel,
                              segment_ids=segment_ids)

    def dense_equivalent(self) -> CausalAttention:
        return CausalAttention(window=self.window, implementation=self.implementation)


class GatheredAttention(RingAttention):
    """Attention over ``context`` with K/V all-gathered: :func:`gathered_attention`
    (``recompute``: its core recomputed in the backward)."""

    algorithm = "all-gather"

    def __call__(self, q, k, v, segment_ids=None) -> jax.Array:
        kernel, _ = self.kernel(q.dtype, q.shape[-1], packed=segment_ids is not None)
        return gathered_attention(q, k, v, size=self.size, balanced=self.balanced,
                                  window=self.window, segment_ids=segment_ids,
                                  recompute=self.recompute,
                                  kernel=None if kernel == "xla-masked" else kernel)


def context_kernel(algorithm: str, implementation: str, platform: str, dtype,
                   head_dim: int, *, packed: bool = False,
                   window: int | None = None) -> tuple[str, str]:
    """The kernel of context attention's blocks and why: where :func:`choose` picks cuDNN for
    the unsplit core, the ring's blocks run jax's Pallas Triton flash kernels
    (:mod:`jphantom.nn.flash`: cuDNN's statistics come back only in the compute dtype), else
    XLA's einsum blocks; the all-gather variant's blocks the same (``xla-masked``: with a sliding
    ``window`` or ``packed``, the layout's position mask on XLA's path instead of blocks)."""
    kernel, why = choose(implementation, platform, dtype, head_dim)
    if algorithm != "ring" and (packed or window is not None):
        return "xla-masked", ((f"a sliding window of {window} tokens" if window is not None
                               else "a packed batch")
                              + f" with {algorithm} context attention: XLA's path under the "
                              "layout's position mask (the backward keeps the [S/C, S] "
                              "probabilities unless the core is recomputed)")
    if kernel == "xla":
        return "xla", why
    if algorithm != "ring":
        return "pallas", (f"{why}; {algorithm} context attention on flash blocks: jax's Pallas "
                          "Triton flash attention (float32 log-sum-exp to merge them)")
    if packed:
        return "xla", (f"{why}; packed batch on the ring: jax's Pallas flash kernel takes one "
                       "segment-id array for queries and keys, a ring block's are two chunks: "
                       "XLA's blocks under the segment mask")
    return "pallas", (f"{why}; ring blocks: jax's Pallas Triton flash attention (float32 "
                      "log-sum-exp to merge them)")


def check_algorithm(name: str) -> str:
    if name not in ALGORITHMS:
        raise ConfigError(f"context attention {name!r}: use one of {', '.join(ALGORITHMS)}")
    return name
