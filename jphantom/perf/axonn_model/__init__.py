"""AxoNN's placement-aware communication model of the 4D algorithm (Singh's thesis ch. 5, Eqs. 5.1-5.7).

The G GPUs form a grid G_x x G_y x G_z x G_data, ranked innermost to outermost X, Y, Z, data (the
``x``, ``y``, ``z``, ``data`` axes of :mod:`jphantom.runtime.mesh`; ``str(grid)`` is the mesh text
``"data=2,z=2,y=2,x=2"``). A fully connected layer O = I W with I [m, k], W [k, n] runs Algorithm 3:
W is split rows over Y and columns over X and flat-sharded over Z (Ŵ, k n / (G_x G_y G_z) per GPU);
I is split rows (tokens) over Z and columns over Y. Per layer and per step its five collectives
cost Eqs. 5.1-5.5 and their sum, Eq. 5.6 (Singh's thesis §2, exact; the "volume" is what each GPU
puts on the wire under the ring algorithm, in elements), written out in
:mod:`~jphantom.perf.axonn_model.equations`.

A *transposed* layer (every other layer, so that O's (Z, X) layout feeds the next layer) swaps the
roles of X and Y: G_x <-> G_y in the volumes, and, since its forward all-reduce then runs over the X
groups, β_x <-> β_y too (the digest's §6 item 7: "logically yes"). The whole network is the sum of
Eq. 5.6 over its layers; m is the tokens of one data group, batch x seq_len / G_data (§2's
implementer note).

Bandwidths (Eq. 5.7, placement-aware). Level i of the hierarchy has G_i ranks whose neighbours are
∏_{j<i} G_j apart. Case 1, the group lies inside a node (∏_{j<=i} G_j <= G_node): β_i is the
*database* entry keyed (G_0 = ∏_{j<i} G_j, G_1 = G_i) (Sec. 5.1.2 profiles G_0 simultaneous rings of
G_1 GPUs with 1 GB messages), or the topology's default intra-node bandwidth when the entry is
missing. Case 2, the group spans nodes:

    (5.7)  β_i = β_inter / min(G_node, ∏_{j<i} G_j)

(one ring over 8 GPUs of 2 nodes gets β_inter; two concurrent rings of 4 across the same nodes get
β_inter / 2 each; a node has at most G_node ring links leaving it). A group of one rank costs 0.

Latency (our addition, Seal et al. Eq. 26's idea in the ring's terms). The paper ignores startup
costs (§2 assumption 3: large messages). Here every collective also costs α per ring step, p - 1
steps for all-gather and reduce-scatter and 2 (p - 1) for all-reduce (Thakur et al.'s ring), one
per point-to-point message, so that many small messages are not free. ``latency=False`` gives the
paper's model exactly.

Units: volumes are elements (compare them with the HLO's bytes / element size); bandwidths are
bytes per second, GB/s = 1e9 bytes/s; times are seconds.

Also here, for the planner (:mod:`jphantom.planner`): the GPT layer list (Singh's thesis §1.4: QKV normal,
attention output transposed, MLP up normal, MLP down transposed), the enumeration of grids with
their divisibility and memory filters, and the per-device memory model (:func:`pmm3d_memory`,
modelled, see its docstring).

One idea a module:

- :mod:`~jphantom.perf.axonn_model.equations`: the grid, layers, collectives, Eqs. 5.1-5.6.
- :mod:`~jphantom.perf.axonn_model.network`: the topology and Eq. 5.7's bandwidths.
- :mod:`~jphantom.perf.axonn_model.shapes`: the GPT's sizes, its block kinds and its layers
  under Alg. 3.
- :mod:`~jphantom.perf.axonn_model.memory`: precisions and the per-device memory model.
- :mod:`~jphantom.perf.axonn_model.search`: the grids enumerated, filtered and ranked.
- :mod:`~jphantom.perf.axonn_model.units`: units and argument checks.
"""

from jphantom.perf.axonn_model.equations import (AXES, Collective, Grid, LayerShape, all_gather_z,
                                                 all_reduce_data, all_reduce_x, all_reduce_y,
                                                 axis_bandwidths, layer_collectives,
                                                 layer_seconds, predict, reduce_scatter_z)
from jphantom.perf.axonn_model.memory import (PRECISIONS, PrecisionBytes,
                                              checkpointed_activations, logits_bytes,
                                              pmm3d_memory, precision_of)
from jphantom.perf.axonn_model.network import (Topology, hierarchy_bandwidths,
                                               placement_bandwidth, point_to_point_bandwidth)
from jphantom.perf.axonn_model.search import configurations, grid_problems, rank
from jphantom.perf.axonn_model.shapes import (BLOCKS, FAMILIES, GPT2_BLOCKS, GPT_20B, GPT_40B,
                                           LLAMA_BLOCKS, BlockKind, GPTShape, gpt_layers)
from jphantom.perf.axonn_model.units import GB, GIB, check_count, check_positive

__all__ = ["GB", "GIB", "AXES", "check_count", "check_positive", "Topology",
           "placement_bandwidth", "point_to_point_bandwidth", "hierarchy_bandwidths", "Grid",
           "LayerShape", "Collective", "all_gather_z", "reduce_scatter_z", "all_reduce_y",
           "all_reduce_x", "all_reduce_data", "layer_collectives", "axis_bandwidths",
           "layer_seconds", "predict", "GPTShape", "BlockKind", "BLOCKS", "GPT2_BLOCKS",
           "LLAMA_BLOCKS", "FAMILIES", "GPT_20B", "GPT_40B", "gpt_layers", "PrecisionBytes",
           "PRECISIONS", "precision_of",
           "checkpointed_activations", "logits_bytes", "grid_problems", "pmm3d_memory",
           "configurations", "rank"]


_RENAMED = {"Precision": "PrecisionBytes", "Layer": "LayerShape"}


def __getattr__(name):
    """The old names of :class:`PrecisionBytes` (``Precision``, which
    :class:`jphantom.step.precision.Precision` also is) and :class:`LayerShape` (``Layer``, which
    :class:`jphantom.models.ffn.Layer` also is), with a DeprecationWarning; they go in the next
    release."""
    if name in _RENAMED:
        import warnings

        warnings.warn(f"jphantom.perf.axonn_model: {name} is now {_RENAMED[name]}; the old "
                      "name goes in the next release", DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'jphantom.perf.axonn_model' has no attribute {name!r}")
