"""Test set-up: 8 simulated CPU devices and float64 available, set before jax initialises."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

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
    from jphantom.mesh import make_mesh

    def build(num_shards: int, axis: str = "model"):
        require_devices(num_shards)
        return make_mesh({axis: num_shards})

    return build
