"""Phantom parallelism (Seal et al.: Seal et al., "A Parallel Alternative for Energy-Efficient Neural
Network Training and Inferencing").

Each of the p ranks keeps, per layer, a dense local block L^(j) [n/p, n/p], a compressor C^(j)
[k, n/p], p-1 decompressors D^(i,j) [n/p, k] (sender i, receiver j) and a bias b^(j) [n/p]. A layer
compresses the rank's n/p activations to k "ghost neurons" (the phantom layer), all-gathers only those
k values per sample, and decompresses what the other ranks sent (Eq. 11). Inputs and outputs stay
sharded on features; no n-wide activation ever moves.

Communication per layer and step (Table II): forward one all-gather of k x batch per rank (result
p x k x batch), backward one reduce-scatter of p x k x batch down to k x batch. Parameters are never
replicated, so there is no gradient all-reduce and the optimizer update is local.

What is here (the maths of :class:`jphantom.nn.phantom.PhantomLinear`, the layer users put in
their models):

- :func:`phantom_layer`: one layer on one rank, a ``jax.custom_vjp`` implementing the paper's
  backward operators (Eqs. 15-21); per rank ``local`` [n_o, n_i], ``compress`` [k, n_i],
  ``decompress`` [p, n_o, k] (``[i]`` is D^(i,j) of sender i; the own slot is masked out: it has
  no effect and gets a zero gradient), ``bias`` [n_o], n_i = in/p, n_o = out/p;
  :func:`rank_compute` is its computation without the collectives (for timing).
- :func:`linear_dense_equivalent` assembles the identical dense layer; :func:`param_count` is
  L(n^2/p + knp) for the FFN; :class:`PhantomConfig` and :func:`max_ghost_width` check Eq. 8.

Symbols: n = ``width``, p = ``num_shards``, k = ``ghost_width``, L = ``depth``.
"""

from __future__ import annotations

import dataclasses
import warnings
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.runtime import comm
from jphantom.errors import ConfigError, JPhantomWarning, check_int
from jphantom.nn.shapes import check_depth, check_width, offdiagonal_mask

def max_ghost_width(width: int, num_shards: int) -> float:
    """Eq. 8 of Seal et al.: phantom has fewer FLOPs and parameters than dense iff k < (n/p)(1 - 1/p)."""
    return (width / num_shards) * (1.0 - 1.0 / num_shards)


@dataclasses.dataclass(frozen=True)
class PhantomConfig:
    """Validated shape of a phantom-parallel FFN.

    Raises :class:`ConfigError` for impossible shapes and warns (:class:`JPhantomWarning`) when
    ``ghost_width`` breaks Eq. 8, i.e. when phantom would be larger than the dense model.
    """

    width: int
    ghost_width: int
    num_shards: int
    depth: int

    def __post_init__(self):
        check_width(self.width, self.num_shards)
        check_depth(self.depth)
        check_int("ghost_width", self.ghost_width, 1)
        if self.ghost_width < 1:
            raise ConfigError(
                f"ghost_width={self.ghost_width} must be >= 1: it is k, the number of ghost neurons "
                "each rank sends per sample (Seal et al.)"
            )
        bound = max_ghost_width(self.width, self.num_shards)
        if self.ghost_width >= bound:
            warnings.warn(
                f"ghost_width={self.ghost_width} is not below (n/p)(1-1/p)={bound:g} for "
                f"width={self.width}, num_shards={self.num_shards} (Seal et al. Eq. 8): the phantom "
                f"model then has at least as many parameters and FLOPs as the dense one. Pick "
                f"ghost_width < {bound:g}.",
                JPhantomWarning,
                stacklevel=3,
            )

    @property
    def block(self) -> int:
        """n/p, the features each rank owns."""
        return self.width // self.num_shards


def param_count(
    width: int, ghost_width: int, num_shards: int, depth: int, *, include_bias: bool = False
) -> int:
    """Parameters of a phantom FFN: L(n^2/p + k n p) weights (Sec. III; Table I counts weights only).

    Per layer: p local blocks (n/p)^2, p compressors k n/p and p(p-1) decompressors (n/p) k. With
    ``include_bias=True`` the L n biases are added.
    """
    n, k, p = width, ghost_width, num_shards
    check_width(n, p)
    check_depth(depth)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"ghost_width={k!r} must be an integer >= 1")
    weights = depth * (n * n // p + k * n * p)
    return weights + (depth * n if include_bias else 0)


def linear_dense_equivalent(params: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The identical dense map of one (unstacked) phantom linear: ``(weight [n_out, n_in], bias
    [n_out])`` with ``y = x W^T + b``; W[j-block rows, i-block cols] = L^(j) if i = j else
    D^(i,j) C^(i). Differentiable, so ``jax.grad`` through it is the oracle for the custom backward."""
    p, n_o, n_i = params["local"].shape
    own = jnp.eye(p, dtype=bool)[:, :, None, None]
    off = jnp.einsum("jimk,ikc->jimc", params["decompress"], params["compress"])  # D^(i,j) C^(i)
    blocks = jnp.where(own, params["local"][:, None], off)  # [j, i, n_o, n_i]
    return blocks.transpose(0, 2, 1, 3).reshape(p * n_o, p * n_i), params["bias"].reshape(p * n_o)


# --------------------------------------------------------------------------------------------------
# Per-rank layer (runs inside shard_map). y: this rank's activations [B, n/p].
# --------------------------------------------------------------------------------------------------


def _received_ghosts(gathered):
    """[p, B, k] as the all-gather delivers it -> [B, p*k]: every sample's p*k received ghosts in one
    row (column i*k + c is ghost c of sender i), the layout in which decompression is one GEMM."""
    num_shards, batch, ghost_width = gathered.shape
    return gathered.transpose(1, 0, 2).reshape(batch, num_shards * ghost_width)


def _decompressor_matrix(decompress, me, num_shards):
    """[p, n/p, k] (slot i = D^(i,j)) -> [n/p, p*k] = [D^(0,j) | ... | D^(p-1,j)], own slot zeroed.

    The copy moves whole k-rows (no element-wise transpose of the n/p x k blocks), is shared by the
    forward and the backward, and lets both use it as it is: decompression (Eq. 11) multiplies by
    its transpose and the messages (Eq. 17) by the matrix itself, neither needing a layout copy.
    """
    masked = decompress * offdiagonal_mask(num_shards, me, decompress.dtype)[:, None, None]
    _, block, ghost_width = decompress.shape
    return masked.transpose(1, 0, 2).reshape(block, num_shards * ghost_width)


def _decompress(gathered, decompress, me, num_shards, fused):
    """Sum_{i != j} D^(i,j) g^(i) for all samples: [p, B, k] x [p, n/p, k] -> [B, n/p] (Eq. 11)."""
    if fused:
        # One GEMM over all p slots, own slot masked: [B, p*k] x [p*k, n/p].
        return _received_ghosts(gathered) @ _decompressor_matrix(decompress, me, num_shards).T
    # The paper's implementation: p-1 separate small GEMMs, one per remote sender (E11).
    total = 0.0
    for offset in range(1, num_shards):
        sender = (me + offset) % num_shards
        g_i = lax.dynamic_index_in_dim(gathered, sender, 0, keepdims=False)  # [B, k]
        d_i = lax.dynamic_index_in_dim(decompress, sender, 0, keepdims=False)  # [n/p, k]
        total = total + g_i @ d_i.T
    return total


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def phantom_layer(axis, num_shards, fused, y, local, compress, decompress, bias):
    """Pre-activation z^(j) = L^(j) y^(j) + sum_{i != j} D^(i,j) C^(i) y^(i) + b^(j)  (Eq. 11).

    Per rank shapes: y [B, n/p], local [n/p, n/p], compress [k, n/p], decompress [p, n/p, k]
    (slot i is D^(i,j)), bias [n/p]. Returns z [B, n/p]. Rectangular layers (a transformer's
    [h, 4h] MLP) have local [n_out/p, n_in/p], compress [k, n_in/p], decompress [p, n_out/p, k].
    """
    z, _ = _phantom_layer_fwd(axis, num_shards, fused, y, local, compress, decompress, bias)
    return z


def _phantom_layer_fwd(axis, num_shards, fused, y, local, compress, decompress, bias):
    me = comm.axis_index(axis)
    ghosts = y @ compress.T  # [B, k]      phantom layer g^(j) = C^(j) y^(j), Eq. 11
    gathered = comm.all_gather(ghosts, axis, axis=0)  # [p, B, k]   Table II: all-gather of k*B
    return _forward_after_gather(y, gathered, local, compress, decompress, bias, me, num_shards,
                                 fused)


def _forward_after_gather(y, gathered, local, compress, decompress, bias, me, num_shards, fused):
    """Eq. 11 once the ghosts are gathered: z^(j) and the residuals the backward needs."""
    # The local GEMM does not wait for the all-gather: each rank computes it while the collective
    # is in flight, then adds the decompressed ghosts (one GEMM when fused).
    z = y @ local.T + _decompress(gathered, decompress, me, num_shards, fused) + bias
    # Keep the gathered ghosts: Eq. 21 needs g^(i) of every sender on the receiver.
    if fused:  # ... side by side with y, [B, n/p + p*k], so that Eqs. 19-21 are one GEMM
        return z, (jnp.concatenate([y, _received_ghosts(gathered)], axis=1), local, compress,
                   decompress)
    return z, (y, gathered, local, compress, decompress)


def _phantom_layer_bwd(axis, num_shards, fused, residuals, dz):
    """Backward operators of Seal et al., Eqs. 15-21, with one reduce-scatter of k x B.

    dz is Delta^(j) = dL/dz^(j) [B, n/p] (Eqs. 15-16). Rank j sends each other rank i the k-wide
    h^(j->i) = Delta^(j) D^(i,j); the reduce-scatter delivers Gamma^(i) = sum_{j != i} h^(j->i) (Eq. 17).
    """
    me = comm.axis_index(axis)
    messages = _backward_messages(residuals, dz, me, num_shards, fused)  # [p, B, k]
    gamma = comm.psum_scatter(messages, axis, scatter_dimension=0)  # [B, k]  Table II: reduce-scatter
    return _backward_gradients(residuals, dz, gamma, me, num_shards, fused)


def _backward_messages(residuals, dz, me, num_shards, fused):
    """h^(j->i) = Delta^(j) D^(i,j) for every receiver i, stacked [p, B, k] (Eq. 17; own slot 0)."""
    decompress = residuals[-1]
    _, _, ghost_width = decompress.shape
    if fused:  # one GEMM with the forward's decompressor matrix (XLA computes it once per step)
        messages = dz @ _decompressor_matrix(decompress, me, num_shards)  # [B, p*k]
        return messages.reshape(dz.shape[0], num_shards, ghost_width).transpose(1, 0, 2)
    messages = jnp.zeros((num_shards, dz.shape[0], ghost_width), dz.dtype)
    for offset in range(1, num_shards):  # the paper's p-1 separate products
        sender = (me + offset) % num_shards
        d_i = lax.dynamic_index_in_dim(decompress, sender, 0, keepdims=False)
        messages = lax.dynamic_update_index_in_dim(messages, dz @ d_i, sender, 0)
    return messages


def _backward_gradients(residuals, dz, gamma, me, num_shards, fused):
    """Eqs. 17-21 given Gamma^(j) [B, k] from the reduce-scatter: (dL/dy, dL/dL, dL/dC, dL/dD, dL/db).

    Fused: Eqs. 19, 20 and 21 are all outer products over the batch, [Delta | Gamma]^T [y | g]: one
    GEMM [n/p + k, B] x [B, n/p + p*k] whose blocks are dL/dL, dL/dC and dL/dD (its k x p*k corner,
    Gamma^T g, is not a gradient and is dropped: 2 k^2 p B extra FLOPs, 1 MFLOP per layer and rank
    at n=4096, p=8, k=16, B=256, 0.2% of the layer). One large GEMM instead of three thin ones
    (k or p*k wide) is what makes the step fast at small batch. Unfused: the paper's p-1 products
    for Eq. 21 and one each for Eqs. 19 and 20.
    """
    d_bias = dz.sum(axis=0)  # Eq. 18
    if fused:
        y_received, local, compress, decompress = residuals
        out_block, in_block = local.shape  # n/p and n/p in the FFN; rectangular in a transformer
        _, _, ghost_width = decompress.shape
        outer = jnp.concatenate([dz, gamma], axis=1).T @ y_received  # [n/p + k, n/p + p*k]
        d_local = outer[:out_block, :in_block]  # Eq. 19: Delta^(j) y^(j)T
        d_compress = outer[out_block:, :in_block]  # Eq. 20: Gamma^(j) y^(j)T
        d_decompress = (  # Eq. 21: Delta^(j) g^(i)T for every sender i; own slot masked
            outer[:out_block, in_block:].reshape(out_block, num_shards, ghost_width).transpose(1, 0, 2)
            * offdiagonal_mask(num_shards, me, dz.dtype)[:, None, None]
        )
    else:
        y, gathered, local, compress, decompress = residuals
        d_decompress = jnp.zeros(decompress.shape, dz.dtype)
        for offset in range(1, num_shards):
            sender = (me + offset) % num_shards
            g_i = lax.dynamic_index_in_dim(gathered, sender, 0, keepdims=False)
            d_decompress = lax.dynamic_update_index_in_dim(d_decompress, dz.T @ g_i, sender, 0)  # Eq. 21
        d_local = dz.T @ y  # Eq. 19
        d_compress = gamma.T @ y  # Eq. 20: Gamma^(j) y^(j)T
    d_y = dz @ local + gamma @ compress  # Eq. 17 (before the activation derivative)
    return d_y, d_local, d_compress, d_decompress, d_bias


def rank_compute(y, gathered, gamma, dz, local, compress, decompress, bias, *, rank, fused=True):
    """One rank's arithmetic of a phantom layer, forward and backward, with the collectives cut out.

    For timing the computation alone at shapes too large to run on a mesh (experiment E11, the
    paper's per-rank shapes at p = 256): ``gathered`` [p, B, k] stands in for the all-gather's
    result and ``gamma`` [B, k] for the reduce-scatter's, so the FLOPs, GEMM shapes and layout
    copies are exactly those of :func:`phantom_layer` on rank ``rank``, without communication.
    Returns a dict: ``ghosts`` (the all-gather's input [B, k]), ``z`` (pre-activation [B, n/p]),
    ``messages`` (the reduce-scatter's input [p, B, k]) and ``grads`` (dL/dy, dL/dL, dL/dC, dL/dD,
    dL/db). Not differentiable; not a training path.
    """
    num_shards = decompress.shape[0]
    ghosts = y @ compress.T  # the all-gather's input, computed as on a rank
    z, residuals = _forward_after_gather(y, gathered, local, compress, decompress, bias, rank,
                                         num_shards, fused)
    messages = _backward_messages(residuals, dz, rank, num_shards, fused)
    grads = _backward_gradients(residuals, dz, gamma, rank, num_shards, fused)
    return {"ghosts": ghosts, "z": z, "messages": messages, "grads": grads}


phantom_layer.defvjp(_phantom_layer_fwd, _phantom_layer_bwd)


