"""Megatron tensor (and sequence) parallelism as Flax NNX layers (Shoeybi et al., Brakel et al.;
Korthikanti et al. 2022).

Each layer runs on one rank inside the training step's ``shard_map`` and calls its collectives on
the mesh axis it was given (``axis``, default ``"model"``, of size p). Parameters are ``nnx.Param``s
whose sharding metadata names that axis; they keep the dense layer's *global* shapes, so a layer
built :meth:`from_module` a plain ``nnx.Linear`` / ``nnx.Embed`` holds the same numbers and gives
them back with :meth:`dense_equivalent`. Leading stacked dimensions (blocks created under
``nnx.vmap``, [L, ...]) are carried along unsplit.

Activations: B tokens' batch, S sequence, h features. Without sequence parallelism the residual
stream is replicated over ``axis`` [B, S, h]; with it (``sequence_parallel=True``, Korthikanti et al. 2022
Sec. 4.2.2) it is split over the sequence [B, S/p, h] and each all-reduce below becomes a
reduce-scatter plus an all-gather of the same volume.

Per call, per rank (elements):

=======================  ==========================================  ============================
layer                    forward                                     backward
=======================  ==========================================  ============================
InputNorm                f: none (SP: all-gather of B S h)            f: all-reduce of B S h (SP:
  (norm before columns)                                              reduce-scatter to B S h / p)
ColumnParallelLinear     f where its input does not vary yet (no     as f
                         InputNorm before it), else none
RowParallelLinear        g: all-reduce of B S h (SP: reduce-scatter)  none (SP: all-gather B S h)
VocabParallelEmbed       all-reduce of B S h (SP: reduce-scatter)     none (SP: all-gather)
VocabParallelHead        f (SP: all-gather); logits stay [B S V/p];   f's all-reduce (SP: RS)
  .cross_entropy_sum     3 all-reduces of B S scalars                 none
  .__call__              + all-gather of B S V (the full logits)      none (a slice)
TensorParallelExperts    f before, g after (as a column/row pair)     f's all-reduce
GatherFeatures           all-gather of B n (feature-split in,        none (keeps the own slice)
                         replicated out)
ScatterFeatures          none (keeps the own slice)                  all-gather of B n
T1Linear (Seal et al.)      all-gather of B n_in (its input's features)  reduce-scatter to B n_in / p
=======================  ==========================================  ============================
**Collective matmul** (``collective_matmul=True`` under sequence parallelism; Wang et al. 2023,
"Overlap Communication with Dependent Computation via Decomposition in Large Deep Learning
Models"): the all-gather before the column layers and the reduce-scatter after a row layer cut
into p-1 ``ppermute`` steps under the chunks' GEMMs (:mod:`jphantom.nn.tensor.collective_matmul`).


Megatron's f (``copy_to_tensor_model_parallel_region``) is ``comm.pcast(x, axis, to="varying")``:
identity forward, its transpose the all-reduce. g (``reduce_from_...``) is ``lax.psum``: its
transpose is free under ``check_vma=True``.

Seal et al.'s FFN takes and returns activations whose features are split over ``axis`` [B, n/p]
(phantom's layout). Megatron's column/row pairs run on replicated [B, n] between them, so the FFN
enters through :class:`GatherFeatures` (Megatron's ``gather_from_tensor_model_parallel_region``)
and, after a row layer, leaves through :class:`ScatterFeatures` (``scatter_to_...``); after a lone
column layer (odd depth) its output is feature-split already. Seal et al.'s own tensor parallelism
(T1, Sec. II-B, Fig. 1a) is :class:`T1Linear`: the weight split on its output features and the
input's features all-gathered in every layer, so input and output keep phantom's layout.

One idea a module:

- :mod:`~jphantom.nn.tensor.dense`: what every layer shares with the dense layer it replaces.
- :mod:`~jphantom.nn.tensor.regions`: Megatron's f and g and their sequence-parallel forms.
- :mod:`~jphantom.nn.tensor.collective_matmul`: the all-gather and reduce-scatter under the GEMMs.
- :mod:`~jphantom.nn.tensor.linear`: the column- and row-parallel ``nnx.Linear``.
- :mod:`~jphantom.nn.tensor.general`: the column and row ``nnx.LinearGeneral``.
- :mod:`~jphantom.nn.tensor.einsum`: the column and row ``nnx.Einsum``.
- :mod:`~jphantom.nn.tensor.shared_heads`: key/value heads fewer than the ranks.
- :mod:`~jphantom.nn.tensor.vocab_parallel`: the vocabulary-parallel embedding and head.
- :mod:`~jphantom.nn.tensor.sequence`: sequence parallelism's boundaries (norms, position table).
- :mod:`~jphantom.nn.tensor.experts`: tensor-parallel experts.
- :mod:`~jphantom.nn.tensor.features`: the feature gather / scatter at phantom's boundaries.
- :mod:`~jphantom.nn.tensor.t1`: Seal et al.'s T1 linear.
"""

from jphantom.nn.tensor.collective_matmul import (SequenceChunks, all_gather_matmul,
                                                  check_collective_matmul, matmul_reduce_scatter)
from jphantom.nn.tensor.dense import matmul, param_value, plain_embed, plain_linear, promote_dtypes
from jphantom.nn.tensor.einsum import (ColumnParallelEinsum, RowParallelEinsum, einsum_operands,
                                       einsum_split)
from jphantom.nn.tensor.experts import TensorParallelExperts
from jphantom.nn.tensor.features import GatherFeatures, ScatterFeatures, scatter_features
from jphantom.nn.tensor.general import ColumnParallelGeneral, RowParallelGeneral
from jphantom.nn.tensor.linear import ColumnParallelLinear, RowParallelLinear
from jphantom.nn.tensor.regions import (copy_to_model, gather_sequence, own_sequence,
                                        reduce_from_model, to_full_sequence, varies_over)
from jphantom.nn.tensor.sequence import InputNorm, PerTokenSequence, SequenceParallelEmbed
from jphantom.nn.tensor.shared_heads import SharedHeadsLinear
from jphantom.nn.tensor.t1 import T1Linear
from jphantom.nn.tensor.vocab_parallel import VocabParallelEmbed, VocabParallelHead, gather_vocab

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ColumnParallelGeneral",
           "RowParallelGeneral", "ColumnParallelEinsum", "RowParallelEinsum", "SharedHeadsLinear",
           "VocabParallelEmbed", "VocabParallelHead", "SequenceParallelEmbed", "InputNorm",
           "PerTokenSequence", "TensorParallelExperts", "T1Linear", "GatherFeatures",
           "ScatterFeatures", "SequenceChunks", "all_gather_matmul", "matmul_reduce_scatter",
           "check_collective_matmul", "matmul", "param_value", "plain_embed", "plain_linear",
           "promote_dtypes", "einsum_operands", "einsum_split", "scatter_features",
           "copy_to_model", "gather_sequence", "own_sequence", "reduce_from_model",
           "to_full_sequence", "varies_over", "gather_vocab"]
