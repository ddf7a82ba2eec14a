"""Replica groups to mesh axes: a collective's ``replica_groups`` (explicit, iota, or GSPMD's
``mesh[...] {axes}``) as device-id groups, and the mesh axes those groups (or a
collective-permute's source/target pairs) span, devices laid out in C order as ``jax.make_mesh``
does."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np

from jphantom.analysis.hlo.text import IOTA, MESH_GROUPS


def _mesh_shape(axes: Mapping[str, int]) -> tuple[list[str], tuple[int, ...]]:
    names = list(axes)
    shape = tuple(int(axes[name]) for name in names)
    if not names or any(size < 1 for size in shape):
        raise ValueError(f"mesh axes {dict(axes)!r} must be a non-empty name -> size (>= 1) map")
    return names, shape


def normalise_replica_groups(text: str) -> str:
    """GSPMD writes replica groups as ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (devices in iota
    order over that shape, or in the order ``device_ids=([2,4]T(1,0))`` gives between the two,
    one group per combination of the axes *not* listed); rewrite that as the
    equivalent iota list ``[2,4]<=[2,4]`` (here; transposed with ``T(...)`` so that the listed axes
    come last) that :func:`jphantom.analysis.hlo.replica_group_lists` reads. Other syntaxes are
    returned unchanged."""
    match = MESH_GROUPS.fullmatch(text.strip())
    if not match:
        return text
    axes = re.findall(r"'([^']*)'\s*=\s*(\d+)", match["axes"])
    over = set(re.findall(r"'([^']*)'", match["over"]))
    names = [name for name, _ in axes]
    sizes = [int(size) for _, size in axes]
    if not axes or not over <= set(names):
        return text
    kept = [i for i, name in enumerate(names) if name not in over]
    grouped = [i for i, name in enumerate(names) if name in over]
    group_size = math.prod(sizes[i] for i in grouped)
    if match["ids"] is not None:  # the mesh's devices: an iota reshaped and transposed
        dims = [int(d) for d in match["ids"].split(",") if d]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match["perm"]:
            ids = ids.transpose([int(d) for d in match["perm"].split(",") if d])
        groups = ids.reshape(sizes).transpose(kept + grouped).reshape(-1, group_size)
        return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups.tolist()) + "}"
    perm = ",".join(str(i) for i in kept + grouped)
    return (f"[{math.prod(sizes) // group_size},{group_size}]<=[{','.join(map(str, sizes))}]"
            f"T({perm})")


def replica_group_lists(replica_groups_text: str, num_devices: int) -> list[list[int]]:
    """The device-id groups of a ``replica_groups`` attribute: explicit ``{{0,1},{2,3}}``, iota
    ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)`` (iota of the product reshaped to the dims after ``<=``,
    transposed by ``T(...)``, reshaped to the dims before ``<=``; one group per row), or empty
    ``{}`` / "" (all ``num_devices`` devices in one group), or GSPMD's
    ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (:func:`normalise_replica_groups`)."""
    text = normalise_replica_groups(replica_groups_text).strip()
    if text in ("", "{}"):
        return [list(range(num_devices))]
    iota = IOTA.fullmatch(text)
    if iota:
        group_shape = [int(d) for d in iota[1].split(",") if d]
        source_shape = [int(d) for d in iota[2].split(",") if d]
        ids = np.arange(math.prod(source_shape)).reshape(source_shape)
        if iota[3] is not None:
            ids = ids.transpose([int(d) for d in iota[3].split(",") if d])
        ids = ids.reshape(group_shape[0], -1) if group_shape else ids.reshape(1, -1)
        return ids.tolist()
    if re.fullmatch(r"\{\s*(\{[0-9,\s]*\}\s*,?\s*)*\}", text):
        return [[int(d) for d in group.split(",") if d.strip()]
                for group in re.findall(r"\{([0-9,\s]*)\}", text[1:-1])]
    raise ValueError(f"unrecognised replica_groups syntax: {replica_groups_text!r}")


def _axes_differing(members: list[int], names: list[str], shape: tuple[int, ...]) -> set[str]:
    """Names of the axes on which the mesh coordinates of ``members`` are not all equal."""
    size = math.prod(shape)
    if any(d < 0 or d >= size for d in members):
        raise ValueError(f"device ids {members} outside a mesh of {size} devices {shape}")
    if len(members) < 2:
        return set()
    coords = np.array(np.unravel_index(members, shape))  # (rank, members), C order
    return {names[a] for a in range(len(shape)) if np.unique(coords[a]).size > 1}


def group_axes(replica_groups_text: str, axes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes, in mesh order, that the replica groups span.

    ``axes`` maps axis name -> size in mesh order (``{"data": 2, "model": 4}``); device id ``d`` has
    coordinates ``numpy.unravel_index(d, sizes)`` (C order, as ``jax.make_mesh`` lays devices out).
    A group spans axis ``a`` iff its members differ in coordinate ``a``; the result is the union over
    the groups. Groups as in ``replica_group_lists``: ``"{{0,1},{2,3}}"``, ``"[2,4]<=[8]"``,
    ``"[4,2]<=[2,4]T(1,0)"``, ``"{}"`` (all devices: every axis of size > 1)."""
    names, shape = _mesh_shape(axes)
    spanned: set[str] = set()
    for group in replica_group_lists(replica_groups_text, math.prod(shape)):
        spanned |= _axes_differing(group, names, shape)
    return tuple(name for name in names if name in spanned)


def pair_axes(source_target_pairs_text: str, axes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes, in mesh order, on which the source and target of some pair differ, for a
    collective-permute's ``source_target_pairs={{0,1},{1,2}}`` (device ids as in ``group_axes``)."""
    names, shape = _mesh_shape(axes)
    text = source_target_pairs_text.strip()
    if not re.fullmatch(r"\{\s*(\{\s*\d+\s*,\s*\d+\s*\}\s*,?\s*)*\}", text):
        raise ValueError(f"unrecognised source_target_pairs syntax: {source_target_pairs_text!r}")
    spanned: set[str] = set()
    for source, target in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", text):
        spanned |= _axes_differing([int(source), int(target)], names, shape)
    return tuple(name for name in names if name in spanned)
