"""Plans: which parallel layer each of a model's layers becomes, applied by path.

    plan = jphantom.plans.megatron(model, sequence_parallel=True)   # or plans.phantom(model, 8)
    model = jphantom.parallelize(model, mesh, plan)                 # = plans.parallelize
    model = jphantom.parallelize(model, mesh, {"blocks.*.attn.q": "column", ...})  # by hand

A *plan* maps module paths (dotted, with ``fnmatch`` globs: ``*`` matches any run of characters,
dots included) to a *style*. The model is changed in place (and returned); its parameters keep
their values and gain the sharding metadata the training step reads. Styles and what they do to
each kind of Flax layer (p = the size of ``axis``):

=============  ==========================================================================
``column``     ``nnx.Linear`` -> :class:`~jphantom.nn.tensor.ColumnParallelLinear` (out / p);
               ``nnx.LinearGeneral`` (``nnx.MultiHeadAttention``'s query, key, value) ->
               :class:`~jphantom.nn.tensor.ColumnParallelGeneral` (heads / p);
               ``Style("column", kv_heads=K)`` (grouped-query attention's key and value
               projections) with more ranks than K heads ->
               :class:`~jphantom.nn.tensor.SharedHeadsLinear` (each rank the head its query
               heads share, the projection replicated)
``row``        ``nnx.Linear`` -> :class:`~jphantom.nn.tensor.RowParallelLinear` (in / p);
               ``nnx.LinearGeneral`` (its output projection) ->
               :class:`~jphantom.nn.tensor.RowParallelGeneral` (heads / p)
``vocab``      ``nnx.Embed`` -> :class:`~jphantom.nn.tensor.VocabParallelEmbed` (V / p);
               ``nnx.Linear`` (an LM head) -> :class:`~jphantom.nn.tensor.VocabParallelHead`
``input``      a norm whose output feeds column-parallel layers (q, k, v; up, gate; the head)
               -> :class:`~jphantom.nn.tensor.InputNorm`: Megatron's f once, here, instead of
               once per layer (three backward all-reduces for q, k, v would be two too many)
``sequence``   Megatron-SP: a norm -> :class:`~jphantom.nn.tensor.InputNorm` on S/p tokens
               whose output is all-gathered over the sequence once for the layers it feeds;
               a position ``nnx.Embed`` -> :class:`~jphantom.nn.tensor.SequenceParallelEmbed`.
               Any ``sequence`` entry turns sequence parallelism on for every column, row, vocab
               and experts layer of the plan, which then take their input from such a norm.
``phantom``    Seal et al.: ``nnx.Linear`` -> :class:`~jphantom.nn.phantom.PhantomLinear`
               (``Style("phantom", ghost_width=k, vocab_output=True)`` for the LM head);
               ``nnx.Embed`` -> :class:`~jphantom.nn.phantom.FeatureParallelEmbed`; norms ->
               :class:`~jphantom.nn.phantom.FeatureParallelNorm`; ``Experts`` ->
               :class:`~jphantom.nn.tensor.TensorParallelExperts` on feature-split streams;
               ``SwitchMoE`` -> :class:`~jphantom.nn.expert_parallel.PhantomMoE` (phantom experts)
``experts``    :class:`~jphantom.nn.moe.Experts` ->
               :class:`~jphantom.nn.tensor.TensorParallelExperts` (FFN width / p); on a mesh
               with an ``expert`` axis :class:`~jphantom.nn.expert_parallel.ExpertParallelExperts`
               (E / G experts per rank, all-to-all dispatch; TED: width / p over ``axis``);
               a routed :class:`~jphantom.nn.moe.SwitchMoE` ->
               :class:`~jphantom.nn.expert_parallel.ExpertParallelMoE` (E / G experts per rank over
               ``expert``, TED over ``axis``; ``Style("experts", dtd=True)``: duplicate token
               dropping), its load-balancing statistics summed over the batch axes
               (E / G experts per rank, all-to-all dispatch; TED: width / p over ``axis``)
``t1``         Seal et al.'s T1 tensor parallelism: ``nnx.Linear`` ->
               :class:`~jphantom.nn.tensor.T1Linear` (out / p; its feature-split input
               all-gathered in every layer, output feature-split)
``gather``     a :class:`~jphantom.nn.boundary.Boundary` ->
               :class:`~jphantom.nn.tensor.GatherFeatures` (feature-split -> replicated)
``scatter``    a :class:`~jphantom.nn.boundary.Boundary` ->
               :class:`~jphantom.nn.tensor.ScatterFeatures` (replicated -> feature-split)
``pmm3d``      AxoNN's 3D matmul on ``x``, ``y``, ``z``: ``nnx.Linear`` ->
               :class:`~jphantom.nn.pmm3d.Pmm3dLinear` (``Style("pmm3d", role="normal" |
               "transposed", weights="kept" | "regather" | "deferred")``); the token
               ``nnx.Embed`` (``vocab_output=True``) -> :class:`~jphantom.nn.pmm3d.Pmm3dEmbed`;
               other embeddings and norms split their features over ``y``; a routed
               ``SwitchMoE`` -> :class:`~jphantom.nn.pmm3d.Pmm3dMoE` (experts over
               ``expert``, their width over ``x``)
(yours)        a style registered for your own layer class with :func:`register_style`
``context``    context parallelism over the ``context`` axis (:mod:`jphantom.nn.attention`):
               a :class:`~jphantom.nn.attention.CausalAttention` core ->
               :class:`~jphantom.nn.attention.RingAttention` (``Style("context",
               algorithm="all-gather")``: :class:`~jphantom.nn.attention.GatheredAttention`;
               ``balanced=False``: the contiguous layout), a
               :class:`~jphantom.nn.attention.Positions` ->
               :class:`~jphantom.nn.attention.ContextPositions`
``replicate``  unchanged: every rank holds the whole layer
=============  ==========================================================================

Everything is checked before anything is changed: a pattern that matches no module, a style that
does not fit the module it matches (``row`` on an ``nnx.Embed``), two patterns giving one module
two styles, or a dimension the axis does not divide is a :class:`~jphantom.errors.ConfigError`
naming the path. A model may define ``check_shards(num_shards)`` to refuse what paths cannot show
(attention heads that do not divide).

One idea a module:

- :mod:`~jphantom.plans.styles`: the styles a plan names, and those registered for your layers.
- :mod:`~jphantom.plans.paths`: a model's modules by dotted path.
- :mod:`~jphantom.plans.convert`: the parallel layer each style makes of each Flax layer.
- :mod:`~jphantom.plans.apply`: :func:`parallelize` and :func:`dense_equivalent`.
- :mod:`~jphantom.plans.gspmd`: :func:`annotate`, the GSPMD baseline.
- :mod:`~jphantom.plans.walk`: how the ready-made plans recognise a model's layers.
- :mod:`~jphantom.plans.megatron_plan`, :mod:`~jphantom.plans.phantom_plan`,
  :mod:`~jphantom.plans.pmm3d_plan`, :mod:`~jphantom.plans.context_plan`: the ready-made plans.
"""

from jphantom.plans.apply import dense_equivalent, parallelize
from jphantom.plans.context_plan import context
from jphantom.plans.convert import EXPERT_AXIS
from jphantom.plans.gspmd import annotate
from jphantom.plans.megatron_plan import megatron
from jphantom.plans.paths import modules_by_path, set_submodule
from jphantom.plans.phantom_plan import phantom
from jphantom.plans.pmm3d_plan import pmm3d
from jphantom.plans.styles import (AXIS_STYLES, NORMS, STYLES, Placement, Style, register_style,
                                   unregister_style)
from jphantom.plans.walk import (COLUMN, HEAD_NORMS, KV_COLUMNS, MLP_NORMS, POSITION_NAMES,
                                 ROUTERS, ROW, VOCAB_NAMES, vocabulary_table)

__all__ = ["parallelize", "dense_equivalent", "annotate", "megatron", "phantom", "pmm3d",
           "context", "Style", "Placement", "register_style", "unregister_style", "STYLES",
           "AXIS_STYLES", "NORMS", "EXPERT_AXIS", "modules_by_path", "set_submodule",
           "vocabulary_table", "COLUMN", "ROW", "HEAD_NORMS", "KV_COLUMNS", "ROUTERS",
           "MLP_NORMS", "VOCAB_NAMES", "POSITION_NAMES"]
