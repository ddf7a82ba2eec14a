"""Collectives and GEMMs inside loops count once per trip: ``lax.scan`` lowers to an HLO ``while``
whose body runs trip-count times (nested loops multiply), and ``hlo.collectives`` / ``hlo.dot_flops``
multiply accordingly. Also: replica groups mapped onto mesh axes (``group_axes``, ``summarize``).

XLA may unroll short loops; when a ``while`` survives in the compiled text (it does for these
lengths on CPU) the per-instruction counts are checked, and the step totals are checked either way.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jphantom.analysis import hlo

from conftest import require_devices

AXES = {"data": 2, "model": 4}
BLOCK = (4, 4)  # per-device block of an (8, 16) array sharded P("data", "model")
BLOCK_BYTES = 4 * 4 * 4  # f32


def _mesh():
    require_devices(8)
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _compiled_text(body) -> str:
    mesh = _mesh()
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "model"),
                              out_specs=P("data", "model")))
    return f.lower(jnp.ones((8, 16), jnp.float32)).compile().as_text()


def _psum_in_and_after_scan(x):
    def step(c, _):
        return c + jnp.sin(lax.psum(c, "model")), None

    y, _ = lax.scan(step, x, None, length=5)
    return lax.psum(y, "model")


def _nested_scans(x):
    def inner(c, _):
        return c + jnp.sin(lax.psum(c, "model")), None

    def outer(c, _):
        return lax.scan(inner, c, None, length=4)[0], None

    return lax.scan(outer, x, None, length=3)[0]


def _gather_in_scan_psum_after(x):
    def step(c, _):
        gathered = lax.all_gather(c, "model", axis=1, tiled=True)  # (4, 16) per device
        return c + jnp.sin(gathered[:, :4]), None

    y, _ = lax.scan(step, x, None, length=6)
    return y + lax.psum(y, "data")


def test_psum_inside_scan_counts_trip_count_times():
    text = _compiled_text(_psum_in_and_after_scan)
    found = hlo.collectives(text)
    assert {c.kind for c in found} == {"all-reduce"}
    assert all(c.shapes == (("f32", BLOCK),) and c.bytes == BLOCK_BYTES for c in found)
    assert all(c.total_bytes == c.bytes * c.count for c in found)
    assert sum(c.count for c in found) == 6
    assert hlo.summarize(found) == [{"kind": "all-reduce", "count": 6, "bytes": 6 * BLOCK_BYTES}]
    if "while(" in text:
        assert sorted(c.count for c in found) == [1, 5]
        in_loop = next(c for c in found if c.count == 5)
        after = next(c for c in found if c.count == 1)
        assert in_loop.computation != after.computation
        assert re.search(rf"ENTRY %?{re.escape(after.computation)}\b", text)


def test_nested_scans_multiply_trip_counts():
    text = _compiled_text(_nested_scans)
    found = hlo.collectives(text)
    assert sum(c.count for c in found) == 3 * 4
    assert sum(c.total_bytes for c in found) == 12 * BLOCK_BYTES
    if text.count("while(") == 2:
        assert [c.count for c in found] == [12]


def test_trip_count_from_condition_without_backend_config():
    """With the backend_config gone, the trip counts come from the loop conditions (i < N inside a
    fusion on CPU); a condition that is no compare against a constant raises, never counts once."""
    text = _compiled_text(_nested_scans)
    if text.count("while(") != 2:
        pytest.skip("XLA unrolled the loops")
    bare = re.sub(r", backend_config=\{.*\}", "", text)
    assert "known_trip_count" not in bare
    assert [c.count for c in hlo.collectives(bare)] == [12]
    with pytest.raises(ValueError, match="trip count"):
        hlo.collectives(bare.replace("direction=LT", "direction=NE"))


def test_summarize_groups_by_mesh_axes():
    text = _compiled_text(_gather_in_scan_psum_after)
    found = hlo.collectives(text)
    gather_bytes = 4 * 16 * 4  # (4, 16) f32 per device
    assert hlo.summarize(found, axes=AXES) == [
        {"kind": "all-gather", "axes": ("model",), "count": 6, "bytes": 6 * gather_bytes},
        {"kind": "all-reduce", "axes": ("data",), "count": 1, "bytes": BLOCK_BYTES},
    ]
    # Without axes: the old per-kind format, trip counts included.
    assert hlo.summarize(found) == [
        {"kind": "all-gather", "count": 6, "bytes": 6 * gather_bytes},
        {"kind": "all-reduce", "count": 1, "bytes": BLOCK_BYTES},
    ]


def test_collective_permute_axes_from_source_target_pairs():
    def ring(x):
        def step(c, _):
            return 2 * lax.ppermute(c, "model", [(i, (i + 1) % 4) for i in range(4)]), None

        return lax.scan(step, x, None, length=3)[0]

    found = hlo.collectives(_compiled_text(ring))
    assert [c.kind for c in found] == ["collective-permute"]
    assert found[0].source_target_pairs.startswith("{{")
    assert hlo.summarize(found, axes=AXES) == [
        {"kind": "collective-permute", "axes": ("model",), "count": 3, "bytes": 3 * BLOCK_BYTES}
    ]


@pytest.mark.parametrize("groups, axes", [
    ("{{0,1,2,3},{4,5,6,7}}", ("model",)),    # rows of the (2, 4) mesh
    ("{{0,4},{1,5},{2,6},{3,7}}", ("data",)),  # columns
    ("{{0,1},{2,3},{4,5},{6,7}}", ("model",)),  # half rows: still only "model" varies
    ("{{0,5},{1,4}}", ("data", "model")),
    ("{{0},{1},{2},{3},{4},{5},{6},{7}}", ()),
    ("[2,4]<=[8]", ("model",)),                # {0,1,2,3},{4,5,6,7}
    ("[4,2]<=[2,4]T(1,0)", ("data",)),         # {0,4},{1,5},{2,6},{3,7}
    ("[1,8]<=[8]", ("data", "model")),
    ("[2,4]<=[4,2]T(1,0)", ("data", "model")),  # {0,2,4,6},{1,3,5,7}: half of each column
    ("{}", ("data", "model")),                 # all devices in one group
    ("", ("data", "model")),                   # no replica_groups attribute: the same
])
def test_group_axes(groups, axes):
    assert hlo.group_axes(groups, AXES) == axes


def test_group_axes_iota_lists():
    assert hlo.replica_group_lists("[4,2]<=[2,4]T(1,0)", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo.replica_group_lists("[2,4]<=[4,2]T(1,0)", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert hlo.group_axes("[4,2]<=[8]", {"a": 2, "b": 2, "c": 2}) == ("c",)
    assert hlo.group_axes("{}", {"data": 1, "model": 8}) == ("model",)  # size-1 axes never vary


def test_group_axes_rejects_bad_input():
    with pytest.raises(ValueError, match="outside a mesh"):
        hlo.group_axes("{{0,8}}", AXES)
    with pytest.raises(ValueError, match="unrecognised"):
        hlo.group_axes("mesh?", AXES)
    assert hlo.pair_axes("{{0,1},{1,2}}", AXES) == ("model",)
    assert hlo.pair_axes("{{0,4},{5,1}}", AXES) == ("data",)
    assert hlo.pair_axes("{{0,5}}", AXES) == ("data", "model")


def test_dot_flops_of_scanned_matmuls():
    m, k, layers = 8, 16, 7

    def f(x, ws):
        return lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    x = jnp.ones((m, k), jnp.float32)
    ws = jnp.ones((layers, k, k), jnp.float32)
    text = jax.jit(f).lower(x, ws).compile().as_text()
    assert hlo.dot_flops(text) == (layers * 2 * m * k * k, layers)


# A hand-written module: a loop of 10 trips (no backend_config: derived from the condition) whose
# body runs a conditional; one branch all-reduces over "model" (iota groups), the other all-gathers
# over "data" asynchronously (start/done, transposed iota groups). A computation nothing calls holds
# a collective that must not be listed.
SYNTHETIC = """\
HloModule synthetic, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%branch0 (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %ar = f32[8]{0} all-reduce(%p0), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
}

%branch1 (p1: f32[8]) -> f32[8] {
  %p1 = f32[8]{0} parameter(0)
  %half = f32[4]{0} slice(%p1), slice={[0:4]}
  %ag-start = (f32[4]{0}, f32[8]{0}) all-gather-start(%half), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %ag-done = f32[8]{0} all-gather-done(%ag-start)
}

%never (q: f32[8]) -> f32[8] {
  %q = f32[8]{0} parameter(0)
  ROOT %unused = f32[8]{0} all-reduce(%q), channel_id=3, replica_groups={}, to_apply=%add
}

%body (state: (s32[], f32[8])) -> (s32[], f32[8]) {
  %state = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[8]{0} get-tuple-element(%state), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %two = s32[] constant(2)
  %pick = s32[] remainder(%i, %two)
  %y = f32[8]{0} conditional(%pick, %x, %x), branch_computations={%branch0, %branch1}
  ROOT %out = (s32[], f32[8]{0}) tuple(%next, %y)
}

%cond (cstate: (s32[], f32[8])) -> pred[] {
  %cstate = (s32[], f32[8]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%cstate), index=0
  %limit = s32[] constant(10)
  ROOT %lt = pred[] compare(%ci, %limit), direction=LT
}

ENTRY %main (x0: f32[8]) -> f32[8] {
  %x0 = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %x0)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %result = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_synthetic_module_branches_async_and_unreachable():
    comps = hlo.parse_module(SYNTHETIC)
    assert [name for name, c in comps.items() if c.entry] == ["main"]
    assert hlo.multipliers(comps) == {
        "main": 1, "body": 10, "cond": 11, "branch0": 10, "branch1": 10, "add": 10,
    }
    found = hlo.collectives(SYNTHETIC)
    assert [(c.name, c.kind, c.count, c.computation, c.bytes) for c in found] == [
        ("ar", "all-reduce", 10, "branch0", 32),
        ("ag-done", "all-gather", 10, "branch1", 32),
    ]
    assert found[1].replica_groups == "[4,2]<=[2,4]T(1,0)"
    assert hlo.summarize(found, axes=AXES) == [
        {"kind": "all-reduce", "axes": ("model",), "count": 10, "bytes": 320},
        {"kind": "all-gather", "axes": ("data",), "count": 10, "bytes": 320},
    ]


def test_synthetic_known_trip_count_wins_and_unknown_raises():
    with_config = SYNTHETIC.replace(
        "body=%body\n", 'body=%body, backend_config={"known_trip_count":{"n":"3"}}\n')
    assert [c.count for c in hlo.collectives(with_config)] == [3, 3]
    unbounded = SYNTHETIC.replace("compare(%ci, %limit)", "compare(%ci, %ci)")
    with pytest.raises(ValueError, match="%loop"):
        hlo.collectives(unbounded)


def test_a_loop_of_at_most_one_trip_under_a_taken_scope_counts_once():
    """The pipeline executor's head and embedding run in loops of zero or one trips whose bound
    XLA cannot know (:func:`jphantom.pipeline.runner.at_most_once`), named
    ``taken_in_<n>_of_<t>_ticks``: their collectives count once per trip of the loop around
    them, as a conditional's branches do; the same loop without the name still raises."""
    scoped = SYNTHETIC.replace("compare(%ci, %limit)", "compare(%ci, %ci)").replace(
        "body=%body\n", 'body=%body, metadata={op_name="jit(step)/on_head_taken_in_3_of_10_'
        'ticks/while"}\n')
    assert hlo.multipliers(hlo.parse_module(scoped))["body"] == 1
    assert [c.count for c in hlo.collectives(scoped)] == [1, 1]


def test_a_switch_naming_its_branch_ticks_counts_each_branch_that_often():
    """The pipeline executor's switch names how many of its loop's t trips each branch runs
    (``branch_ticks_<n0>_<n1>_of_<t>_ticks``, jphantom.pipeline.copies.branch_ticks): each
    branch's collectives count that many times, and their bytes with them, not once a trip."""
    scoped = SYNTHETIC.replace(
        "branch_computations={%branch0, %branch1}",
        'branch_computations={%branch0, %branch1}, '
        'metadata={op_name="jit(step)/branch_ticks_3_7_of_10_ticks/cond"}')
    assert {k: v for k, v in hlo.multipliers(hlo.parse_module(scoped)).items()
            if k.startswith("branch")} == {"branch0": 3, "branch1": 7}
    assert [(c.name, c.count, c.bytes) for c in hlo.collectives(scoped)] == [
        ("ar", 3, 32), ("ag-done", 7, 32)]


def test_a_bound_hidden_from_xla_is_read_back():
    """The step's accumulation loop hides its bound from XLA behind an optimization barrier
    (:func:`jphantom.step.grads.accumulate`, so that XLA's GPU passes leave it a loop): the loop
    survives, its trip count is the constant it carries, and its collective counts 3 times, also
    with XLA's backend_config removed."""
    from jphantom.step.grads import accumulate

    def body(x):
        micro = [jnp.stack([x, 2 * x, 3 * x])]
        return accumulate(lambda mb: lax.psum(mb[0], "model"), micro, mean=False)

    text = _compiled_text(body)
    assert text.count("while(") == 1
    bare = re.sub(r", backend_config=\{.*\}", "", text)
    for compiled in (text, bare):
        assert hlo.summarize(hlo.collectives(compiled), axes=AXES) == [
            {"kind": "all-reduce", "axes": ("model",), "count": 3, "bytes": 3 * BLOCK_BYTES}]


def test_saved_residuals_are_the_forward_loops_stacks_per_layer_row_and_token():
    """``saved_residuals`` reads what a scanned layer stack keeps for its backward from the
    compiled program: the forward loop's results [L, rows, tokens, ...] (here each layer's
    input and its tanh, float32), not the weights [L, h, h]; and an array holding whole sets of
    them ([slots, L, rows, tokens, ...], a pipeline stash) counts its sets."""
    from jphantom.analysis.hlo.residuals import saved_residuals

    layers, rows, tokens, h = 5, 2, 8, 4

    def loss(w, x):
        def layer(c, wl):
            return jnp.tanh(c @ wl) * c, None

        return jnp.sum(lax.scan(layer, x, w)[0])

    def step(w, x):
        grads = jax.grad(loss)(w, x)
        return grads, jnp.zeros((3, layers, rows, tokens, h), jnp.float32) + x[None, None]

    w = jnp.full((layers, h, h), 0.1, jnp.float32)
    x = jnp.ones((rows, tokens, h), jnp.float32)
    text = jax.jit(step).lower(w, x).compile().as_text()
    found = saved_residuals(text, layers=layers, rows=rows, tokens={tokens})
    assert found["shapes"] and all(s.startswith(f"f32[{layers},{rows},{tokens},")
                                   for s in found["shapes"])
    assert found["bytes"] % (layers * rows * tokens * h * 4) == 0
    assert found["copies"] == 3
    assert saved_residuals(text, layers=layers, rows=rows + 1, tokens={tokens})["bytes"] == 0


def test_saved_residuals_are_a_stash_s_slots_where_no_layer_loop_returns_them():
    """A pipeline whose chunks run their layers unrolled has no layer loop: what it keeps for
    the backward is the tick loop's stash, [slots, L, rows, tokens, ...], one set a slot."""
    from jphantom.analysis.hlo.residuals import saved_residuals

    layers, rows, tokens, h = 2, 2, 8, 4

    def ticks(x):
        def tick(i, stash):
            slot = i % 3
            return lax.dynamic_update_index_in_dim(stash, jnp.tanh(stash[slot] + i), slot, 0)

        stash = jnp.zeros((3, layers, rows, tokens, h), jnp.float32) + x[None, None]
        return lax.fori_loop(0, lax.optimization_barrier(4), tick, stash)

    text = jax.jit(ticks).lower(jnp.ones((rows, tokens, h), jnp.float32)).compile().as_text()
    found = saved_residuals(text, layers=layers, rows=rows, tokens={tokens})
    assert found["shapes"] == [f"f32[{layers},{rows},{tokens},{h}]"], found
    assert found["bytes"] == layers * rows * tokens * h * 4 and found["copies"] == 3


def test_saved_residuals_leave_out_the_token_ids_a_loop_carries():
    """A loop carrying integer arrays shaped like a stack of residuals (a pipeline's targets,
    [micro-batches, rows, tokens], when the micro-batches equal the layers) stores no residual:
    only floating-point arrays are activations."""
    from jphantom.analysis.hlo.residuals import saved_residuals

    layers, rows, tokens = 2, 1, 8

    def loop(ids):
        return lax.fori_loop(0, lax.optimization_barrier(3), lambda i, c: c + 1, ids)

    text = jax.jit(loop).lower(jnp.zeros((layers, rows, tokens), jnp.int32)).compile().as_text()
    assert saved_residuals(text, layers=layers, rows=rows, tokens={tokens})["bytes"] == 0
