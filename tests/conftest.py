"""Test set-up: 8 simulated CPU devices and float64 available, set before jax initialises."""

import gc
import os
import pathlib
import shutil
import tempfile
from importlib.metadata import version

# The suite is compile-bound: LLVM's -O0 for the CPU backend compiles about a quarter faster and
# changes no floating-point semantics (XLA's HLO passes, fusion included, still run). jax 0.10's
# CPU compiler also keeps its legacy elemental emitters beside the fusion emitters (the only ones
# from jax 0.11): they compile the suite's programs about 4x faster (`make test` 564 -> 316 s on
# 2 cores) and are as exact in float32, but not in float64 (GPT-2's float64 gradients under
# tensor parallelism: 5.7e-10 from one device, against 1e-13 with the fusion emitters) and they
# give NaN on FP8's FNUZ formats, so the float64 checks at 1e-10 and the FNUZ steps compile with
# the fusion emitters (``helpers.jit_exact``).
LEGACY_EMITTERS = tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_backend_optimization_level=0"
                                   + (" --xla_cpu_use_fusion_emitters=false" if LEGACY_EMITTERS
                                      else ""))

# The suite runs on CPU devices; naming the platform also lets an installed CUDA plugin register
# without a GPU, for the ahead-of-time compiles of tests/compile/test_aot.py.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

# Tests compile many identical programs (the same tiny step in several tests and pages): jax's
# persistent compilation cache, in a directory of this session only (shared by its xdist
# workers, removed at its end; never inherited by the processes a test starts), compiles each
# once. Off with JPHANTOM_TEST_CACHE=0.
CACHE = pathlib.Path(tempfile.gettempdir()) / "jphantom-test-compiles-{}".format(
    os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid())
if os.environ.get("JPHANTOM_TEST_CACHE", "1") != "0":
    jax.config.update("jax_compilation_cache_dir", str(CACHE))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)  # library code always passes explicit dtypes
jax.devices()  # the 8 devices start now: a test's CLI call cannot shrink them for later tests

# Python's cyclic garbage collector took 42-45 s of each worker's ~1,000 s under Python 3.12
# (jax 0.12; counted with gc.callbacks): every traced step allocates many small objects. The
# modules imported so far never become garbage (freeze), and collections run 20-30x less often:
# test_transformer.py 53.5 -> 48.8 s and test_context.py 46.3 -> 42.8 s on 3.12, no change on
# 3.11. Tests hold no large buffer in reference cycles, so memory stays bounded.
gc.freeze()
gc.set_threshold(20_000, 20, 20)


def require_devices(count: int) -> None:
    """Skip (not fail) when the machine has fewer devices than a mesh needs."""
    if jax.device_count() < count:
        pytest.skip(f"needs {count} devices, have {jax.device_count()}")


@pytest.fixture
def mesh_of():
    """``mesh_of(4)`` -> a ``model=4`` mesh on the first 4 devices; ``mesh_of("data=2,model=4")``
    -> that mesh on the first 8. Skips when the machine has too few devices."""
    from jphantom.runtime.mesh import MeshConfig, first_devices

    def build(shape, axis: str = "model"):
        config = MeshConfig.parse(shape) if isinstance(shape, str) else MeshConfig.of({axis: shape})
        require_devices(config.device_count)
        return config.build(first_devices(config.device_count))

    return build


# The longest files first: `make test` sends whole files to its two workers (pytest-xdist's
# loadfile, so that a file's tests share their compiled steps) in collection order, and a long
# file taken last leaves the other worker idle at the end. The docs first: the README's runs
# compile the steps other tests' runs of the same shapes then read from the session's cache.
# Seconds per file on 2 cores, measured with `python benchmarks/suite_time.py` (Python 3.12,
# 2026-12-01; refresh when they change much).
LONGEST_FIRST = ("test_docs.py", "test_hf_families.py", "test_token_mean.py", "test_transformer.py",
                 "test_master_weights.py", "test_user_models.py", "test_pipeline.py",
                 "test_generate.py", "test_zero.py", "test_run.py", "test_remat.py",
                 "test_pmm3d.py", "test_verify.py", "test_resilience.py", "test_expert.py",
                 "test_llama.py", "test_zero_bubble_run.py", "test_gradient_sink.py",
                 "test_families.py", "test_chunked_loss.py", "test_collective_matmul.py",
                 "test_context.py", "test_attention_kernels.py", "test_byo_model.py",
                 "test_packed_attention.py", "test_fp8.py", "test_phantom.py", "test_inputs.py",
                 "test_train.py", "test_data_parallel.py", "test_moe_transformer.py",
                 "test_pipeline_cli.py", "test_hlo.py", "test_models.py", "test_checkpoint.py")


def pytest_configure(config):
    """pytest-xdist 3.7 and later send the files with the most tests first
    (``--loadscope-reorder``, on by default), which is not the longest first: keep the order
    :func:`pytest_collection_modifyitems` gives."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """``make test``'s 10-minute budget: a test marked ``slow`` where it is written runs only in
    ``make test-all``, and so does each cell a test names in ``@pytest.mark.slow_cells(ids)``
    (siblings of a faster cell of the same idea, which stays in the fast suite). Then the longest
    files first."""
    declared, seen = {}, set()
    for item in items:
        cells = item.get_closest_marker("slow_cells")
        if cells is None:
            continue
        test = f"{item.path.name}::{item.originalname}"
        declared[test] = set(cells.args)
        cell = item.callspec.id if hasattr(item, "callspec") else None
        seen.add((test, cell))
        if cell in cells.args:
            item.add_marker(pytest.mark.slow)
    check_slow_cells(declared, seen, {item.path.name for item in items})
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[id(item)]))


def check_slow_cells(declared: dict[str, set[str]], seen: set[tuple[str, str]],
                     files: set[str]) -> None:
    """Every cell a ``slow_cells`` mark names is one of its test's (checked when every test file
    was collected): a renamed parameter would otherwise silently leave the mark and join the
    fast suite's budget."""
    every_file = {p.name for p in pathlib.Path(__file__).parent.rglob("test_*.py")}
    if not every_file <= files:
        return
    missing = sorted(f"{test}[{cell}]" for test, cells in declared.items() for cell in cells
                     if (test, cell) not in seen)
    if missing:
        raise pytest.UsageError("slow_cells names cells its test does not have: "
                                + ", ".join(missing))


def pytest_sessionfinish(session, exitstatus):
    """The session's compilation cache goes with it (the controller's, after its workers)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(CACHE, ignore_errors=True)
