"""The GPU defaults (jphantom.runtime.gpu_defaults): merged into the environment flag by flag, never over
what the user set; `jphantom train` applies them only where an NVIDIA GPU is visible, and says
what it set. (That `jphantom compile` records them: tests/compile/test_aot.py, with the GPU compiler.)"""

import os

import pytest

from jphantom import cli
from jphantom.runtime import gpu_defaults


def test_merge_keeps_the_users_flags_and_adds_the_rest():
    user = "--xla_dump_to=/tmp/d --xla_gpu_enable_pipelined_all_gather=false " \
           "--xla_gpu_enable_latency_hiding_scheduler"
    defaults = gpu_defaults.current()  # this jaxlib's (the pipeliner flags only before 0.12)
    merged, added = gpu_defaults.merge_flags(user)
    assert merged.startswith(user)  # the user's, as written, first
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in merged
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in added
    assert added == [f"--{name}={value}" for name, value in defaults.items()
                     if name not in ("xla_gpu_enable_pipelined_all_gather",
                                     "xla_gpu_enable_latency_hiding_scheduler")]
    assert gpu_defaults.flag_names(merged) >= set(defaults) | {"xla_dump_to"}
    # as one compilation takes them: the user's values where given (a bare flag is true), typed,
    # and only the flags this jaxlib has as compile options
    options = gpu_defaults.compiler_options(merged)
    assert set(options) == set(defaults)
    if "xla_gpu_enable_pipelined_all_gather" in defaults:
        assert options["xla_gpu_enable_pipelined_all_gather"] is False
    assert options["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert gpu_defaults.merge_flags(merged) == (merged, [])  # applying twice adds nothing


def test_apply_sets_only_what_is_unset_and_says_what():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    applied = gpu_defaults.apply(env)
    assert env["XLA_FLAGS"].startswith("--xla_force_host_platform_device_count=8 --xla_gpu_")
    assert applied[-1] == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    assert gpu_defaults.apply(env) == []  # everything set now
    mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert not any(a.startswith("XLA_PYTHON") for a in gpu_defaults.apply(mine))
    assert mine["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    flags_only = {}
    assert all(a.startswith("--") for a in gpu_defaults.apply(flags_only, allocator=False))
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in flags_only


def test_nvidia_gpu_visible_from_jax_platforms():
    assert gpu_defaults.nvidia_gpu_visible({"JAX_PLATFORMS": "cuda"}) is True
    assert gpu_defaults.nvidia_gpu_visible({"JAX_PLATFORMS": "cpu"}) is False
    assert gpu_defaults.nvidia_gpu_visible({"JAX_PLATFORMS": "tpu"}) is False


@pytest.mark.parametrize("platforms, printed", [("cuda", True), ("cpu", False)])
def test_train_applies_them_on_nvidia_gpus_only(monkeypatch, capsys, platforms, printed):
    """The step train takes before jax starts (cli.train_gpu_defaults, called by main): on an
    NVIDIA GPU one line says what it set; elsewhere nothing changes."""
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_pipelined_all_reduce=false")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("JPHANTOM_PROCESS_ID", raising=False)
    cli.train_gpu_defaults()
    out = capsys.readouterr().out
    if printed:
        assert out.startswith("gpu defaults: --xla_gpu_enable_latency_hiding_scheduler=true")
        assert out.count("\n") == 1 and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9" in out
        assert "pipelined_all_reduce" not in out  # the user's =false stays
        assert "--xla_gpu_enable_pipelined_all_reduce=false" in os.environ["XLA_FLAGS"]
    else:
        assert out == ""
        assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_pipelined_all_reduce=false"
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


def test_no_gpu_defaults_flag_on_train_and_compile():
    parser = cli.build_parser()
    assert parser.parse_args(["train", "--no-gpu-defaults"]).no_gpu_defaults is True
    assert parser.parse_args(["compile", "--no-gpu-defaults"]).no_gpu_defaults is True
    assert parser.parse_args(["train"]).no_gpu_defaults is False


def test_the_pipeliner_flags_are_left_out_from_jaxlib_0_12():
    """jaxlib 0.12's XLA has no compile option for the three collective-pipeliner flags ("No such
    compile option", measured on its CPU and ROCm compilers): the defaults leave them out there,
    keep them on 0.10 and 0.11, and every other flag stays."""
    old, new = gpu_defaults.current("0.11.2"), gpu_defaults.current("0.12.0.1")
    assert old == gpu_defaults.XLA_FLAGS
    assert set(old) - set(new) == set(gpu_defaults.RETIRED)
    assert len(new) == len(gpu_defaults.XLA_FLAGS) - 3
    import jax

    compiled = jax.jit(lambda a: a + 1).lower(jax.numpy.ones(2))
    for name in gpu_defaults.current():  # each accepted by this jaxlib's compiler
        compiled.compile(compiler_options={name: True})


def test_fp8_runs_get_cublaslt_fp8_gemms_and_no_other_run_does(monkeypatch, capsys):
    """--precision fp8 adds --xla_gpu_enable_triton_gemm=false (XLA's Triton GEMM rewriter runs
    before its cuBLAS FP8 rewriter and would take the FP8 dots: gpu_defaults' docstring); bf16 and
    float32 leave Triton's GEMMs to the autotuner; a user's own value is kept. (What XLA compiles
    then: tests/compile/test_aot.py.)"""
    assert gpu_defaults.current(precision="fp8")["xla_gpu_enable_triton_gemm"] == "false"
    for precision in (None, "bf16", "float32"):
        assert "xla_gpu_enable_triton_gemm" not in gpu_defaults.current(precision=precision)
    env = {}
    assert "--xla_gpu_enable_triton_gemm=false" in gpu_defaults.apply(env, precision="fp8")
    mine = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    assert not any("triton" in a for a in gpu_defaults.apply(mine, precision="fp8"))
    options = gpu_defaults.compiler_options(mine["XLA_FLAGS"], gpu_defaults.current(
        precision="fp8"))
    assert options["xla_gpu_enable_triton_gemm"] is True  # the user's
    # train reads the run's precision from its flags before jax starts
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    for name in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "JPHANTOM_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    cli.train_gpu_defaults(cli.build_parser().parse_args(["train", "--precision", "fp8"]))
    assert "--xla_gpu_enable_triton_gemm=false" in capsys.readouterr().out
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cli.train_gpu_defaults(cli.build_parser().parse_args(["train", "--precision", "bf16"]))
    assert "triton" not in capsys.readouterr().out + os.environ["XLA_FLAGS"]


def test_an_fp8_gemm_benchmark_compiles_with_the_fp8_runs_kernel_choice():
    """A GEMM benchmark's process has the bf16 flags (Triton GEMMs on): its FP8 GEMM gets the FP8
    run's options per compile on an NVIDIA GPU (the user's value kept), none elsewhere."""
    from types import SimpleNamespace

    h200 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
    assert gpu_defaults.fp8_gemm_options(h200, {}) == {"xla_gpu_enable_triton_gemm": False}
    mine = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    assert gpu_defaults.fp8_gemm_options(h200, mine) == {"xla_gpu_enable_triton_gemm": True}
    for other in (SimpleNamespace(platform="gpu", device_kind="AMD Instinct MI300X"),
                  SimpleNamespace(platform="cpu", device_kind="cpu")):
        assert gpu_defaults.fp8_gemm_options(other, {}) == {}


def test_pipelined_runs_do_not_double_buffer_their_loops(monkeypatch, capsys):
    """A run with a ``stage`` axis over 1 gets --xla_gpu_enable_while_loop_double_buffering=false
    (PIPELINE_XLA_FLAGS: the schedule's tick loop unrolled by two held two ticks' buffers and
    made XLA rematerialise); every other run keeps it on; a user's own value is kept."""
    flag = "xla_gpu_enable_while_loop_double_buffering"
    assert gpu_defaults.current(pipelined=True)[flag] == "false"
    assert gpu_defaults.current()[flag] == "true"
    assert [gpu_defaults.is_pipelined(m) for m in ("data=2,stage=4", "stage=1,model=8",
                                                    "data=8", None, "stage=x")] == [
        True, False, False, False, False]  # a mesh that does not parse is for the run to refuse
    mine = {"XLA_FLAGS": f"--{flag}=true"}
    assert not any(flag in a for a in gpu_defaults.apply(mine, pipelined=True))
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    for name in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "JPHANTOM_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    cli.train_gpu_defaults(cli.build_parser().parse_args(
        ["train", "--model", "llama", "--mesh", "stage=2,data=2", "--microbatches", "2"]))
    assert f"--{flag}=false" in capsys.readouterr().out
