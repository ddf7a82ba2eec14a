"""Causal attention cores and context parallelism: the sequence of every activation split over a
``context`` mesh axis.

A model computes q, k and v with its own projections and hands them to an *attention core*, a
parameterless NNX module; it asks a *positions* module for the global positions of the tokens it
holds (rotary phases, a position table). On one device, and under every strategy that keeps the
sequence whole, those are :class:`CausalAttention` and :class:`Positions`. Context parallelism
swaps them (plan style ``context``, :func:`jphantom.plans.context`) for

=========================  =====================================================================
:class:`RingAttention`     K/V chunks passed around the ring of ``context`` ranks with
                           ``lax.ppermute``, online-softmax (log-sum-exp) accumulation, fully
                           masked chunks skipped; the backward (``jax.custom_vjp``) passes K/V
                           around the ring again and carries dK/dV accumulators home, storing no
                           K/V of the forward's steps. The default.
:class:`GatheredAttention` K and V all-gathered over ``context`` (MaxText's default), then the
                           ring's blocks on the gathered chunks (flash attention's statistics
                           kept, no [S/C, S] probabilities; a sliding window or a packed batch:
                           one masked [S/C, S] block); backward a reduce-scatter of dK/dV (the
                           gather's transpose). Works inside a pipeline's slots.
:class:`ContextPositions`  the global positions of this rank's tokens.
=========================  =====================================================================

Everything else of the model (embeddings, norms, MLP, head, loss) runs on the rank's chunk as it
is: the loss is this rank's mean, which the training step averages over ``context`` as it does
over ``data``, and every parameter's gradient is summed over ``context``.

**Layouts.** S tokens on C ranks. *Contiguous*: rank r holds tokens [rS/C, (r+1)S/C); under a
causal mask rank C-1 does C times rank 0's attention work. *Balanced* (the default; Megatron-LM's
and MaxText's load-balanced causal layout): the sequence is cut into 2C chunks of c = S/(2C) and
rank r holds chunks r and 2C-1-r, so that every rank does the same work.
:func:`to_context_order` puts a batch in that order (the training step does it before placing
the batch; :func:`from_context_order` undoes it).

**Ring attention** (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers";
flash attention's online softmax, Dao et al. 2022; causal balancing as in Megatron-LM's context
parallelism). Step 0 attends the rank's own chunk under the causal mask; step s = 1..C-1 receives
the K/V chunk of rank j = r - s (mod C) from its left neighbour and merges

    lse = logaddexp(lse, lse_s),   o = o exp(lse_old - lse) + o_s exp(lse_s - lse)

Contiguous layout: j < r attends the whole chunk, j > r is fully masked and skipped. Balanced:
j < r attends both of r's chunks against j's first chunk (j's second chunk is later than both of
r's); j > r attends r's second chunk against both of j's (r's first chunk precedes them): 2c^2
query-key pairs either way, c^2 fewer than the diagonal step's 4c^2 less its masked half.
:func:`schedule` is the table of what each rank does at each step; :func:`attention_work` counts
its query-key pairs.

Bytes per layer and rank (B sequences, Hk key/value heads of dimension d, e bytes per element;
q has Hq = G Hk heads):

===============  ==============================================  ================================
algorithm        forward                                         backward
===============  ==============================================  ================================
ring             (C-1) K/V chunks: (C-1) 2 B (S/C) Hk d e        (C-1) K/V chunks again and
                 (collective-permutes)                           (C-1) dK/dV chunks (float32)
all-gather       all-gather of K and V: (C-1)/C 2 B S Hk d e      reduce-scatter of dK and dV,
                 received                                        the same bytes
===============  ==============================================  ================================

Memory: the ring holds one [B, Hq, S/C, S/C] score block at a time (1/C^2 of the unsplit
attention's), the all-gather one [B, Hq, S/C, S] block (1/C) and the whole sequence's K and V.

One idea a module:

- :mod:`~jphantom.nn.attention.core`: the unsplit causal core and its positions.
- :mod:`~jphantom.nn.attention.kernel_choice`: cuDNN's flash attention or XLA's path, and why.
- :mod:`~jphantom.nn.attention.layout`: the contiguous and balanced layouts over ``context``.
- :mod:`~jphantom.nn.attention.schedule`: the ring's schedule and each rank's work.
- :mod:`~jphantom.nn.attention.blocks`: blockwise attention with the online softmax.
- :mod:`~jphantom.nn.attention.ring`: ring attention and its backward.
- :mod:`~jphantom.nn.attention.context`: the context layers (ring, all-gather, positions).
- :mod:`~jphantom.nn.attention.model_cores`: a model's cores configured and reported.
- :mod:`~jphantom.nn.attention.packing`: packed batches' segment ids and positions, carried to
  the cores.
"""

from jphantom.nn.attention.blocks import block, block_grads
from jphantom.nn.attention.context import (ALGORITHMS, ContextPositions, GatheredAttention,
                                           RingAttention, check_algorithm, context_kernel,
                                           gathered_attention)
from jphantom.nn.attention.core import CausalAttention, Positions, causal_attention
from jphantom.nn.attention.kernel_choice import (DETERMINISTIC_FLAGS, FUSED_DTYPES,
                                                 IMPLEMENTATIONS, check_implementation, choose,
                                                 fused_problem, platform_of)
from jphantom.nn.attention.layout import (AXIS, from_context_order, layout_positions,
                                          to_context_order)
from jphantom.nn.attention.model_cores import configure, context_of, kernels_of
from jphantom.nn.attention.packing import Packing, packing_of, segment_mask
from jphantom.nn.attention.ring import ring_attention
from jphantom.nn.attention.schedule import EARLY, FULL, LATE, SKIP, attention_work, schedule


__all__ = ["causal_attention", "Positions", "CausalAttention", "ContextPositions", "choose",
           "configure", "platform_of", "fused_problem", "IMPLEMENTATIONS", "context_kernel",
           "kernels_of",
           "RingAttention", "GatheredAttention", "ring_attention", "gathered_attention",
           "to_context_order", "from_context_order", "layout_positions", "schedule",
           "attention_work", "context_of", "ALGORITHMS", "Packing", "packing_of",
           "segment_mask"]
