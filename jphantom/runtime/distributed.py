"""Multi-process start-up: ``jax.distributed.initialize`` plus the checks jax lacks.

jax detects the cluster itself (SLURM, Open MPI, Kubernetes, Cloud TPU, mpi4py, and its own
``JAX_COORDINATOR_ADDRESS`` / ``JAX_COORDINATOR_PORT`` / ``JAX_LOCAL_DEVICE_IDS``), so
:func:`initialize` passes on only what it is given. jphantom adds: validation of every coordinator
setting it can see before jax sees it (:func:`check_settings`; jax 0.10 segfaults on port ``abc``
and aborts on port 99999); process 0 checks that its port can be bound, the others that a jax
coordinator answers within the timeout, where jax would abort (:mod:`jphantom.runtime.coordinator`); gloo
CPU collectives and ``jax_num_cpu_devices``; ``initialization_timeout`` and
``heartbeat_timeout_seconds`` passed through (a process whose peer dies exits with jax's "another
task died" error within the heartbeat timeout).

jax has no variables for the process count and id outside its cluster detection, so
:func:`initialize_from_env` (``jphantom launch`` children, the CLI) reads ``JPHANTOM_NUM_PROCESSES``,
``JPHANTOM_PROCESS_ID``, ``JPHANTOM_DEVICES_PER_PROCESS``, ``JPHANTOM_INIT_TIMEOUT`` and jax's
``JAX_COORDINATOR_ADDRESS``; ``JPHANTOM_DISTRIBUTED=1`` lets jax detect everything (srun, mpirun).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping, Sequence

from jphantom.runtime.coordinator import (check_port_free, check_reaches_self, probe_coordinator,
                                  split_address)
from jphantom.errors import ConfigError, check_int

ENV_NUM_PROCESSES = "JPHANTOM_NUM_PROCESSES"
ENV_PROCESS_ID = "JPHANTOM_PROCESS_ID"
ENV_DEVICES = "JPHANTOM_DEVICES_PER_PROCESS"
ENV_TIMEOUT = "JPHANTOM_INIT_TIMEOUT"
ENV_DISTRIBUTED = "JPHANTOM_DISTRIBUTED"
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # jax's own; jax reads it too


def check_settings(coordinator_address=None, num_processes=None, process_id=None, *,
                   local_device_ids=None, local_device_count=None, initialization_timeout=300,
                   heartbeat_timeout_seconds=100, env: Mapping[str, str] | None = None,
                   platform=None) -> None:
    """Validate every setting :func:`initialize` will hand to jax; pure (reads only ``env``,
    default ``os.environ``, for jax's ``JAX_COORDINATOR_ADDRESS`` / ``JAX_COORDINATOR_PORT`` /
    ``JAX_COORDINATOR_BIND_ADDRESS``). ``None`` means "jax detects it". Raises ConfigError
    naming the setting, the constraint and the fix."""
    env = os.environ if env is None else env
    if coordinator_address is not None:
        split_address(coordinator_address)
    for name in (ENV_COORDINATOR, "JAX_COORDINATOR_BIND_ADDRESS"):
        if env.get(name) and (name != ENV_COORDINATOR or coordinator_address is None):
            split_address(env[name], name)
    port = env.get("JAX_COORDINATOR_PORT", "").strip()
    if port and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(f"JAX_COORDINATOR_PORT={port!r}: set it to an integer in 1..65535")
    if num_processes is not None:
        check_int("num_processes", num_processes, 1)
    if process_id is not None:
        check_int("process_id", process_id, 0)
        if num_processes is not None and process_id >= num_processes:
            raise ConfigError(f"process_id={process_id} is out of range for num_processes="
                              f"{num_processes}: give each process an id in 0..{num_processes - 1}")
    if local_device_count is not None:
        check_int("local_device_count", local_device_count, 1)
    ids = [local_device_ids] if isinstance(local_device_ids, int) else local_device_ids
    if ids is not None and (not isinstance(ids, Sequence) or not ids):
        raise ConfigError(f"local_device_ids={local_device_ids!r}: give a list like [0, 1]")
    for value in ids or ():
        check_int("local_device_ids entry", value, 0)
    check_int("initialization_timeout (seconds)", initialization_timeout, 1)
    check_int("heartbeat_timeout_seconds", heartbeat_timeout_seconds, 1)
    if platform is not None:
        names = [p.strip().lower() for p in str(platform).split(",")] if isinstance(
            platform, str) else []
        if not names or not all(p in PLATFORMS for p in names):
            raise ConfigError(f"platform={platform!r} is not a jax platform: give one of "
                              f"{', '.join(PLATFORMS)} (or a comma-separated list of them, as "
                              "JAX_PLATFORMS takes), or None to let jax choose")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None,
               platform: str | None = None, local_device_count: int | None = None,
               initialization_timeout: int = 300, heartbeat_timeout_seconds: int = 100,
               timeout_s: int | None = None) -> None:
    """Start jax's distributed runtime in this process; call it before any other jax call.

    Arguments left ``None`` are not passed on, so jax's cluster detection (SLURM, Open MPI,
    Kubernetes, TPU, ``JAX_COORDINATOR_ADDRESS``) fills them. ``platform`` (one of
    :data:`PLATFORMS`, or a comma-separated list of them) sets ``jax_platforms``;
    ``local_device_count`` sets ``jax_num_cpu_devices`` (CPU devices per process); CPU collectives
    across processes use gloo unless another implementation was configured. ``timeout_s`` is the
    old name of ``initialization_timeout``. Raises ConfigError for a bad setting, RuntimeError
    when no coordinator answers in time or jax fails; the half-started runtime is shut down.
    """
    if timeout_s is not None:
        initialization_timeout = timeout_s
    if "jax" in sys.modules and sys.modules["jax"].distributed.is_initialized():
        raise RuntimeError("jphantom.runtime.distributed.initialize was called twice; call shutdown() "
                           "first to restart the distributed runtime")
    check_settings(coordinator_address, num_processes, process_id,
                   local_device_ids=local_device_ids, local_device_count=local_device_count,
                   initialization_timeout=initialization_timeout,
                   heartbeat_timeout_seconds=heartbeat_timeout_seconds, platform=platform)
    address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    start = time.monotonic()
    if process_id == 0 and address:
        bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
        check_port_free(split_address(bind or address)[1])
        if not bind:
            check_reaches_self(address, min(initialization_timeout, 10))
    elif process_id is not None and address:
        probe_coordinator(address, initialization_timeout)

    import jax

    if platform is not None:
        jax.config.update("jax_platforms", platform)
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    given = dict(coordinator_address=coordinator_address, num_processes=num_processes,
                 process_id=process_id, local_device_ids=local_device_ids)
    try:
        jax.distributed.initialize(
            **{k: v for k, v in given.items() if v is not None},
            initialization_timeout=max(1, math.ceil(initialization_timeout
                                                    - (time.monotonic() - start))),
            heartbeat_timeout_seconds=heartbeat_timeout_seconds)
    except Exception as err:
        shutdown()
        if isinstance(err, ValueError) and "be defined" in str(err):  # jax lacks a value
            raise ConfigError(
                f"jax found no cluster to join ({err}). Fix: pass coordinator_address='host:port', "
                "num_processes and process_id (for the CLI: JAX_COORDINATOR_ADDRESS, "
                f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}), or start the processes with "
                "`jphantom launch`, srun or mpirun") from err
        where = ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None) or "detected"
        raise RuntimeError(f"jax.distributed.initialize failed ({where}): "
                           f"{type(err).__name__}: {err}") from err


def initialize_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Initialise when the environment asks for it; return whether it did.

    Triggered by ``JPHANTOM_NUM_PROCESSES`` / ``JPHANTOM_PROCESS_ID`` (set by ``jphantom launch``)
    or ``JPHANTOM_DISTRIBUTED=1`` (jax detects everything: srun, mpirun, Kubernetes). Also reads
    ``JAX_COORDINATOR_ADDRESS``, ``JPHANTOM_DEVICES_PER_PROCESS``, ``JPHANTOM_INIT_TIMEOUT``.
    """
    env = os.environ if env is None else env
    if not (env.get(ENV_NUM_PROCESSES) or env.get(ENV_PROCESS_ID)
            or env.get(ENV_DISTRIBUTED, "").strip() == "1"):
        return False

    def number(name: str) -> int | None:
        text = env.get(name, "").strip()
        if text and not text.lstrip("-").isdigit():
            raise ConfigError(f"{name}={text!r} is not an integer: set it to a whole number")
        return int(text) if text else None

    timeout = number(ENV_TIMEOUT)
    try:
        if env.get(ENV_COORDINATOR):
            split_address(env[ENV_COORDINATOR], ENV_COORDINATOR)
        initialize(env.get(ENV_COORDINATOR) or None, number(ENV_NUM_PROCESSES),
                   number(ENV_PROCESS_ID), local_device_count=number(ENV_DEVICES),
                   initialization_timeout=300 if timeout is None else timeout)
    except ConfigError as err:
        names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_DEVICES, ENV_TIMEOUT)
        given = ", ".join(f"{n}={env[n]}" for n in names if env.get(n))
        raise ConfigError(f"{err} (from the environment: {given or ENV_DISTRIBUTED + '=1'})") from None
    return True


def shutdown() -> None:
    """Shut down jax's distributed runtime in this process (no-op when it is not running)."""
    import jax

    jax.distributed.shutdown()


def is_initialized() -> bool:
    """Whether jax's distributed runtime is running in this process."""
    import jax

    return jax.distributed.is_initialized()


_ACCELERATOR_PLATFORMS = ("cuda", "gpu", "rocm", "tpu")
PLATFORMS = ("cpu", *_ACCELERATOR_PLATFORMS)
"""The ``platform`` values :func:`initialize` accepts (jax's ``jax_platforms`` names)."""
GPU_PLUGINS = {"nvidia-smi": ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12",
                           "jax_plugins.xla_cuda13"),
            "rocm-smi": ("jax_rocm60_plugin", "jax_rocm7_plugin", "jax_plugins.xla_rocm60",
                         "jax_plugins.xla_rocm7")}


def has_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def accelerator_visible(env=None) -> bool:
    """Whether jax will find an accelerator, decided without starting jax (jax cannot change its
    device count once started): ``JAX_PLATFORMS`` names one (``cuda``, ``gpu``, ``rocm``,
    ``tpu``), or it is unset and ``nvidia-smi`` / ``rocm-smi`` is on the PATH with a matching jax
    plugin installed."""
    import shutil

    env = os.environ if env is None else env
    platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return any(p in _ACCELERATOR_PLATFORMS for p in platforms)
    return any(shutil.which(tool) and any(has_module(m) for m in modules)
               for tool, modules in GPU_PLUGINS.items())
