"""Test set-up: 8 simulated CPU devices and float64 available, set before jax initialises."""

import os

# The suite is compile-bound: LLVM's -O0 for the CPU backend compiles about a quarter faster and
# changes no floating-point semantics (XLA's HLO passes, fusion included, still run).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_backend_optimization_level=0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)  # library code always passes explicit dtypes


def require_devices(count: int) -> None:
    """Skip (not fail) when the machine has fewer devices than a mesh needs."""
    if jax.device_count() < count:
        pytest.skip(f"needs {count} devices, have {jax.device_count()}")


@pytest.fixture
def mesh_of():
    """``mesh_of(4)`` -> a ``model=4`` mesh on the first 4 devices; ``mesh_of("data=2,model=4")``
    -> that mesh on the first 8. Skips when the machine has too few devices."""
    from jphantom.mesh import MeshConfig, first_devices

    def build(shape, axis: str = "model"):
        config = MeshConfig.parse(shape) if isinstance(shape, str) else MeshConfig.of({axis: shape})
        require_devices(config.device_count)
        return config.build(first_devices(config.device_count))

    return build
