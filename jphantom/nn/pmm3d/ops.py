"""AxoNN's 3D parallel matrix multiply (Singh's thesis ch. 5, Algorithm 3), per rank on mesh axes
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

Weights (:class:`jphantom.nn.pmm3d.Pmm3dLinear`'s ``weights``): ``regather`` gathers each weight
again for the backward instead of keeping it (AxoNN's default without ``cache_weights``, one more
all-gather per layer); ``deferred`` all-gathers every layer's weights once before the layers'
scan, so the reduce-scatters run once after the backward (the dissertation's deferred
reduce-scatter, at the memory of the whole gathered model). Degenerate grids: ``z`` alone is FSDP / ZeRO-3, ``z`` and ``data`` HSDP, ``x``
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

import jax
from jax.ad_checkpoint import checkpoint_name as name_residual

from jphantom.runtime import comm
from jphantom.step import remat
from jphantom.runtime.mesh import X, Y, Z

GATHERED = "pmm3d_gathered_weight"
ROLES = {"normal": (Y, X), "transposed": (X, Y)}  # (contraction axis, output axis)


def gather(w_shard: jax.Array, axis: int) -> jax.Array:
    """``W`` from this rank's Z shard: all-gather over ``z`` on the output dimension (Eq. 5.1)."""
    return checkpoint_name(comm.all_gather(w_shard, Z, axis=axis, tiled=True))


def checkpoint_name(w):
    return name_residual(w, GATHERED)


def linear(inputs: jax.Array, w: jax.Array, bias: jax.Array, role: str) -> jax.Array:
    """``O = all-reduce_contract(I W) + b`` with the gathered ``w [in/G_c, out/G_o]``: inputs
    ``[..., in/G_c]`` -> ``[..., out/G_o]`` (Eq. 5.3 forward; Eqs. 5.2, 5.4 by autodiff)."""
    contract, _ = ROLES[role]
    return remat.name_collective(comm.psum(inputs @ w, contract)) + bias


# -- the FFN ----------------------------------------------------------------------------------------


# -- the transformer --------------------------------------------------------------------------------


