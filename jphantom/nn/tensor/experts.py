"""Tensor-parallel experts (TED's tensor part, Singh's thesis Eq. 7.1, without an expert axis):
every SwiGLU expert's FFN width split over the mesh axis, f before and g after as a column/row
pair."""

from __future__ import annotations

import jax
from flax import nnx

from jphantom.runtime import comm
from jphantom.nn import metadata
from jphantom.nn.moe import Experts
from jphantom.nn.tensor.regions import reduce_from_model, to_full_sequence


class TensorParallelExperts(nnx.Module):
    """A mixture of SwiGLU experts with every expert's FFN width split over ``axis`` (TED's tensor
    part, Singh's thesis Eq. 7.1, without an expert axis): w_gate, w_up [E, h, f] split on f,
    w_down [E, f, h] split on f; f before, g after, as a column/row pair.

    ``feature_split=True`` (phantom models, whose stream is [B, S, h/p]): the input's features are
    all-gathered (B S h; backward reduce-scatter) and the output reduce-scattered back to h/p
    (B S h; backward all-gather), the gates being replicated already."""

    fp8 = False  # the experts' GEMMs on FP8 operands (precision='fp8')

    def __init__(self, w_gate, w_up, w_down, *, axis: str = "model",
                 sequence_parallel: bool = False, feature_split: bool = False,
                 top_k: int | None = None):
        self.axis, self.sequence_parallel = axis, sequence_parallel
        self.feature_split, self.top_k = feature_split, top_k
        self.w_gate = metadata.param(w_gate, (None, None, axis))
        self.w_up = metadata.param(w_up, (None, None, axis))
        self.w_down = metadata.param(w_down, (None, axis, None))

    @classmethod
    def from_module(cls, experts: Experts, *, axis: str = "model",
                    sequence_parallel: bool = False,
                    feature_split: bool = False) -> "TensorParallelExperts":
        return cls(experts.w_gate.get_value(), experts.w_up.get_value(), experts.w_down.get_value(), axis=axis,
                   sequence_parallel=sequence_parallel, feature_split=feature_split,
                   top_k=experts.top_k)

    def dense_equivalent(self) -> Experts:
        return Experts.of(self.w_gate[...], self.w_up[...], self.w_down[...], top_k=self.top_k)

    def __call__(self, x: jax.Array, gates: jax.Array) -> jax.Array:
        if self.feature_split:
            x = comm.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True)  # [.., h]
            partial_sum = Experts.apply(x, gates, self.w_gate[...], self.w_up[...],
                                        self.w_down[...], fp8=self.fp8)
            return comm.psum_scatter(partial_sum, self.axis, scatter_dimension=x.ndim - 1,
                                    tiled=True)  # [.., h/p]
        x = to_full_sequence(x, self.axis, self.sequence_parallel)
        partial_sum = Experts.apply(x, gates, self.w_gate[...], self.w_up[...], self.w_down[...],
                                    fp8=self.fp8)
        return reduce_from_model(partial_sum, self.axis, self.sequence_parallel)
