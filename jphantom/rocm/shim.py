"""The private jax names jphantom touches for AMD GPUs it does not have, in one place.

jax registers the ROCm PJRT plugin (``jax_plugins.xla_rocm7.initialize``) only after
``jax._src.hardware_utils.num_available_amd_gpus`` finds a GPU under ``/sys/class/kfd``; without
one it raises ``No AMD GPUs were found, skipping ROCm plugin initialization`` and
``jax.experimental.topologies.get_topology_desc(platform="rocm", ...)`` then fails with
``topology not implemented for rocm``. The CUDA plugin has no such gate. Compiling needs no GPU,
so :func:`allow_without_gpu` makes that count one *for plugin registration only*, before jax
discovers its plugins, and only where the count is zero; nothing else in jax reads it.

Tested against jax 0.12.0 (the only version with a ROCm plugin on the registry) by
``tests/compile/test_rocm.py``, which checks that the function still exists with this signature,
so a jax that renames it fails there, in one place, rather than in a user's compile.

Without an AMD GPU, jax's plugin discovery also logs the ROCm plugin declining ("Jax plugin
configuration error: Exception when calling jax_plugins.xla_rocm7.initialize()" and a traceback)
at every start, through the logger of its private module ``jax._src.xla_bridge``:
:func:`quiet_declined_plugin` drops that record and no other (the command line uses it where no
accelerator is present, :mod:`jphantom.cli.quiet`).
"""

from __future__ import annotations

import inspect
import logging

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


class PluginDeclined(logging.Filter):
    """Drops jax's record of the ROCm plugin declining to start for want of a GPU."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("Jax plugin configuration error" in message and "xla_rocm" in message)


LOGGER = "jax._src.xla_bridge"  # private: where jax's plugin discovery logs


def quiet_declined_plugin() -> None:
    """Drop the ROCm plugin's declining record from jax's plugin-discovery log (module
    docstring); every other record is kept."""
    logging.getLogger(LOGGER).addFilter(PluginDeclined())


__all__ = ["LOGGER", "PluginDeclined", "allow_without_gpu", "quiet_declined_plugin"]
