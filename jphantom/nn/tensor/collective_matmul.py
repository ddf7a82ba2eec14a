"""Collective matmul under sequence parallelism (``collective_matmul=True``; Wang et al. 2023,
"Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models", which XLA's windowed einsum and torchtitan's async tensor parallelism implement): the
all-gather before the column layers and the reduce-scatter after a row layer are cut into p-1
``ppermute`` steps of one sequence chunk [B, S/p, h] each, and every GEMM into p GEMMs of one
chunk, so that each step's transfer runs under the GEMM of the chunk already at hand:

- :class:`~jphantom.nn.tensor.InputNorm` hands the column layers it feeds its own chunk
  (:class:`SequenceChunks`); the first of them passes the chunks around the ring (rank r receives
  rank r+1's chunk, then r+2's, ...) in a loop whose step multiplies the chunk at hand while the
  next one arrives (:func:`all_gather_matmul`), and leaves the gathered sequence for the others
  (k and v after q, up after gate), which multiply it whole: one ring per norm, the all-gather's
  bytes, with the first layer's GEMM under it.
- :class:`~jphantom.nn.tensor.RowParallelLinear` computes, in a loop, the partial sum of the
  chunk that is on its way to rank r-1-i at step i while the accumulator from rank r-1 is in
  flight, and adds them (:func:`matmul_reduce_scatter`): after p-1 steps rank r holds the whole
  sum of its own chunk.

Each is a ``lax.scan``: written out step by step, XLA merges the chunks' GEMMs back into one
(its dot merger and concatenate simplification), and nothing is left to overlap.

The bytes are the all-gather's and the reduce-scatter's, as (p-1) collective-permutes of
B S h / p each; backward, autodiff turns each ring around (the gradients' reduce-scatter and
all-gather, overlapped the same way)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.runtime import comm
from jphantom.step import remat
from jphantom.nn.tensor.dense import matmul


class SequenceChunks:
    """This rank's chunk [B, S/p, h] of a sequence split over ``axis``, not yet gathered: what a
    collective-matmul :class:`InputNorm` hands the column layers it feeds. The first
    :class:`ColumnParallelLinear` to take it gathers the sequence around the ring with its own
    GEMM under the transfers (:func:`all_gather_matmul`) and leaves the gathered sequence here;
    the others (k and v after q, up after gate) multiply that: one ring per norm, as one
    all-gather was."""

    def __init__(self, local: jax.Array, axis: str):
        self.local, self.axis = local, axis
        self.whole = None  # [B, S, h] once the first column layer has gathered it


def _varying_zeros(shape, like):
    zeros = jnp.zeros(shape, like.dtype)
    axes = tuple(sorted(comm.varying_axes(like)))
    return comm.pcast(zeros, axes, to="varying") if axes else zeros


def all_gather_matmul(layer, x: jax.Array, kernel: jax.Array, axis: str):
    """``(all-gather(x) @ kernel, all-gather(x))`` over the sequence, as a collective matmul:
    x [B, S/p, in] -> ([B, S, out], [B, S, in]). A loop of p-1 steps: each passes the chunk at
    hand to the left neighbour (rank r receives r+1's, then r+2's, ...; p-1
    collective-permutes of B S in / p, the all-gather's bytes) while multiplying it, then the
    last chunk's GEMM."""
    size, rank = lax.axis_size(axis), comm.axis_index(axis)
    chunk, seq = x.shape[-2], x.ndim - 2
    to_left = [(i, (i - 1) % size) for i in range(size)]

    def place(buffer, block, step):
        return lax.dynamic_update_slice_in_dim(buffer, block, ((rank + step) % size) * chunk, seq)

    def step(carry, index):
        held, gathered, out = carry
        arriving = remat.name_collective(lax.ppermute(held, axis, to_left))  # under the GEMM
        out = place(out, matmul(layer, held, kernel), index)
        return (arriving, place(gathered, held, index), out), None

    whole = (*x.shape[:-2], chunk * size)
    y_like = jax.eval_shape(lambda a: matmul(layer, a, kernel), x)
    carry = (x, _varying_zeros((*whole, x.shape[-1]), x),
             _varying_zeros((*whole, y_like.shape[-1]), x).astype(y_like.dtype))
    (last, gathered, out), _ = lax.scan(step, carry, jnp.arange(size - 1))
    out = place(out, matmul(layer, last, kernel), size - 1)
    return out, place(gathered, last, size - 1)


def matmul_reduce_scatter(layer, x: jax.Array, kernel: jax.Array, axis: str) -> jax.Array:
    """(x @ kernel) summed over ``axis`` and scattered over the sequence, as a collective matmul:
    x [B, S, in/p] -> [B, S/p, out]. A loop: step i computes the partial sum of the chunk bound
    for rank r-1-i while the accumulator received from rank r-1 is in flight, then adds them
    (p-1 collective-permutes of B S out / p, the reduce-scatter's bytes)."""
    size, rank = lax.axis_size(axis), comm.axis_index(axis)
    chunk = x.shape[-2] // size
    to_right = [(i, (i + 1) % size) for i in range(size)]

    def part(index):
        rows = lax.dynamic_slice_in_dim(x, (index % size) * chunk, chunk, axis=x.ndim - 2)
        return matmul(layer, rows, kernel)

    def step(total, index):
        arrived = remat.name_collective(lax.ppermute(total, axis, to_right))
        return arrived + part(rank - 1 - index), None

    total, _ = lax.scan(step, part(rank - 1), jnp.arange(1, size))
    return total


def check_collective_matmul(collective_matmul: bool, sequence_parallel: bool) -> bool:
    """The rule of :func:`jphantom.registry.strategies.check_collective_matmul`; the flag as a bool."""
    from jphantom.registry.strategies import check_collective_matmul as rule

    rule(collective_matmul, sequence_parallel)
    return bool(collective_matmul)
