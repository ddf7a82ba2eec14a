"""Device meshes: a frozen, validated description of named axis sizes, built with ``jax.make_mesh``.

Every jphantom program runs on one mesh whose axes come from a fixed vocabulary, outermost first:

=========  ================================================================================
axis       what it splits
=========  ================================================================================
``data``   the batch (data parallelism; ZeRO shards optimizer state, gradients, parameters)
``stage``  the layers (pipeline parallelism)
``expert`` the experts of a mixture-of-experts layer
``context`` the sequence of every activation (context parallelism: ring or all-gather attention,
           :mod:`jphantom.nn.attention`)
``z``      AxoNN's 3D matrix multiply, depth axis (Singh's thesis ch. 5)
``y``      AxoNN's 3D matrix multiply, column axis
``x``      AxoNN's 3D matrix multiply, row axis
``model``  the features of every layer (tensor and phantom parallelism): innermost, so that its
           devices are contiguous, as Megatron and AxoNN place tensor parallelism inside a node
=========  ================================================================================

A :class:`MeshConfig` lists only the axes a run uses, always in that order (``"model=4,data=2"`` is
the same mesh as ``"data=2,model=4"``). Absent axes have size 1 and are not part of the mesh: a
layer asks :meth:`MeshConfig.size` and skips the collectives of a trivial axis.

All axes are ``AxisType.Auto``: the parallel layers run inside ``jax.shard_map`` with explicit specs
(every collective written by hand), and the GSPMD baseline lets ``jax.jit`` choose collectives from
``NamedSharding`` annotations, which is what Auto axes are for.

A :class:`MeshConfig` is data: parsing and validating one imports neither jax nor numpy (a run's
configuration does it, :mod:`jphantom.config`); jax is imported where a mesh is built or devices
are asked for.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from jphantom.errors import ConfigError

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

# The mesh axis names, defined here only (every module that names an axis imports it from here).
DATA, STAGE, EXPERT, CONTEXT, Z, Y, X, MODEL = ("data", "stage", "expert", "context", "z", "y",
                                                 "x", "model")
AXES = (DATA, STAGE, EXPERT, CONTEXT, Z, Y, X, MODEL)
# The axes whose ranks hold different samples of the batch (the step splits the batch over them):
# data, expert (expert-data parallelism) and z (pmm3d's rows are split over it too).
BATCH_AXES = (DATA, EXPERT, Z)
MAX_SIMULATED_DEVICES = 512


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Named axis sizes in the canonical order of :data:`AXES`. Validated on construction.

    ``MeshConfig.of({"data": 2, "model": 4})``, ``MeshConfig.parse("data=2,model=4")``.
    """

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self):
        if not self.axes:
            raise ConfigError("the mesh has no axes: give at least one, e.g. 'model=8' or {'model': 8}")
        seen = set()
        for name, size in self.axes:
            if name not in AXES:
                raise ConfigError(f"unknown mesh axis {name!r}: use names from {AXES} "
                                  "(e.g. 'data=2,model=4')")
            if name in seen:
                raise ConfigError(f"mesh axis {name!r} is given twice: give each axis once")
            seen.add(name)
            if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                raise ConfigError(f"mesh axis {name!r} has size {size!r}; sizes must be integers >= 1")
        ordered = tuple(sorted(((n, int(s)) for n, s in self.axes), key=lambda a: AXES.index(a[0])))
        object.__setattr__(self, "axes", ordered)

    @classmethod
    def of(cls, axes: Mapping[str, int] | MeshConfig) -> MeshConfig:
        if isinstance(axes, MeshConfig):
            return axes
        if not isinstance(axes, Mapping):
            raise ConfigError(f"mesh axes must be a mapping like {{'model': 8}}, got {axes!r}")
        return cls(tuple(axes.items()))

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """``"data=2,model=4"`` -> MeshConfig. The one parser of mesh strings (CLI, TOML)."""
        axes = []
        items = [item.strip() for item in str(text).split(",")]
        if "" in items and any(items):
            raise ConfigError(f"mesh {text!r} has an empty entry: write NAME=SIZE entries "
                              "separated by single commas, e.g. 'data=2,model=4'")
        for item in items:
            if not item:
                continue
            name, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"mesh entry {item!r} is not NAME=SIZE: write e.g. 'data=2,model=4'")
            try:
                size = int(value.strip())
            except ValueError:
                raise ConfigError(f"mesh axis {name.strip()!r} has size {value.strip()!r}, not an "
                                  "integer: write e.g. 'data=2,model=4'") from None
            axes.append((name.strip(), size))
        return cls(tuple(axes))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> dict[str, int]:
        return dict(self.axes)

    @property
    def device_count(self) -> int:
        return math.prod(size for _, size in self.axes)

    def size(self, name: str) -> int:
        """Size of axis ``name``; 1 if the mesh does not have it."""
        return self.shape.get(name, 1)

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self.axes)

    def build(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The ``jax.sharding.Mesh`` over ``devices`` (default: all of ``jax.devices()``), whose
        count must equal the product of the axis sizes."""
        import jax
        from jax.sharding import AxisType, Mesh

        pool = list(jax.devices()) if devices is None else list(devices)
        if self.device_count != len(pool):
            platform = pool[0].platform if pool else "none"
            hint = (f"on CPU simulate them with `--devices {self.device_count}`"
                    if self.device_count > len(pool) else
                    f"pass devices=jax.devices()[:{self.device_count}] to use a subset")
            raise ConfigError(
                f"mesh {self} needs {self.device_count} devices but {len(pool)} are given "
                f"({platform}). Fix: use a mesh whose sizes multiply to {len(pool)}, or {hint}.")
        types = (AxisType.Auto,) * len(self.axes)
        split = node_split(self, pool)
        if split is None:
            return jax.make_mesh(tuple(size for _, size in self.axes), self.names,
                                 axis_types=types, devices=pool)
        from jax.experimental import mesh_utils

        inside, across = split
        grid = mesh_utils.create_hybrid_device_mesh(
            tuple(inside[n] for n in self.names), tuple(across[n] for n in self.names),
            devices=pool, process_is_granule=True)
        return Mesh(grid, self.names, axis_types=types)


def node_split(config: MeshConfig, devices: Sequence[jax.Device]
               ) -> tuple[dict[str, int], dict[str, int]] | None:
    """How ``config``'s axes split over the nodes (processes) of ``devices``: ``(inside,
    across)`` with ``inside[axis] * across[axis] == size``, the innermost axes (``model``, then
    ``x``, ``y``, ``z``, ``context``, ``expert``, ``stage``, ``data``) filling a node's devices first, as Megatron
    and AxoNN place tensor parallelism inside a node's NVLink domain; the rest spans nodes
    (``mesh_utils.create_hybrid_device_mesh`` builds the mesh). ``None`` when the devices are one
    node, or when the sizes cannot fill whole nodes (then devices are taken in order)."""
    nodes = sorted({d.process_index for d in devices})
    if len(nodes) < 2 or len(devices) % len(nodes):
        return None
    room = len(devices) // len(nodes)
    inside, across = {}, {}
    for name in reversed(config.names):
        size = config.size(name)
        inside[name] = math.gcd(size, room)
        across[name] = size // inside[name]
        room //= inside[name]
    return (inside, across) if room == 1 else None


def axis_domains(config: MeshConfig, domains: Sequence[tuple[str, int]]) -> dict[str, str]:
    """Where each axis's groups sit when the innermost axes fill nested domains of devices first,
    as :func:`node_split` fills a node: ``domains`` innermost first, ``(name, devices)``, e.g.
    ``(("package", 2), ("node", 8))`` for Frontier (an MI250X package holds 2 GCDs, joined by
    200 GB/s of Infinity Fabric; :mod:`jphantom.planner.clusters`). Each axis gets the name of
    the smallest domain that holds each of its groups whole (its size times the sizes of the axes
    inside it divides the domain's devices), else ``"across nodes"``. ``axis_domains(
    MeshConfig.parse("data=8,model=2"), (("package", 2), ("node", 8)))`` is ``{"model":
    "package", "data": "across nodes"}``. Devices are taken in order, a package's GCDs adjacent
    (as Frontier numbers them), so this is where :meth:`MeshConfig.build` puts them."""
    out = {}
    for domain, room in sorted(domains, key=lambda d: d[1], reverse=True):
        for name in reversed(config.names):  # innermost first, as node_split fills a node
            if room % config.size(name):
                break
            out[name] = domain
            room //= config.size(name)
    return {name: out.get(name, "across nodes") for name in config.names}


def axes_across_nodes(mesh: Mesh) -> tuple[str, ...]:
    """The axes of ``mesh`` whose groups hold devices of more than one node (process)."""
    import numpy as np

    grid = np.vectorize(lambda d: d.process_index)(mesh.devices)
    out = []
    for i, name in enumerate(mesh.axis_names):
        moved = np.moveaxis(grid, i, -1)
        if (moved != moved[..., :1]).any():
            out.append(name)
    return tuple(out)


_POOL: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("jphantom_device_pool",
                                                                     default=None)


@contextlib.contextmanager
def device_pool(devices: Sequence[jax.Device]) -> Iterator[None]:
    """Within the block, runs are built on ``devices`` instead of ``jax.devices()``: the devices of
    a target compiled ahead of time (:mod:`jphantom.costs.aot`: GPUs or TPUs this machine does not have,
    from ``jax.experimental.topologies``), whose meshes compile but never run."""
    token = _POOL.set(tuple(devices))
    try:
        yield
    finally:
        _POOL.reset(token)


def available_devices() -> tuple[jax.Device, ...]:
    """The devices runs are built on: :func:`device_pool`'s inside one, else ``jax.devices()``."""
    pool = _POOL.get()
    if pool is not None:
        return pool
    import jax

    return tuple(jax.devices())


def make_mesh(axes: Mapping[str, int] | MeshConfig | str,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """``make_mesh({"data": 2, "model": 4})`` or ``make_mesh("data=2,model=4")``: the mesh over
    ``devices`` (default all devices; the sizes must multiply to their count)."""
    config = MeshConfig.parse(axes) if isinstance(axes, str) else MeshConfig.of(axes)
    return config.build(devices)


def model_mesh(mesh: str | None, num_shards: int) -> MeshConfig:
    """The mesh of a run given as a mesh string and/or a shard count: ``mesh`` if given (then
    ``num_shards`` must be 1 or its ``model`` size), else ``model=<num_shards>``."""
    if mesh is None:
        return MeshConfig.of({"model": num_shards})
    config = MeshConfig.parse(mesh)
    if num_shards not in (1, config.size("model")):
        raise ConfigError(f"num_shards={num_shards} disagrees with mesh {mesh!r} "
                          f"(model={config.size('model')}): give one of them")
    return config


RAGGED_ALL_TO_ALL_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")  # XLA:CPU has none (jax-ml/jax#34755)


def has_ragged_all_to_all(platform: str | None = None) -> bool:
    """Whether XLA implements ``lax.ragged_all_to_all`` on ``platform`` (default: that of the
    first of :func:`available_devices`): its GPU and TPU backends do, its CPU backend does not
    (``tests/strategies/test_expert.py`` compiles one on this machine's backend to check the table)."""
    return (platform or available_devices()[0].platform) in RAGGED_ALL_TO_ALL_PLATFORMS


def first_devices(count: int) -> list[jax.Device]:
    """The first ``count`` devices, for meshes smaller than the machine (tests, shard sweeps)."""
    if count < 1:
        raise ConfigError(f"device count {count} must be >= 1")
    pool = available_devices()
    if count > len(pool):
        raise ConfigError(
            f"{count} devices needed but {len(pool)} are available "
            f"({pool[0].platform}): on CPU simulate more with `--devices {count}`")
    return list(pool[:count])


def mesh_config_of(mesh: Mesh) -> MeshConfig:
    return MeshConfig(tuple((name, int(size)) for name, size in mesh.shape.items()))


def axis_size(mesh: Mesh, axis: str) -> int:
    """Size of ``axis`` in ``mesh``, with a clear error if the mesh has no such axis."""
    if axis not in mesh.shape:
        raise ConfigError(
            f"mesh axes {tuple(mesh.axis_names)} have no axis {axis!r}: build the mesh with it, e.g. "
            f"make_mesh({{{axis!r}: N}}), or pass axis=<one of {tuple(mesh.axis_names)}>")
    return int(mesh.shape[axis])


def simulate_cpu_devices(count: int) -> None:
    """Make the CPU backend expose ``count`` devices. Call before jax initialises its backends.

    Scripts and the CLI call this in their entry points (never at import time of the library). If the
    backend is already up with a different device count, this raises instead of silently doing nothing.
    """
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SIMULATED_DEVICES:
        raise ConfigError(f"simulated device count {count!r} must be an integer in "
                          f"[1, {MAX_SIMULATED_DEVICES}]")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        have = jax.local_device_count() if jax.default_backend() == "cpu" else None
        if have == count:
            return
        raise RuntimeError(
            f"simulate_cpu_devices({count}) was called after jax initialised its backends "
            f"(backend={jax.default_backend()!r}, local devices={jax.local_device_count()}). Call it "
            "first thing in your script, before any jax computation, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} in the environment."
        ) from None
    # Also export the flag so that child processes see the same count.
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])


def ensure_devices(count: int) -> None:
    """Scripts' entry: at least ``count`` devices. Simulates ``count`` CPU devices if jax has not
    started yet; if it has (a test process, a GPU host) and has enough devices, does nothing;
    otherwise raises with the fix."""
    try:
        simulate_cpu_devices(count)
    except RuntimeError:
        import jax

        if jax.device_count() >= count:
            return
        raise ConfigError(
            f"{count} devices needed, jax already runs with {jax.device_count()}: start a fresh "
            f"process, or set XLA_FLAGS=--xla_force_host_platform_device_count={count} before jax "
            "starts") from None


def device_memory(mesh: Mesh) -> tuple[int | None, str]:
    """(bytes one device of ``mesh`` can hold, where the number comes from), read without
    allocating: the device's ``memory_stats()['bytes_limit']`` where the backend reports it
    (GPUs), else the host's physical memory (``os.sysconf``) shared by the mesh's devices
    (simulated CPU devices all live in the host's memory); ``(None, "unknown")`` if neither."""
    device = mesh.devices.flat[0]
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory statistics raise or return None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory_stats()['bytes_limit']"
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None, "unknown"
    devices = mesh.devices.size
    return host // devices, (f"host physical memory {host / 2**30:.1f} GiB shared by {devices} "
                             f"{device.platform} device(s)")
