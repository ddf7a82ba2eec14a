"""Meshes, device simulation and the command line."""

import json

import jax
import pytest

from jphantom import cli
from jphantom.registry import program as programs
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import MAX_SIMULATED_DEVICES, MeshConfig, first_devices, make_mesh, simulate_cpu_devices


def test_make_mesh_names_axes_and_uses_auto_axis_types():
    mesh = make_mesh({"data": 2, "model": 4})
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert dict(make_mesh("model=2", first_devices(2)).shape) == {"model": 2}
    assert MeshConfig.parse("model=4,data=2") == MeshConfig.of({"data": 2, "model": 4})


def test_mesh_and_devices_must_match_with_a_clear_error():
    with pytest.raises(ConfigError, match=r"needs 16 devices but 8 are given.*--devices 16"):
        make_mesh({"data": 2, "model": 8})
    with pytest.raises(ConfigError, match=r"needs 4 devices but 8 are given"):
        make_mesh({"model": 4})
    with pytest.raises(ConfigError, match=r"axis 'model' has size 0"):
        make_mesh({"model": 0})
    with pytest.raises(ConfigError, match=r"16 devices needed but 8 are available"):
        first_devices(16)


def test_simulating_devices_after_start_up_says_it_is_too_late():
    simulate_cpu_devices(jax.device_count())  # same count: fine
    with pytest.raises(RuntimeError, match=r"after jax initialised.*XLA_FLAGS"):
        simulate_cpu_devices(3)
    with pytest.raises(ConfigError, match=rf"\[1, {MAX_SIMULATED_DEVICES}\]"):
        simulate_cpu_devices(MAX_SIMULATED_DEVICES + 1)


def test_cli_inspect_json_reports_collectives_flops_params(capsys):
    assert cli.main(["inspect", "--strategy", "phantom", "--width", "64", "--depth", "2",
                     "--ghost-width", "2", "--batch", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"] == "model=8"
    kinds = {c["kind"]: c for c in report["collectives"]}
    # Both layers' collectives sit in one lax.scan loop: one op each in the HLO, run twice.
    assert kinds["all-gather"] == {"kind": "all-gather", "axes": ["model"], "count": 2,
                                   "bytes": 2 * 8 * 8 * 2 * 4}
    assert kinds["reduce-scatter"] == {"kind": "reduce-scatter", "axes": ["model"], "count": 2,
                                       "bytes": 2 * 8 * 2 * 4}
    ops = [op for op in report["collective_ops"] if op["kind"] == "all-gather"]
    assert sum(op["count"] for op in ops) == 2  # layer 0, and layer 1 in the scan
    assert {op["bytes"] for op in ops} == {8 * 8 * 2 * 4}
    # the module's parameters: Seal et al.'s weights (Table I) + 2 x 64 biases + the fused
    # decompressor's own slot (k n/p per rank and layer, never used: test_phantom.py)
    weights = 2 * (64 * 64 // 8 + 2 * 64 * 8)
    assert report["flops"] > 0 and report["params"] == weights + 2 * 64 + 2 * 2 * 64


def test_cli_inspect_on_a_data_and_model_mesh(capsys):
    """--mesh data=2,model=4: rows per collective kind and mesh axes; the gradients' all-reduce is
    over data, the loss over both axes."""
    assert cli.main(["inspect", "--strategy", "tensor-t1", "--width", "64", "--batch", "8",
                     "--mesh", "data=2,model=4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mesh"] == "data=2,model=4"
    rows = {(c["kind"], tuple(c["axes"])): c for c in report["collectives"]}
    assert set(rows) == {("all-gather", ("model",)), ("reduce-scatter", ("model",)),
                         ("all-reduce", ("data",)), ("all-reduce", ("data", "model"))}
    assert rows[("all-reduce", ("data", "model"))]["bytes"] == 4  # the loss
    assert rows[("all-reduce", ("data",))]["bytes"] == 4 * 2 * (64 * 64 + 64) // 4  # grads
    assert rows[("all-gather", ("model",))]["bytes"] == 2 * 4 * 4 * 64  # 2 layers, [4, 64] f32
    assert cli.main(["inspect", "--strategy", "phantom", "--shards", "2", "--mesh", "model=4",
                     "--width", "64", "--batch", "8"]) == 2
    assert "--shards 2 disagrees with --mesh model=4" in capsys.readouterr().err


def test_cli_table_and_errors(capsys):
    assert cli.main(["inspect", "--strategy", "phantom", "tensor-t1", "tensor", "--width", "64",
                     "--ghost-width", "2", "--batch", "8", "--shards", "4"]) == 0
    out = capsys.readouterr().out
    assert "phantom" in out and "tensor-t1" in out and "reduce-scatter [model]" in out
    assert "mesh model=4" in out
    assert cli.main(["inspect", "--width", "60", "--batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "width=60 is not divisible by num_shards=8" in err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line
    assert cli.main(["inspect", "--mesh", "data=4,model=4", "--width", "64", "--batch", "8",
                     "--ghost-width", "2"]) == 2
    assert "mesh data=4,model=4 needs 16 devices but 8 are available" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "inspect" in capsys.readouterr().out


def test_cli_lists_the_registry_strategies(capsys):
    with pytest.raises(SystemExit):
        cli.main(["inspect", "--strategy", "tensor-t2"])
    err = capsys.readouterr().err
    assert "invalid choice: 'tensor-t2'" in err
    for name in programs.strategies_for("ffn"):
        assert name in err


@pytest.mark.parametrize("argv, message", [
    (["inspect", "--devices", "0"], "0 simulated devices: give 1 to"),
    (["inspect", "--devices", str(MAX_SIMULATED_DEVICES + 1)], "simulated devices: give 1 to"),
    (["inspect", "--batch", "0"], "batch=0 must be at least 1"),
    (["inspect", "--width", "-4"], "width=-4 must be at least 1"),
    (["compare", "--shards", "0"], "shards=0 must be an integer >= 1"),
    (["compare", "--batch", "0"], "0 must be >= 1"),
    (["compare", "--shards", "2,2"], "repeats [2]"),
    (["compare", "--seeds", "0,1,0"], "repeats [0]"),
    (["compare", "--shards", "two"], "not a comma-separated list of integers"),
])
def test_cli_rejects_bad_numbers_before_running(argv, message, capsys):
    """Rejected by the argument parser or by the configuration, before anything runs: exit 2."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_explicit_device_count_that_cannot_be_had_is_one_line(capsys):
    """This process already runs jax with 8 CPU devices: --devices 4 cannot be honoured."""
    assert cli.main(["inspect", "--devices", "4", "--width", "64", "--batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "cannot simulate 4 devices" in err and err.count("\n") == 1


def test_accelerator_detection_reads_jax_platforms_first(monkeypatch):
    """The CLI asks :func:`jphantom.runtime.distributed.accelerator_visible` (which the launcher shares)."""
    import shutil

    from jphantom.runtime import distributed

    assert cli.accelerator_visible({"JAX_PLATFORMS": "cpu"}) is False
    assert cli.accelerator_visible({"JAX_PLATFORMS": "cuda,cpu"}) is True
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    assert cli.accelerator_visible({}) is False  # no nvidia-smi / rocm-smi: simulate CPU devices
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(distributed, "has_module", lambda name: False)
    assert cli.accelerator_visible({}) is False  # a GPU but no jax plugin for it
    monkeypatch.setattr(distributed, "has_module", lambda name: name == "jax_cuda12_plugin")
    assert cli.accelerator_visible({}) is True


def test_demo_inspects_then_compares_on_the_devices_it_has(tmp_path, monkeypatch, capsys):
    """demo: inspect of phantom, tensor-t1, tensor and gspmd at p = 8 (this process's 8 CPU
    devices), then compare with its defaults on shards 2,4,8 (the training itself is stubbed)."""
    seen = {}
    monkeypatch.setattr(cli.compare, "handle", lambda args: seen.setdefault("args", args) and 0)
    assert cli.main(["demo", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "p=8, k=16" in out
    for name in ("phantom", "tensor-t1", "tensor", "gspmd"):
        assert f"\n{name} " in out
    assert seen["args"].shards == (2, 4, 8) and seen["args"].out == str(tmp_path / "demo")
    assert seen["args"].devices is None


def test_param_count_is_never_negative_or_fractional_where_jphantom_computes_it():
    """The entry points that report parameter counts validate their inputs first."""
    from jphantom.loop.compare import CompareConfig
    from jphantom.config import RunConfig
    from jphantom.models.ffn import FFNConfig
    from jphantom.nn.phantom import ops as phantom

    ffn = dict(model="ffn", strategy="phantom", width=64, mesh="model=4", out=None)
    with pytest.raises(ConfigError, match="ghost_width=-100"):
        RunConfig.from_flags(**ffn, ghost_width=-100)
    with pytest.raises(ConfigError, match="depth=2.5"):
        RunConfig.from_flags(**ffn, depth=2.5, ghost_width=2)
    with pytest.raises(ConfigError, match="ghost_width=-1"):
        RunConfig.from_flags(**ffn, ghost_width=-1)
    with pytest.raises(ConfigError, match="ghost_widths=-3"):
        CompareConfig.from_flags(width=64, shards=(2,), ghost_widths=(-3,))
    # Seal et al.'s count (Table I: weights only) beside the model's (biases, and the fused
    # decompressor's own slot, whose k n/p per layer never moves: test_phantom.py)
    weights = phantom.param_count(64, 2, 4, 2)
    assert weights == 2 * (64 * 64 // 4 + 2 * 64 * 4)
    built = programs.build(FFNConfig(64, 2, 2), "phantom", "model=4")
    assert built.param_count == weights + 2 * 64 + 2 * 2 * 64


@pytest.mark.parametrize("args", [(64, -100, 4, 2), (64, 2, 4, 2.5), (2.5, 2, 1, 2)])
def test_phantom_param_count_rejects_bad_inputs(args):
    """``nn.phantom.ops.param_count(width, ghost_width, num_shards, depth)``."""
    from jphantom.nn.phantom import ops as phantom

    with pytest.raises(ConfigError):
        phantom.param_count(*args)


@pytest.mark.parametrize("text", ["data=2,,model=2", "data=2,", ",model=4"])
def test_a_mesh_with_an_empty_entry_is_refused(text):
    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import MeshConfig

    with pytest.raises(ConfigError, match="empty entry"):
        MeshConfig.parse(text)


def test_train_says_when_the_mesh_leaves_devices_idle(tmp_path, capsys):
    from jphantom import cli as cli_module

    assert cli_module.main(["train", "--model", "ffn", "--strategy", "tensor", "--mesh",
                            "data=2,model=1", "--width", "8", "--steps", "1", "--no-progress",
                            "--out", str(tmp_path / "out"), "--devices", "8"]) == 0
    assert "uses 2 of the 8 devices; 6 stay idle" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_inspect_and_compile_build_the_same_run_from_the_same_flags(model, tmp_path):
    """One table of defaults (cli.STEP_DEFAULTS): for a language model `inspect` and `compile`
    get the same dtype, vocabulary, shape, batch and optimizer, from the flags, from a TOML file,
    or from neither; without --model, inspect builds the FFN and compile Llama."""
    parser = cli.build_parser()
    file = tmp_path / "run.toml"
    file.write_text(f'model = "{model}"\nlayers = 2\n')
    for argv in (["--model", model], ["--model", model, "--hidden", "64", "--batch", "8"],
                 ["--config", str(file)]):
        inspect = cli.step_settings(parser.parse_args(["inspect", *argv]), cli.INSPECT_MODEL)
        compile_ = cli.step_settings(parser.parse_args(["compile", *argv]), cli.COMPILE_MODEL)
        inspect.pop("strategy"), compile_.pop("strategy")  # each command's own (later per run)
        assert inspect == compile_, argv
        for key in ("dtype", "vocab", "layers", "hidden", "heads", "seq_len", "batch",
                    "optimizer"):
            assert key in inspect, key
    assert inspect["layers"] == 2 and inspect["vocab"] == cli.LM_DEFAULTS["vocab"]
    default_inspect = cli.step_settings(parser.parse_args(["inspect"]), cli.INSPECT_MODEL)
    default_compile = cli.step_settings(parser.parse_args(["compile"]), cli.COMPILE_MODEL)
    assert default_inspect == {**cli.FFN_DEFAULTS, "model": "ffn", "strategy": ["phantom"]}
    assert default_compile == {**cli.LM_DEFAULTS, "model": "llama", "strategy": ["tensor"]}
