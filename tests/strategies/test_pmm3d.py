"""AxoNN's 3D parallel matrix multiply (``pmm3d``, Singh's thesis ch. 5): every (G_x, G_y, G_z, G_data)
grid of 8 devices gives the single-device loss and every gradient, for the FFN and the transformer;
the compiled step moves exactly Eqs. 5.1-5.5's volumes over the axes Algorithm 3 names; the
degenerate grids are FSDP (z) and Megatron (x)."""

import functools
import itertools
import math
from collections import Counter

import jax
import numpy as np
import pytest

from jphantom.registry import program as program_module
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.models.ffn import FFNConfig

from conftest import require_devices
from helpers import (assert_tree_close, batch, compiled_hlo, gradient_step, oracle_loss_and_grads,
                     perturb, random_params)

WIDTH, DEPTH, BATCH = 16, 3, 16


def grids(devices=8):
    """Every ordered (G_x, G_y, G_z, G_data) with product ``devices``: 20 for 8."""
    out = []
    powers = [d for d in range(1, devices + 1) if devices % d == 0]
    for gx, gy, gz in itertools.product(powers, repeat=3):
        if devices % (gx * gy * gz) == 0:
            out.append((gx, gy, gz, devices // (gx * gy * gz)))
    return out


def mesh_text(grid):
    gx, gy, gz, gd = grid
    return f"data={gd},z={gz},y={gy},x={gx}"


def output_axis(depth):
    """The axis splitting the FFN's output features: x after a normal last layer (odd depth)."""
    return "x" if depth % 2 else "y"


def test_there_are_twenty_grids_of_eight_devices():
    assert len(grids(8)) == 20 and len(grids(16)) == 35


@functools.lru_cache(maxsize=None)
def _ffn_inputs(depth=DEPTH):
    program = program_module.build(FFNConfig(WIDTH, depth), "pmm3d", "x=1")
    params = perturb(random_params(program), 0.1)
    x, t = batch(WIDTH, BATCH, dtype=np.float32)
    return params, np.asarray(x), np.asarray(t)


FFN_FAST = {(8, 1, 1, 1), (1, 8, 1, 1), (1, 1, 8, 1), (1, 1, 1, 8), (2, 2, 2, 1), (2, 1, 2, 2),
            (1, 2, 2, 2), (4, 2, 1, 1)}


@pytest.mark.parametrize("grid", [g if g in FFN_FAST else pytest.param(g, marks=pytest.mark.slow)
                                  for g in grids(8)], ids=mesh_text)
@pytest.mark.slow_cells(  # make test: x alone, z x y x x, and data x z x x
    "data=1,z=1,y=2,x=4", "data=1,z=1,y=8,x=1", "data=2,z=2,y=2,x=1", "data=8,z=1,y=1,x=1",
    "data=1,z=8,y=1,x=1")
def test_pmm3d_ffn_equals_the_dense_ffn_on_every_grid(grid):
    """Loss and every gradient of the training step (all reductions included) equal the dense
    FFN's on one device (float64 oracle, float32 1e-5), depth 3: a (normal, transposed) pair and
    a lone normal layer."""
    require_devices(8)
    params, x, t = _ffn_inputs()
    _, _, step, value_and_grad = gradient_step("pmm3d", FFNConfig(WIDTH, DEPTH), mesh_text(grid))
    loss, grads = value_and_grad(params, x, t)
    want_loss, want_grads = oracle_loss_and_grads(step, params, x, t)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert_tree_close(grads, want_grads, 1e-5)


def expected_ffn_collectives(grid, n, rows, depth) -> Counter:
    """Per-device result elements of one FFN training step, by (kind, mesh axes), from Algorithm
    3 and Eqs. 5.1-5.5 (layer l normal for even l, transposed for odd; m = rows per data group):
    per layer, all-gather over z of the block n^2/(G_o G_c) (5.1), all-reduce over the
    contraction axis of m n/(G_z G_o) (5.3), all-reduce over the output axis of the input gradient
    m n/(G_z G_c) (5.4; not for layer 0, whose input needs no gradient), reduce-scatter over z to
    n^2/(G_x G_y G_z) (5.2), all-reduce over data of that (5.5); plus each bias (n/G_o) summed
    once over the batch axes it is replicated on, data and z (tokens), in one all-reduce (the
    program step of earlier releases summed it over z, then over data: the same elements, one
    collective more), and the loss. Groups of one rank move nothing and are left out."""
    gx, gy, gz, gd = grid
    size = {"x": gx, "y": gy, "z": gz, "data": gd}
    m = rows // gd
    found = Counter()

    def add(kind, axis, elements):
        if size[axis] > 1:
            found[kind, (axis,)] += elements

    for layer in range(depth):
        contract, out = ("y", "x") if layer % 2 == 0 else ("x", "y")
        gc, go = size[contract], size[out]
        add("all-gather", "z", n * n // (gc * go))
        add("all-reduce", contract, m * n // (gz * go))
        if layer:
            add("all-reduce", out, m * n // (gz * gc))
        add("reduce-scatter", "z", n * n // (gx * gy * gz))
        add("all-reduce", "data", n * n // (gx * gy * gz))
        bias_axes = tuple(a for a in ("data", "z") if size[a] > 1)
        if bias_axes:
            found["all-reduce", bias_axes] += n // go
    loss_axes = tuple(a for a in ("data", "z", "y", "x")
                      if a in ("data", "z", output_axis(depth)) and size[a] > 1)
    if loss_axes:
        found["all-reduce", loss_axes] += 1
    return found


@pytest.mark.parametrize("grid", grids(8), ids=mesh_text)
# make test: each axis alone (data, z, y, x at 8), all three at 2, and data beside y and x
@pytest.mark.slow_cells(
    "data=4,z=1,y=1,x=2", "data=1,z=4,y=1,x=2", "data=1,z=2,y=1,x=4", "data=2,z=4,y=1,x=1",
    "data=2,z=1,y=4,x=1", "data=4,z=2,y=1,x=1", "data=4,z=1,y=2,x=1", "data=2,z=2,y=2,x=1",
    "data=1,z=4,y=2,x=1", "data=1,z=2,y=4,x=1", "data=2,z=2,y=1,x=2", "data=1,z=1,y=4,x=2",
    "data=2,z=1,y=1,x=4", "data=1,z=1,y=2,x=4")
def test_pmm3d_ffn_step_moves_exactly_eqs_5_1_to_5_5(grid):
    """The compiled training step's collectives (trip counts applied), by kind and mesh axes,
    equal Algorithm 3's per layer, element for element, on every grid of 8 devices."""
    require_devices(8)
    _, mesh, step, _ = gradient_step("pmm3d", FFNConfig(WIDTH, DEPTH), mesh_text(grid))
    text = compiled_hlo(step, ((BATCH, WIDTH), np.float32), ((BATCH, WIDTH), np.float32))
    found = Counter()
    for op in collectives(text):
        axes = op.mesh_axes(dict(mesh.shape))
        if axes:  # a group of one rank moves nothing
            found[op.kind, axes] += op.elements * op.count
    assert found == expected_ffn_collectives(grid, WIDTH, BATCH, DEPTH)


VOCAB, SEQ, HIDDEN, HEADS, LAYERS, TOKENS_BATCH = 32, 8, 16, 8, 2, 8


def _gpt(**kw):
    from jphantom.models.gpt2 import TransformerConfig

    return TransformerConfig(**{**dict(vocab_size=VOCAB, seq_len=SEQ, hidden=HIDDEN, heads=HEADS,
                                       layers=LAYERS), **kw})


@functools.lru_cache(maxsize=None)
def _gpt_inputs():
    program = program_module.build(_gpt(), "pmm3d", "x=1")
    params = random_params(program)
    block = params["blocks"]["block"]
    for norm in (block["ln_1"], block["ln_2"], params["ln_f"]):
        norm["scale"] = 1.0 + norm["scale"]
    keys = jax.random.split(jax.random.PRNGKey(1))
    tokens = np.asarray(jax.random.randint(keys[0], (TOKENS_BATCH, SEQ), 0, VOCAB))
    targets = np.asarray(jax.random.randint(keys[1], (TOKENS_BATCH, SEQ), 0, VOCAB))
    return params, tokens, targets


def _check_gpt(strategy, grid):
    require_devices(8)
    params, tokens, targets = _gpt_inputs()
    _, _, step, value_and_grad = gradient_step(strategy, _gpt(), mesh_text(grid))
    loss, grads = value_and_grad(params, tokens, targets)
    want_loss, want_grads = oracle_loss_and_grads(step, params, tokens, targets)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    # the key bias's gradient is zero in exact arithmetic (softmax ignores a constant added to
    # every key's score): its leaf is compared against 1e-2, the others relative to themselves
    assert_tree_close(grads, want_grads, 1e-5, floor=1e-2)


FAST_GRIDS = [(2, 1, 2, 2)]


@pytest.mark.parametrize("grid", FAST_GRIDS, ids=mesh_text)
def test_pmm3d_transformer_equals_the_dense_transformer(grid):
    """The GPT (LayerNorm over y-split features, attention on x-split heads, vocabulary-parallel
    embedding and tied head): loss and every gradient equal the single-device model, float32
    1e-5, on two grids here and on all twenty with the slow test below."""
    _check_gpt("pmm3d", grid)


@pytest.mark.slow  # the other 18 grids: ~1.5 min
@pytest.mark.parametrize("grid", [g for g in grids(8) if g not in FAST_GRIDS], ids=mesh_text)
def test_pmm3d_transformer_equals_the_dense_transformer_on_every_grid(grid):
    _check_gpt("pmm3d", grid)


def _pattern(strategy, mesh_text, zero=0):
    """(kind, elements) -> executions of the compiled FFN step's collectives (depth 2)."""
    require_devices(8)
    _, mesh, step, _ = gradient_step(strategy, FFNConfig(WIDTH, 2), mesh_text, zero=zero)
    text = compiled_hlo(step, ((BATCH, WIDTH), np.float32), ((BATCH, WIDTH), np.float32))
    found = Counter()
    for op in collectives(text):
        if op.mesh_axes(dict(mesh.shape)):
            found[op.kind, op.elements] += op.count
    return found


def test_degenerate_grids_are_fsdp_and_megatron():
    """z alone is FSDP / ZeRO-3: per layer an all-gather of the whole weight before use, again
    for the backward (pmm3d-regather; the first layer's serves only the data's gradient, which is
    not needed) and a reduce-scatter of its gradient. jphantom's ZeRO-3 on data=8 does the same
    with the (column, row) pair's parameters as one flat buffer (FSDP's flat parameter, biases
    included, where pmm3d all-reduces them): one all-gather of the pair forward, one of what its
    backward reads (both weights, and the column bias its recomputation needs; in one buffer the
    first weight cannot be left out), one reduce-scatter of the pair's gradient. x alone is
    Megatron: one all-reduce of m n per (column, row) pair, as strategy 'tensor' (whose FFN also
    gathers its feature-sharded input and output)."""
    require_devices(8)
    block = WIDTH * WIDTH
    fsdp = _pattern("pmm3d-regather", "z=8")
    zero3 = _pattern("tensor", "data=8,model=1", zero=3)
    weights = {("all-gather", block): 3, ("reduce-scatter", block // 8): 2}
    assert {k: v for k, v in fsdp.items() if k in weights} == weights
    pair = 2 * block + 2 * WIDTH
    assert {k: v for k, v in zero3.items() if k[0] != "all-reduce"} == {
        ("all-gather", pair): 1, ("all-gather", pair - WIDTH): 1,
        ("reduce-scatter", pair // 8): 1}
    megatron, tensor = _pattern("pmm3d", "x=8"), _pattern("tensor", "model=8")
    assert megatron == {("all-reduce", BATCH * WIDTH): 1}
    assert tensor[("all-reduce", BATCH * WIDTH)] == 1


@pytest.mark.parametrize("strategy, mesh, kw, message", [
    ("pmm3d", "x=3,y=1", {}, "width=16 is not divisible by x x z = 3"),
    ("pmm3d", "model=2", {}, "runs on mesh axes"),
    ("pmm3d", "stage=2,x=2", {}, "pipeline stages"),
    ("pmm3d", "data=2,x=2", {"zero": 1}, "pmm3d"),
    ("pmm3d-deferred", "data=2,x=2", {"zero": 3}, "pmm3d-deferred already shards"),
])
def test_pmm3d_programs_that_cannot_run_are_config_errors(strategy, mesh, kw, message):
    import optax

    with pytest.raises(ConfigError, match=message):
        program = program_module.build(FFNConfig(WIDTH, DEPTH), strategy, mesh)
        program.train_step(program.mesh.build(jax.devices()[:program.mesh.device_count]),
                           optax.sgd(0.1), **kw)


@pytest.mark.parametrize("strategy", [
    "pmm3d-regather", "pmm3d-deferred"])
@pytest.mark.slow_cells("pmm3d-regather")  # make test: deferred (the same layer's other option)
def test_pmm3d_variants_equal_the_dense_ffn_and_move_what_they_say(strategy):
    """``pmm3d-regather`` all-gathers each weight again in the backward (AxoNN's default: one more
    all-gather per layer); ``pmm3d-deferred`` gathers every weight before the layers and
    reduce-scatters once after the backward (the same bytes, one all-gather and one
    reduce-scatter per stack of layers: the normal and the transposed one). Depth 6: the first
    (normal, transposed) pair runs before the scan, the other two pairs inside it."""
    require_devices(8)
    grid, depth = (2, 2, 2, 1), 6
    config = FFNConfig(WIDTH, depth)
    params, x, t = _ffn_inputs(depth)
    _, mesh, step, value_and_grad = gradient_step(strategy, config, mesh_text(grid))
    loss, grads = value_and_grad(params, x, t)
    want_loss, want_grads = oracle_loss_and_grads(step, params, x, t)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert_tree_close(grads, want_grads, 1e-5)
    text = compiled_hlo(step, ((BATCH, WIDTH), np.float32), ((BATCH, WIDTH), np.float32))
    ops = [op for op in collectives(text)
           if op.mesh_axes(dict(mesh.shape)) == ("z",) and op.kind != "all-reduce"]
    gathered = sum(op.elements * op.count for op in ops if op.kind == "all-gather")
    scattered = sum(op.elements * op.count for op in ops if op.kind == "reduce-scatter")
    block = WIDTH * WIDTH // 4  # n^2 / (G_x G_y)
    if strategy == "pmm3d-regather":
        # forward: 6 layers; backward: every layer but the first gathered again (the first's
        # W serves only the gradient of the data, which is not needed)
        assert gathered == (2 * depth - 1) * block
    else:
        assert sum(op.count for op in ops if op.kind == "all-gather") == 2  # one per stack
        assert sum(op.count for op in ops if op.kind == "reduce-scatter") == 2
        assert gathered == depth * block
    assert scattered == depth * block // 2


@pytest.mark.parametrize("strategy", [pytest.param("pmm3d-regather", marks=pytest.mark.slow),
                                      pytest.param("pmm3d-deferred", marks=pytest.mark.slow)])
def test_pmm3d_variants_run_the_transformer(strategy):
    """The variants are options of the pmm3d linear layer, so any model runs them: the GPT's
    linears regathering or deferring their weights equal the single-device model."""
    _check_gpt(strategy, (2, 2, 2, 1))


def _moe_gpt():
    return _gpt(moe_every=1, experts=4, capacity_factor=4.0)


@functools.lru_cache(maxsize=None)
def _moe_inputs():
    params = random_params(program_module.build(_moe_gpt(), "pmm3d", "x=1"))
    _, tokens, targets = _gpt_inputs()
    return params, tokens, targets


@pytest.mark.parametrize("mesh", [
    "expert=2,x=2,y=2",
    pytest.param("z=2,y=2,x=2", marks=pytest.mark.slow),
    pytest.param("data=2,expert=2,y=2", marks=pytest.mark.slow)])
@pytest.mark.slow_cells("expert=2,x=2,y=2")
def test_pmm3d_moe_equals_one_device_and_gathers_its_tokens_over_y(mesh):
    """GPT-2's routed MoE blocks under pmm3d (:class:`jphantom.nn.pmm3d.Pmm3dMoE`): loss and every
    gradient equal one device; the only all-gathers over ``y`` are the MoE inputs' features (one
    of B S h / (G_data G_expert G_z) elements per MoE layer forward) and every MoE layer moves
    2 dispatch + 2 combine all-to-alls of E C h over ``expert`` (forward and backward), with
    C = min(ceil(c T k / E), T) on the rank's T = B S / (G_data G_expert G_z) tokens
    (:meth:`~jphantom.nn.routing.MoEConfig.capacity`: an expert takes a token at most once, so
    here, c = 4, k = 2, E = 4, C = min(2T, T) = T and nothing is dropped)."""
    require_devices(8)
    params, tokens, targets = _moe_inputs()
    _, mesh_obj, step, value_and_grad = gradient_step("pmm3d", _moe_gpt(), mesh)
    loss, grads = value_and_grad(params, tokens, targets)
    want_loss, want_grads = oracle_loss_and_grads(step, params, tokens, targets)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert_tree_close(grads, want_grads, 1e-5, floor=1e-2)
    shape = dict(mesh_obj.shape)
    # the program just run (the same compilation: jit caches it)
    text = value_and_grad.lower(params, tokens, targets).compile().as_text()
    found = Counter()
    for op in collectives(text):
        axes = op.mesh_axes(shape)
        if (op.kind, axes) in (("all-gather", ("y",)), ("all-to-all", ("expert",))):
            found[op.kind, axes, op.elements] += op.count
    rows = TOKENS_BATCH // (shape.get("data", 1) * shape.get("expert", 1) * shape.get("z", 1))
    want = Counter()
    if shape.get("y", 1) > 1:
        want["all-gather", ("y",), rows * SEQ * HIDDEN] = LAYERS
    if shape.get("expert", 1) > 1:
        count = rows * SEQ  # T, this rank's tokens (the gather over y is of features)
        capacity = min(math.ceil(4.0 * count * 2 / 4), count)  # min(ceil(c T k / E), T)
        want["all-to-all", ("expert",), 4 * capacity * HIDDEN] = 4 * LAYERS
    assert found == want
