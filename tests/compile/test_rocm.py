"""Compiling for AMD GPUs without one (jphantom.rocm, ``compile --target rocm:...``).

The fast tests run everywhere: the targets' descriptions, the one-line refusals without the ROCm
extra, the GPU-count shim's hold on jax's private function, and the stand-in library builder on a
small fake plugin (gcc and readelf). The compiles themselves need the ROCm compiler (``pip install
'jphantom[rocm]'``, Python >= 3.12: ``make test-rocm`` builds that environment); without it they
skip, saying so."""

import ctypes
import importlib.util
import shutil
import subprocess
import sys

import pytest

from jphantom import rocm
from jphantom.costs import aot
from jphantom.errors import ConfigError
from jphantom.rocm import shim, stubs

has_rocm_compiler = rocm.problem() is None and importlib.util.find_spec("jax_plugins") is not None
needs_rocm_compiler = pytest.mark.skipif(
    not has_rocm_compiler, reason=f"needs the ROCm compiler: {rocm.problem() or rocm.INSTALL}")
needs_toolchain = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("readelf") is None,
                                     reason="needs gcc and readelf")


def test_rocm_targets_are_xla_s_descriptions_with_their_memory_and_peaks():
    mi250x = aot.Target.parse("rocm:mi250x", nodes=2)
    assert (mi250x.device_count, mi250x.devices_per_node, mi250x.peak_tflops) == (16, 8, 191.5)
    assert mi250x.memory_bytes == 67628957696  # one GCD's 64 GB as XLA's mi200.txtpb gives it
    assert 'gcn_arch_name: "gfx90a' in mi250x.config_text()
    mi300x = aot.Target.parse("rocm:mi300x")
    assert (mi300x.memory_bytes, mi300x.peak_tflops) == (206158430208, 1307.4)
    assert 'gcn_arch_name: "gfx942' in mi300x.config_text()
    assert 'gcn_arch_name: "gfx950' in aot.Target.parse("rocm:mi350x").config_text()
    assert mi250x.name == "rocm:mi250x x 2 node(s) x 8" and mi250x.is_gpu
    with pytest.raises(ConfigError, match="rocm:mi250x, rocm:mi300x, rocm:mi350x"):
        aot.Target.parse("rocm:mi100")


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the refusal of Python 3.11")
def test_without_the_extra_compile_for_rocm_is_one_line_before_anything_is_built():
    out = subprocess.run([sys.executable, "-m", "jphantom", "compile", "--target", "rocm:mi250x"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "jphantom: error: compiling for ROCm needs Python >= 3.12 (the ROCm plugin's wheels are "
        "cp312/cp313; this is 3.11): pip install 'jphantom[rocm]'  (Python >= 3.12; jax 0.12.0)"]


def test_the_shim_holds_jax_s_gpu_count_function():
    """The one private function the shim replaces exists, with ``stop_at``, on this jax; where it
    counts no AMD GPU the shim makes it one, once, and marks it."""
    from jax._src import hardware_utils

    original = hardware_utils.num_available_amd_gpus
    try:
        patched = shim.allow_without_gpu()
        assert patched == (original(stop_at=1) == 0)
        if patched:
            assert hardware_utils.num_available_amd_gpus(stop_at=2) == 1
            assert shim.allow_without_gpu() is True  # idempotent
    finally:
        hardware_utils.num_available_amd_gpus = original


def _shared_object(folder, name, source, *, version_script=None, links=()):
    (folder / f"{name}.c").write_text(source)
    command = ["gcc", "-shared", "-fPIC", "-o", str(folder / name), f"-Wl,-soname,{name}",
               str(folder / f"{name}.c"), *links]
    if version_script:
        (folder / f"{name}.map").write_text(version_script)
        command.append(f"-Wl,--version-script,{folder / f'{name}.map'}")
    subprocess.run(command, check=True, capture_output=True)
    return folder / name


@needs_toolchain
def test_stand_ins_let_a_plugin_whose_libraries_are_missing_load(tmp_path):
    """A fake plugin linked against a versioned runtime (as the ROCm plugin is against
    ``libamdhip64.so.7``'s ``hip_4.2``...) and an unversioned one, both then removed: it does not
    load; the stand-ins planned from its ELF alone define each symbol under its version, and it
    loads."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    _shared_object(runtime, "libfakehip.so.7", "int fakeMalloc(void){return 0;}\n"
                   "int fakeFree(void){return 0;}\n",
                   version_script="fake_4.2 { global: fakeMalloc; };\n"
                                  "fake_6.5 { global: fakeFree; };\n")
    _shared_object(runtime, "libfakeprof.so.1", "int fakeProfile(void){return 0;}\n")
    plugin = _shared_object(
        tmp_path, "fake_plugin.so",
        "int fakeMalloc(void); int fakeFree(void); int fakeProfile(void);\n"
        "int (*table[])(void) = {fakeMalloc, fakeFree, fakeProfile};\n",
        links=[f"-L{runtime}", "-l:libfakehip.so.7", "-l:libfakeprof.so.1"])
    shutil.rmtree(runtime)
    with pytest.raises(OSError, match="libfakehip.so.7"):
        ctypes.CDLL(str(plugin))
    planned = {lib.soname: lib for lib in stubs.needed_libraries([plugin])}
    assert set(planned) == {"libfakehip.so.7", "libfakeprof.so.1"}
    assert planned["libfakehip.so.7"].symbols == {"fake_4.2": ("fakeMalloc",),
                                                  "fake_6.5": ("fakeFree",)}
    assert planned["libfakeprof.so.1"].symbols == {"": ("fakeProfile",)}
    for path in stubs.build(list(planned.values()), tmp_path / "stand-ins"):
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(plugin))  # loads now


@needs_toolchain
def test_a_stand_in_that_is_called_names_itself_and_aborts(tmp_path):
    """Every stand-in returned a non-null pointer, so a call that reached one ran on with a
    made-up result; now it prints its symbol to stderr and aborts. The registrations the plugin's
    load makes, and error-string getters, still answer."""
    library = stubs.Library("libfakehip.so.7", {"": ("hipMalloc", "__hipRegisterFatBinary",
                                                     "hipGetErrorString")})
    assert [stubs.kind_of(n) for n in ("hipMalloc", "__hipRegisterFatBinary",
                                       "hipGetErrorString", "_ZTVN3foo3BarE")] == [
        "fail", "handle", "text", "data"]
    [path] = stubs.build([library], tmp_path)
    code = (f"import ctypes, sys; lib = ctypes.CDLL({str(path)!r}); "
            "[setattr(getattr(lib, n), 'restype', ctypes.c_char_p) for n in "
            "('__hipRegisterFatBinary', 'hipGetErrorString', 'hipMalloc')]; "
            "print(lib.__hipRegisterFatBinary().decode(), lib.hipGetErrorString().decode(), "
            "sep='|', flush=True); lib.hipMalloc(); print('ran on')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -6 and "ran on" not in out.stdout  # SIGABRT
    assert out.stdout.strip() == "|".join(["ROCm runtime stand-in (jphantom.rocm.stubs)"] * 2)
    assert out.stderr.startswith("jphantom: hipMalloc was called, but it is a stand-in for the "
                                 "ROCm runtime"), out.stderr


def test_the_stand_ins_cache_honours_jphantom_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("JPHANTOM_CACHE_DIR", str(tmp_path / "cache"))
    assert stubs.cache_root() == tmp_path / "cache" / "rocm-stubs"
    monkeypatch.delenv("JPHANTOM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert stubs.cache_root() == tmp_path / "xdg" / "jphantom" / "rocm-stubs"


# -------------------------------------------------------------------------------------------------
# Compiles for MI250X and MI300X (make test-rocm)
# -------------------------------------------------------------------------------------------------

LLAMA = dict(model="llama", layers=2, hidden=128, heads=8, kv_heads=8, seq_len=64, vocab=512,
             batch=16)


@pytest.fixture(scope="module")
def mi250x():
    target = aot.Target.parse("rocm:mi250x", nodes=2)
    return target, target.devices()


@needs_rocm_compiler
@pytest.mark.parametrize("strategy, options, expected", [
    ("tensor", {"sequence_parallel": True}, {"all-gather", "reduce-scatter"}),
    ("phantom", {"ghost_width": 8}, {"all-gather", "reduce-scatter", "all-reduce"}),
    ("tensor", {"zero": 3, "mesh": "data=16"}, {"all-gather", "reduce-scatter"}),
], ids=["tensor-sp", "phantom", "zero3"])
def test_a_llama_step_compiles_for_two_frontier_nodes(mi250x, strategy, options, expected):
    """2 nodes x 8 MI250X GCDs: AMDGPU code for the step, memory per GCD, the collectives the
    strategy's formulas name (sequence parallelism's gathers and scatters over ``model``,
    phantom's, ZeRO-3's over ``data``), exactly those over ``data`` crossing the nodes, and the
    report saying its runtime was stood in for."""
    target, devices = mi250x
    flags = {**LLAMA, "strategy": strategy, "mesh": "data=2,model=8", **options}
    report = aot.compile_report(flags, target, devices=devices)
    assert report["target"]["platform"] == "rocm" and report["memory"]["fits"]
    assert 0 < report["memory"]["peak_bytes"] < 2**30
    rows = report["collectives"]
    assert expected <= {r["kind"] for r in rows}
    for row in rows:
        assert row["crosses_nodes"] == (row["count"] if "data" in row["axes"] else 0), row
    assert any("data" in r["axes"] for r in rows)
    assert report["kernels"]["gemms"]["total"] > 0
    assert any("stand-ins for ROCm" in note for note in report["notes"])


@needs_rocm_compiler
def test_fp8_compiles_to_fnuz_gemms_on_mi300x_ocp_on_mi350x_refused_on_mi250x(mi250x, tmp_path):
    target = aot.Target.parse("rocm:mi300x")
    hlo = tmp_path / "step.hlo"
    report = aot.compile_report({**LLAMA, "strategy": "tensor", "mesh": "model=8",
                                 "precision": "fp8"}, target, hlo_out=hlo)
    assert report["kernels"]["gemms"]["fp8"] > 0
    text = hlo.read_text()
    assert "f8e4m3fnuz" in text and "f8e5m2fnuz" in text
    assert "f8e4m3fn[" not in text and "f8e5m2[" not in text  # no OCP operand anywhere
    with pytest.raises(ConfigError, match="no FP8 GEMMs"):
        aot.compile_report({**LLAMA, "strategy": "tensor", "mesh": "data=2,model=8",
                            "precision": "fp8"}, mi250x[0], devices=mi250x[1])
    # the MI350X (gfx950) takes the OCP formats, as NVIDIA's GPUs do
    report = aot.compile_report({**LLAMA, "strategy": "tensor", "mesh": "model=8",
                                 "precision": "fp8"}, aot.Target.parse("rocm:mi350x"),
                                hlo_out=hlo)
    text = hlo.read_text()
    assert report["kernels"]["gemms"]["fp8"] > 0
    assert "f8e4m3fn[" in text and "f8e5m2[" in text and "fnuz[" not in text


@pytest.mark.skipif(has_rocm_compiler, reason="with the extra the script compiles (minutes)")
def test_the_rocm_benchmark_says_what_to_install_in_one_line(tmp_path):
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "rocm_compile.py"
    out = subprocess.run([sys.executable, str(script), "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "jphantom[rocm]" in out.stderr and not list(tmp_path.iterdir())


@needs_rocm_compiler
def test_on_rocm_jax_has_no_fused_attention_so_auto_takes_xla_s_path(mi250x):
    """What each attention choice becomes when compiled for the MI250X: jax's cuDNN path is
    refused by jax itself, XLA's path compiles to fusions with no custom call, and ``auto`` picks
    it and says why (jphantom.nn.attention.choose)."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jphantom.nn import attention
    from jphantom.nn.attention.kernel_choice import platform_of

    _, devices = mi250x
    mesh = Mesh(np.array(devices[:1]), ("x",))
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec()))

    def attend(implementation):
        return jax.jit(lambda a, b, c: jax.nn.dot_product_attention(
            a, b, c, is_causal=True, implementation=implementation)).lower(q, q, q).compile()

    with pytest.raises(RuntimeError, match="cuDNN is not detected"):
        attend("cudnn")
    assert not re.findall(r'custom_call_target="', attend("xla").as_text())
    kernel, why = attention.choose("auto", platform_of(devices[0]), jnp.bfloat16, 64)
    assert kernel == "xla" and "no fused attention" in why
