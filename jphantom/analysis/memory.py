"""Will a training step fit? A simple per-device estimate, checked before anything is allocated.

Training at a size that cannot fit (width 2**20 is 8 TiB of dense weights) should fail at once with
the numbers, not after minutes of swapping or with an allocator crash. :func:`estimate_training_memory`
adds up, per device:

===================  ========  ===================================================================
entry                how       what
===================  ========  ===================================================================
``parameters``       exact     the device's shards of every parameter (``abstract_params``: shapes
                               and shardings only, nothing allocated)
``gradients``        exact     = parameters (jax materialises every gradient before the update)
``optimizer_state``  exact     ``optimizer_states`` x parameters (0 SGD, 1 momentum, 2 Adam;
                               scalar step counters left out)
``batch``            exact     the device's shards of the inputs and targets
``activations``      rough     ``depth x local batch x width`` elements: one full-width activation
                               per layer and sample (what tensor-t1 saves for its backward; the
                               other strategies save that or less). Compiler temporaries are not
                               counted, so this is a lower bound of the real peak.
===================  ========  ===================================================================

:func:`available_memory` is what a device can hold: ``jax.devices()[0].memory_stats()["bytes_limit"]``
where the backend reports it (GPUs), else the host's physical memory (``os.sysconf``) shared by the
devices of the mesh (simulated CPU devices all live in the host's memory).
:func:`check_fits` raises :class:`ConfigError` with the estimate when the total exceeds it.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from jphantom.errors import ConfigError

OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2}
GIB = 2**30


def _device_bytes(abstract) -> int:
    total = 0
    for leaf in jax.tree.leaves(abstract):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def estimate_training_memory(program, mesh, model_config, *, batch: int,
                             optimizer_states: int) -> dict[str, int]:
    """Bytes per device of one training step of ``program`` on ``mesh`` (module docstring)."""
    from jphantom.step import abstract_params

    params = _device_bytes(abstract_params(program, mesh))
    itemsize = np.dtype(model_config.dtype).itemsize
    batch_shape = (batch, model_config.width)
    batch_bytes = sum(_device_bytes(jax.ShapeDtypeStruct(batch_shape, model_config.dtype,
                                                         sharding=s))
                      for s in program.batch_shardings(mesh))
    local_batch = batch // program.mesh.size("data")
    estimate = {
        "parameters": params,
        "gradients": params,
        "optimizer_state": optimizer_states * params,
        "batch": batch_bytes,
        "activations": model_config.depth * local_batch * model_config.width * itemsize,
    }
    estimate["total"] = sum(estimate.values())
    return estimate


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def available_memory(mesh) -> tuple[int | None, str]:
    """(bytes one device of ``mesh`` can hold, where the number comes from); None if unknown."""
    device = mesh.devices.flat[0]
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics raise or return None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory_stats()['bytes_limit']"
    host = _host_memory()
    if host is None:
        return None, "unknown"
    devices = mesh.devices.size
    return host // devices, (f"host physical memory {host / GIB:.1f} GiB shared by {devices} "
                             f"{device.platform} device(s)")


def check_fits(estimate: dict[str, int], mesh, what: str = "this training step") -> None:
    """Raise :class:`ConfigError` with the estimate if it exceeds :func:`available_memory`."""
    limit, source = available_memory(mesh)
    if limit is None or estimate["total"] <= limit:
        return
    parts = ", ".join(f"{name} {value / GIB:.3g}" for name, value in estimate.items()
                      if name != "total")
    raise ConfigError(
        f"{what} needs about {estimate['total'] / GIB:.3g} GiB per device ({parts} GiB), more than "
        f"the {limit / GIB:.3g} GiB available ({source}). Use a smaller width, depth or batch, "
        "more shards, or a lighter optimizer.")
