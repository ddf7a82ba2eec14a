"""The compiled training step moves exactly the bytes the papers' formulas predict: no more, no less.

Each test compiles forward + backward + SGD update (one ``jax.jit`` of one ``shard_map``, layers
under ``lax.scan``), parses every collective out of the optimized HLO, counting each as many times as
its loop runs, and compares the per-device result buffers (kind, element count, bytes) with the
strategy's own inventory (``strategies.get(name).collective_inventory``, i.e. the hand-written
``collective_buffers``), plus the one scalar all-reduce of the MSE loss.
"""

from collections import defaultdict

import pytest

from jphantom import strategies
from jphantom.analysis.inspect import StepSpec, inspect_step
from jphantom.mesh import MeshConfig
from jphantom.models.ffn import FFNConfig
from jphantom.sharding import phantom, tensor

from conftest import require_devices

WIDTH, BATCH, GHOST = 64, 16, 3
F32 = 4


def _buffers(report):
    """kind -> sorted element counts of every result buffer (once per execution), and kind ->
    total bytes over the step."""
    elements, nbytes = defaultdict(list), defaultdict(int)
    for op in report["collective_ops"]:
        for dtype, shape in op["shapes"]:
            assert dtype == "f32", op
            count = 1
            for d in shape:
                count *= d
            elements[op["kind"]] += [count] * op["count"]
        nbytes[op["kind"]] += op["bytes"] * op["count"]
    return {k: sorted(v) for k, v in elements.items()}, dict(nbytes)


def _expected(formula):
    with_loss = {kind: list(sizes) for kind, sizes in formula.items() if sizes}
    with_loss.setdefault("all-reduce", []).append(1)  # the scalar MSE loss (shape [])
    return {k: sorted(v) for k, v in with_loss.items()}


def _assert_exact(report, formula):
    elements, nbytes = _buffers(report)
    want = _expected(formula)
    assert elements == want, f"collective buffers {elements} != formula {want}"
    assert nbytes == {kind: F32 * sum(sizes) for kind, sizes in want.items()}
    summary = {row["kind"]: row["bytes"] for row in report["collectives"]}
    assert summary == nbytes
    assert all(row["axes"] == ["model"] for row in report["collectives"])  # model=p mesh
    assert report["collective_bytes"] == sum(nbytes.values())


def _inventory(name, depth, num_shards, ghost_width=None):
    """What the strategy says its step communicates (the step model asks the same)."""
    config = FFNConfig(width=WIDTH, depth=depth, ghost_width=ghost_width)
    return strategies.get(name).collective_inventory(
        config, MeshConfig.of({"model": num_shards}), BATCH)


@pytest.mark.parametrize("strategy", ["phantom", "phantom-unfused"])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_shards", [2, 8])
def test_phantom_step_moves_only_k_wide_messages(strategy, num_shards, depth):
    """Per layer: one all-gather of B x p x k and one reduce-scatter back to B x k (Table II), and no
    all-reduce except the scalar loss: parameters are never replicated, so no gradient all-reduce."""
    require_devices(num_shards)
    report = inspect_step(StepSpec(strategy, WIDTH, depth, BATCH, num_shards, GHOST))
    formula = phantom.collective_buffers(width=WIDTH, ghost_width=GHOST, num_shards=num_shards,
                                         depth=depth, batch=BATCH)
    assert formula["all-gather"] == [BATCH * num_shards * GHOST] * depth
    assert formula["reduce-scatter"] == [BATCH * GHOST] * depth
    assert _inventory(strategy, depth, num_shards, GHOST) == formula
    _assert_exact(report, formula)


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_shards", [2, 8])
def test_tensor_t1_step_collectives(num_shards, depth):
    """T1: all-gather of the n/p-wide activations into B x n per layer, reduce-scatter of B x n down
    to B x n/p per layer except the input layer (its only output would be dL/dx)."""
    require_devices(num_shards)
    report = inspect_step(StepSpec("tensor-t1", WIDTH, depth, BATCH, num_shards))
    formula = tensor.collective_buffers(width=WIDTH, num_shards=num_shards, depth=depth,
                                        batch=BATCH, layout="t1")
    assert formula == {"all-gather": [BATCH * WIDTH] * depth,
                       "reduce-scatter": [BATCH * WIDTH // num_shards] * (depth - 1)}
    assert _inventory("tensor-t1", depth, num_shards) == formula
    _assert_exact(report, formula)


@pytest.mark.parametrize("depth, gathers, all_reduces", [(1, 1, 0), (2, 2, 1), (3, 1, 2), (4, 2, 3)])
@pytest.mark.parametrize("num_shards", [2, 8])
def test_tensor_megatron_step_collectives(num_shards, depth, gathers, all_reduces):
    """tensor (Megatron): entry all-gather, one g all-reduce per pair forward, one f all-reduce per
    column layer but the first backward, and the exit scatter's all-gather backward when the depth
    is even."""
    require_devices(num_shards)
    report = inspect_step(StepSpec("tensor", WIDTH, depth, BATCH, num_shards))
    formula = tensor.collective_buffers(width=WIDTH, num_shards=num_shards, depth=depth,
                                        batch=BATCH, layout="megatron")
    assert formula == {"all-gather": [BATCH * WIDTH] * gathers,
                       "all-reduce": [BATCH * WIDTH] * all_reduces}
    assert _inventory("tensor", depth, num_shards) == formula
    _assert_exact(report, formula)


def test_phantom_bytes_are_k_over_block_of_t1_per_collective():
    """Seed 000 Eq. 9: per collective, phantom moves k/(n/p) of T1's bytes."""
    require_devices(8)
    p, depth = 8, 2
    ph = inspect_step(StepSpec("phantom", WIDTH, depth, BATCH, p, GHOST))
    t1 = inspect_step(StepSpec("tensor-t1", WIDTH, depth, BATCH, p))
    ratio = GHOST / (WIDTH / p)
    ph_bytes = {r["kind"]: r["bytes"] / r["count"] for r in ph["collectives"]}
    t1_bytes = {r["kind"]: r["bytes"] / r["count"] for r in t1["collectives"]}
    for kind in ("all-gather", "reduce-scatter"):
        assert ph_bytes[kind] == pytest.approx(ratio * t1_bytes[kind])


@pytest.mark.parametrize("text, groups, axes", [
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]], ("data",)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]], ("model",)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", [list(range(8))], ("data", "model")),
])
def test_gspmd_mesh_replica_groups_are_read_as_iota_lists(text, groups, axes):
    """GSPMD prints replica groups as a mesh and the axes the groups run along;
    inspect.normalise_replica_groups turns that into the iota form hlo reads."""
    from jphantom.analysis import hlo
    from jphantom.analysis.inspect import normalise_replica_groups

    iota = normalise_replica_groups(text)
    assert hlo.replica_group_lists(iota, 8) == groups
    assert hlo.group_axes(iota, {"data": 2, "model": 4}) == axes
    assert normalise_replica_groups("{{0,1},{2,3}}") == "{{0,1},{2,3}}"
