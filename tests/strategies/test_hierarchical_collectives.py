"""PCCL's hierarchical collectives (:mod:`jphantom.runtime.collectives`, Singh's thesis ch. 6): bitwise
equal to the flat collectives over (node, local) in value and in gradient, log2(nodes) permutes
across nodes in HLO (forward and backward), the alpha-beta selector on hand-computed cases, named
errors.

Inputs are small integers in float32, so every sum is exact whatever order it is taken in and the
comparisons are exact (``assert_array_equal``), not approximate.
"""

import functools
import importlib.util
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.runtime import collectives as hc

from conftest import require_devices

RANKS = P(("node", "local"))  # rank r = node * local_size + local holds row block r
ROWS, COLS = 8, 16  # per-rank input: a multiple of 8 ranks along both axes (reduce-scatter)
GATHER, SCATTER = "all-gather", "reduce-scatter"
FLAT = {
    GATHER: lambda x, axis: lax.all_gather(x, ("node", "local"), axis=axis, tiled=True),
    SCATTER: lambda x, axis: lax.psum_scatter(x, ("node", "local"), scatter_dimension=axis,
                                              tiled=True),
}
HIERARCHICAL = {
    GATHER: lambda x, axis: hc.hierarchical_all_gather(x, "node", "local", axis=axis),
    SCATTER: lambda x, axis: hc.hierarchical_reduce_scatter(x, "node", "local", axis=axis),
}


@functools.lru_cache(maxsize=None)
def _mesh(nodes, local):
    require_devices(nodes * local)
    return jax.make_mesh((nodes, local), ("node", "local"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[: nodes * local])


@functools.lru_cache(maxsize=None)
def _collective(kind, method, nodes, local, axis, in_spec=RANKS):
    """Jitted global function: every rank's result stacked along dim 0; and its vjp."""
    per_rank = functools.partial((FLAT if method == "flat" else HIERARCHICAL)[kind], axis=axis)
    fn = jax.jit(jax.shard_map(per_rank, mesh=_mesh(nodes, local), in_specs=in_spec,
                               out_specs=RANKS, check_vma=True))
    vjp = jax.jit(lambda x, ct: jax.vjp(fn, x)[1](ct)[0])
    return fn, vjp


def _ints(shape, seed):
    """Small integers as float32: sums of them are exact in any order."""
    return jax.random.randint(jax.random.PRNGKey(seed), shape, -8, 9).astype(jnp.float32)


def _input(nodes, local):
    return _ints((nodes * local * ROWS, COLS), seed=nodes)


def _axes(nodes, local):
    return {"node": nodes, "local": local}


# ------------------------------------------------------------------------------------------------
# Values and gradients.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [GATHER, SCATTER])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
# make test: axis 0, both kinds, on 4 nodes of 2 and (reduce-scatter) 2 nodes of 4
@pytest.mark.slow_cells("2-4-1-all-gather", "2-4-1-reduce-scatter", "2-4-0-all-gather",
                        "4-2-1-all-gather", "4-2-1-reduce-scatter")
def test_hierarchical_equals_flat_in_value_and_gradient(kind, axis, nodes, local):
    """Rank (node, local)'s result is the flat collective's, element for element, with node outer;
    and so is the vjp (the all-gather's is a reduce-scatter and vice versa)."""
    x = _input(nodes, local)
    flat, flat_vjp = _collective(kind, "flat", nodes, local, axis)
    mine, mine_vjp = _collective(kind, "hierarchical", nodes, local, axis)
    want = flat(x)
    np.testing.assert_array_equal(mine(x), want)
    assert len(np.unique(np.asarray(want))) > 8  # not a constant that any order would reproduce
    cotangent = _ints(want.shape, seed=100 + nodes)
    np.testing.assert_array_equal(mine_vjp(x, cotangent), flat_vjp(x, cotangent))


def test_block_order_is_node_outer():
    """The gathered blocks come in rank order node * local_size + local: rank r's rows, filled
    with r, land at block r on every rank (on (2, 4) a local-outer order would differ)."""
    nodes, local = 2, 4
    fn, _ = _collective(GATHER, "hierarchical", nodes, local, 0)
    x = jnp.repeat(jnp.arange(nodes * local, dtype=jnp.float32), 2)[:, None]  # rank r: [[r], [r]]
    out = np.asarray(fn(x)).reshape(nodes * local, nodes * local, 2)  # [rank, block, row]
    np.testing.assert_array_equal(out, np.broadcast_to(np.arange(8.0)[None, :, None], out.shape))


@pytest.mark.parametrize("kind", [GATHER, SCATTER])
@pytest.mark.parametrize("nodes,local", [(8, 1), (1, 8)])
def test_one_level_meshes(kind, nodes, local):
    """Degenerate hierarchies: pure recursive doubling/halving over 8 nodes, or one node (no
    rounds), both equal the flat collective."""
    x = _input(nodes, local)
    np.testing.assert_array_equal(_collective(kind, "hierarchical", nodes, local, 1)[0](x),
                                  _collective(kind, "flat", nodes, local, 1)[0](x))


@pytest.mark.parametrize("kind", [GATHER, SCATTER])
def test_replicated_input_under_check_vma(kind):
    """An input invariant over both axes (in_specs P()) passes check_vma and equals the flat."""
    x = _ints((ROWS, COLS), seed=3)
    np.testing.assert_array_equal(_collective(kind, "hierarchical", 4, 2, 0, P())[0](x),
                                  _collective(kind, "flat", 4, 2, 0, P())[0](x))


# ------------------------------------------------------------------------------------------------
# HLO: the rounds.
# ------------------------------------------------------------------------------------------------


def _hlo(kind, method, nodes, local, backward=False):
    fn, vjp = _collective(kind, method, nodes, local, 0)
    x = _input(nodes, local)
    if backward:  # the forward of a linear map is dead code in its vjp: this is the backward alone
        return collectives(vjp.lower(x, fn(x)).compile().as_text())
    return collectives(fn.lower(x).compile().as_text())


def _ops(found, nodes, local):
    return [(c.kind, c.mesh_axes(_axes(nodes, local)), c.bytes, c.count) for c in found]


@pytest.mark.parametrize("kind,in_node", [(GATHER, "all-gather"), (SCATTER, "reduce-scatter")])
@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2), (8, 1)])
def test_hlo_has_log2_nodes_permutes_across_nodes(kind, in_node, nodes, local):
    """Forward: exactly log2(nodes) collective-permutes, each over the node axis alone (doubling
    for the all-gather, halving for the reduce-scatter), plus one in-node collective over the
    local axis (none when local = 1); nothing over both axes."""
    ops = _ops(_hlo(kind, "hierarchical", nodes, local), nodes, local)
    permutes = [op for op in ops if op[0] == "collective-permute"]
    assert len(permutes) == hc.rounds(kind, nodes, local) == int(math.log2(nodes))
    assert all(axes == ("node",) and count == 1 for _, axes, _, count in permutes), ops
    sizes = [nbytes for _, _, nbytes, _ in permutes]
    block = ROWS * COLS * 4 // (1 if kind == GATHER else nodes * local)  # bytes of a node's block
    if kind == GATHER:  # round s receives 2^s blocks of x
        assert sizes == [block * 2**s for s in range(len(sizes))], ops
    else:  # round s receives half of what is left: nodes/2, nodes/4, ..., 1 blocks
        assert sizes == [block * nodes / 2 ** (s + 1) for s in range(len(sizes))], ops
    others = [(op, axes, count) for op, axes, _, count in ops if op != "collective-permute"]
    assert others == ([(in_node, ("local",), 1)] if local > 1 else []), ops


@pytest.mark.parametrize("kind,transposed", [(GATHER, "reduce-scatter"), (SCATTER, "all-gather")])
@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
def test_backward_is_the_dual_hierarchical_collective(kind, transposed, nodes, local):
    """The vjp of recursive doubling is recursive halving and vice versa: log2(nodes) permutes
    over the node axis, and the in-node collective is the transposed one, over local."""
    ops = _ops(_hlo(kind, "hierarchical", nodes, local, backward=True), nodes, local)
    permutes = [op for op in ops if op[0] == "collective-permute"]
    assert len(permutes) == int(math.log2(nodes))
    assert all(axes == ("node",) for _, axes, _, _ in permutes), ops
    assert [op[:2] for op in ops if op[0] != "collective-permute"] == [(transposed, ("local",))]
    # The forward's messages, in reverse: halving from N/2 blocks of x for the all-gather's
    # backward, doubling from one block of the result for the reduce-scatter's.
    block = ROWS * COLS * 4 // (1 if kind == GATHER else nodes * local)
    assert sorted(nbytes for _, _, nbytes, _ in permutes) == [block * 2**s for s in
                                                              range(len(permutes))], ops


@pytest.mark.parametrize("kind", [GATHER, SCATTER])
def test_flat_is_one_collective_over_both_axes(kind):
    ops = _ops(_hlo(kind, "flat", 4, 2), 4, 2)
    assert [op[:2] for op in ops] == [(kind, ("node", "local"))], ops


# ------------------------------------------------------------------------------------------------
# The selector and the front-ends.
# ------------------------------------------------------------------------------------------------

# alpha 10 μs, 100 GB/s between nodes (1e5 B/μs), 50 GB/s inside one (5e4 B/μs).
LINKS = dict(alpha_us=10.0, beta_inter=100.0, beta_intra=50.0)
MiB = 2**20


@pytest.mark.parametrize("kind", [GATHER, SCATTER])
def test_cost_model_by_hand(kind):
    """N = 2 nodes of M = 4, n = 1 MiB:
    flat = 7 alpha + 7/8 n / 5e4 = 70 + 18.350 us;
    hierarchical = 3 alpha + 3/4 n / 5e4 + 1 alpha + 1/2 (n/4) / (1e5/4) = 40 + 15.729 + 5.243 us."""
    n = MiB
    assert hc.cost_us(kind, "flat", n, 2, 4, **LINKS) == pytest.approx(70 + 7 / 8 * n / 5e4)
    assert hc.cost_us(kind, "hierarchical", n, 2, 4, **LINKS) == pytest.approx(
        40 + 3 / 4 * n / 5e4 + 1 / 2 * n / 1e5)
    # One node: the hierarchical algorithm is the flat ring; a tie goes to "flat".
    assert hc.cost_us(kind, "flat", n, 1, 8, **LINKS) == hc.cost_us(kind, "hierarchical", n, 1, 8,
                                                                      **LINKS)


@pytest.mark.parametrize("kind", [GATHER, SCATTER])
@pytest.mark.parametrize("nbytes,nodes,local,want", [
    # 2 x 4: flat - hier = 30 us - 2.5e-6 us/B * n, crossover at n = 12 MB.
    (1 * MiB, 2, 4, "hierarchical"),  # 88.35 vs 60.97 us
    (64 * MiB, 2, 4, "flat"),  # 1244.4 vs 1382.2 us
    (11_000_000, 2, 4, "hierarchical"),
    (13_000_000, 2, 4, "flat"),
    # Many nodes, small message: 511 alpha of a flat ring against 3 + 6.
    (1 * MiB, 64, 8, "hierarchical"),  # 5130.9 vs 158.7 us
    # Few nodes, huge message: flat - hier = 70 us - 3.75e-6 us/B * n, crossover 18.7 MB.
    (2**30, 2, 8, "flat"),
    # Nothing to gain inside one node (tie) or with no rounds defined (3 nodes).
    (1 * MiB, 1, 8, "flat"),
    (1 * MiB, 3, 4, "flat"),
])
def test_choose_by_hand(kind, nbytes, nodes, local, want):
    assert hc.choose(kind, nbytes, nodes, local, **LINKS) == want


def test_choose_reproduces_the_docstring_crossovers():
    """Default constants: 4 nodes of 8 go flat above ~39 MB, 256 nodes of 8 below ~2.7 GB stay
    hierarchical (the module docstring's numbers)."""
    assert hc.choose(GATHER, 38e6, 4, 8) == "hierarchical"
    assert hc.choose(GATHER, 40e6, 4, 8) == "flat"
    assert hc.choose(GATHER, 2.6e9, 256, 8) == "hierarchical"
    assert hc.choose(GATHER, 2.8e9, 256, 8) == "flat"


def test_rounds():
    assert [hc.rounds(GATHER, n, 4) for n in (1, 2, 4, 8, 1024)] == [0, 1, 2, 3, 10]
    assert hc.rounds(SCATTER, 8, 1) == 3


@functools.lru_cache(maxsize=None)
def _front_end(kind, nodes, local, **model):
    op = hc.all_gather if kind == GATHER else hc.reduce_scatter
    per_rank = lambda x: op(x, "node", "local", 0, "auto", **model)
    return jax.jit(jax.shard_map(per_rank, mesh=_mesh(nodes, local), in_specs=RANKS,
                                 out_specs=RANKS, check_vma=True))


@pytest.mark.parametrize("kind", [GATHER, SCATTER])
def test_auto_front_end_follows_the_model(kind):
    """Tiny message on 2 x 4: the default constants pick hierarchical (1 permute in HLO); with no
    latency (alpha = 0) only the bandwidth counts and the flat collective wins. Same values."""
    x = _input(2, 4)
    want = _collective(kind, "flat", 2, 4, 0)[0](x)
    for model, permutes in (({}, 1), ({"alpha_us": 0.0}, 0)):
        fn = _front_end(kind, 2, 4, **model)
        ops = _ops(collectives(fn.lower(x).compile().as_text()), 2, 4)
        assert sum(op[0] == "collective-permute" for op in ops) == permutes, (model, ops)
        np.testing.assert_array_equal(fn(x), want)


def test_auto_falls_back_to_flat_for_three_nodes():
    x = _input(3, 2)
    fn = _front_end(GATHER, 3, 2)
    ops = _ops(collectives(fn.lower(x).compile().as_text()), 3, 2)
    assert [op[:2] for op in ops] == [(GATHER, ("node", "local"))], ops
    np.testing.assert_array_equal(fn(x), _collective(GATHER, "flat", 3, 2, 0)[0](x))


# ------------------------------------------------------------------------------------------------
# Errors.
# ------------------------------------------------------------------------------------------------


def _trace(per_rank, nodes=2, local=4, shape=(16, 16)):
    fn = jax.shard_map(per_rank, mesh=_mesh(nodes, local), in_specs=RANKS, out_specs=RANKS,
                       check_vma=True)
    return jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, jnp.float32))


@pytest.mark.parametrize("per_rank,match", [
    (lambda x: hc.hierarchical_all_gather(x, "node", "node"), "both 'node'"),
    (lambda x: hc.hierarchical_all_gather(x, "node", "nodes"), "unbound axis name"),
    (lambda x: hc.hierarchical_all_gather(x, "node", "local", axis=2), "axis=2"),
    (lambda x: hc.hierarchical_reduce_scatter(x, "node", "local", axis=0), "multiple of"),
    (lambda x: hc.flat_reduce_scatter(x, "node", "local", axis=0), "multiple of"),
    (lambda x: hc.all_gather(x, "node", "local", method="ring"), "method='ring'"),
])
def test_bad_calls_are_config_errors(per_rank, match):
    with pytest.raises(ConfigError, match=match):
        _trace(per_rank)  # per rank [2, 16]: 2 rows cannot be scattered over 8 ranks


def test_three_nodes_refuse_recursive_doubling():
    with pytest.raises(ConfigError, match="power of two"):
        _trace(lambda x: hc.hierarchical_all_gather(x, "node", "local"), nodes=3, local=2,
               shape=(12, 4))
    with pytest.raises(ConfigError, match="power of two"):
        hc.rounds(SCATTER, 6, 1)


@pytest.mark.parametrize("call", [
    lambda: hc.choose("all-reduce", 1024, 2, 4),
    lambda: hc.choose(GATHER, -1, 2, 4),
    lambda: hc.choose(GATHER, float("nan"), 2, 4),
    lambda: hc.choose(GATHER, 1024, 0, 4),
    lambda: hc.choose(GATHER, 1024, 2, 2.5),
    lambda: hc.choose(GATHER, 1024, 2, 4, alpha_us=-1.0),
    lambda: hc.choose(GATHER, 1024, 2, 4, beta_inter=0.0),
    lambda: hc.choose(GATHER, 1024, 2, 4, beta_intra=True),
    lambda: hc.cost_us(GATHER, "ring", 1024, 2, 4),
    lambda: hc.cost_us(GATHER, "hierarchical", 1024, 3, 4),
    lambda: hc.rounds(GATHER, 4, 0),
])
def test_bad_model_inputs_are_config_errors(call):
    with pytest.raises(ConfigError):
        call()


# ------------------------------------------------------------------------------------------------
# experiments/hierarchical_collectives.py --quick.
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_experiment_quick_run(tmp_path):
    """The script's round table matches rounds() and the ring's p-1; every cell timed and checked
    (the script raises on a wrong result); the no-network caveat is in the JSON. No timing is
    asserted: simulated devices have no network."""
    require_devices(4)
    script = Path(__file__).resolve().parents[2] / "experiments" / "hierarchical_collectives.py"
    spec = importlib.util.spec_from_file_location("experiment_hierarchical_collectives", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--quick", "--out", str(tmp_path)])

    results = json.loads((tmp_path / "results.json").read_text())
    assert (tmp_path / "hierarchical_collectives.png").stat().st_size > 0
    assert "no network" in results["note"]
    for row in results["rounds"]:
        for kind in (GATHER, SCATTER):
            counts = row[kind]
            assert counts["permutes_over_node"] == counts["rounds()"] == row["log2_nodes"]
            assert counts["permutes_other"] == 0
            assert counts["ring_permutes_p_equals_nodes"] == row["nodes"] - 1
    cells = results["cells"]
    assert {(c["kind"], c["p"], c["nbytes"]) for c in cells} == {
        (k, p, n) for k in (GATHER, SCATTER) for p in (2, 4) for n in (2**10, 2**14)}
    for c in cells:
        assert all(len(t) == 3 and min(t) > 0 for t in c["times_us"].values()), c
        assert c["model_choice"] == ("flat" if c["p"] == 2 else "hierarchical")  # ties go flat
