"""Exactness as a user command (jphantom.verify, `jphantom verify`): the layouts the tests call
exact report <= 1e-5 for the loss and every gradient; a layer broken on purpose is named; the
model given (to verify or to make_train_step) is left as it was."""

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jphantom
from jphantom import plans
from jphantom.cli import main
from jphantom.runtime.mesh import MeshConfig, first_devices
from jphantom.models.llama import Llama, LlamaConfig, lm_loss
from jphantom.nn import tensor
from jphantom.pipeline.runner import PipelineConfig

LLAMA = LlamaConfig(vocab_size=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2,
                    max_positions=16)


def _mesh(text):
    mesh = MeshConfig.parse(text)
    return mesh.build(first_devices(mesh.device_count))


def _tokens(rows=8):
    return np.random.default_rng(0).integers(0, 64, (rows, 16)).astype(np.int32)


def _snapshot(model):
    graphdef, state = nnx.split(model)
    variables = [(path, dict(v.get_metadata())) for path, v in nnx.iter_graph(model)
                 if isinstance(v, nnx.Variable)]
    return graphdef, [np.asarray(a) for a in jax.tree.leaves(state)], variables


@pytest.mark.parametrize("mesh, plan, options", [
    ("data=2,model=2", "megatron-sp", {}),
    ("data=2,model=2", "megatron", {"zero": 3}),
    ("stage=2,model=2", "megatron", {"pipeline": PipelineConfig(microbatches=2),
                                     "remat": "nothing_saveable"}),
], ids=["tensor-sp", "zero3", "pipeline-remat"])
@pytest.mark.slow_cells("zero3", "pipeline-remat")
def test_exact_layouts_report_within_1e_5_and_leave_the_model_as_it_was(mesh, plan, options):
    model = Llama(LLAMA, rngs=nnx.Rngs(0))
    before = _snapshot(model)
    layout = plans.megatron(model, sequence_parallel=plan == "megatron-sp")
    report = jphantom.verify(model, _mesh(mesh), layout, lm_loss, _tokens(), _tokens(),
                             **options)
    assert report.ok, str(report)
    assert report.loss_error <= 1e-5 and report.worst[1] <= 1e-5
    assert len(report.errors) == 12 and "layers.block.mlp.down_proj.kernel" in report.errors
    after = _snapshot(model)
    assert before[0] == after[0] and before[2] == after[2]
    assert all(np.array_equal(a, b) for a, b in zip(before[1], after[1]))


class _DoubledBiasGradient(tensor.ColumnParallelLinear):
    """A column layer broken on purpose: its bias' gradient comes out doubled (the value is
    right, so only that gradient differs)."""

    def __call__(self, x):
        y = super().__call__(x)
        bias = self.bias[...]
        return y + bias - jax.lax.stop_gradient(bias) + (bias - jax.lax.stop_gradient(bias))


def test_a_layer_broken_on_purpose_is_named():
    model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 4,
                                                                             rngs=nnx.Rngs(1)))
    mesh = _mesh("model=2")
    model = plans.parallelize(model, mesh, {"layers.0": "column", "layers.1": "row"})
    model.layers[0] = _DoubledBiasGradient(model.layers[0].kernel[...], model.layers[0].bias[...])
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    t = np.random.default_rng(2).standard_normal((4, 4)).astype(np.float32)
    loss = lambda m, x, t: ((m(x) - t) ** 2).mean()
    report = jphantom.verify(model, mesh, None, loss, x, t)
    assert not report.ok
    assert report.worst[0] == "layers.0.bias" and report.worst[1] > 0.1
    assert report.loss_error <= 1e-5  # the forward is right
    assert "DIFFERS" in str(report) and "layers.0.bias" in str(report)


def test_make_train_step_leaves_the_model_as_it_was():
    """The step sets the blocks' remat policy and, with a stage axis, the layer axis' sharding
    on a copy of its own (what it sets, it sets as it is made and traced: lowered, not run)."""
    model = Llama(LLAMA, rngs=nnx.Rngs(0))
    before = _snapshot(model)
    step = jphantom.make_train_step(model, _mesh("stage=2,data=2"), optax.sgd(0.1), lm_loss,
                                    remat="nothing_saveable",
                                    pipeline=PipelineConfig(microbatches=2))
    step.lower(step.init(), _tokens(), _tokens())
    after = _snapshot(model)
    assert before[0] == after[0] and before[2] == after[2] and model.layers.remat == "none"
    assert all(np.array_equal(a, b) for a, b in zip(before[1], after[1]))


# make test: `jphantom verify --json` on a family (test_families.py), the API's reports here
@pytest.mark.slow
def test_the_verify_command_reports_and_exits_by_the_tolerance(capsys):
    flags = ["verify", "--model", "llama", "--layers", "1", "--hidden", "32", "--heads", "4",
             "--kv-heads", "2", "--seq-len", "16", "--batch", "8", "--strategy", "tensor",
             "--mesh", "data=2,model=2", "--json"]
    assert main(flags) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["worst"]["error"] <= 1e-5
    assert set(report["errors"]) >= {"embed_tokens.embedding", "lm_head.kernel"}
    assert main(flags + ["--tolerance", "1e-12"]) == 1  # float32 against float64: not that close
    assert main(flags[:-1] + ["--tolerance", "-1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


class _Dense(nnx.Module):
    def __init__(self, n_in, n_out, seed=0):
        self.w = nnx.Param(nnx.initializers.lecun_normal()(jax.random.PRNGKey(seed), (n_in, n_out)))

    def __call__(self, x):
        return x @ self.w[...]


class _Column(nnx.Module):
    def __init__(self, w, axis):
        from jphantom.nn import metadata

        self.axis, self.w = axis, metadata.param(w, (None, axis))

    def __call__(self, x):
        return tensor.copy_to_model(x, self.axis) @ self.w[...]

    def dense_equivalent(self):
        dense = _Dense(*self.w.shape)
        dense.w = nnx.Param(self.w[...])
        return dense


class _Row(_Column):
    def __init__(self, w, axis):
        from jphantom.nn import metadata

        self.axis, self.w = axis, metadata.param(w, (axis, None))

    def __call__(self, x):
        return jax.lax.psum(x @ self.w[...], self.axis)


class _Pair(nnx.Module):
    def __init__(self):
        self.up, self.down = _Dense(8, 16, 1), _Dense(16, 8, 2)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


@pytest.fixture
def registered():
    jphantom.register_style("test-column", _Dense, lambda m, at: _Column(m.w[...], at.axis))
    jphantom.register_style("test-row", _Dense, lambda m, at: _Row(m.w[...], at.axis))
    yield
    plans.unregister_style("test-column")
    plans.unregister_style("test-row")


def test_a_registered_style_parallelises_a_users_layer_exactly(registered):
    x = np.random.default_rng(3).standard_normal((8, 8)).astype(np.float32)
    mse = lambda m, x, t: ((m(x) - t) ** 2).mean()
    for mesh in ("model=2", "data=2,model=4"):
        report = jphantom.verify(_Pair(), _mesh(mesh), {"up": "test-column",
                                                        "down": jphantom.Style("test-row")},
                                 mse, x, x)
        assert report.ok, str(report)
    model = plans.parallelize(_Pair(), {"model": 2}, {"up": "test-column", "down": "test-row"})
    assert isinstance(model.up, _Column) and isinstance(model.down, _Row)


def test_registered_styles_refuse_what_they_do_not_fit(registered):
    from jphantom.errors import ConfigError

    with pytest.raises(ConfigError, match="applies to _Dense, not Linear"):
        plans.parallelize(nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0))), {"model": 2},
                          {"layers.0": "test-column"})
    jphantom.register_style("test-broken", _Dense, lambda m, at: nnx.Linear(8, 16,
                                                                            rngs=nnx.Rngs(0)))
    try:
        with pytest.raises(ConfigError, match="not an nnx.Module with dense_equivalent"):
            plans.parallelize(_Pair(), {"model": 2}, {"up": "test-broken"})
    finally:
        plans.unregister_style("test-broken")
    with pytest.raises(ConfigError, match="built in"):
        jphantom.register_style("column", _Dense, lambda m, at: m)
    with pytest.raises(ConfigError, match="register_style adds a style"):
        jphantom.Style("test-nothing")


GPT2_FLAGS = ["verify", "--model", "gpt2", "--layers", "1", "--hidden", "32", "--heads", "4",
              "--seq-len", "16", "--batch", "8", "--strategy", "tensor", "--mesh", "model=2",
              "--json"]


@pytest.mark.parametrize("precision, tolerance", [
    ("bf16", 32 * 2.0 ** -8),
    pytest.param("fp8", 2 * 2.0 ** -3, marks=pytest.mark.slow),
])
@pytest.mark.slow_cells("bf16-0.125")
def test_verify_compares_mixed_precision_with_the_one_device_step_at_that_precision(
        precision, tolerance, capsys):
    """Against float64 a bf16 or fp8 step could never pass 1e-5; against the one-device step at
    its own precision it passes the tolerance derived from that precision, which the report
    states (jphantom.step.exactness.tolerance_of: 32 unit roundoffs of bf16, one E5M2 step)."""
    assert main([*GPT2_FLAGS, "--precision", precision]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tolerance"] == tolerance and precision in report["reference"]
    assert report["tolerance_derived"] != "float32"
    # not float32-exact (so 1e-5 would fail: test_the_verify_command_reports_and_exits_by_the_
    # tolerance checks that exit), within its own precision's tolerance
    assert 1e-5 < report["worst"]["error"] <= tolerance


# make test: verify's reports against float64 (the layouts above; the command in test_families.py)
@pytest.mark.slow
def test_the_one_device_step_at_a_precision_is_verify_s_reference_bit_for_bit():
    """On one device the step and the reference are the same computation: no difference."""
    model = Llama(LLAMA, rngs=nnx.Rngs(0))
    report = jphantom.verify(model, _mesh("model=1"), None, lm_loss, _tokens(), _tokens(),
                             precision="bf16")
    assert report.worst[1] == 0 and report.loss_error == 0 and report.tolerance == 2.0 ** -3


def test_only_a_float32_pass_is_called_exact():
    """fp8 printed "exact within 0.25" for a largest difference of 0.123: a mixed precision's
    pass is now "within the documented bound" (its derivation beside it), "exact" is kept for
    float32 against float64 at 1e-5."""
    from jphantom.step.exactness import Report

    def report(error, derived, tolerance):
        return Report(1.0, 1.0, 0.0, {"w": error}, tolerance, "ref", derived)

    assert str(report(1e-7, "float32", 1e-5)).startswith("exact within 1e-05 (float32; ")
    fp8 = report(0.123, "one E5M2 rounding step, 2 u = 2^-2", 0.25)
    assert fp8.verdict == "within the documented bound" and "exact" not in str(fp8)
    assert str(fp8).startswith("within the documented bound 0.25 (one E5M2 rounding step")
    assert report(1e-3, "as given", 1e-2).verdict == "within the given tolerance"
    assert str(report(0.5, "float32", 1e-5)).startswith("DIFFERS from the reference beyond 1e-05")


def test_fp8_scale_groups_are_the_step_s_data_ranks_and_micro_batches():
    """Each data (and z) rank quantises its own rows, each micro-batch its own: the groups of rows
    the fp8 reference runs by itself; expert ranks share their scales."""
    from types import SimpleNamespace

    from jphantom.step.exactness import scale_groups

    def step(mesh, accumulate=1, spmd="shard_map"):
        return SimpleNamespace(mesh=SimpleNamespace(shape=mesh), pipeline=None,
                               accumulate=accumulate, spmd=spmd, setup=None)

    batch = [np.zeros((8, 4))]
    rows = lambda groups: [g.tolist() for g in groups]
    assert rows(scale_groups(step({"data": 2, "model": 2}), batch)) == [[0, 1, 2, 3],
                                                                         [4, 5, 6, 7]]
    assert rows(scale_groups(step({"data": 2}, accumulate=2), batch)) == [
        [0, 1], [2, 3], [4, 5], [6, 7]]
    assert rows(scale_groups(step({"expert": 2}), batch)) == [list(range(8))]
    assert rows(scale_groups(step({"data": 2}, accumulate=2, spmd="gspmd"), batch)) == [
        [0, 1, 2, 3], [4, 5, 6, 7]]  # the whole global micro-batch, consecutive rows


# make test: an FP8 step under a layout against the one-device FP8 step (test_fp8.py)
@pytest.mark.slow
def test_a_data_parallel_fp8_step_is_compared_with_per_rank_scaled_references():
    """The reference quantises each data rank's rows by themselves, as the step does: the loss
    agrees exactly (a whole-batch reference differed by the recipe's per-rank scaling)."""
    model = Llama(dataclasses.replace(LLAMA, layers=1), rngs=nnx.Rngs(0))
    report = jphantom.verify(model, _mesh("data=2"), None, lm_loss, _tokens(), _tokens(),
                             precision="fp8")
    assert report.loss_error < 1e-6 and "2 groups of rows" in report.reference
    assert report.ok and report.verdict == "within the documented bound"


@pytest.mark.parametrize("flag", ["--steps", "--out", "--checkpoint-dir", "--on-nonfinite",
                                  "--learning-rate", "--data", "--progress"])
def test_verify_lists_no_flag_it_does_not_use(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", flag, "1"] if flag != "--progress" else ["verify", flag])
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err
