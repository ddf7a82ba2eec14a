"""``master_weights="sharded"``: Megatron's distributed optimizer (bf16 parameters and gradients,
float32 master weights and Adam moments in ZeRO-1's shards over ``data``) trains as the float32
master bf16 step on one device does, within bf16's rounding; moves one bf16 all-gather of the
parameters and one bf16 reduce-scatter of the gradients over ``data``; and its checkpoints are
the plain step's."""

import dataclasses
import functools
import json

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from jphantom.registry import program as program_module
from jphantom.analysis import hlo
from jphantom.loop.checkpointer import Checkpointer
from jphantom.errors import ConfigError
from jphantom.models.ffn import FFNConfig
from jphantom.pipeline.config import PipelineConfig

from conftest import require_devices
from helpers import (abstract_state, assert_tree_close, compiled_hlo, gradient_step,
                     random_params)

WIDTH, DEPTH, BATCH = 16, 4, 16
BF16 = 2.0 ** -8  # bf16's unit roundoff
CONFIG = FFNConfig(WIDTH, DEPTH, None, "float32")


def _step(mesh_text, optimizer=None, **options):
    program = program_module.build(CONFIG, "tensor", mesh_text)
    require_devices(program.mesh.device_count)
    mesh = program.mesh.build(jax.devices()[:program.mesh.device_count])
    return program, program.train_step(mesh, optimizer or optax.adam(1e-3), donate=False,
                                       **options)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((BATCH, WIDTH)).astype(np.float32) for _ in range(2))


def _sharded(mesh_text, optimizer=None, accumulate=1, zero=1):
    return _step(mesh_text, optimizer, precision="bf16", zero=zero, master_weights="sharded",
                 accumulate=accumulate)


@functools.lru_cache(maxsize=None)
def _one_device(steps=3):
    """The float32-master bf16 step on one device: per step its loss, gradients and parameters."""
    program, step = _step("data=1,model=1", precision="bf16")
    state = step.init(random_params(program))
    grad = jax.jit(step.value_and_grad())
    out = []
    for i in range(steps):
        _, grads = grad(state.params, *_data(i))
        state, loss = step(state, *_data(i))
        out.append((float(loss), jax.device_get(grads), jax.device_get(state.params)))
    return out


@pytest.mark.parametrize("mesh, accumulate, zero", [
    ("data=2,model=2", 1, 1), ("data=4,model=1", 1, 1), ("data=2,model=2", 2, 1),
    ("data=2,model=2", 2, 2)])
# make test: no tensor parallelism, and accumulation under ZeRO-2 beside it (the other two cells,
# each a part of that one: make test-all)
@pytest.mark.slow_cells("data=2,model=2-1-1", "data=2,model=2-2-1")
def test_sharded_master_trains_like_the_float32_master_bf16_step_on_one_device(mesh, accumulate,
                                                                               zero):
    """Also accumulating 2 micro-batches (ZeRO-1: their bf16 gradients summed in float32 between
    one gather and one reduce-scatter; ZeRO-2: each micro-batch's reduce-scattered in float32
    into the rank's shards)."""
    program, step = _sharded(mesh, accumulate=accumulate, zero=zero)
    state = step.init(random_params(program))
    # the state: float32 master weights and Adam moments in shards over data
    for leaf, spec in zip(jax.tree.leaves(state.params), step.layout.zero_specs()):
        assert leaf.dtype == np.float32 and leaf.sharding.spec == spec
    grad = jax.jit(step.value_and_grad())
    for i, (want_loss, want_grads, want_params) in enumerate(_one_device()):
        loss, grads = grad(state.params, *_data(i))
        assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))
        assert_tree_close(jax.device_get(grads), want_grads, 4 * BF16)
        state, loss = step(state, *_data(i))
        assert float(loss) == pytest.approx(want_loss, rel=2 * BF16)
        assert_tree_close(jax.device_get(state.params), want_params, 4 * BF16)


@pytest.mark.parametrize("zero", [1, pytest.param(2, marks=pytest.mark.slow)])  # the same program
def test_a_pipelined_sharded_master_step_is_the_float32_master_pipelined_step_within_bf16(zero):
    """Through a pipeline (1F1B, 2 micro-batches, stage=2, data=2): the bf16 parameters gathered
    over ``data`` once before the schedule (no per-task cast), each stage's gradients summed in
    float32 across its tasks and reduce-scattered once after it in bf16; the master in float32
    shards. Loss and gradients are the float32-master bf16 pipelined step's (itself exact in
    float32 against one device: tests/pipeline) within bf16's rounding of the reduced
    gradients. ZeRO-2's is the same program: a pipeline's micro-batches reduce once."""
    pipeline = PipelineConfig("1f1b", 2)
    program, _, step, sharded = gradient_step("tensor", CONFIG, "data=2,stage=2", zero=zero,
                                              precision="bf16", master_weights="sharded",
                                              pipeline=pipeline)
    _, _, plain_step, plain = gradient_step("tensor", CONFIG, "data=2,stage=2", zero=1,
                                            precision="bf16", pipeline=pipeline)
    params = random_params(program)
    stored = step.init(params).params
    for leaf, spec in zip(jax.tree.leaves(stored), step.layout.zero_specs()):
        assert leaf.dtype == np.float32 and leaf.sharding.spec == spec
    loss, grads = sharded(stored, *_data())
    want_loss, want_grads = plain(plain_step.init(params).params, *_data())
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))
    assert float(loss) == pytest.approx(float(want_loss), rel=BF16)
    assert_tree_close(jax.device_get(grads), jax.device_get(want_grads), 2 * BF16)
    # over data, once a step whatever the micro-batches: the split parameters all-gathered
    # (P elements per rank) and their gradients reduce-scattered (P / D), in bf16 as lowered
    shape = ((BATCH, WIDTH), np.float32)
    layout, mesh = step.layout, step.mesh
    full = [int(np.prod(NamedSharding(mesh, s).shard_shape(a.shape)))
            for a, s in zip(layout.shapes, layout.specs)]
    split = sum(n for n, d in zip(full, layout.zero_dims) if d >= 0)
    compiled = _over_data(compiled_hlo(step, shape, shape), mesh)
    elements = lambda cs: sum(c.elements * c.count for c in cs)
    assert elements(compiled["all-gather"]) == split
    assert elements(compiled["reduce-scatter"]) == split // 2
    batch = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec))
             for (s, d), spec in zip((shape, shape), step.specs_of_batch(2))]
    lowered = _over_data(step.lower(abstract_state(step), *batch).as_text(dialect="hlo"), mesh)
    for kind in ("all-gather", "reduce-scatter"):
        assert {dtype for c in lowered[kind] for dtype, _ in c.shapes} == {"bf16"}


@pytest.mark.slow  # make test: the pipelined sharded-master step's float32 sums (the default) above
def test_a_pipeline_sums_its_gradients_in_bf16_when_told_within_bf16():
    """``accumulate_grads_in="compute"`` (NeMo's bf16 gradient buffer): the pipeline's gradient
    sums are bf16 where the float32 ones were (the schedule loop's carry, from the compiled
    program) and the step is the float32-summed one within bf16's rounding of 4 micro-batches'
    sums."""
    options = dict(zero=1, precision="bf16", master_weights="sharded")
    steps = {}
    for where in ("float32", "compute"):
        pipeline = PipelineConfig("1f1b", 4, accumulate_grads_in=where)
        steps[where] = gradient_step("tensor", CONFIG, "data=2,stage=2", pipeline=pipeline,
                                     **options)
    program, _, step, bf16_sums = steps["compute"]
    stored = step.init(random_params(program)).params
    loss, grads = bf16_sums(stored, *_data())
    want_loss, want_grads = steps["float32"][3](stored, *_data())
    assert float(loss) == pytest.approx(float(want_loss), rel=BF16)
    assert_tree_close(jax.device_get(grads), jax.device_get(want_grads), 4 * BF16)
    shape = ((BATCH, WIDTH), np.float32)
    carried = {where: _loop_carry(compiled_hlo(s[2], shape, shape))
               for where, s in steps.items()}
    widened = carried["float32"] - carried["compute"]  # the float32 sums, now in bf16
    assert widened and all(dtype == "f32" for dtype, _ in widened)
    assert {("bf16", dims) for _, dims in widened} <= carried["compute"]


def _loop_carry(text):
    """The (dtype, dims) of the arrays the compiled program's while loops carry."""
    import re

    shapes = set()
    for line in text.splitlines():
        if " while(" in line:
            result = line.split("=", 1)[1].split(" while(")[0]
            shapes |= set(re.findall(r"(\w+)\[([\d,]*)\]", result))
    return shapes


def _over_data(text, mesh):
    """Per kind, the collectives over ``data`` alone in the HLO ``text``."""
    kinds = {}
    for c in hlo.collectives(text):
        c = dataclasses.replace(c, replica_groups=hlo.normalise_replica_groups(c.replica_groups))
        if c.mesh_axes(dict(mesh.shape)) == ("data",):
            kinds.setdefault(c.kind, []).append(c)
    return kinds


@pytest.mark.parametrize("accumulate", [1, 4])
def test_sharded_master_gathers_bf16_parameters_and_reduce_scatters_bf16_gradients_once(
        accumulate):
    """Per step over ``data`` (D=2): the split parameters all-gathered once in bf16 (P elements,
    2P bytes per rank; one flat buffer per group of like parameters, here the stacked layers'
    and the first pair's), its transpose one reduce-scatter of their gradients in bf16 (P/D),
    an all-reduce of the parameters left replicated; the update on the float32 shards moves
    nothing. The compiled CPU program has these collectives; their dtype is read from the
    program as lowered, since XLA:CPU widens bf16 collectives to float32 (an H100 compile keeps
    them bf16: docs/training.md). Accumulating 4 micro-batches moves the same: once a step,
    not once a micro-batch."""
    program, step = _sharded("data=2,model=2", accumulate=accumulate)
    shape = ((BATCH, WIDTH), np.float32)
    layout, mesh = step.layout, step.mesh
    full = [int(np.prod(NamedSharding(mesh, s).shard_shape(a.shape)))
            for a, s in zip(layout.shapes, layout.specs)]
    split = sum(n for n, d in zip(full, layout.zero_dims) if d >= 0)
    replicated = sum(full) - split
    groups = 2  # the stacked layers' flat buffer and the first (column, row) pair's
    compiled = _over_data(compiled_hlo(step, shape, shape), mesh)
    assert set(compiled) == {"all-gather", "reduce-scatter", "all-reduce"}
    elements = lambda cs: sum(c.elements * c.count for c in cs)
    assert sum(c.count for c in compiled["all-gather"]) == groups
    assert sum(c.count for c in compiled["reduce-scatter"]) == groups
    assert elements(compiled["all-gather"]) == split
    assert elements(compiled["reduce-scatter"]) == split // 2
    assert elements(compiled["all-reduce"]) == replicated
    batch = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec))
             for (s, d), spec in zip((shape, shape), step.specs_of_batch(2))]
    lowered = _over_data(step.lower(abstract_state(step), *batch).as_text(dialect="hlo"), mesh)
    for kind, expected in (("all-gather", 2 * split), ("reduce-scatter", 2 * split // 2)):
        assert {dtype for c in lowered[kind] for dtype, _ in c.shapes} == {"bf16"}
        assert sum(c.bytes * c.count for c in lowered[kind]) == expected


def test_a_sharded_master_checkpoint_is_the_plain_steps_both_ways(tmp_path):
    program, sharded = _sharded("data=2,model=2")
    _, plain = _step("data=2,model=2", precision="float32")
    state = sharded.init(random_params(program))
    state, _ = sharded(state, *_data())
    saver = Checkpointer(tmp_path / "a", asynchronous=False)
    saver.save(1, state.params, state.opt_state)
    target = plain.abstract_state()
    params, opt_state, _ = saver.restore(target.params, target.opt_state)
    assert_tree_close(jax.device_get(params), jax.device_get(state.params), 0)
    assert_tree_close(jax.device_get(opt_state), jax.device_get(state.opt_state), 0)
    assert all(p.sharding.spec == s for p, s in zip(jax.tree.leaves(params), plain.param_specs))
    # and back: the plain step's checkpoint resumes the sharded one, which trains on from it
    plain_state = plain.init(random_params(program, seed=3))
    saver = Checkpointer(tmp_path / "b", asynchronous=False)
    saver.save(1, plain_state.params, plain_state.opt_state)
    target = sharded.abstract_state()
    params, opt_state, _ = saver.restore(target.params, target.opt_state)
    assert_tree_close(jax.device_get(params), jax.device_get(plain_state.params), 0)
    assert all(p.sharding.spec == s
               for p, s in zip(jax.tree.leaves(params), sharded.layout.zero_specs()))
    _, loss = sharded(type(state)(params, opt_state), *_data())
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("accumulate", [1, 2])
# make test-all: a composition of the sharded master (bf16, above) and the FP8 step (test_fp8.py)
@pytest.mark.slow_cells("2", "1")
def test_an_fp8_sharded_master_step_is_the_float32_master_fp8_step_within_bf16(accumulate):
    """NeMo's FP8 runs keep Megatron's distributed optimizer: the bf16 parameters gathered once,
    each GEMM's FP8 operands quantised from them, as the float32-master FP8 step quantises its
    parameters' bf16 cast. Same mesh, ZeRO-1 both: only where the master lives differs."""
    program, sharded = _step("data=2,model=2", precision="fp8", zero=1,
                             master_weights="sharded", accumulate=accumulate)
    _, plain = _step("data=2,model=2", precision="fp8", zero=1, accumulate=accumulate)
    assert "f8e4m3fn" in compiled_hlo(sharded, ((BATCH, WIDTH), np.float32),
                                      ((BATCH, WIDTH), np.float32))
    params = random_params(program)
    ours, theirs = sharded.init(params), plain.init(params)
    for i in range(3):
        ours, loss = sharded(ours, *_data(i))
        theirs, want = plain(theirs, *_data(i))
        assert float(loss) == pytest.approx(float(want), rel=2 * BF16)
    assert_tree_close(jax.device_get(ours.params), jax.device_get(theirs.params), 4 * BF16)


@pytest.mark.parametrize("options, message", [
    (dict(master_weights="sharded", zero=1), "precision='bf16'"),
    (dict(master_weights="sharded", precision="bf16"), "use zero=1 or 2, not zero=0"),
    (dict(master_weights="sharded", precision="bf16", zero=3), "not zero=3"),
    (dict(master_weights="halves"), "'replicated'"),
])
def test_unsupported_sharded_master_settings_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        _step("data=2,model=2", **options)


def test_sharded_master_needs_a_data_axis():
    with pytest.raises(ConfigError, match="data>=2"):
        _step("data=1,model=2", precision="bf16", zero=1, master_weights="sharded")


FFN = ["train", "--model", "ffn", "--strategy", "tensor", "--width", "8", "--depth", "2",
       "--batch", "16", "--steps", "2", "--eval-every", "1", "--eval-batches", "1",
       "--no-progress", "--mesh", "data=2,model=2", "--precision", "bf16", "--zero", "1",
       "--optimizer", "adam"]


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_train_master_weights_sharded_end_to_end_matches_replicated(tmp_path, capsys):
    from jphantom import cli

    assert cli.main([*FFN, "--master-weights", "sharded", "--out", str(tmp_path / "s")]) == 0
    assert "bf16 compute, sharded master weights" in capsys.readouterr().out
    results = json.loads((tmp_path / "s" / "results.json").read_text())
    assert results["step"]["master_weights"] == "sharded"
    assert cli.main([*FFN, "--out", str(tmp_path / "r")]) == 0
    plain = json.loads((tmp_path / "r" / "results.json").read_text())
    assert plain["step"]["master_weights"] == "replicated"
    for key in ("train_loss", "validation_loss"):
        assert results["history"][key] == pytest.approx(plain["history"][key], rel=4 * BF16)


def test_bad_master_weights_flags_are_one_line(tmp_path, capsys):
    from helpers import exit_code

    out = tmp_path / "never"
    assert exit_code([*FFN, "--master-weights", "sharded", "--zero", "3", "--out",
                      str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jphantom: error:") and err.count("\n") == 1, err
    assert "use zero=1 or 2, not zero=3" in err and not out.exists()
