"""benchmarks/amd_check.py off AMD hardware: one line and a nonzero exit, before jax starts; the
gfx names it reads from the kernel driver's topology. (The checks themselves need an AMD GPU:
untested on one until someone runs the script.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "amd_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("amd_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gfx_names_from_the_driver_topology(tmp_path):
    amd = load_script()
    assert [amd.gfx_name(v) for v in (90010, 90402, 90008, 110000)] == [
        "gfx90a", "gfx942", "gfx908", "gfx1100"]
    for node, version in (("0", 0), ("1", 90010), ("2", 90402)):  # node 0: the CPU
        (tmp_path / node).mkdir()
        (tmp_path / node / "properties").write_text(
            f"cpu_cores_count 0\ngfx_target_version {version}\nsimd_count 440\n")
    assert amd.amd_gpus(tmp_path) == ["gfx90a", "gfx942"]
    assert amd.amd_gpus(tmp_path / "absent") == []


def test_no_amd_gpu_is_one_line_and_exit_2(tmp_path, capsys):
    amd = load_script()
    assert amd.main(["--out", str(tmp_path / "out")], kfd_nodes=tmp_path / "none") == 2
    out = capsys.readouterr()
    assert out.err == "" and len(out.out.strip().splitlines()) == 1
    assert out.out.startswith("amd_check: no AMD GPU on this machine")
    assert not (tmp_path / "out").exists()  # nothing written


def test_the_command_says_so_on_this_machine(tmp_path):
    if load_script().amd_gpus():
        pytest.skip("this machine has an AMD GPU")
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and "no AMD GPU" in lines[0], lines
