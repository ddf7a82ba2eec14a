"""``jphantom launch``: run one command as N local processes joined by ``jax.distributed``.

For testing multi-process runs on one machine. Child ``r`` gets ``JAX_COORDINATOR_ADDRESS`` =
``127.0.0.1:PORT`` (jax's own variable), ``JPHANTOM_NUM_PROCESSES=N``, ``JPHANTOM_PROCESS_ID=r``
and, when asked, ``JPHANTOM_DEVICES_PER_PROCESS`` and ``JPHANTOM_INIT_TIMEOUT``, which
:func:`jphantom.runtime.distributed.initialize_from_env` turns into ``jax.distributed.initialize`` (the
``jphantom`` command calls it first). With ``--devices-per-process D`` on a machine with
accelerators, child ``r`` also gets ``JAX_LOCAL_DEVICE_IDS`` = its own D devices ``rD..rD+D-1``.
Cluster variables (``SLURM_*``, ``OMPI_*``, ``PMI_*``, ``PMIX_*``) are removed from the children's
environment: they are a job of their own, and jax's detection must not override the launcher.

Every output line of child ``r`` is printed prefixed with ``[r] ``. When a child fails, the others
are stopped (SIGTERM, then SIGKILL after :data:`STOP_S`) and launch fails with one line naming it
(``--max-restarts N``: starts the run again, from its newest checkpoint; ``--min-processes M``:
without the failed process, its ``data`` axis shrunk to the devices left, while at least M
remain). A SIGTERM or SIGINT to
launch is forwarded to every process, which get :data:`GRACE_S` (``--grace``) to write their
checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from jphantom.runtime import distributed
from jphantom.runtime.coordinator import check_port_free
from jphantom.errors import ConfigError, check_int

GRACE_S = 30.0
"""Seconds a child gets between the SIGTERM launch forwards and SIGKILL (to finish its step and
write its checkpoint)."""
STOP_S = 5.0
"""Seconds the other children get between SIGTERM and SIGKILL when one has failed (they wait
in a collective for it, most likely)."""

CLUSTER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_")

PROCESSES_PER_CPU = 8
"""Processes launch starts per CPU core at most: each is a Python process running jax (its own
runtime threads), so more than this only queues on the cores."""
BYTES_PER_PROCESS = 256 * 2**20
"""Memory launch counts per process (a Python process with jax imported holds about this much
before any array): the machine's memory over it bounds ``-n`` too."""


def max_processes() -> int:
    """The most processes launch starts on this machine: :data:`PROCESSES_PER_CPU` per CPU core,
    and no more than the physical memory holds at :data:`BYTES_PER_PROCESS` each (at least 1)."""
    by_cpus = PROCESSES_PER_CPU * (os.cpu_count() or 1)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf figure: the cores alone
        return by_cpus
    return max(1, min(by_cpus, memory // BYTES_PER_PROCESS))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_env(rank: int, num_processes: int, port: int, *, devices_per_process: int | None = None,
              timeout: int | None = None, accelerator: bool = False,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of child ``rank``: ``base`` (default ``os.environ``) without cluster
    variables or other distributed settings, plus the launcher's (module docstring)."""
    names = (distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID, distributed.ENV_DEVICES,
             distributed.ENV_TIMEOUT, distributed.ENV_DISTRIBUTED, "JAX_LOCAL_DEVICE_IDS")
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(CLUSTER_PREFIXES + ("JAX_COORDINATOR_",)) and k not in names}
    env.update({distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                distributed.ENV_NUM_PROCESSES: str(num_processes),
                distributed.ENV_PROCESS_ID: str(rank), "PYTHONUNBUFFERED": "1"})
    if devices_per_process is not None:
        env[distributed.ENV_DEVICES] = str(devices_per_process)
        if accelerator:
            first = rank * devices_per_process
            env["JAX_LOCAL_DEVICE_IDS"] = ",".join(
                str(i) for i in range(first, first + devices_per_process))
    if timeout is not None:
        env[distributed.ENV_TIMEOUT] = str(timeout)
    return env


def child_command(command: Sequence[str]) -> list[str]:
    """``command`` without a leading ``--``; ``jphantom ...`` runs with this Python interpreter."""
    command = list(command[1:] if command and command[0] == "--" else command)
    if not command:
        raise ConfigError("jphantom launch: no command given. Fix: put it after --, e.g. "
                          "jphantom launch -n 2 -- jphantom train --mesh data=2")
    if command[0] == "jphantom":
        return [sys.executable, "-m", "jphantom.cli", *command[1:]]
    return command


def check_processes(num_processes) -> int:
    """``num_processes`` an integer in 1 .. :func:`max_processes`, else a ConfigError naming the
    limit and how it is derived (before anything starts)."""
    check_int("--num-processes", num_processes, 1)
    limit = max_processes()
    if num_processes > limit:
        raise ConfigError(f"--num-processes {num_processes} is more than this machine runs: at "
                          f"most {limit} ({PROCESSES_PER_CPU} per CPU core of "
                          f"{os.cpu_count() or 1}, {BYTES_PER_PROCESS // 2**20} MiB of memory "
                          f"each); give -n {limit} or fewer, or use several machines")
    return num_processes


def launch(command: Sequence[str], num_processes: int, *, port: int | None = None,
           devices_per_process: int | None = None, timeout: int | None = None,
           deadline: int | None = None, grace: float = GRACE_S, max_restarts: int = 0,
           min_processes: int | None = None) -> int:
    """Run ``command`` as ``num_processes`` local processes and wait for all of them; returns
    the exit status for the command line (0, or 143 / 130 when launch itself was sent SIGTERM /
    SIGINT: the signal is forwarded to every process, which then has ``grace`` seconds to write
    its checkpoint before SIGKILL).

    Each child leads its own process group, and stopping a child stops its group (what it started
    too). ``deadline``: seconds after which every process is stopped. ``max_restarts``: when a
    process fails, stop the others and start the run again, up to that many times, with
    ``--resume`` added when the command's ``--checkpoint-dir`` holds a complete checkpoint
    (torchrun's elastic restart on jax.distributed). ``min_processes``: a restart goes on without
    the process that failed (as if its host were lost) while at least that many remain and the
    command's ``--mesh`` can shrink its ``data`` axis in proportion (:func:`shrunk`; else it
    starts as many as before). A process that exits with status 2 (a configuration error, which
    a restart would meet again) is not restarted. Raises ConfigError for a bad setting (before
    anything starts) and RuntimeError, one line naming the process that failed first and how
    (and any process left suspended), when a child fails and no restart is left.
    """
    _check_settings(num_processes, devices_per_process, timeout, deadline, grace, max_restarts,
                    min_processes)
    argv = child_command(command)
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 1 <= port <= 65535):
        raise ConfigError(f"--port {port!r} is not a port in 1..65535: pick a free port >= 1024 "
                          "or leave --port out for a free one")
    if port is not None:
        check_port_free(port)
    accelerator = False
    if devices_per_process is not None:
        from jphantom.runtime.distributed import accelerator_visible

        accelerator = accelerator_visible()
    attempt = 0
    while True:
        outcome = _run_once(argv, num_processes, port if attempt == 0 and port else free_port(),
                            devices_per_process, timeout, accelerator, deadline, grace)
        if outcome is None:
            return 0
        if isinstance(outcome, str) and outcome.startswith("SIG"):
            sys.stderr.write(f"launch: {outcome} forwarded to the {num_processes} processes; "
                             "they stopped\n")
            return 128 + signal.Signals[outcome].value
        if outcome == "deadline":
            raise RuntimeError(f"launch: --deadline {deadline} s passed; stopped all "
                               f"{num_processes} processes")
        rank, code, suspended = outcome
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0
               else "ran past --step-timeout (status 124)" if code == 124
               else f"exited with status {code}")
        also = (f"; process(es) {', '.join(map(str, suspended))} were suspended (SIGSTOP) and "
                "never arrived" if suspended else "")
        if code == 2:
            raise RuntimeError(f"launch: process {rank} of {num_processes} {how} (a "
                               "configuration error: a restart would meet it again); stopped the "
                               f"others; its output is above, prefixed [{rank}]")
        if attempt < max_restarts:
            attempt += 1
            argv, resumed = _resumed(argv)
            failed_of = num_processes
            argv, num_processes, fewer = _shrink(argv, num_processes, min_processes)
            sys.stderr.write(f"launch: process {rank} of {failed_of} {how}{also}; stopped the "
                             f"others; restart {attempt} of {max_restarts}{fewer}"
                             f"{' from the newest checkpoint (--resume)' if resumed else ''}\n")
            continue
        raise RuntimeError(f"launch: process {rank} of {num_processes} {how}{also}; stopped the "
                           f"others; its output is above, prefixed [{rank}]")


def _check_settings(num_processes, devices_per_process, timeout, deadline, grace,
                    max_restarts, min_processes) -> None:
    """:func:`launch`'s settings, each checked before anything starts (ConfigError)."""
    check_processes(num_processes)
    for name, value in (("--devices-per-process", devices_per_process), ("--timeout", timeout),
                        ("--deadline", deadline)):
        if value is not None:
            check_int(name, value, 1)
    check_int("--max-restarts", max_restarts, 0)
    if min_processes is not None:
        check_int("--min-processes", min_processes, 1)
        if min_processes > num_processes:
            raise ConfigError(f"--min-processes {min_processes} is more than --num-processes "
                              f"{num_processes}: give at most {num_processes}")
        if max_restarts == 0:
            raise ConfigError("--min-processes applies to restarts: give --max-restarts N too")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise ConfigError(f"--grace {grace!r} must be a number of seconds >= 0")


def _shrink(argv, num_processes: int, min_processes: int | None):
    """A restart's command and process count: the most processes below ``num_processes``, down
    to ``min_processes``, for which the command's ``--mesh`` shrinks in proportion
    (:func:`shrunk`), else as before; and the words for the restart's line."""
    for smaller in range(num_processes - 1, (min_processes or num_processes) - 1, -1):
        shrunk_argv = shrunk(argv, num_processes, smaller)
        if shrunk_argv is not None:
            mesh = _mesh_of(shrunk_argv)
            return shrunk_argv, smaller, f" with {smaller} processes (--mesh {mesh})"
    if (min_processes or num_processes) < num_processes:
        return argv, num_processes, (
            f" with all {num_processes} processes (the command's --mesh "
            f"{_mesh_of(argv) or '(none)'} has no data axis that shrinks to "
            f"{min_processes}..{num_processes - 1} processes)")
    return argv, num_processes, ""


def _run_once(argv, num_processes, port, devices_per_process, timeout, accelerator, deadline,
              grace):
    """One start of every process; ``None`` when all exited 0, else ``"deadline"``, the name of
    a signal launch received (forwarded), or ``(rank, status, suspended ranks)`` of the first
    process that failed."""
    lock = threading.Lock()
    procs, relays = [], []
    received = []
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:  # a signal to launch goes to every process (their preemption checkpoint)
        def forward(signum, frame):
            received.append(signal.Signals(signum).name)
            for proc in procs:
                _signal_group(proc, signal.SIGTERM)
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, forward)
    failed = None
    try:
        for rank in range(num_processes):
            env = child_env(rank, num_processes, port, devices_per_process=devices_per_process,
                            timeout=timeout, accelerator=accelerator)
            try:
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)  # its own process group
            except OSError as err:
                raise ConfigError(f"jphantom launch: cannot start {argv[0]!r}: {err}") from None
            procs.append(proc)
            for pipe, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                relay = threading.Thread(target=_relay, args=(pipe, sink, f"[{rank}] ", lock),
                                         daemon=True)
                relay.start()
                relays.append(relay)
        failed = _wait(procs, None if deadline is None else time.monotonic() + deadline,
                       received)
        if isinstance(failed, tuple):
            failed = (*failed, [r for r, proc in enumerate(procs) if _suspended(proc)])
    finally:
        _stop(procs, grace if received else STOP_S, terminate=not received)
        for relay in relays:
            relay.join(timeout=GRACE_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received[0] if received else failed


def _suspended(proc) -> bool:
    """Whether ``proc`` is stopped (SIGSTOP, state T in /proc; False where /proc is absent)."""
    try:
        with open(f"/proc/{proc.pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _resumed(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` with ``--resume`` when its ``--checkpoint-dir`` holds a complete checkpoint."""
    directory = None
    for i, arg in enumerate(argv):
        if arg == "--checkpoint-dir" and i + 1 < len(argv):
            directory = argv[i + 1]
        elif arg.startswith("--checkpoint-dir="):
            directory = arg.split("=", 1)[1]
    if directory is None or not _has_checkpoint(directory):
        return argv, False
    return (argv if "--resume" in argv else [*argv, "--resume"]), True


def _mesh_index(argv: list[str]) -> tuple[int, bool] | None:
    """Where ``argv`` gives ``--mesh``: (index, whether it is ``--mesh=VALUE``), the last one."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--mesh" and i + 1 < len(argv):
            found = (i + 1, False)
        elif arg.startswith("--mesh="):
            found = (i, True)
    return found


def _mesh_of(argv: list[str]) -> str | None:
    where = _mesh_index(argv)
    if where is None:
        return None
    i, inline = where
    return argv[i].split("=", 1)[1] if inline else argv[i]


def shrunk(argv: list[str], processes: int, fewer: int) -> list[str] | None:
    """``argv`` for ``fewer`` processes instead of ``processes``: its ``--mesh`` with the
    ``data`` axis shrunk in proportion (each process keeps its devices; the global batch stays,
    split over fewer data ranks, and resuming reshards the checkpoint), or None where it cannot:
    no ``--mesh`` on the command line, no ``data`` axis, or a size that does not divide."""
    from jphantom.runtime.mesh import MeshConfig

    where = _mesh_index(argv)
    if where is None:
        return None
    i, inline = where
    try:
        mesh = MeshConfig.parse(_mesh_of(argv))
    except ConfigError:
        return None
    data = mesh.size("data")
    if (data * fewer) % processes:
        return None
    smaller = MeshConfig.of({**mesh.shape, "data": data * fewer // processes})
    value = str(smaller)
    return [*argv[:i], f"--mesh={value}" if inline else value, *argv[i + 1:]]


def _has_checkpoint(directory: str) -> bool:
    """A complete Orbax step folder in ``directory`` (a number, not a temporary or damaged
    one). Read from the file system rather than by ``Checkpointer.latest_step()``: Orbax's
    manager starts jax's backend, which on a GPU machine would take device memory in the
    launcher the processes need."""
    from pathlib import Path

    folder = Path(directory)
    return folder.is_dir() and any(p.is_dir() and p.name.isdigit() for p in folder.iterdir())


def _relay(pipe, sink, prefix: str, lock: threading.Lock) -> None:
    """Copy ``pipe`` to ``sink`` line by line, each line prefixed."""
    for line in iter(pipe.readline, b""):
        text = line.decode("utf-8", errors="replace").rstrip("\n")
        with lock:
            sink.write(f"{prefix}{text}\n")
            sink.flush()
    pipe.close()


def _wait(procs, deadline: float | None = None, received=()):
    """Wait until every child has exited 0 (-> None), one has failed (-> (rank, status)), the
    monotonic ``deadline`` has passed (-> "deadline") or launch received a signal (-> None: the
    caller reports it)."""
    while True:
        if received:
            return None
        if deadline is not None and time.monotonic() > deadline:
            return "deadline"
        codes = [proc.poll() for proc in procs]
        failed = next(((rank, code) for rank, code in enumerate(codes) if code), None)
        if failed is not None or all(code == 0 for code in codes):
            return failed
        time.sleep(0.05)


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs, grace: float = STOP_S, *, terminate: bool = True) -> None:
    """SIGTERM every child's process group (what a child started is stopped with it, even after
    the child itself has exited), SIGKILL the groups still there after ``grace`` seconds (at
    once for a suspended child, which cannot act on SIGTERM). ``terminate=False``: they were
    sent a signal already (forwarded from launch's own), which a second one would turn into
    "stop now": only wait, then SIGKILL."""
    for proc in procs:
        if _suspended(proc):
            _signal_group(proc, signal.SIGKILL)
        elif terminate:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def add_parser(subparsers) -> None:
    """Register ``jphantom launch`` on the CLI's subparsers."""
    import argparse

    parser = subparsers.add_parser(
        "launch", help="run a command as N local processes joined by jax.distributed (testing)",
        description="Start N copies of COMMAND on this machine, joined into one jax.distributed "
                    "run: a coordinator on 127.0.0.1, process ids 0..N-1 (JAX_COORDINATOR_ADDRESS, "
                    "JPHANTOM_NUM_PROCESSES, JPHANTOM_PROCESS_ID; a jphantom command joins by "
                    "itself, a Python script calls jphantom.runtime.distributed.initialize_from_env()). "
                    "Output lines are prefixed [rank]; if a process fails, the others are stopped "
                    "and launch exits with status 1.",
        epilog="Examples: jphantom launch -n 2 --devices-per-process 4 -- jphantom train "
               "--strategy tensor --mesh data=2,model=4 | jphantom launch -n 4 --timeout 60 -- "
               "python my_script.py")
    parser.add_argument("-n", "--num-processes", type=int, required=True, metavar="N",
                        help="number of processes (at most 8 per CPU core, and no more than "
                             "the memory holds at 256 MiB each: refused before any starts)")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="D",
                        help="CPU devices simulated per process; with accelerators, process r "
                             "gets devices rD..rD+D-1 (default: jax's choice)")
    parser.add_argument("--port", type=int, default=None,
                        help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--timeout", type=int, default=None, metavar="S",
                        help="seconds each process waits for the coordinator and the others at "
                             "start-up (jax's initialization_timeout; default 300)")
    parser.add_argument("--deadline", type=int, default=None, metavar="S",
                        help="stop every process after S seconds in all and exit with status 1 "
                             "(default: no limit)")
    parser.add_argument("--grace", type=float, default=GRACE_S, metavar="S",
                        help="seconds the processes get to write their checkpoint when launch "
                             "is sent SIGTERM or SIGINT (forwarded to each) before SIGKILL "
                             f"(default {GRACE_S:g})")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="when a process fails (or its --step-timeout fires), stop the "
                             "others and start the run again, up to N times, with --resume "
                             "when its --checkpoint-dir holds a checkpoint (default 0)")
    parser.add_argument("--min-processes", type=int, default=None, metavar="M",
                        help="with --max-restarts: each restart goes on without the process "
                             "that failed while at least M remain, the command's --mesh data "
                             "axis shrunk in proportion (when it divides; else all N start "
                             "again)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the command every process runs, after --")
    parser.set_defaults(handler=_main)


def _main(args) -> int:
    try:
        return launch(args.command, args.num_processes, port=args.port,
                      devices_per_process=args.devices_per_process, timeout=args.timeout,
                      deadline=args.deadline, grace=args.grace, max_restarts=args.max_restarts,
                      min_processes=args.min_processes)
    except RuntimeError as error:
        print(f"jphantom: error: {error}", file=sys.stderr)
        return 1
