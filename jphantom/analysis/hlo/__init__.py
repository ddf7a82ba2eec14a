"""Parse the collectives (and the GEMMs) out of compiled HLO text.

``collectives(hlo_text)`` lists every collective instruction with its kind (the HLO op name:
"all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all"), result shapes,
per-device result bytes, replica groups, the computation it sits in and ``count``: how many times it
executes per step. Asynchronous pairs (``all-gather-start`` / ``all-gather-done``) count once, with
the bytes of the ``-done`` result.

Loops are counted by their trip count. The module is split into its computations and each
computation reachable from ENTRY gets a *multiplier*, the number of times it runs per execution of
the module (``multipliers``):

* ENTRY runs once;
* a ``while`` body runs (caller's multiplier) x (trip count) times, its condition one time more,
  since the condition is evaluated once more than the body to exit; nested loops multiply;
* computations reached through ``calls=`` (fusions, ``call``, async wrappers such as
  ``async-start``), ``to_apply=`` (reductions, sort comparators, ...) and the like run as often as
  their caller;
* conditional branches (``branch_computations={...}``, ``true_computation=``,
  ``false_computation=``) are each counted as often as their caller, as if every branch ran: the
  branch taken is only known at run time, so this is an upper bound for the branches;
* a computation called from several places adds up the counts of all its call sites.

The trip count of a ``while`` comes from XLA's ``backend_config`` (``"known_trip_count":{"n":"N"}``)
when present, otherwise from its condition computation (the loop variable compared with a constant,
e.g. ``compare(i, constant(N)), direction=LT``; possibly inside a fusion); when neither works,
``ValueError`` is raised rather than guessing.

``dot_flops(hlo_text)`` counts the FLOPs of the ``dot`` instructions with the same multipliers.
``kernels(hlo_text)`` counts, with them too, the kernels that decide a step's speed: fused
attention custom calls (cuDNN's), hand-written Pallas kernels, GEMMs by emitter and whether they
read FP8, and the asynchronous collectives with GEMMs scheduled under them.
``summarize`` tallies collectives per kind and, given the mesh axes, per kind and mesh axes
(``group_axes`` maps replica groups onto mesh axes).

One idea a module:

- :mod:`~jphantom.analysis.hlo.text`: the text read into computations and instructions.
- :mod:`~jphantom.analysis.hlo.callgraph`: trip counts and multipliers.
- :mod:`~jphantom.analysis.hlo.accounting`: the collectives, their bytes and counts, the tallies.
- :mod:`~jphantom.analysis.hlo.groups`: replica groups to mesh axes.
- :mod:`~jphantom.analysis.hlo.gemms`: GEMM FLOPs and which kernels are GEMMs.
- :mod:`~jphantom.analysis.hlo.kernel_census`: the kernels that decide a step's speed.
- :mod:`~jphantom.analysis.hlo.residuals`: what the layer loop stores for the backward.
"""

from jphantom.analysis.hlo.accounting import KINDS, HloCollective, collectives, summarize
from jphantom.analysis.hlo.callgraph import multipliers, trip_count
from jphantom.analysis.hlo.gemms import custom_call_target, dot_flops, gemm_kind
from jphantom.analysis.hlo.groups import (group_axes, normalise_replica_groups, pair_axes,
                                          replica_group_lists)
from jphantom.analysis.hlo.kernel_census import format_kernels, kernels
from jphantom.analysis.hlo.text import (DTYPE_BYTES, Computation, Instruction, attr_value,
                                        parse_instruction, parse_module, type_bytes)


__all__ = ["collectives", "summarize", "HloCollective", "KINDS", "DTYPE_BYTES", "multipliers",
           "trip_count", "dot_flops", "gemm_kind", "custom_call_target", "kernels",
           "format_kernels", "group_axes", "pair_axes", "replica_group_lists",
           "normalise_replica_groups", "Instruction", "Computation", "parse_instruction",
           "parse_module", "type_bytes", "attr_value"]


def __getattr__(name):
    """``Collective``: :class:`HloCollective`'s old name (which
    :class:`jphantom.perf.axonn_model.Collective`, a modelled collective, also is), with a
    DeprecationWarning; it goes in the next release."""
    if name == "Collective":
        import warnings

        warnings.warn("jphantom.analysis.hlo: Collective is now HloCollective; the old name "
                      "goes in the next release", DeprecationWarning, stacklevel=2)
        return HloCollective
    raise AttributeError(f"module 'jphantom.analysis.hlo' has no attribute {name!r}")
