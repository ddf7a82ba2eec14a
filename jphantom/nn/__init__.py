"""Parallel layers as Flax NNX modules, and the building blocks models are written with.

A parallel layer runs on one rank inside the training step's ``shard_map``, keeps its parameters
as ``nnx.Param``s whose sharding metadata names the mesh axes they are split on, calls its
collectives on the axis it was given, and converts from and back to the plain Flax layer it
replaces (``from_module`` / ``dense_equivalent``). :func:`jphantom.parallelize` swaps them into a
model by path; a model holds none of them itself.

- :mod:`jphantom.nn.tensor`: Megatron's column- and row-parallel linears with f and g,
  vocabulary-parallel embedding and head, sequence parallelism, tensor-parallel experts; the
  feature gather / scatter at a feature-split model's boundaries; Seal et al.'s T1 linear.
- :mod:`jphantom.nn.pmm3d`: AxoNN's 3D matmul linear (weights kept, regathered or deferred) and
  token table.
- :mod:`jphantom.nn.boundary`: the plain point between layers where a plan may re-lay an
  activation out.
- :mod:`jphantom.nn.phantom`: the phantom linear (Seal et al.), feature-split embeddings and norms.
- :mod:`jphantom.nn.moe`: mixtures of experts, plain: SwiGLU or GELU experts (Mixtral's
  router), and the routed :class:`SwitchMoE` (capacity, dropless, load-balancing and z losses).
- :mod:`jphantom.nn.expert_parallel`: expert parallelism over ``expert`` (all-to-all dispatch), TED and
  DTD over ``model``, phantom-parallel experts.
- :mod:`jphantom.nn.attention`: the causal attention core and positions a model computes with,
  and context parallelism: ring and all-gather attention over ``context``.
- :mod:`jphantom.nn.stack`: blocks stacked over depth under ``lax.scan``.
- :mod:`jphantom.nn.loss`: the LM loss through whatever head a model has.
- :mod:`jphantom.nn.metadata`: the mesh-axis metadata of parameters.
"""

from jphantom.nn.attention import (CausalAttention, ContextPositions, GatheredAttention,
                                   Positions, RingAttention)
from jphantom.nn.boundary import Boundary
from jphantom.nn.expert_parallel import ExpertParallelExperts, ExpertParallelMoE, PhantomMoE
from jphantom.nn.moe import Experts, SwitchMoE, top_k_gates
from jphantom.nn.loss import cross_entropy, cross_entropy_terms
from jphantom.nn.phantom import FeatureParallelEmbed, FeatureParallelNorm, PhantomLinear
from jphantom.nn.stack import Stacked, set_remat
from jphantom.nn.tensor import (ColumnParallelEinsum, ColumnParallelGeneral, ColumnParallelLinear,
                                RowParallelEinsum, GatherFeatures,
                                PerTokenSequence, RowParallelGeneral, RowParallelLinear,
                                ScatterFeatures, SequenceParallelEmbed, SharedHeadsLinear,
                                T1Linear, TensorParallelExperts, VocabParallelEmbed,
                                VocabParallelHead)

__all__ = ["ColumnParallelLinear", "ColumnParallelGeneral", "RowParallelGeneral",
           "ColumnParallelEinsum", "RowParallelEinsum",
           "SharedHeadsLinear", "PerTokenSequence", "RowParallelLinear", "VocabParallelEmbed", "VocabParallelHead",
           "SequenceParallelEmbed", "TensorParallelExperts", "GatherFeatures", "ScatterFeatures",
           "T1Linear", "Boundary", "PhantomLinear", "FeatureParallelEmbed", "FeatureParallelNorm",
           "Experts", "top_k_gates", "Stacked", "SwitchMoE", "ExpertParallelExperts",
           "ExpertParallelMoE", "PhantomMoE", "set_remat", "cross_entropy", "cross_entropy_terms", "CausalAttention",
           "Positions", "RingAttention", "GatheredAttention", "ContextPositions"]
