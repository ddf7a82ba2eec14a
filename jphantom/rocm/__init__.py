"""Compiling for AMD Instinct GPUs (MI250X, MI300X, MI350X) from a machine without one.

``jphantom compile --target rocm:mi250x`` uses XLA's ROCm compiler through jax's ROCm PJRT plugin
(``pip install 'jphantom[rocm]'``: jax 0.12.0 and ``jax-rocm7-pjrt``, Python >= 3.12) as
``--target gpu:h100`` uses the CUDA plugin: ``jax.experimental.topologies`` gives the target's
devices from a ``GpuTargetConfigProto`` (XLA's own MI250/MI300X/MI350X descriptions, shipped in
:mod:`jphantom.targets`) and the training step compiles to AMDGPU code objects, with the
target's memory, collectives and kernels. Two things stand between the plugin and a CPU-only
machine, each in one module:

- :mod:`jphantom.rocm.stubs`: the plugin links ROCm's runtime libraries at load; stand-ins are
  built once (gcc, readelf) into a cache and loaded, never where ROCm is installed;
- :mod:`jphantom.rocm.shim`: jax registers the plugin only if it counts an AMD GPU; the one
  private-API bypass, documented and tested.

:func:`prepare` does both, before jax starts its backends; :func:`problem` says why this
environment cannot (one line), before anything is built.
"""

from __future__ import annotations

import importlib.metadata
import sys

INSTALL = "pip install 'jphantom[rocm]'  (Python >= 3.12; jax 0.12.0)"
PJRT = "jax-rocm7-pjrt"


def problem() -> str | None:
    """Why this environment cannot compile for ROCm, or None."""
    if sys.version_info < (3, 12):
        return (f"compiling for ROCm needs Python >= 3.12 (the ROCm plugin's wheels are cp312/"
                f"cp313; this is {sys.version_info.major}.{sys.version_info.minor}): {INSTALL}")
    try:
        pjrt = importlib.metadata.version(PJRT)
    except importlib.metadata.PackageNotFoundError:
        return f"compiling for ROCm needs {PJRT} at jaxlib's version: {INSTALL}"
    jaxlib = importlib.metadata.version("jaxlib")
    if pjrt != jaxlib:
        return (f"{PJRT} {pjrt} differs from jaxlib {jaxlib}: the plugin must match it: "
                f"pip install 'jaxlib=={pjrt}' 'jax=={pjrt}'")
    if not sys.platform.startswith("linux"):
        return "the ROCm plugin is Linux only"
    return None


_prepared: dict = {}


def prepare() -> dict:
    """Make this process able to compile for ROCm: stand-in libraries where ROCm is missing, the
    plugin allowed to register without a GPU. Call before jax's backends start; once per process.
    Returns what it did (``stubbed``: the stand-ins' sonames; ``gpu_count_patched``)."""
    if not _prepared:
        from jphantom.rocm import shim, stubs

        paths = stubs.ensure()
        patched = shim.allow_without_gpu()
        _prepared.update(stubbed=[p.name for p in paths], gpu_count_patched=patched,
                         stub_folder=str(paths[0].parent) if paths else None)
    return dict(_prepared)


def register_plugin() -> None:
    """Register jax's ROCm plugin now (its own ``initialize()``, as jax's plugin discovery calls
    it): for a process whose jax discovered its plugins before :func:`prepare` (a test session,
    a notebook), when the plugin then declined for want of a GPU."""
    import importlib

    prepare()
    for name in ("jax_plugins.xla_rocm7", "jax_plugins.xla_rocm10"):
        try:
            plugin = importlib.import_module(name)
        except ImportError:
            continue
        plugin.initialize()
        return


def stand_ins() -> list[str]:
    """The ROCm runtime libraries this process loaded stand-ins for (empty before
    :func:`prepare`, or where ROCm is installed)."""
    return list(_prepared.get("stubbed", []))


__all__ = ["INSTALL", "prepare", "problem", "register_plugin", "stand_ins"]
