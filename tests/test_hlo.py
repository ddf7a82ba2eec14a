"""The compiled training step moves exactly the bytes the papers' formulas predict: no more, no less.

Each test compiles forward + backward + SGD update of the FFN's module step (one ``jax.jit`` of
one ``shard_map``, layers under ``lax.scan``), parses every collective out of the optimized HLO,
counting each as many times as its loop runs, and compares the per-device result buffers (kind,
element count, bytes) with the formula written here from the papers (and in the layers'
docstrings), plus the one scalar all-reduce of the MSE loss.
"""

import functools
from collections import defaultdict

import numpy as np
import pytest

from jphantom.analysis import hlo
from jphantom.models.ffn import FFNConfig

from conftest import require_devices
from helpers import compiled_hlo, gradient_step

WIDTH, BATCH, GHOST = 64, 16, 3
F32 = 4


@functools.lru_cache(maxsize=None)
def _ops(strategy, depth, num_shards, ghost_width=None):
    """Every collective of the compiled step on ``model=p`` (and the mesh's axis sizes)."""
    require_devices(num_shards)
    config = FFNConfig(width=WIDTH, depth=depth, ghost_width=ghost_width)
    program, mesh, step, _ = gradient_step(strategy, config, f"model={num_shards}")
    text = compiled_hlo(step, ((BATCH, WIDTH), np.float32), ((BATCH, WIDTH), np.float32))
    return hlo.collectives(text), dict(mesh.shape)


def _buffers(ops):
    """kind -> sorted element counts of every result buffer (once per execution), and kind ->
    total bytes over the step."""
    elements, nbytes = defaultdict(list), defaultdict(int)
    for op in ops:
        for dtype, shape in op.shapes:
            assert dtype == "f32", op
            elements[op.kind] += [int(np.prod(shape))] * op.count
        nbytes[op.kind] += op.bytes * op.count
    return {k: sorted(v) for k, v in elements.items()}, dict(nbytes)


def _expected(formula):
    with_loss = {kind: list(sizes) for kind, sizes in formula.items() if sizes}
    with_loss.setdefault("all-reduce", []).append(1)  # the scalar MSE loss (shape [])
    return {k: sorted(v) for k, v in with_loss.items()}


def _assert_exact(found, formula):
    ops, axes = found
    elements, nbytes = _buffers(ops)
    want = _expected(formula)
    assert elements == want, f"collective buffers {elements} != formula {want}"
    assert nbytes == {kind: F32 * sum(sizes) for kind, sizes in want.items()}
    summary = {row["kind"]: row["bytes"] for row in hlo.summarize(ops)}
    assert summary == nbytes
    assert all(op.mesh_axes(axes) == ("model",) for op in ops)  # model=p mesh


def phantom_formula(depth, num_shards, ghost_width=GHOST, batch=BATCH):
    """Table II of seed 000 per layer: forward one all-gather of k B from each of p ranks (result
    p k B), backward one reduce-scatter down to k B, at every layer including the first (Gamma_1
    feeds dL/dC_1, Eq. 20)."""
    return {"all-gather": [num_shards * ghost_width * batch] * depth,
            "reduce-scatter": [ghost_width * batch] * depth}


def t1_formula(depth, num_shards, batch=BATCH):
    """T1: L all-gathers of B n, L-1 reduce-scatters to B n/p (the first layer's would only
    produce dL/dx)."""
    return {"all-gather": [batch * WIDTH] * depth,
            "reduce-scatter": [batch * WIDTH // num_shards] * (depth - 1)}


def megatron_formula(depth, batch=BATCH):
    """Megatron: the entry gather's all-gather of B n, the exit scatter's backward all-gather
    when the depth is even; all-reduces of B n: floor(L/2) g forward, ceil(L/2) - 1 f backward
    (the first f's would only feed dL/dx)."""
    pairs, odd = divmod(depth, 2)
    return {"all-gather": [batch * WIDTH] * (1 + (0 if odd else 1)),
            "all-reduce": [batch * WIDTH] * (pairs + pairs + odd - 1)}


@pytest.mark.parametrize("strategy", ["phantom", "phantom-unfused"])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_shards", [2, 8])
def test_phantom_step_moves_only_k_wide_messages(strategy, num_shards, depth):
    """Per layer: one all-gather of B x p x k and one reduce-scatter back to B x k (Table II), and no
    all-reduce except the scalar loss: parameters are never replicated, so no gradient all-reduce."""
    _assert_exact(_ops(strategy, depth, num_shards, GHOST), phantom_formula(depth, num_shards))


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_shards", [2, 8])
def test_tensor_t1_step_collectives(num_shards, depth):
    """T1: all-gather of the n/p-wide activations into B x n per layer, reduce-scatter of B x n down
    to B x n/p per layer except the input layer (its only output would be dL/dx)."""
    _assert_exact(_ops("tensor-t1", depth, num_shards), t1_formula(depth, num_shards))


@pytest.mark.parametrize("depth, gathers, all_reduces", [(1, 1, 0), (2, 2, 1), (3, 1, 2), (4, 2, 3)])
@pytest.mark.parametrize("num_shards", [2, 8])
def test_tensor_megatron_step_collectives(num_shards, depth, gathers, all_reduces):
    """tensor (Megatron): entry all-gather, one g all-reduce per pair forward, one f all-reduce per
    column layer but the first backward, and the exit scatter's all-gather backward when the depth
    is even."""
    formula = megatron_formula(depth)
    assert formula == {"all-gather": [BATCH * WIDTH] * gathers,
                       "all-reduce": [BATCH * WIDTH] * all_reduces}
    _assert_exact(_ops("tensor", depth, num_shards), formula)


def test_phantom_bytes_are_k_over_block_of_t1_per_collective():
    """Seed 000 Eq. 9: per collective, phantom moves k/(n/p) of T1's bytes."""
    p, depth = 8, 2
    per_op = lambda ops: {r["kind"]: r["bytes"] / r["count"] for r in hlo.summarize(ops)}
    ph = per_op(_ops("phantom", depth, p, GHOST)[0])
    t1 = per_op(_ops("tensor-t1", depth, p)[0])
    ratio = GHOST / (WIDTH / p)
    for kind in ("all-gather", "reduce-scatter"):
        assert ph[kind] == pytest.approx(ratio * t1[kind])


@pytest.mark.parametrize("text, groups, axes", [
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]], ("data",)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]], ("model",)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", [list(range(8))], ("data", "model")),
])
def test_gspmd_mesh_replica_groups_are_read_as_iota_lists(text, groups, axes):
    """GSPMD prints replica groups as a mesh and the axes the groups run along;
    hlo.normalise_replica_groups turns that into the iota form hlo reads."""
    iota = hlo.normalise_replica_groups(text)
    assert hlo.replica_group_lists(iota, 8) == groups
    assert hlo.group_axes(iota, {"data": 2, "model": 4}) == axes
    assert hlo.normalise_replica_groups("{{0,1},{2,3}}") == "{{0,1},{2,3}}"


def test_gspmd_mesh_replica_groups_with_device_ids_and_their_attribute():
    """Shardy's partitioner (jax 0.10, a pipeline's vmap over stages) also orders the mesh's
    devices by an iota ``device_ids=([2,2,2]T(1,0,2))`` (mesh position (i, j, k) is device
    4 j + 2 i + k here) and the attribute reader takes it whole, not up to the first comma."""
    attrs = (", channel_id=6, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], "
             "device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, metadata={op_name=\"x\"}")
    text = hlo._attr_value(attrs, "replica_groups")
    assert text.endswith("{'axis_0'}")
    assert hlo.replica_group_lists(text, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hlo.group_axes(text, {"a": 2, "b": 2, "c": 2}) == ("b",)
