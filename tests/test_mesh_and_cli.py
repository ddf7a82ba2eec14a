"""Meshes, device simulation and the command line."""

import json

import jax
import pytest

from jphantom import cli
from jphantom.errors import ConfigError
from jphantom.mesh import make_mesh, simulate_cpu_devices


def test_make_mesh_names_axes_and_uses_auto_axis_types():
    mesh = make_mesh({"data": 2, "model": 4})
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_mesh_larger_than_the_devices_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"needs 16 devices but 8 are available.*--devices 16"):
        make_mesh({"data": 2, "model": 8})
    with pytest.raises(ConfigError, match=r"needs 4 devices but 8"):
        make_mesh({"model": 4}, strict=True)
    with pytest.raises(ConfigError, match=r"axis 'model' has size 0"):
        make_mesh({"model": 0})


def test_simulating_devices_after_start_up_says_it_is_too_late():
    simulate_cpu_devices(jax.device_count())  # same count: fine
    with pytest.raises(RuntimeError, match=r"after jax initialised.*XLA_FLAGS"):
        simulate_cpu_devices(3)


def test_cli_inspect_json_reports_collectives_flops_params(capsys):
    assert cli.main(["inspect", "--strategy", "phantom", "--width", "64", "--depth", "2",
                     "--ghost-width", "2", "--batch", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = {c["kind"]: c for c in report["collectives"]}
    assert kinds["all-gather"] == {"kind": "all-gather", "count": 2, "bytes": 2 * 8 * 8 * 2 * 4}
    assert kinds["reduce-scatter"] == {"kind": "reduce-scatter", "count": 2, "bytes": 2 * 8 * 2 * 4}
    assert report["flops"] > 0 and report["params"] == 2 * (64 * 64 // 8 + 2 * 64 * 8)


def test_cli_table_and_errors(capsys):
    assert cli.main(["inspect", "--strategy", "phantom", "tensor-t1", "--width", "64",
                     "--ghost-width", "2", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "phantom" in out and "tensor-t1" in out and "reduce-scatter" in out
    assert cli.main(["inspect", "--width", "60", "--batch", "8"]) == 2
    assert "width=60 is not divisible by num_shards=8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "inspect" in capsys.readouterr().out
