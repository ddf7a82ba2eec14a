"""The benchmark scripts run end to end (``--quick``, tiny sizes) and write a complete result;
what they compute exactly is asserted, their timing targets never."""

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import require_devices

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "phantom_vs_tp.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("phantom_vs_tp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # compiles and times every FFN strategy: ~6 s
def test_quick_benchmark_writes_every_strategy(tmp_path, capsys):
    require_devices(8)
    bench = _load_script()
    result = bench.main(["--quick", "--out", str(tmp_path), "--no-plot"])

    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["quick"] is True
    assert data["machine"]["devices"] == 8
    rows = {(r["strategy"], r["batch"]): r for r in data["rows"]}
    for batch in data["config"]["batches"]:
        for name in bench.STRATEGIES:
            row = rows[(name, batch)]
            for key in ("params", "flops_per_device", "flops_step", "step_seconds", "flops_per_second",
                        "collective_bytes_per_device", "collectives", "step_seconds_all"):
                assert key in row, f"{name}: missing {key}"
            assert row["step_seconds"] > 0 and row["flops_per_device"] > 0 and row["params"] > 0
            assert row["collective_bytes_per_device"] > 0  # every sharded strategy communicates
            assert len(row["step_seconds_all"]) == data["config"]["steps"]
    for name in bench.REFERENCES:
        assert data["reference"]["flops_per_second"][name] > 0
    assert data["compile"]["depth"] == 6 and data["compile"]["median_seconds"] > 0
    # (a) and (b) at every batch size, (c) at the largest, (d) once.
    kinds = [c["name"][:3] for c in data["targets"]]
    batches = len(data["config"]["batches"])
    assert kinds == ["(a)"] * batches + ["(b)"] * batches + ["(c)", "(d)"]
    for check in data["targets"]:
        assert {"measured", "target", "pass", "relation", "description"} <= set(check)
    assert result["rows"] == data["rows"]
    printed = capsys.readouterr().out
    assert "Targets:" in printed and "phantom-unfused" in printed


@pytest.mark.slow  # five compiled transformer steps: ~30 s
def test_quick_transformer_benchmark_reports_every_strategy(tmp_path):
    """The transformer benchmark runs (tiny sizes) and reports each strategy; its targets are
    printed, never asserted (speed lives in benchmarks)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "transformer_strategies.py"
    spec = importlib.util.spec_from_file_location("transformer_strategies", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quick", "--out", str(tmp_path)])
    labels = [row["label"] for row in result["rows"]]
    assert labels == ["dense", "gspmd", "tensor", "tensor + SP", "phantom"]
    by = {row["label"]: row for row in result["rows"]}
    assert by["phantom"]["collective_bytes_per_device"] < by["tensor"]["collective_bytes_per_device"]
    assert (tmp_path / "results.json").exists()


@pytest.mark.slow  # four compiled AdamW steps on 8 devices: ~15 s
def test_quick_zero_benchmark_reports_every_stage(tmp_path):
    """benchmarks/zero_stages.py runs (tiny sizes); model state at rest shrinks stage by stage as
    Cheng et al. say (parameters + Adam per device: 12P, (4 + 8/D)P, same, 12P/D)."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "zero_stages.py"
    spec = importlib.util.spec_from_file_location("zero_stages", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    stages = json.loads((tmp_path / "results.json").read_text())["stages"]
    state = [stages[f"zero-{z}"]["model_state_bytes"] for z in range(4)]
    assert state[0] > state[1] == state[2] > state[3]
    for z in range(4):
        row = stages[f"zero-{z}"]
        assert row["model_state_bytes"] == pytest.approx(row["model_state_formula_bytes"], rel=0.1)


@pytest.mark.slow  # two compiled GPT-2 steps and two abstract compiles: ~30 s
def test_quick_nnx_step_benchmark_moves_the_same_bytes_with_sgd_and_adamw(tmp_path):
    """benchmarks/nnx_step.py runs (tiny sizes): the optax update runs element-wise on the global
    arrays after the shard_map, so AdamW's step moves exactly SGD's collective bytes; the compile
    times of both depths are recorded (their target is printed, never asserted)."""
    require_devices(8)
    spec = importlib.util.spec_from_file_location(
        "nnx_step", Path(__file__).resolve().parents[2] / "benchmarks" / "nnx_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    moved = result["collective_bytes_per_device"]
    assert moved["sgd"] == moved["adamw"] > 0
    assert set(result["median_step_seconds"]) == {"sgd", "adamw"}
    assert {"2_layers", "sgd_main", "adamw_main"} <= set(result["compile_seconds"])


@pytest.mark.slow  # four child processes, each compiling a tiny Llama step: ~50 s
def test_gpu_step_small_runs_every_variant_side_by_side(tmp_path):
    """benchmarks/gpu_step.py --small (the device check, at CPU sizes): jphantom's bf16, fp8,
    chunk and accumulating variants and the plain-JAX reference each run in their own process, start from the
    same loss (ln V: both models' initial logits are near zero) and learn; the ratio of step
    times is reported; the Pallas blocks match the einsum blocks (interpreted here)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_step.py"
    done = subprocess.run([sys.executable, str(script), "--small", "--out", str(tmp_path),
                           "--steps", "2", "--warmup", "1", "--skip", "train"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_step.json").read_text())
    rows = {r["variant"]: r for r in results["variants"]}
    assert set(rows) == {"jphantom-bf16", "reference-bf16", "jphantom-fp8",
                         "jphantom-bf16-unchunked", "jphantom-bf16-c26", "jphantom-bf16-acc4"}
    for row in rows.values():
        assert "error" not in row, row
        assert abs(row["losses"][0] - 6.238) < 0.1  # ln 512
        assert row["losses"][-1] < row["losses"][0]
    assert rows["jphantom-bf16-c26"]["loss_chunks"] == 1  # 256 tokens x 512: one chunk anyway
    assert "ratio_jphantom_bf16_over_reference_bf16" in results
    assert rows["jphantom-bf16-acc4"]["accumulate"] == 4
    assert rows["jphantom-bf16-acc4"]["tokens_per_second"] > 0
    assert {"ratio_jphantom_fp8_over_jphantom_bf16",
            "ratio_jphantom_bf16_acc4_over_4x_jphantom_bf16",
            "ratio_compiled_temp_acc4_over_bf16"} <= set(results)
    blocks = results["flash-blocks"]
    assert blocks["interpreted"] and all(v["out"] < 0.01 for k, v in blocks.items()
                                         if isinstance(v, dict))


@pytest.mark.slow  # five child processes of train: ~30 s
def test_gpu_resilience_small_refuses_the_huge_step_and_resumes_exactly(tmp_path):
    """benchmarks/gpu_resilience.py --small (the device check, at CPU sizes): the step that does
    not fit is one line and exit 2 before work; SIGTERM leaves a checkpoint of the step reached
    and --resume ends with the uninterrupted run's loss (CPU is deterministic: exactly)."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_resilience.py"
    done = subprocess.run([sys.executable, str(script), "--small", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "gpu_resilience.json").read_text())
    assert results["memory"]["exit"] == 2 and results["memory"]["lines"] == 1
    assert not results["memory"]["resource_exhausted"]
    preempt = results["preempt"]
    assert preempt["exit"] == 143 and preempt["checkpoint_steps"] == [preempt["steps_done"]]
    assert preempt["abs_difference"] == 0.0 and preempt["run_to_run_abs_difference"] == 0.0


@pytest.mark.slow  # counts two git revisions (7.5 s); test_layering checks the rule itself
def test_code_counts_see_what_the_function_rule_sees():
    """benchmarks/code_counts.py counts the functions over 80 lines the layering test lists as
    exemptions (the same AST measure), and finds no strategy-name comparison in registry/program.py."""
    import importlib.util

    from test_layering import LONG_FUNCTIONS

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "code_counts.py"
    if not (path.parents[1] / ".git").exists():
        pytest.skip("counts a git revision: needs the repository's history")
    spec = importlib.util.spec_from_file_location("code_counts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.counts("HEAD")
    assert result["functions_over_80_lines"] == len(LONG_FUNCTIONS)
    assert "registry/program.py" not in result["files_comparing_strategy_names"]
    assert result["rule_messages"]["sequence parallelism needs tensor"] == 1
    # the family names the families' own modules compare are theirs to compare
    assert not [f for f in result["files_comparing_family_names"]
                if f.startswith("models/") or f == "registry/families.py"]
    assert result["root_modules"] == len(result["root_module_names"])
    assert all(len(where) > 1 for where in result["shared_class_names"].values())
    assert result["config_build_call_sites"] >= 1


def test_suite_time_sums_its_workers_files(tmp_path):
    """benchmarks/suite_time.py: the per-worker sums add up over the workers, by phase."""
    path = SCRIPT.parent / "suite_time.py"
    spec = importlib.util.spec_from_file_location("suite_time", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    summary = module.summary
    for worker, (compile_s, hits) in {"gw0": (2.0, 1), "gw1": (3.5, 2)}.items():
        (tmp_path / f"{worker}.json").write_text(json.dumps({
            "sums": {"/jax/core/compile/backend_compile_duration": compile_s,
                     "/jax/core/compile/jaxpr_trace_duration": 1.0},
            "counts": {"/jax/compilation_cache/cache_hits": hits,
                       "/jax/compilation_cache/compile_requests_use_cache": 4,
                       "gc generation 2": 1},
            "gc_seconds": 0.25,
            "tests": {"t/a.py::x": [1.0, compile_s, 2], f"t/{worker}.py::y": [hits, 0.5, 1]},
            "programs": {"jit(step)": [compile_s, 3], f"jit({worker})": [0.5, hits]}}))
    got = summary(tmp_path)
    assert got["backend compile"] == 5.5 and got["tracing"] == 2.0
    assert got["lowering to MLIR"] == 0.0
    assert got["compile requests"] == 8 and got["cache hits"] == 3
    assert got["garbage collector s"] == 0.5 and got["collections"] == {"gc generation 2": 2}
    # per file, longest first: a file's tests summed over the workers that ran them
    assert got["longest files (wall s, backend s, compiles)"] == {
        "t/a.py": [2.0, 5.5, 4], "t/gw1.py": [2.0, 0.5, 1], "t/gw0.py": [1.0, 0.5, 1]}
    # per program (jax's fun_name), costliest first, summed over the workers
    assert list(got["costliest programs (backend s, compiles)"].items()) == [
        ("jit(step)", [5.5, 6]), ("jit(gw0)", [0.5, 1]), ("jit(gw1)", [0.5, 2])]
    # the machine's speed, read beside the wall: one compile of the fixed reference program
    assert 0 < module.reference_compile(repeats=1) < 60
