"""AxoNN's placement-aware communication model (Singh's thesis ch. 5, Eqs. 5.1-5.7) and ``jphantom plan``.

Pure arithmetic: nothing is compiled. Expected seconds are computed by hand from the equations as
the paper writes them, not through the module under test."""

import json
import math

import pytest

from jphantom import cli
from jphantom.errors import ConfigError
from jphantom.perf import axonn_model as ax
from jphantom.perf.axonn_model import GB, Grid, LayerShape, Topology
from jphantom.pipeline.schedule import lockstep
from jphantom.planner import LAYOUTS, plan

from helpers import exit_code


def _one_line_error(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.startswith("jphantom: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err


# --------------------------------------------------------------------------------------------------
# Topology and Eq. 5.7
# --------------------------------------------------------------------------------------------------


def test_perlmutter_preset_is_four_gpus_and_four_nics_of_25_gbps():
    perlmutter = Topology.perlmutter()
    assert perlmutter.gpus_per_node == 4
    assert perlmutter.inter_node_gbps == 100.0  # 4 Slingshot-11 NICs x 25 GB/s
    assert perlmutter.intra_node(1, 4) == 300 * GB and perlmutter.intra_node(1, 2) == 100 * GB
    assert perlmutter.intra_node(2, 2) == 100 * GB
    assert all(g0 * g1 <= 4 for g0, g1 in perlmutter.table)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"gpus_per_node": 0, "inter_node_gbps": 100}, "gpus_per_node=0"),
    ({"gpus_per_node": 2.5, "inter_node_gbps": 100}, "gpus_per_node=2.5"),
    ({"gpus_per_node": True, "inter_node_gbps": 100}, "gpus_per_node=True"),
    ({"gpus_per_node": 4, "inter_node_gbps": -1}, "inter_node_gbps=-1"),
    ({"gpus_per_node": 4, "inter_node_gbps": math.inf}, "inter_node_gbps=inf"),
    ({"gpus_per_node": 4, "inter_node_gbps": 100, "intra_node_gbps": 0}, "intra_node_gbps=0"),
    ({"gpus_per_node": 4, "inter_node_gbps": 100, "latency_us": -5}, "latency_us=-5"),
    ({"gpus_per_node": 4, "inter_node_gbps": 100, "intra_node_table": {(2, 4): 300}},
     "G0 x G1 = 8 > gpus_per_node=4"),
    ({"gpus_per_node": 4, "inter_node_gbps": 100, "intra_node_table": {(1, 2): 0}},
     "intra_node_table[(1, 2)]=0"),
    ({"gpus_per_node": 4, "inter_node_gbps": 100, "intra_node_table": {4: 1}}, "((G0, G1), GB/s)"),
])
def test_topology_names_the_bad_value_and_the_fix(kwargs, fragment):
    with pytest.raises(ConfigError) as error:
        Topology(**kwargs)
    assert fragment in str(error.value)


def test_fig_5_3_one_ring_of_8_gets_beta_inter_two_rings_of_4_get_half():
    two_nodes_of_4 = Topology(gpus_per_node=4, inter_node_gbps=100)
    # (left) one ring over GPUs 0..7 on 2 nodes: nothing inside it, β = β_inter
    assert ax.axis_bandwidths(Grid(8, 1, 1, 1), two_nodes_of_4)["x"] == 100 * GB
    # (right) rings (0, 2, 4, 6) and (1, 3, 5, 7): G_x = 2 inside them, β = β_inter / 2
    assert ax.axis_bandwidths(Grid(2, 4, 1, 1), two_nodes_of_4)["y"] == 50 * GB
    assert ax.placement_bandwidth(two_nodes_of_4, inner=2, size=4) == 50 * GB


def test_eq_5_7_divisor_is_capped_at_gpus_per_node():
    node_of_4 = Topology(gpus_per_node=4, inter_node_gbps=100)
    # Y groups of 2 whose members are 8 apart: 8 concurrent rings, but a node has only 4 GPUs
    assert ax.axis_bandwidths(Grid(8, 2, 1, 1), node_of_4)["y"] == 100 * GB / 4
    assert ax.axis_bandwidths(Grid(2, 2, 4, 1), node_of_4)["z"] == 100 * GB / 4
    assert ax.axis_bandwidths(Grid(2, 2, 2, 8), node_of_4)["data"] == 100 * GB / 4
    assert ax.placement_bandwidth(node_of_4, inner=64, size=2) == 100 * GB / 4


def test_case_1_uses_the_database_entry_else_the_default():
    node = Topology(gpus_per_node=8, inter_node_gbps=100, intra_node_gbps=200,
                    intra_node_table={(1, 4): 400, (4, 2): 150})
    bandwidth = ax.axis_bandwidths(Grid(4, 2, 1, 1), node)
    assert bandwidth["x"] == 400 * GB  # key (1, 4)
    assert bandwidth["y"] == 150 * GB  # key (4, 2): 4 concurrent pairs inside the node
    assert ax.axis_bandwidths(Grid(2, 4, 1, 1), node)["y"] == 200 * GB  # (2, 4) missing: default
    assert ax.axis_bandwidths(Grid(2, 4, 1, 1), node)["z"] == math.inf  # G_z = 1: no collective


# --------------------------------------------------------------------------------------------------
# Eqs. 5.1-5.6
# --------------------------------------------------------------------------------------------------


def test_hand_computed_8_gpus_2x2x2x2_one_layer():
    # 2 nodes of 4 GPUs, flat 200 GB/s inside a node, β_inter = 100 GB/s
    topology = Topology(gpus_per_node=4, inter_node_gbps=100, intra_node_gbps=200, latency_us=5)
    grid = Grid(2, 2, 2, 2)
    m, k, n, bf16 = 1024, 256, 512, 2
    # Eq. 5.7: X (0,1): inside, (1, 2) -> 200; Y (0,2): inside, (2, 2) -> 200;
    # Z (0,4): spans, 100 / min(4, 4) = 25; data (0,8): spans, 100 / min(4, 8) = 25 GB/s
    beta_x, beta_y, beta_z, beta_data = 200e9, 200e9, 25e9, 25e9
    assert ax.axis_bandwidths(grid, topology) == {"x": beta_x, "y": beta_y, "z": beta_z,
                                                  "data": beta_data}
    t_ag_z = 1 / beta_z * (2 - 1) * k * n / (2 * 2 * 2) * bf16  # (5.1): 16384 elements
    t_rs_z = 1 / beta_z * (2 - 1) / 2 * k * n / (2 * 2) * bf16  # (5.2): 16384
    t_ar_y = 2 / beta_y * (2 - 1) / 2 * m * n / (2 * 2) * bf16  # (5.3): 131072
    t_ar_x = 2 / beta_x * (2 - 1) / 2 * m * k / (2 * 2) * bf16  # (5.4): 65536
    t_ar_d = 2 / beta_data * (2 - 1) / 2 * k * n / (2 * 2 * 2) * bf16  # (5.5): 16384
    assert (t_ag_z, t_rs_z, t_ar_y, t_ar_x, t_ar_d) == pytest.approx(
        (1.31072e-6, 1.31072e-6, 1.31072e-6, 6.5536e-7, 1.31072e-6))
    paper = ax.layer_seconds(LayerShape(m, k, n), grid, topology, bytes_per_element=2,
                             latency=False)
    assert paper["5.1"] == pytest.approx(t_ag_z) and paper["5.2"] == pytest.approx(t_rs_z)
    assert paper["5.3"] == pytest.approx(t_ar_y) and paper["5.4"] == pytest.approx(t_ar_x)
    assert paper["5.5"] == pytest.approx(t_ar_d)
    assert paper["total"] == pytest.approx(5.89824e-6)  # (5.6)
    # with α = 5 μs per ring step: AG 1 + RS 1 + three all-reduces of 2 (2 - 1) = 8 steps
    with_latency = ax.layer_seconds(LayerShape(m, k, n), grid, topology, bytes_per_element=2)
    assert with_latency["total"] == pytest.approx(5.89824e-6 + 8 * 5e-6)
    # two identical layers cost twice one (Σ over layers)
    two = ax.predict([LayerShape(m, k, n)] * 2, grid, topology, bytes_per_element=2, latency=False)
    assert two["total"] == pytest.approx(2 * 5.89824e-6)
    assert two["by_axis"]["z"] == pytest.approx(2 * (t_ag_z + t_rs_z))


def test_volumes_are_eqs_5_1_to_5_5_and_buffers_are_the_hlo_result_buffers():
    grid, (m, k, n) = Grid(4, 2, 8, 2), (4096, 1024, 3072)
    ag, rs, ar_fwd, ar_bwd, ar_data = ax.layer_collectives(LayerShape(m, k, n), grid)
    assert ag.wire == pytest.approx(ax.all_gather_z(k, n, grid)) == 7 * k * n / 64
    assert rs.wire == pytest.approx(ax.reduce_scatter_z(k, n, grid))
    assert ar_fwd.wire == pytest.approx(ax.all_reduce_y(m, n, grid))
    assert ar_bwd.wire == pytest.approx(ax.all_reduce_x(m, k, grid))
    assert ar_data.wire == pytest.approx(ax.all_reduce_data(k, n, grid))
    assert ax.all_gather_z(k, n, grid) == pytest.approx(ax.reduce_scatter_z(k, n, grid))
    # per-GPU result buffers (Singh's thesis §1.3's table): what the compiled HLO reports
    assert (ag.kind, ag.axis, ag.group, ag.buffer) == ("all-gather", "z", 8, k * n / (4 * 2))
    assert (rs.kind, rs.axis, rs.group, rs.buffer) == ("reduce-scatter", "z", 8, k * n / 64)
    assert (ar_fwd.axis, ar_fwd.group, ar_fwd.buffer) == ("y", 2, m * n / (8 * 4))
    assert (ar_bwd.axis, ar_bwd.group, ar_bwd.buffer) == ("x", 4, m * k / (8 * 2))
    assert (ar_data.axis, ar_data.group, ar_data.buffer) == ("data", 2, k * n / 64)


def test_transposed_layer_swaps_g_x_g_y_and_beta_x_beta_y():
    node = Topology(gpus_per_node=8, inter_node_gbps=100, intra_node_gbps=200,
                    intra_node_table={(1, 4): 400, (4, 2): 100})
    grid, (m, k, n) = Grid(4, 2, 1, 1), (64, 32, 48)  # β_x = 400, β_y = 100 GB/s
    normal = ax.layer_seconds(LayerShape(m, k, n), grid, node, bytes_per_element=1, latency=False)
    assert normal["5.3"] == pytest.approx(2 * (1 / 2) * m * n / (1 * 4) / 100e9)  # over Y
    assert normal["5.4"] == pytest.approx(2 * (3 / 4) * m * k / (1 * 2) / 400e9)  # over X
    swapped = ax.layer_seconds(LayerShape(m, k, n, transposed=True), grid, node,
                               bytes_per_element=1, latency=False)
    # G_x <-> G_y: the forward all-reduce runs over the X groups (4 ranks, β_x), O split (Z, Y)
    assert swapped["5.3"] == pytest.approx(2 * (3 / 4) * m * n / (1 * 2) / 400e9)
    assert swapped["5.4"] == pytest.approx(2 * (1 / 2) * m * k / (1 * 4) / 100e9)
    assert normal["5.1"] == swapped["5.1"] == 0.0  # G_z = 1


def test_zero_cost_when_a_g_is_one_even_with_latency():
    topology = Topology.perlmutter()
    only_y = ax.layer_seconds(LayerShape(512, 256, 256), Grid(1, 8, 1, 1), topology)
    assert only_y["5.1"] == only_y["5.2"] == only_y["5.4"] == only_y["5.5"] == 0.0
    assert only_y["5.3"] > 0
    one_gpu = ax.predict(ax.gpt_layers(ax.GPT_20B, 2048), Grid(1, 1, 1, 1), topology)
    assert one_gpu["total"] == 0.0
    assert all(c.wire == 0 and c.steps == 0 for c in ax.layer_collectives(
        LayerShape(512, 256, 256), Grid(1, 1, 1, 1)))


def test_gpt_layer_list_follows_section_1_4_and_sums_over_blocks():
    layers = ax.gpt_layers(ax.GPT_20B, 4096)
    h = 7168
    assert len(layers) == 4 * 32
    assert [(l.k, l.n, l.transposed) for l in layers[:4]] == [
        (h, 3 * h, False), (h, h, True), (h, 4 * h, False), (4 * h, h, True)]
    assert {l.m for l in layers} == {4096}
    assert ax.gpt_layers(ax.GPT_20B, 4096, lm_head=True)[-1] == LayerShape(4096, h, 51200, False,
                                                                      "lm_head")
    topology, grid = Topology.perlmutter(), Grid(4, 2, 2, 2)
    one_block = ax.predict(layers[:4], grid, topology)["total"]
    assert ax.predict(layers, grid, topology)["total"] == pytest.approx(32 * one_block)


def test_paper_model_on_gpt_20b_matches_the_equations_written_out():
    """Σ of Eq. 5.6 over GPT-20B's 128 layers on one grid, every term from the paper's text."""
    topology = Topology.perlmutter()
    gx, gy, gz, gd = 4, 2, 2, 2  # 32 GPUs: X inside a node, Y, Z, data across nodes
    beta = {"x": 300e9, "y": 100e9 / 4, "z": 100e9 / 4, "data": 100e9 / 4}
    m = 64 * 2048 // gd  # batch 64 sequences of 2048 tokens, per data group
    h, total = 7168, 0.0
    for k, n, transposed in [(h, 3 * h, False), (h, h, True), (h, 4 * h, False),
                             (4 * h, h, True)]:
        x, y, bx, by = (gy, gx, beta["y"], beta["x"]) if transposed else (gx, gy, beta["x"],
                                                                           beta["y"])
        total += 2 * ((gz - 1) * k * n / (x * y * gz) / beta["z"]  # (5.1)
                      + (gz - 1) / gz * k * n / (x * y) / beta["z"]  # (5.2)
                      + 2 / by * (y - 1) / y * m * n / (gz * x)  # (5.3)
                      + 2 / bx * (x - 1) / x * m * k / (gz * y)  # (5.4)
                      + 2 / beta["data"] * (gd - 1) / gd * k * n / (x * y * gz))  # (5.5)
    assert ax.axis_bandwidths(Grid(gx, gy, gz, gd), topology) == beta
    predicted = ax.predict(ax.gpt_layers(ax.GPT_20B, m), Grid(gx, gy, gz, gd), topology,
                           bytes_per_element=2, latency=False)["total"]
    assert predicted == pytest.approx(32 * total)


# --------------------------------------------------------------------------------------------------
# Enumeration and filters
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("devices, count", [(1, 1), (8, 20), (16, 35), (32, 56), (64, 84),
                                            (12, 40)])
def test_configurations_are_every_ordered_factorisation(devices, count):
    grids = ax.configurations(devices)
    assert len(grids) == count == len(set(grids))
    assert all(g.devices == devices for g in grids)


def test_divisibility_and_memory_filters():
    shape = ax.GPT_20B  # 56 heads: G_x must divide 56
    problems = ax.grid_problems(Grid(16, 1, 2, 1), shape, batch=64)
    assert any("heads=56 not divisible by G_x=16" in p for p in problems)
    assert any("batch=3" in p for p in ax.grid_problems(Grid(1, 1, 2, 2), shape, batch=3))
    admissible = ax.configurations(32, shape, batch=64)
    assert Grid(16, 2, 1, 1) not in admissible and Grid(8, 4, 1, 1) in admissible
    fitting = ax.configurations(32, shape, batch=64, memory_gib=40)
    assert set(fitting) < set(admissible)
    assert Grid(1, 1, 1, 32) not in fitting  # 20B parameters x 16 bytes replicated
    assert Grid(1, 1, 32, 1) in fitting  # FSDP: 1/32 of the state
    memory = ax.pmm3d_memory(Grid(1, 1, 32, 1), shape, 64)
    assert memory["state"] == pytest.approx(
        16 * ((32 * 12 * 7168**2 + 51200 * 7168) / 32
              + shape.param_count() - 32 * 12 * 7168**2 - 51200 * 7168))
    assert all(memory["total"] >= value for value in memory.values())
    with pytest.raises(ConfigError, match="devices=0"):
        ax.configurations(0)


def test_rank_puts_the_cheapest_grid_first_and_latency_off_is_the_papers_model():
    ranked = ax.rank(ax.GPT_20B, 32, Topology.perlmutter(), batch=64, latency=False)
    seconds = [s for _, s in ranked]
    assert seconds == sorted(seconds) and len(ranked) == len(ax.configurations(
        32, ax.GPT_20B, batch=64, lm_head=False))
    grid, best = ranked[0]
    layers = ax.gpt_layers(ax.GPT_20B, 64 * 2048 // grid.data)
    assert best == ax.predict(layers, grid, Topology.perlmutter(), latency=False)["total"]
    with_latency = dict(ax.rank(ax.GPT_20B, 32, Topology.perlmutter(), batch=64))
    assert all(with_latency[g] >= s for g, s in ranked)


# --------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------

SMALL = ax.GPTShape(layers=2, hidden=64, heads=4, seq_len=16, vocab_size=256)


def test_plan_prices_tensor_with_the_registry_inventory():
    flat = Topology(gpus_per_node=4, inter_node_gbps=10, intra_node_gbps=200, latency_us=0)
    result = plan(SMALL, 8, flat, batch=8, latency=False)
    row = next(r for r in result if r.layout == "tensor" and r.mesh == "data=2,model=4")
    tokens = 4 * 16  # 4 sequences per data rank
    # Megatron: (4 L + 2) all-reduces of [tokens, h] and 3 of [tokens] (cross-entropy), over model=4
    # inside a node (200 GB/s), ring volume 2 (p-1)/p x buffer, 2 bytes per element
    elements = (4 * 2 + 2) * tokens * 64 + 3 * tokens
    assert row.comm_by_axis["model"] == pytest.approx(2 * 3 / 4 * elements * 2 / 200e9)
    # data=2 across nodes (ranks 4 apart): β_inter / min(4, 4); the rank's parameters once
    params = (2 * (12 * 64 * 64 + 7 * 64) + 256 * 64) / 4 + (
        SMALL.param_count() - 2 * (12 * 64 * 64 + 7 * 64) - 256 * 64)
    assert row.comm_by_axis["data"] == pytest.approx(2 * 1 / 2 * params * 2 / (10e9 / 4))
    assert row.flops_per_device == SMALL.flops_per_step(8) / 8


def test_plan_covers_every_layout_and_ranks_fitting_rows_by_comm_plus_bubble():
    result = plan(ax.GPT_20B, 32, batch=64, memory_gib=40)
    assert {r.layout for r in result} == set(LAYOUTS)
    assert [r.rank for r in result] == list(range(1, len(result) + 1))
    fitting = [r for r in result if r.fits]
    assert result.rows[:len(fitting)] == tuple(fitting)
    keys = [r.key_s for r in fitting]
    assert keys == sorted(keys)
    assert result.top.same_model and result.top.fits and result.top.layout != "phantom"
    assert all(r.memory_gib <= 40 for r in fitting)
    assert sum(r.layout == "pmm3d" for r in result) == len(ax.configurations(
        32, ax.GPT_20B, batch=64))
    assert all("PP" not in r.layout for r in result)  # PP means pipeline, never phantom
    pipelines = {r.options["schedule"]: r for r in result if r.mesh == "data=2,stage=16"}
    M = 64 // 2
    assert pipelines["1f1b"].options == {"schedule": "1f1b", "microbatches": M}
    compute = ax.GPT_20B.flops_per_step(64) / 32 / 280e12
    assert pipelines["1f1b"].bubble_s == pytest.approx(compute * (16 - 1) / M)
    # the zero-bubble rows: the idle time of their lock-step tables (t_b = 2 t_f, B = W)
    for name in ("zb-h1", "zb-v"):
        idle = lockstep(name, 16, M).cost() - 3 * M
        assert pipelines[name].bubble_s == pytest.approx(compute * idle / (3 * M))
    assert pipelines["zb-v"].bubble_s < pipelines["zb-h1"].bubble_s < pipelines["1f1b"].bubble_s
    no_limit = plan(ax.GPT_20B, 32, batch=64)
    assert all(r.fits is None for r in no_limit)


def test_zero_3_regathers_so_it_moves_about_one_and_a_half_times_fsdp_pmm3d():
    result = plan(ax.GPT_20B, 32, batch=64, latency=False)
    fsdp = next(r for r in result if r.mesh == "data=1,z=32,y=1,x=1")
    zero3 = next(r for r in result if r.layout == "zero-3")
    assert fsdp.variant == "FSDP" and zero3.options == {"zero": 3}
    # pmm3d (Eqs. 5.1, 5.2): AG + RS of the matmul weights W, same ring volume (31/32) and β;
    # ZeRO-3 (jphantom/step/zero.py): each block gathered twice (forward, remat backward), the rest
    # (embeddings, final norm) once, every gradient reduce-scattered once; pmm3d's position
    # table [S, h] is replicated, its gradient all-reduced over z (an RS + AG's volume)
    h = 7168
    weights, everything = 32 * 12 * h**2 + 51200 * h, ax.GPT_20B.param_count()
    rest = everything - 32 * (12 * h**2 + 13 * h)
    assert zero3.comm_s / fsdp.comm_s == pytest.approx((3 * everything - rest)
                                                       / (2 * weights + 2 * 2048 * h))


def test_plan_refuses_bad_inputs_by_name():
    for kwargs, fragment in (({"devices": 0}, "devices=0"), ({"devices": 8, "batch": 0}, "batch=0"),
                             ({"devices": 8, "memory_gib": -1}, "memory_gib=-1"),
                             ({"devices": 8, "precision": "fp8"}, "precision='fp8'"),
                             ({"devices": 8, "layouts": ("PP",)}, "layouts=['PP']")):
        kwargs.setdefault("batch", 8)
        with pytest.raises(ConfigError) as error:
            plan(SMALL, **kwargs)
        assert fragment in str(error.value)
    with pytest.raises(ConfigError, match="GPTShape"):
        plan("gpt", 8, batch=8)


# --------------------------------------------------------------------------------------------------
# jphantom plan
# --------------------------------------------------------------------------------------------------

GPT_20B_FLAGS = ["--layers", "32", "--hidden", "7168", "--heads", "56", "--seq-len", "2048"]
GPT_40B_FLAGS = ["--layers", "38", "--hidden", "9216", "--heads", "72", "--seq-len", "2048"]


@pytest.mark.parametrize("flags, devices", [(GPT_20B_FLAGS, "32"), (GPT_40B_FLAGS, "64")])
def test_cli_prints_a_ranking_and_a_top_choice_on_perlmutter(capsys, flags, devices):
    argv = ["plan", "--model", "transformer", *flags, "--batch", "512", "--devices", devices,
            "--gpus-per-node", "4", "--inter-node-gbps", "100", "--memory-gib", "40"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("rank"))
    assert "comm s" in lines[header] and "mem GiB" in lines[header] and "fits" in lines[header]
    ranks = [int(line.split()[0]) for line in lines[header + 1:header + 11]]
    assert ranks == list(range(1, 11))
    assert "beta_inter 100 GB/s" in out and f"{devices} GPUs" in out
    top = next(line for line in lines if line.startswith("Top choice"))
    assert "Top choice: rank 1, " in top and " on data=" in top and "GiB per GPU" in top


def test_cli_json_parses_and_carries_the_assumptions(capsys):
    assert cli.main(["plan", *GPT_20B_FLAGS, "--devices", "32", "--batch", "64", "--memory-gib",
                     "40", "--top", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["rows"]) == 5 and result["rows"][0]["rank"] == 1
    assert result["assumptions"]["topology"]["inter_node_gbps"] == 100
    assert result["assumptions"]["batch_sequences"] == 64
    assert result["top_choice"]["same_model"] and result["top_choice"]["fits"]
    assert {"strategy", "mesh", "comm_s", "flops_per_device", "memory_gib", "fits"} <= set(
        result["rows"][0])


@pytest.mark.parametrize("argv, fragment", [
    (["--devices", "0"], "--devices 0 must be >= 1"),
    (["--devices", "abc"], "--devices 'abc' is not a whole number"),
    (["--memory-gib", "-1"], "--memory-gib -1"),
    (["--inter-node-gbps", "0"], "--inter-node-gbps 0"),
    (["--precision", "fp8"], "precision='fp8'"),
    (["--model", "ffn"], "--model ffn: the planner prices dense decoder blocks"),
    (["--model", "qwen4"], "model='qwen4' is not a model family"),
    (["--heads", "5"], "hidden=7168 is not divisible by heads=5"),
    (["--devices", "1000000000000000000"], "devices=1000000000000000000 exceeds the planner's"),
])
def test_cli_bad_value_is_one_line_and_exit_2(capsys, argv, fragment):
    assert exit_code(["plan", *argv]) == 2
    _one_line_error(capsys, fragment)


def test_cli_says_how_the_gpus_sit_on_nodes(capsys):
    for devices, says in (("1", "1 GPU of one 4-GPU node."), ("8", "8 GPUs = 2 node(s) x 4.")):
        assert cli.main(["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len",
                         "16", "--vocab", "256", "--batch", "8", "--devices", devices]) == 0
        assert says in capsys.readouterr().out.splitlines()[0]


def test_pmm3d_prices_the_position_table_gradient():
    """GPT-2's learned positions [S, h/G_y] are all-reduced over data x z: the bytes grow with S
    where the blocks' collectives do not (no x, y split)."""
    def fsdp(seq_len):
        rows = plan(ax.GPTShape(layers=2, hidden=64, heads=4, seq_len=seq_len, vocab_size=256),
                    4, batch=4, layouts=("pmm3d",), latency=False)
        return next(r for r in rows if r.mesh == "data=1,z=4,y=1,x=1")
    short, long = fsdp(16), fsdp(4096)
    assert short.bytes_by_axis["z"] == long.bytes_by_axis["z"]  # the blocks' collectives
    for seq_len, row in ((16, short), (4096, long)):  # [S, h] result, 2-byte messages
        assert row.bytes_by_axis["data+z"] == seq_len * 64 * 2 and row.comm_by_axis["data+z"] > 0


def test_cli_help_has_an_example(capsys):
    assert exit_code(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Examples: jphantom plan" in out and "--inter-node-gbps" in out


def test_pipeline_messages_use_one_pair_link_inside_a_node_and_eq_5_7_across():
    perlmutter = Topology.perlmutter()
    assert ax.point_to_point_bandwidth(perlmutter, inner=1, size=4) == 100 * GB  # a pair's NVLink
    assert ax.point_to_point_bandwidth(perlmutter, inner=1, size=8) == 100 * GB  # β_inter
    assert ax.point_to_point_bandwidth(perlmutter, inner=2, size=4) == 100 * GB / 2
    result = plan(ax.GPT_20B, 32, batch=64, latency=False)
    rows = {r.options["schedule"]: r for r in result if r.mesh == "data=8,stage=4"}
    messages = 2 * (64 // 8) * 2048 * 7168  # M forward + M backward messages of [S, h]
    assert rows["1f1b"].comm_by_axis["stage"] == pytest.approx(messages * 2 / 100e9)
    assert rows["zb-h1"].comm_by_axis["stage"] == pytest.approx(messages * 2 / 100e9)
    # zb-v: each device holds two chunks, whose boundaries both send (V placement)
    assert rows["zb-v"].comm_by_axis["stage"] == pytest.approx(2 * messages * 2 / 100e9)


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_plan_work_is_bounded_in_the_depth():
    """A million layers price like one block counted a million times: the pmm3d rows' modelled
    communication scales exactly with L, and the search finishes (it once built every layer)."""
    from jphantom.perf.axonn_model import GPTShape
    from jphantom.planner import plan

    def pmm3d_comm(layers):
        shape = GPTShape(layers=layers, hidden=1024, heads=16, seq_len=128, vocab_size=1024)
        result = plan(shape, 8, batch=64, layouts=("pmm3d",))
        return {row.mesh: row.comm_s for row in result.rows}

    one, many = pmm3d_comm(2), pmm3d_comm(1_000_000)
    assert one.keys() == many.keys() and one
    for mesh in one:  # comm(L) = L * block + head: linear in L
        assert many[mesh] > 1e5 * one[mesh] / 2


def test_llama_shape_counts_jphantoms_llama_and_prices_its_layouts():
    """The planner's Llama (GQA, SwiGLU, untied head) has the parameters of jphantom's Llama, its
    QKV width is h + 2 h kv/a, and its plan has no phantom rows (GPT-2 blocks only)."""
    from jphantom.registry import program
    from jphantom.runtime.mesh import MeshConfig
    from jphantom.models.llama import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden=64, intermediate=160, layers=3, heads=8,
                         kv_heads=2, max_positions=32)
    shape = ax.GPTShape.of(config)
    assert shape.family == "llama" and shape.linears()[0][2] == 64 + 2 * 64 * 2 // 8
    built = program.build(config, "tensor", MeshConfig.parse("model=1"))
    assert shape.param_count() == built.param_count
    result = plan(shape, 8, batch=16)
    assert {row.layout for row in result} >= {"pmm3d", "tensor", "zero-3"}
    assert not any(row.layout == "phantom" for row in result)
    with pytest.raises(ConfigError, match="kv_heads=3"):
        ax.GPTShape(layers=2, hidden=64, heads=8, family="llama", kv_heads=3)


def test_as_compiled_adds_what_jphantoms_step_moves():
    """``as_compiled``: float32 gradient reductions (2x the data bytes under bf16), the pmm3d
    weight re-gathered over z (Eq. 5.1 twice), the recomputed forward collectives."""
    shape = ax.GPTShape(layers=2, hidden=64, heads=4, seq_len=32, vocab_size=256)
    papers = {(r.layout, r.mesh): r for r in plan(shape, 8, batch=16, latency=False)}
    compiled = {(r.layout, r.mesh): r for r in plan(shape, 8, batch=16, latency=False,
                                                     as_compiled=True)}
    data = ("data", "data=8,model=1")
    assert compiled[data].bytes_by_axis["data"] == 2 * papers[data].bytes_by_axis["data"]
    fsdp = ("pmm3d", "data=1,z=8,y=1,x=1")
    assert compiled[fsdp].bytes_by_axis["z"] > 1.8 * papers[fsdp].bytes_by_axis["z"]
    tp = ("tensor", "data=2,model=4")
    assert compiled[tp].bytes_by_axis["model"] > papers[tp].bytes_by_axis["model"]


def test_a_context_only_layout_prices_its_gradient_all_reduce():
    """data=1,context=C: the gradients are all-reduced over the C context ranks (they saw
    different tokens); the planner used to price that at 0 s (data's level has no link), so with a
    large vocabulary such a layout ranked first."""
    from jphantom.planner import plan
    from jphantom.perf.axonn_model import GPTShape

    result = plan(GPTShape(layers=2, hidden=256, heads=4, seq_len=1024, vocab_size=65536), 8,
                  batch=8, layouts=("context",))
    row = next(r for r in result.rows if r.mesh == "data=1,context=8,model=1")
    assert row.comm_by_axis["data+context"] > 0 and row.bytes_by_axis["data+context"] > 0


# --------------------------------------------------------------------------------------------------
# --cluster: Frontier's and an MI300X platform's nodes
# --------------------------------------------------------------------------------------------------

SMALL_FLAGS = ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "16", "--vocab",
               "256", "--batch", "16"]


def test_frontier_and_mi300x_presets_load_with_every_number_cited():
    from jphantom.planner import clusters
    from jphantom.predict.device import SOURCES

    frontier = clusters.get("frontier")
    assert (frontier.gpus_per_node, frontier.gpus_per_package) == (8, 2)
    assert frontier["in_package_gbps"] == 200 and frontier["between_packages_gbps"] == 50
    assert (frontier["nics_per_node"], frontier["nic_gbps"]) == (4, 25)
    assert frontier.device == "mi250x-gcd"
    for cluster in clusters.CLUSTERS.values():
        for key, number in cluster.numbers.items():
            assert number.source in SOURCES and len(number.cite) > 10, (cluster.name, key)
    net = frontier.topology()
    assert net.inter_node_gbps == 100 and net.gpus_per_node == 8
    assert net.intra_node(1, 2) == 200 * GB  # a GCD pair in one MI250X
    assert net.intra_node(2, 2) == 50 * GB and net.intra_node(1, 8) == 50 * GB  # across packages
    assert ax.placement_bandwidth(net, 8, 4) == 100 * GB / 8  # 8 GCDs share the node's 4 NICs
    mi300x = clusters.get("mi300x").topology()  # fully connected: a 64 GB/s link to each peer
    assert mi300x.intra_node(1, 8) == 448 * GB and mi300x.intra_node(4, 2) == 64 * GB
    assert mi300x.inter_node_gbps == 400
    assert clusters.get("perlmutter").topology() == Topology.perlmutter()


def test_a_2_wide_inner_axis_sits_inside_a_package_on_frontier():
    from types import SimpleNamespace

    from jphantom.runtime.mesh import MeshConfig, axis_domains, node_split
    from jphantom.planner import clusters

    domains = clusters.get("frontier").domains
    assert domains == (("package", 2), ("node", 8))
    config = MeshConfig.parse("data=8,model=2")
    assert axis_domains(config, domains) == {"model": "package", "data": "across nodes"}
    assert axis_domains(MeshConfig.parse("data=2,z=4,x=2"), domains) == {
        "x": "package", "z": "node", "data": "across nodes"}
    assert axis_domains(MeshConfig.parse("data=4,model=4"), domains)["model"] == "node"
    assert axis_domains(MeshConfig.parse("model=3,data=2"), domains) == {
        "data": "across nodes", "model": "across nodes"}  # 3 GCDs fill no package or node
    # node_split, which builds the mesh, fills a node innermost first: the 2-wide model axis
    # takes adjacent GCDs, the 2 of one MI250X
    devices = [SimpleNamespace(id=i, process_index=i // 8) for i in range(16)]
    assert node_split(config, devices) == ({"model": 2, "data": 4}, {"model": 1, "data": 2})


def test_plan_cluster_frontier_ranks_on_its_nodes(capsys):
    assert cli.main(["plan", *SMALL_FLAGS, "--devices", "16", "--cluster", "frontier"]) == 0
    out = capsys.readouterr().out
    assert "16 GPUs = 2 node(s) x 8." in out.splitlines()[0]
    assert "Network (frontier): beta_inter 100 GB/s" in out and "(1,2) 200, else 50" in out
    assert "fit in 59.6046 GiB" in out  # the GCD's 64 GB
    assert "Top choice: rank" in out
    assert cli.main(["plan", *SMALL_FLAGS, "--devices", "16"]) == 0  # the default is unchanged
    default = capsys.readouterr().out
    assert "Network (perlmutter)" in default and "16 GPUs = 4 node(s) x 4." in default


def test_a_named_device_s_memory_is_the_plan_s_memory_limit(capsys):
    """plan --objective time --device h100-sxm said "no memory limit" and chose data=32 at
    327 GiB per GPU on an 80 GB card; now the device's HBM is the limit unless --memory-gib
    says otherwise, also over a cluster whose own GPU is another."""
    h100 = "fit in 74.5058 GiB (h100-sxm's 80 GB of HBM, from its description)"
    for extra in ([], ["--cluster", "perlmutter"]):
        assert cli.main(["plan", "--objective", "time", "--device", "h100-sxm", *extra]) == 0
        out = capsys.readouterr().out
        assert h100 in out and "no memory limit" not in out
        top = next(line for line in out.splitlines() if line.startswith("Top choice"))
        assert float(top.split(" GiB per GPU")[0].rsplit(", ", 1)[1]) <= 74.5058, top
    assert cli.main(["plan", "--objective", "time", "--device", "h100-sxm",
                     "--memory-gib", "40"]) == 0
    assert "fit in 40 GiB." in capsys.readouterr().out
    assert cli.main(["plan", "--cluster", "perlmutter"]) == 0
    assert "fit in 40 GiB (perlmutter: the node's figure)" in capsys.readouterr().out


def test_plan_refuses_an_unknown_cluster_naming_the_choices(capsys):
    assert exit_code(["plan", "--cluster", "nonsense"]) == 2
    _one_line_error(capsys, "--cluster 'nonsense'", "perlmutter, frontier, mi300x")


def test_accumulation_names_the_layouts_it_leaves_out():
    """A probe's finding: plan --accumulate 3 on a batch of 512 priced 14 of 86 layouts without a
    word; the header names the rule that left the others out."""
    from jphantom.planner.report import format_plan

    text = format_plan(plan(ax.GPT_20B, 32, batch=512, accumulate=3), top=1)
    assert ("3 accumulation micro-batches (a layout whose batch per data rank is no multiple of 3 "
            "is left out)") in text.splitlines()[0]


def test_a_reader_that_leaves_early_gets_no_traceback():
    """``jphantom plan ... | head -0``: the reader closes the pipe before the plan is printed;
    the command ends quietly with a shell's SIGPIPE code (141), no BrokenPipeError traceback."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "jphantom", "plan", "--device", "h100-sxm"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        process.stdout.close()  # long before the plan's first line (imports alone take longer)
        error = process.stderr.read().decode()
        assert process.wait(timeout=120) == 141
    assert "Traceback" not in error and "BrokenPipe" not in error, error
