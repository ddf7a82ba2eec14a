"""``jphantom plan``: rank every parallel layout of a GPT on G GPUs by modelled communication.

Singh's Sec. 5.1.2 enumerates the 4D grids (G_x, G_y, G_z, G_data), prices each with Eqs.
5.1-5.7 and runs the top few. This module does that (:mod:`jphantom.perf.axonn_model`) and prices
the other layouts jphantom trains with the same alpha-beta, placement-aware network model, so that
one table compares them. Every row is a layout you could run: its registry strategy, its mesh (the
:mod:`jphantom.runtime.mesh` text; axes outermost first) and its options.

==============  ==========  ===============================================================
layout          strategy    communication per step (per GPU)
==============  ==========  ===============================================================
pmm3d           pmm3d       Σ over the GPT's linear layers of Eq. 5.6 (Eqs. 5.1-5.5), the
                            tied LM head as one more normal layer (§1.4's layout)
tensor          tensor      ``inventory.collective_inventory(..., "tensor")`` on
                            data=D,model=T (Megatron's f/g all-reduces; Shoeybi et al.),
                            then the data all-reduce of the rank's parameters
tensor + SP     tensor      the same with ``sequence_parallel=True`` (all-reduces become
                            reduce-scatter + all-gather pairs; Korthikanti et al. 2022)
data            tensor      model=1: only the data all-reduce of all parameters
phantom         phantom     ``inventory.collective_inventory(..., "phantom")`` (k ghosts per
                            token all-gathered, reduced backward; Seal et al.) + data all-reduce
pipeline 1F1B   tensor      stage=P,data=D (model=1): one point-to-point message of one
                            micro-batch's activations [S, h] per micro-batch forward and one
                            gradient backward; the data all-reduce of the stage's parameters
pipeline ZB-H1  tensor      the same messages and memory; the bubble of the zero-bubble
                            schedule's lock-step table (:mod:`jphantom.pipeline.table`)
pipeline ZB-V   tensor      twice the messages (two chunks per device, the V placement); the
                            same memory; its lock-step bubble
zero-3          tensor      data=G,model=1 with ``--zero 3``: per micro-batch every block is
                            all-gathered forward and again backward (jphantom re-gathers under
                            remat) and its gradient reduce-scattered (Cheng et al. §1.2: 6P bytes)
context         tensor      data=D,context=C (model=1), ring attention: per layer (C-1) K/V
                            chunks [B S/C Hk d] forward, again backward (and in the recompute
                            forward), (C-1) dK/dV chunks backward (:mod:`jphantom.nn.attention`);
                            the gradient all-reduce over data x context
==============  ==========  ===============================================================

Each collective costs count x (wire elements x bytes / β + ring steps x α) (``Collective``), β
from Eq. 5.7 for the group's level in the mesh's hierarchy, innermost first (``model``/``x``,
``y``, ``z``, ``stage``, ``data``: the device order :meth:`jphantom.runtime.mesh.MeshConfig.build` uses);
a pipeline's point-to-point messages use one GPU pair's link
(:func:`jphantom.perf.axonn_model.point_to_point_bandwidth`).

The ranking key is ``comm_s + bubble_s``: the paper ranks by communication alone; a pipeline's
cost is mostly its bubble, idle time (P - 1)/M of its compute (1F1B with M micro-batches), so the
bubble is priced too, at the assumed sustained FLOP/s. Compute is not in the key: every dense
layout does the same FLOPs per device (Narayanan's count / G); phantom does fewer, but trains a
different, smaller model (Seal et al.), so its FLOPs are shown, not credited.

Memory per device (modelled; 16 bytes of state per parameter for bf16 + Adam, per-layer activation
checkpointing as the Ch. 5 runs, Korthikanti's per-layer activation count:
:func:`jphantom.perf.axonn_model.checkpointed_activations`) decides ``fits`` when a limit is given;
layouts that do not fit rank after those that do.

Not modelled: overlap of communication with compute (the paper's OAR/ORS/OAG), activation-recompute
collectives (AG_z and AR_y again in the recompute forward), AxoNN's backward re-gather of W,
non-linear layers' collectives under pmm3d (LayerNorm's psum over Y), the tied embedding's gradient
exchange between the first and last pipeline stage, optimizer and kernel time, MoE blocks.

One idea a module:

- :mod:`~jphantom.planner.search`: the planner, :func:`plan` (a loop over the registry's
  strategies, each pricing its layouts: :meth:`jphantom.registry.strategies.Strategy.price`).
- :mod:`~jphantom.planner.layouts`: the layouts of the table above, each enumerating its meshes
  and pricing them.
- :mod:`~jphantom.planner.pricing`: collectives to seconds; the layouts' collectives and counts.
- :mod:`~jphantom.planner.result`: :class:`PlanRow` and :class:`Ranking`.
- :mod:`~jphantom.planner.report`: :func:`format_plan`, the ranking as text.
- :mod:`~jphantom.planner.command`: ``jphantom plan`` on the command line (:func:`add_parser`).
- :mod:`~jphantom.planner.clusters`: the nodes ``--cluster`` names (Perlmutter, Frontier, an MI300X
  platform), every number cited.
"""

from jphantom.planner.command import add_parser
from jphantom.planner.report import format_plan
from jphantom.planner.result import PlanRow, Ranking
from jphantom.planner.layouts import PIPELINES
from jphantom.planner.search import DEFAULT_DEVICE_TFLOPS, LAYOUTS, plan

__all__ = ["plan", "Ranking", "PlanRow", "format_plan", "add_parser", "LAYOUTS", "PIPELINES",
           "DEFAULT_DEVICE_TFLOPS"]
