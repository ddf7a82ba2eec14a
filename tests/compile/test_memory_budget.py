"""A GPU run's memory (jphantom.costs.budget): the fraction jax's allocator takes, the budget jax
passes to XLA with it, and the slop factor that gives an ahead-of-time compile the same budget.
(That `jphantom compile` passes the factor and reports the limit: tests/compile/test_aot.py, with
the GPU compiler.)"""

import jax
import pytest

from jphantom.analysis.compiled import abstract_batch, compiled_memory
from jphantom.config import RunConfig
from jphantom.costs import budget
from jphantom.errors import ConfigError

H100 = 84942979072  # XLA's h100_sxm description: device_memory_size
GIB = 2**30


def test_the_fraction_is_the_users_else_jphantoms_else_jaxs():
    assert budget.memory_fraction(True, {}) == 0.9  # jphantom's GPU default
    assert budget.memory_fraction(False, {}) == 0.75  # jax's own
    assert budget.memory_fraction(True, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.97"}) == 0.97
    assert budget.memory_fraction(True, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}) is None
    for bad in ("0", "1.5", "most"):
        with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION=.*at most 1"):
            budget.memory_fraction(True, {"XLA_PYTHON_CLIENT_MEM_FRACTION": bad})


@pytest.mark.parametrize("fraction", [0.75, 0.9, 0.98])
def test_the_slop_factor_gives_the_ahead_of_time_compile_the_runs_budget(fraction):
    """XLA without an allocator budgets 80% of the device; with the factor, its budget is the
    run's (the allocator's limit less the inputs and outputs, times 95%) to within one percent
    of the fallback's room (the factor is a whole percent)."""
    io = int(11.22 * GIB)  # NeMo's Llama3-8B layout on 8 H100s: sharded master and moments
    slop = budget.runtime_slop_factor(H100, fraction, io)
    fallback = H100 * 80 // 100
    run = budget.scheduler_budget(budget.allocator_bytes(H100, fraction), io)
    assert abs(budget.scheduler_budget(fallback, io, slop) - run) <= (fallback - io) // 100
    assert budget.runtime_slop_factor(H100, None, io) == 95  # the platform allocator: XLA's 80%
    assert budget.runtime_slop_factor(H100, 0.9, io, slop_percent=150) > 150  # the user's factor
    assert budget.runtime_slop_factor(H100, 0.9, 0) == round(95 * 0.9 / 0.8)


def test_the_users_slop_factor_is_read_from_xla_flags():
    assert budget.slop_from_flags("--xla_dump_to=/tmp/d") == 95
    assert budget.slop_from_flags("--xla_gpu_memory_limit_slop_factor=175 --x=1") == 175
    with pytest.raises(ConfigError, match="whole percent"):
        budget.slop_from_flags("--xla_gpu_memory_limit_slop_factor=lots")


@pytest.mark.parametrize("flags", [
    dict(mesh="data=2,model=4", zero=1, master_weights="sharded", accumulate=2),
    pytest.param(dict(mesh="data=8", zero=3), marks=pytest.mark.slow),  # make test: the first
])
def test_inputs_and_outputs_estimated_before_compiling_are_xlas(flags):
    """The estimate from the abstract arguments and the lowering equals the compiled program's
    arguments + outputs - aliased, less XLA's tuple pointer tables (8 bytes a leaf)."""
    config = RunConfig.from_flags(model="llama", layers=2, hidden=64, heads=4, kv_heads=2,
                                  intermediate=128, vocab=256, seq_len=32, batch=8,
                                  optimizer="adamw", precision="bf16", strategy="tensor",
                                  **flags)
    built = config.build()
    arguments = (built.step.abstract_state(), *abstract_batch(config, built.program, built.step))
    lowered = built.step.lower(*arguments)
    estimate = budget.io_bytes(arguments, lowered.args_info, lowered.out_info)
    memory = compiled_memory(lowered.compile())
    exact = budget.compiled_io_bytes(memory)
    assert memory["alias_bytes"] > 0  # the state is donated and aliased
    tables = 8 * (len(jax.tree.leaves(lowered.out_info)) + len(jax.tree.leaves(arguments)))
    assert 0 <= exact - estimate <= tables, (exact, estimate)


def test_a_peak_fits_the_allocators_limit_not_the_whole_device():
    memory = {"argument_bytes": int(11.22 * GIB), "output_bytes": int(11.22 * GIB),
              "alias_bytes": int(11.22 * GIB)}
    peak = int(76.8 * GIB)  # NeMo's Llama3-8B layout on 8 H100s
    at_09 = budget.GpuMemory(H100, 0.9).report(peak, memory)
    assert not at_09["fits"] and at_09["limit_bytes"] == int(0.9 * H100) < peak < H100
    assert 0.97 < at_09["fraction_needed"] < 0.98
    assert at_09["scheduler_budget_bytes"] == (int(0.9 * H100) - int(11.22 * GIB)) * 95 // 100
    assert budget.GpuMemory(H100, 0.98).report(peak, memory)["fits"]
    assert budget.GpuMemory(H100, None).report(peak, memory)["limit_bytes"] == H100
