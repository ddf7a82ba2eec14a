"""Device meshes from named axis sizes, and CPU device simulation for scripts.

jphantom builds every mesh with ``AxisType.Auto`` axes: the parallel layers use ``jax.shard_map`` with
explicit ``in_specs``/``out_specs`` (so every collective is written by hand), and the GSPMD baseline
relies on the compiler choosing collectives from ``NamedSharding`` annotations, which is what Auto
axes are for. ``jax.make_mesh`` defaults to Explicit axes in jax 0.10; we never rely on that.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jphantom.errors import ConfigError


def simulate_cpu_devices(count: int) -> None:
    """Make the CPU backend expose ``count`` devices. Call before jax initialises its backends.

    Scripts and the CLI call this in their entry points (never at import time of the library). If the
    backend is already up with a different device count, this raises instead of silently doing nothing.
    """
    if count < 1:
        raise ConfigError(f"device count {count} must be >= 1")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        have = jax.local_device_count() if jax.default_backend() == "cpu" else None
        if have == count:
            return
        raise RuntimeError(
            f"simulate_cpu_devices({count}) was called after jax initialised its backends "
            f"(backend={jax.default_backend()!r}, local devices={jax.local_device_count()}). Call it "
            "first thing in your script, before any jax computation, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} in the environment."
        )
    jax.config.update("jax_num_cpu_devices", count)
    # Also export the flag so that child processes (and older jax versions) see the same count.
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])


def ensure_devices(count: int) -> None:
    """Scripts' entry: at least ``count`` devices. Simulates ``count`` CPU devices if jax has not
    started yet; if it has (a test process, a GPU host) and has enough devices, does nothing;
    otherwise raises with the fix."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if jax.device_count() >= count:
            return
        raise ConfigError(
            f"{count} devices needed, jax already runs with {jax.device_count()}: start a fresh "
            f"process, or set XLA_FLAGS=--xla_force_host_platform_device_count={count} before jax "
            "starts")
    simulate_cpu_devices(count)


def make_mesh(
    axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None, *, strict: bool = False
) -> Mesh:
    """Build a mesh from named axis sizes, e.g. ``make_mesh({"data": 2, "model": 4})``.

    The product of the sizes must not exceed the number of devices. With ``strict=False`` (default) a
    smaller mesh takes the first devices, which is how tests run p=2 on 8 simulated devices; with
    ``strict=True`` the product must equal the device count exactly.
    """
    if not axes:
        raise ConfigError("mesh axes are empty: pass at least one axis, e.g. {'model': 8}")
    for name, size in axes.items():
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ConfigError(f"mesh axis {name!r} has size {size!r}; sizes must be integers >= 1")
    needed = math.prod(axes.values())
    pool = list(jax.devices()) if devices is None else list(devices)
    if needed > len(pool) or (strict and needed != len(pool)):
        raise ConfigError(
            f"mesh {dict(axes)} needs {needed} devices but {len(pool)} are available "
            f"({pool[0].platform if pool else 'none'}). Fix: use a mesh whose sizes multiply to at most "
            f"{len(pool)}, or on CPU simulate more devices with `--devices {needed}` / "
            f"jphantom.mesh.simulate_cpu_devices({needed}) before jax initialises."
        )
    grid = np.asarray(pool[:needed], dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes.keys()), axis_types=(AxisType.Auto,) * len(axes))


def axis_size(mesh: Mesh, axis: str) -> int:
    """Size of ``axis`` in ``mesh``, with a clear error if the mesh has no such axis."""
    if axis not in mesh.shape:
        raise ConfigError(
            f"mesh axes {tuple(mesh.axis_names)} have no axis {axis!r}: build the mesh with it, e.g. "
            f"make_mesh({{{axis!r}: N}}), or pass axis=<one of {tuple(mesh.axis_names)}>"
        )
    return int(mesh.shape[axis])
