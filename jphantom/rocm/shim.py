"""The one private jax API jphantom touches to compile for AMD GPUs without one.

jax registers the ROCm PJRT plugin (``jax_plugins.xla_rocm7.initialize``) only after
``jax._src.hardware_utils.num_available_amd_gpus`` finds a GPU under ``/sys/class/kfd``; without
one it raises ``No AMD GPUs were found, skipping ROCm plugin initialization`` and
``jax.experimental.topologies.get_topology_desc(platform="rocm", ...)`` then fails with
``topology not implemented for rocm``. The CUDA plugin has no such gate. Compiling needs no GPU,
so :func:`allow_without_gpu` makes that count one *for plugin registration only*, before jax
discovers its plugins, and only where the count is zero; nothing else in jax reads it.

Tested against jax 0.12.0 (the only version with a ROCm plugin on the registry) by
``tests/test_rocm.py``, which checks that the function still exists with this signature, so a jax
that renames it fails there, in one place, rather than in a user's compile.
"""

from __future__ import annotations

import inspect

from jphantom.errors import ConfigError


def allow_without_gpu() -> bool:
    """Let the ROCm plugin register on a machine with no AMD GPU. Returns True if it patched
    (no GPU here), False where jax already counts one (nothing changed)."""
    from jax._src import hardware_utils  # private: the plugin's only gate (module docstring)

    count = getattr(hardware_utils, "num_available_amd_gpus", None)
    if count is None or "stop_at" not in inspect.signature(count).parameters:
        raise ConfigError("this jax has no jax._src.hardware_utils.num_available_amd_gpus("
                          "stop_at): compiling for ROCm is tested with jax 0.12.0 only: pip "
                          "install 'jphantom[rocm]'")
    if getattr(count, "jphantom_shim", False):
        return True
    if count(stop_at=1) > 0:
        return False

    def one_for_registration(stop_at: int | None = None) -> int:
        return 1

    one_for_registration.jphantom_shim = True
    hardware_utils.num_available_amd_gpus = one_for_registration
    return True


__all__ = ["allow_without_gpu"]
