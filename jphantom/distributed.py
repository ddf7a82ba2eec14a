"""Multi-process (multi-host) start-up: a thin, well-reported wrapper around ``jax.distributed``.

Call :func:`initialize` first thing in every process, before any jax computation; afterwards
``jax.devices()`` lists the devices of *all* processes, so ``jphantom.mesh.make_mesh`` builds a
global mesh and the phantom / tensor-parallel layers run unchanged across processes.

Where the cluster description comes from (per value, first match wins):

1. the explicit arguments of :func:`initialize`;
2. ``JPHANTOM_COORDINATOR`` (``host:port`` of process 0), ``JPHANTOM_NUM_PROCESSES``,
   ``JPHANTOM_PROCESS_ID``;
3. SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS`` and the first host of ``SLURM_STEP_NODELIST`` (or
   ``SLURM_JOB_NODELIST``), with the port from ``JPHANTOM_PORT``, else derived from ``SLURM_JOB_ID``
   (like jax does: one port in 61440-65535 per job), else :data:`DEFAULT_PORT`;
4. OpenMPI: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``; OpenMPI does not say where rank 0
   runs, so the coordinator still comes from ``JPHANTOM_COORDINATOR`` (or the argument).

:func:`resolve_cluster` does this resolution as a pure function (it reads a mapping you pass, never
initialises anything), which is what the tests exercise. Nothing here has import-time side effects.

On CPU (``platform="cpu"``, ``jax_platforms``/``JAX_PLATFORMS`` = cpu, or no accelerator plugin
installed) cross-process collectives need an implementation: :func:`initialize` selects gloo
(``jax_cpu_collectives_implementation="gloo"``) and ``local_device_count`` sets
``jax_num_cpu_devices`` (simulated CPU devices per process).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import socket
import time
from collections.abc import Mapping

from jphantom.errors import ConfigError

DEFAULT_PORT = 12355
"""Coordinator port used under SLURM when neither ``JPHANTOM_PORT`` nor ``SLURM_JOB_ID`` is set."""

_ENV_COORDINATOR = "JPHANTOM_COORDINATOR"
_ENV_NUM_PROCESSES = "JPHANTOM_NUM_PROCESSES"
_ENV_PROCESS_ID = "JPHANTOM_PROCESS_ID"
_ENV_PORT = "JPHANTOM_PORT"


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Resolved description of this process's place in a multi-process run.

    ``sources`` maps each of ``coordinator_address``, ``num_processes`` and ``process_id`` to where
    its value came from (an argument name or environment variable), for error messages and logs.
    ``local_process_id`` is the rank within the node when the launcher says so (``SLURM_LOCALID``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``), else ``None``.
    """

    coordinator_address: str
    num_processes: int
    process_id: int
    local_process_id: int | None = None
    sources: tuple[tuple[str, str], ...] = ()

    def source_of(self, field: str) -> str:
        """Where ``field`` came from, e.g. ``"SLURM_PROCID"`` or ``"argument process_id"``."""
        return dict(self.sources).get(field, "unknown")


def first_host(nodelist: str) -> str:
    """First host name of a SLURM nodelist.

    Handles the compressed forms SLURM prints: ``"node07"``, ``"a,b"``, ``"node[01-04]"``,
    ``"node[01,07-09],gpu[1-2]"`` (-> ``"node07"``, ``"a"``, ``"node01"``, ``"node01"``). Zero
    padding is kept as written.
    """
    text = nodelist.strip()
    if not text:
        raise ConfigError("SLURM nodelist is empty: cannot tell which host runs process 0")
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", text)
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        if not prefix:
            raise ConfigError(f"cannot parse SLURM nodelist {nodelist!r}: no host name before ','")
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not first:
        raise ConfigError(f"cannot parse SLURM nodelist {nodelist!r}: empty range in '[...]'")
    return f"{prefix}{first}"


def _parse_int(value: str, name: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def _slurm_port(env: Mapping[str, str]) -> int:
    if env.get(_ENV_PORT):
        return _parse_int(env[_ENV_PORT], _ENV_PORT)
    if env.get("SLURM_JOB_ID"):
        # Same rule as jax's own SLURM detection: a per-job port in [65535 - 2**12 + 1, 65535].
        return _parse_int(env["SLURM_JOB_ID"], "SLURM_JOB_ID") % 2**12 + (65535 - 2**12 + 1)
    return DEFAULT_PORT


def resolve_cluster(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> ClusterSpec:
    """Fill the unset cluster values from ``env`` (default ``os.environ``); pure, no jax calls.

    Reads, in this order per value: the arguments; ``JPHANTOM_COORDINATOR``,
    ``JPHANTOM_NUM_PROCESSES``, ``JPHANTOM_PROCESS_ID``; SLURM ``SLURM_PROCID``, ``SLURM_NTASKS``,
    ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` (+ ``JPHANTOM_PORT`` / ``SLURM_JOB_ID``),
    ``SLURM_LOCALID``; OpenMPI ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``.

    Raises :class:`ConfigError` naming every value that could not be found (and the variables that
    were tried), or when ``process_id`` is not in ``[0, num_processes)``.
    """
    env = os.environ if env is None else env
    sources: dict[str, str] = {}
    local_process_id: int | None = None

    if coordinator_address is not None:
        sources["coordinator_address"] = "argument coordinator_address"
    elif env.get(_ENV_COORDINATOR):
        coordinator_address = env[_ENV_COORDINATOR].strip()
        sources["coordinator_address"] = _ENV_COORDINATOR
    if num_processes is not None:
        sources["num_processes"] = "argument num_processes"
    elif env.get(_ENV_NUM_PROCESSES):
        num_processes = _parse_int(env[_ENV_NUM_PROCESSES], _ENV_NUM_PROCESSES)
        sources["num_processes"] = _ENV_NUM_PROCESSES
    if process_id is not None:
        sources["process_id"] = "argument process_id"
    elif env.get(_ENV_PROCESS_ID):
        process_id = _parse_int(env[_ENV_PROCESS_ID], _ENV_PROCESS_ID)
        sources["process_id"] = _ENV_PROCESS_ID

    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        if process_id is None:
            process_id = _parse_int(env["SLURM_PROCID"], "SLURM_PROCID")
            sources["process_id"] = "SLURM_PROCID"
        if num_processes is None:
            num_processes = _parse_int(env["SLURM_NTASKS"], "SLURM_NTASKS")
            sources["num_processes"] = "SLURM_NTASKS"
        nodelist_var = next(
            (v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(v)), None
        )
        if coordinator_address is None and nodelist_var is not None:
            coordinator_address = f"{first_host(env[nodelist_var])}:{_slurm_port(env)}"
            sources["coordinator_address"] = nodelist_var
        if env.get("SLURM_LOCALID"):
            local_process_id = _parse_int(env["SLURM_LOCALID"], "SLURM_LOCALID")
    elif "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        if process_id is None:
            process_id = _parse_int(env["OMPI_COMM_WORLD_RANK"], "OMPI_COMM_WORLD_RANK")
            sources["process_id"] = "OMPI_COMM_WORLD_RANK"
        if num_processes is None:
            num_processes = _parse_int(env["OMPI_COMM_WORLD_SIZE"], "OMPI_COMM_WORLD_SIZE")
            sources["num_processes"] = "OMPI_COMM_WORLD_SIZE"
        if env.get("OMPI_COMM_WORLD_LOCAL_RANK"):
            local_process_id = _parse_int(
                env["OMPI_COMM_WORLD_LOCAL_RANK"], "OMPI_COMM_WORLD_LOCAL_RANK"
            )

    missing = []
    if coordinator_address is None:
        missing.append(
            "coordinator_address (argument coordinator_address=, or JPHANTOM_COORDINATOR=host:port "
            "of process 0; under SLURM also SLURM_STEP_NODELIST/SLURM_JOB_NODELIST)"
        )
    if num_processes is None:
        missing.append(
            "num_processes (argument num_processes=, or JPHANTOM_NUM_PROCESSES, SLURM_NTASKS, "
            "OMPI_COMM_WORLD_SIZE)"
        )
    if process_id is None:
        missing.append(
            "process_id (argument process_id=, or JPHANTOM_PROCESS_ID, SLURM_PROCID, "
            "OMPI_COMM_WORLD_RANK)"
        )
    if missing:
        launcher = ""
        if "OMPI_COMM_WORLD_RANK" in env and coordinator_address is None:
            launcher = (
                " Running under OpenMPI: it does not say where rank 0 runs, so export "
                "JPHANTOM_COORDINATOR=<rank-0 host>:<free port> to every rank (mpirun -x)."
            )
        raise ConfigError(
            "jphantom.distributed.initialize cannot tell the cluster layout; missing: "
            + "; ".join(missing)
            + "."
            + launcher
            + " Fix: pass them as arguments, or export JPHANTOM_COORDINATOR=host:port, "
            "JPHANTOM_NUM_PROCESSES=N and JPHANTOM_PROCESS_ID=i (0..N-1) in every process, or "
            "launch with srun (SLURM) / mpirun (OpenMPI)."
        )
    if isinstance(coordinator_address, str) and ":" not in coordinator_address:
        raise ConfigError(
            f"coordinator_address={coordinator_address!r} (from "
            f"{sources['coordinator_address']}) has no port: write it as host:port, e.g. "
            f"{coordinator_address}:{DEFAULT_PORT}"
        )
    if num_processes < 1:
        raise ConfigError(
            f"num_processes={num_processes} (from {sources['num_processes']}) must be >= 1"
        )
    if not 0 <= process_id < num_processes:
        raise ConfigError(
            f"process_id={process_id} (from {sources['process_id']}) must be in "
            f"[0, {num_processes}) for num_processes={num_processes} "
            f"(from {sources['num_processes']})"
        )
    return ClusterSpec(
        coordinator_address=str(coordinator_address),
        num_processes=int(num_processes),
        process_id=int(process_id),
        local_process_id=local_process_id,
        sources=tuple(sorted(sources.items())),
    )


def _has_accelerator_plugin() -> bool:
    """Whether a GPU/TPU PJRT plugin is installed (checked without starting any jax backend)."""
    from importlib.metadata import entry_points

    if importlib.util.find_spec("libtpu") is not None:
        return True
    if list(entry_points(group="jax_plugins")):
        return True
    try:
        import jax_plugins  # namespace package used by the cuda/rocm plugins
    except ImportError:
        return False
    return bool(list(getattr(jax_plugins, "__path__", [])))


def _uses_cpu(platform: str | None) -> bool:
    import jax

    if platform is not None:
        return platform.lower() == "cpu"
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or ""
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not _has_accelerator_plugin()


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
    *,
    timeout_s: int = 120,
    platform: str | None = None,
) -> ClusterSpec:
    """Start jax's distributed runtime for this process; call it before any other jax call.

    Values not passed are read from the environment by :func:`resolve_cluster`:
    ``JPHANTOM_COORDINATOR``, ``JPHANTOM_NUM_PROCESSES``, ``JPHANTOM_PROCESS_ID``; then SLURM
    (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST``, port from
    ``JPHANTOM_PORT`` or ``SLURM_JOB_ID``); then OpenMPI (``OMPI_COMM_WORLD_RANK``,
    ``OMPI_COMM_WORLD_SIZE``, coordinator from ``JPHANTOM_COORDINATOR``). Nothing found raises
    :class:`ConfigError` listing exactly what is missing.

    ``platform`` (e.g. ``"cpu"``) also sets ``jax_platforms``. On CPU this selects gloo
    cross-process collectives and ``local_device_count`` sets ``jax_num_cpu_devices``; on an
    accelerator ``local_device_count=N`` makes the first N local devices visible. ``timeout_s`` is
    passed as ``jax.distributed.initialize(initialization_timeout=...)``: how long to wait for all
    processes to reach the coordinator. Failures raise ``RuntimeError`` naming the coordinator
    address, the process id and the timeout: a coordinator that accepts no connection within
    ``timeout_s`` (checked with a TCP probe by processes other than 0), a coordinator port that
    cannot be bound, bad arguments. Caveat (jax 0.10): once connected, if the *other* processes
    do not all register within the timeout, jax's C++ client terminates the process (SIGABRT,
    "Terminating process because the JAX distributed service detected fatal errors ...
    DEADLINE_EXCEEDED"); no Python exception can be raised then, so launchers should treat exit
    code 134 as "a peer never arrived".

    Returns the resolved :class:`ClusterSpec`.
    """
    import jax
    from jax._src import xla_bridge

    spec = resolve_cluster(coordinator_address, num_processes, process_id)
    if local_device_count is not None and (
        not isinstance(local_device_count, int) or local_device_count < 1
    ):
        raise ConfigError(f"local_device_count={local_device_count!r} must be an integer >= 1")
    if timeout_s is None or timeout_s <= 0:
        raise ConfigError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "jphantom.distributed.initialize was called twice: jax's distributed runtime is "
            "already up in this process. Call jphantom.distributed.shutdown() first to restart it."
        )
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "jphantom.distributed.initialize must run before any jax computation, but jax has "
            "already initialised its backends in this process (a jax.devices(), jnp array or jit "
            "call ran first). Move the initialize() call to the very start of the program."
        )

    if platform is not None:
        jax.config.update("jax_platforms", platform)
    cpu = _uses_cpu(platform)
    kwargs = {}
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if local_device_count is not None:
            jax.config.update("jax_num_cpu_devices", local_device_count)
        # Everything is resolved already: keep jax from re-detecting (and overriding) it.
        kwargs["cluster_detection_method"] = "deactivate"
    elif local_device_count is not None:
        kwargs["local_device_ids"] = list(range(local_device_count))

    where = (
        f"coordinator {spec.coordinator_address} (from {spec.source_of('coordinator_address')}), "
        f"process_id={spec.process_id} of num_processes={spec.num_processes}, "
        f"timeout {timeout_s:g} s"
    )
    start = time.monotonic()
    if spec.process_id != 0:
        # jax 0.10 aborts the whole process (C++ LOG(FATAL), no Python exception) when the
        # coordinator cannot be reached in time; probing the port first turns the common failure
        # (wrong address, process 0 not started, firewall) into a catchable RuntimeError.
        _wait_for_coordinator(spec.coordinator_address, timeout_s, where)
    remaining = max(1, int(round(timeout_s - (time.monotonic() - start))))
    try:
        jax.distributed.initialize(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
            initialization_timeout=remaining,
            **kwargs,
        )
    except Exception as err:
        _reset_after_failure()
        raise RuntimeError(
            f"jax.distributed.initialize failed for {where}: {type(err).__name__}: {err}. "
            "Check that every process was started with the same coordinator address and process "
            "count, that process 0 is running and its port is reachable from this host (firewall, "
            "HTTP(S)_PROXY variables), and raise timeout_s if processes start far apart."
        ) from err
    return spec


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), _parse_int(port, "coordinator port")


def _wait_for_coordinator(address: str, timeout_s: float, where: str) -> None:
    """Retry a TCP connect to ``address`` until it accepts or ``timeout_s`` passes."""
    host, port = _split_address(address)
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout_s)):
                return
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise RuntimeError(
        f"jphantom.distributed.initialize could not reach the coordinator for {where}: nothing "
        f"accepted a connection at {address} within {timeout_s:g} s (last error: {last}). Check "
        "that process 0 is running with the same coordinator address, that the host name resolves "
        "and the port is reachable from this host, or raise timeout_s."
    )


def _reset_after_failure() -> None:
    """Drop half-initialised client/service objects so that is_initialized() is False again."""
    from jax._src import distributed as _dist

    state = _dist.global_state
    state.client = None
    if state.service is not None:
        try:
            state.service.shutdown()
        except Exception:  # best effort: the original error is what the user needs to see
            pass
        state.service = None
    state.preemption_sync_manager = None


def shutdown() -> None:
    """Shut down jax's distributed runtime in this process (no-op when it is not running).

    Every process should call it (or simply exit); process 0 waits, up to jax's shutdown timeout,
    for the others before stopping the coordinator.
    """
    import jax

    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def is_initialized() -> bool:
    """Whether jax's distributed runtime is running in this process."""
    import jax

    return jax.distributed.is_initialized()
