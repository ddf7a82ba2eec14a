"""Where a parameter lives: mesh-axis names carried by every ``nnx.Param`` as sharding metadata.

A parallel layer creates its parameters with :func:`param`, which records

- ``sharding`` (stored by Flax as ``out_sharding``): one mesh-axis name (or ``None``) per array
  dimension, what ``nnx.get_partition_spec`` reads and what the training step turns into the
  ``PartitionSpec`` of the parameter's shards;
- ``reduce_axes``: mesh axes over which this rank sees only part of the parameter's uses, so its
  gradient is summed over them once per step, after the backward (Megatron-SP's LayerNorm and
  row-bias parameters, which see S/p tokens per rank, Korthikanti et al. 2022, Sec. 4.2.2).

Nothing here communicates. Parameters are created with ``eager_sharding=False``: the step places
them (``jax.jit`` with ``out_shardings``), so a model can be parallelised without a mesh context.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jphantom.runtime.comm import varying_axes  # noqa: F401 (re-exported: the layers' name for it)


def param(value: jax.Array, axes: Sequence[str | None], *, reduce_axes: Sequence[str] = ()
          ) -> nnx.Param:
    """An ``nnx.Param`` of ``value`` split over ``axes`` (one entry per dimension; leading stacked
    dimensions that ``axes`` leaves out are unsplit)."""
    axes = tuple(axes)
    axes = (None,) * (value.ndim - len(axes)) + axes
    metadata = {"reduce_axes": tuple(reduce_axes)} if reduce_axes else {}
    return nnx.Param(value, out_sharding=axes, eager_sharding=False, **metadata)


def axes_of(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The mesh axis of each dimension of ``variable`` (``None``: not split)."""
    meta = variable.get_metadata()
    axes = meta.get("out_sharding", meta.get("sharding_names", meta.get("sharding")))
    if axes is None:
        return (None,) * variable.get_value().ndim
    if isinstance(axes, P):
        axes = tuple(axes)
    return tuple(axes) + (None,) * (variable.get_value().ndim - len(axes))


def reduce_axes_of(variable: nnx.Variable) -> tuple[str, ...]:
    return tuple(variable.get_metadata().get("reduce_axes", ()))


def spec_of(variable: nnx.Variable, mesh_axes: Sequence[str]) -> P:
    """The ``PartitionSpec`` of ``variable`` on a mesh of ``mesh_axes`` (axes the mesh lacks are
    dropped: a plan for ``model`` runs on a mesh without one as if ``model=1``)."""
    names = []
    for entry in axes_of(variable):
        group = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(a for a in group if a is not None and a in mesh_axes)
        names.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while names and names[-1] is None:
        names.pop()
    return P(*names)
