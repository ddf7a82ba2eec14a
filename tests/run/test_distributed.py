"""jphantom.runtime.distributed, jphantom.runtime.coordinator and jphantom.runtime.launch.

Fast tests: the validation of every coordinator setting (pure), that jphantom hands jax nothing
that would override jax's own cluster detection (``jax.distributed.initialize`` monkeypatched to
record its arguments), the coordinator probe against servers started here, the launcher with
children that do not start jax, and one subprocess per bad setting that jax 0.10 would turn into a
segfault or an abort: each must end with a Python error (exit status 1) naming the setting.

Real multi-process jax: ``jphantom launch`` end to end (about 4 s); slow: two processes x 4 CPU
devices joined over gloo compute the phantom FFN's loss and gradients exactly like one process on 8
devices (tests/run/_distributed_worker.py), and a process killed mid-run makes its peer exit within the
heartbeat timeout instead of hanging.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import jax
import numpy as np
import pytest

from jphantom import cli
from jphantom.runtime import distributed, launch
from jphantom.runtime.coordinator import check_port_free, probe_coordinator, split_address
from jphantom.errors import ConfigError
from helpers import child_env

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_distributed_worker.py")
WORKER_TIMEOUT_S = 120
SETTINGS_FRAME = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty HTTP/2 SETTINGS frame


def free_port() -> int:
    return launch.free_port()


@contextmanager
def server(reply: bytes | None):
    """A TCP server on 127.0.0.1 that answers every connection with ``reply`` (``None``: accept
    and stay silent); yields its port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: stop
                return
            held.append(conn)
            if reply is not None:
                try:
                    conn.recv(64)
                    conn.sendall(reply)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn in held:
            conn.close()


def clean_env(extra: dict[str, str] | None = None, local_devices: int = 2) -> dict[str, str]:
    """The parent's environment without device count, cluster variables or jax settings."""
    env = {k: v for k, v in child_env(local_devices).items()
           if not k.startswith(("JPHANTOM_", "SLURM_", "OMPI_", "PMI_", "JAX_"))}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


# --------------------------------------------------------------------------------------------------
# check_settings / split_address: pure.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("address, expected", [("10.0.0.1:1234", ("10.0.0.1", 1234)),
                                               ("node07.cluster:65535", ("node07.cluster", 65535)),
                                               ("[::1]:8476", ("::1", 8476))])
def test_split_address(address, expected):
    assert split_address(address) == expected


def test_good_settings_pass():
    distributed.check_settings(env={})  # everything left to jax's detection
    distributed.check_settings("10.0.0.1:1234", 4, 3, local_device_ids=[0, 1], local_device_count=2,
                               initialization_timeout=1, heartbeat_timeout_seconds=1, env={})


@pytest.mark.parametrize("args, kwargs, fragment", [
    (("127.0.0.1:abc", 2, 0), {}, "coordinator_address='127.0.0.1:abc': port 'abc'"),
    (("127.0.0.1:99999", 2, 0), {}, "port '99999' is not an integer in 1..65535"),
    (("127.0.0.1:0", 2, 0), {}, "port '0'"),
    (("127.0.0.1", 2, 0), {}, "is not host:port"),
    ((":1234", 2, 0), {}, "has no usable host"),
    (("h:1", 2, 2), {}, "process_id=2 is out of range for num_processes=2"),
    (("h:1", 2, -1), {}, "process_id=-1"),
    (("h:1", 0, 0), {}, "num_processes=0"),
    (("h:1", "2", 0), {}, "num_processes='2'"),
    (("h:1", 2, True), {}, "process_id=True"),
    ((), {"local_device_count": 0}, "local_device_count=0"),
    ((), {"local_device_ids": [0, -1]}, "local_device_ids entry=-1"),
    ((), {"local_device_ids": []}, "local_device_ids=[]"),
    ((), {"initialization_timeout": 0}, "initialization_timeout (seconds)=0"),
    ((), {"initialization_timeout": 1.5}, "initialization_timeout (seconds)=1.5"),
    ((), {"heartbeat_timeout_seconds": -3}, "heartbeat_timeout_seconds=-3"),
    ((), {"platform": "nonsense"}, "platform='nonsense' is not a jax platform: give one of cpu, "
                                   "cuda, gpu, rocm, tpu"),
    ((), {"platform": "cpu,nonsense"}, "platform='cpu,nonsense'"),
    ((), {"platform": 3}, "platform=3"),
])
def test_bad_settings_name_the_setting(args, kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        distributed.check_settings(*args, **kwargs, env={})
    assert fragment in str(info.value)


def test_jax_variables_are_checked_too():
    with pytest.raises(ConfigError, match="JAX_COORDINATOR_ADDRESS='h:abc'"):
        distributed.check_settings(env={"JAX_COORDINATOR_ADDRESS": "h:abc"})
    with pytest.raises(ConfigError, match="JAX_COORDINATOR_PORT='70000'"):
        distributed.check_settings(env={"JAX_COORDINATOR_PORT": "70000"})
    with pytest.raises(ConfigError, match="JAX_COORDINATOR_BIND_ADDRESS"):
        distributed.check_settings(env={"JAX_COORDINATOR_BIND_ADDRESS": "[::]:x"})
    # An explicit address replaces JAX_COORDINATOR_ADDRESS (as in jax), so that one is not read.
    distributed.check_settings("h:1", env={"JAX_COORDINATOR_ADDRESS": "h:abc"})


def test_port_in_use_is_reported():
    with server(None) as port:
        with pytest.raises(ConfigError, match=f"port {port}"):
            check_port_free(port)
    check_port_free(free_port())


# --------------------------------------------------------------------------------------------------
# The coordinator probe, against servers started here.
# --------------------------------------------------------------------------------------------------


def _headers(block: bytes) -> bytes:
    """An HTTP/2 HEADERS frame of stream 1 (END_STREAM | END_HEADERS) holding ``block``."""
    return len(block).to_bytes(3, "big") + b"\x01\x05\x00\x00\x00\x01" + block


# what jax's coordinator answers the probe's call: SETTINGS, its ACK, HEADERS with :status 200
COORDINATOR_REPLY = (SETTINGS_FRAME + b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
                     + _headers(b"\x88\x00\x02te\x00"))


@pytest.mark.parametrize("status", [b"\x88", b"\x00\x07:status\x03200"],
                         ids=["indexed", "literal, as jax's coordinator writes it"])
def test_probe_accepts_an_http2_server(status):
    ack = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"
    with server(SETTINGS_FRAME + ack + _headers(status + b"\x00\x02te\x00")) as port:
        start = time.monotonic()
        probe_coordinator(f"127.0.0.1:{port}", 5)
        assert time.monotonic() - start < 2


def test_probe_rejects_an_http2_server_that_is_no_grpc_server():
    """A sandbox's HTTP/2 proxy answered SETTINGS for an unreachable host, the probe passed, and
    jax's client aborted the process (rc 134 after 21.6 s) on the 404 of its RegisterTask."""
    with server(SETTINGS_FRAME + _headers(b"\x8d")) as port:
        start = time.monotonic()
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: an HTTP/2 server answers there "
                                              "but no jax coordinator .*HTTP status 404"):
            probe_coordinator(f"127.0.0.1:{port}", 5)
        assert time.monotonic() - start < 2


def test_probe_waits_for_a_coordinator_that_starts_late():
    port = free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def start_late():
        time.sleep(0.5)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        conn, _ = listener.accept()
        conn.recv(64)
        conn.sendall(SETTINGS_FRAME)
        conn.close()

    thread = threading.Thread(target=start_late, daemon=True)
    thread.start()
    try:
        probe_coordinator(f"127.0.0.1:{port}", 5)
    finally:
        thread.join(5)
        listener.close()


def test_probe_rejects_another_service_at_once():
    with server(b"HTTP/1.1 400 Bad Request\r\n\r\n") as port:
        start = time.monotonic()
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}: what listens there is not"):
            probe_coordinator(f"127.0.0.1:{port}", 5)
        assert time.monotonic() - start < 2


@pytest.mark.parametrize("listening", [False, True], ids=["nothing listens", "silent listener"])
def test_probe_gives_up_within_the_timeout(listening):
    with server(None) if listening else _nothing() as port:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}: no jax coordinator answered "
                                               "within 1 s") as info:
            probe_coordinator(f"127.0.0.1:{port}", 1)
        assert time.monotonic() - start < 2
    assert ("accepted the connection" in str(info.value)) == listening


@contextmanager
def _nothing():
    yield free_port()


# --------------------------------------------------------------------------------------------------
# What jphantom hands jax: nothing that overrides jax's own detection.
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def jax_calls(monkeypatch):
    """Record jax.distributed.initialize's arguments instead of starting anything; no cluster,
    jax or jphantom variables in the environment."""
    for name in list(os.environ):
        if name.startswith(("JPHANTOM_", "SLURM_", "OMPI_", "JAX_COORDINATOR", "JAX_LOCAL")):
            monkeypatch.delenv(name)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    return calls


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "4",
         "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}


def test_under_slurm_jax_detects_everything(jax_calls, monkeypatch):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    distributed.initialize()
    assert jax_calls == [{"initialization_timeout": 300, "heartbeat_timeout_seconds": 100}]
    # The same through the CLI's entry (srun ... jphantom train with JPHANTOM_DISTRIBUTED=1).
    monkeypatch.setenv("JPHANTOM_DISTRIBUTED", "1")
    assert distributed.initialize_from_env() is True
    assert jax_calls[1] == jax_calls[0]


def test_only_given_values_are_passed_on(jax_calls):
    port = free_port()
    distributed.initialize(f"127.0.0.1:{port}", 2, 0, initialization_timeout=7,
                           heartbeat_timeout_seconds=3)
    distributed.initialize(num_processes=2, timeout_s=9)  # timeout_s: the old name
    assert jax_calls == [
        dict(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=0,
             initialization_timeout=7, heartbeat_timeout_seconds=3),
        dict(num_processes=2, initialization_timeout=9, heartbeat_timeout_seconds=100),
    ]


def test_initialize_from_env(jax_calls, monkeypatch):
    assert distributed.initialize_from_env({}) is False
    assert jax_calls == []
    with server(COORDINATOR_REPLY) as port:
        env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JPHANTOM_NUM_PROCESSES": "2",
               "JPHANTOM_PROCESS_ID": "1", "JPHANTOM_INIT_TIMEOUT": "30"}
        assert distributed.initialize_from_env(env) is True
    (call,) = jax_calls
    assert call["coordinator_address"] == f"127.0.0.1:{port}"
    assert (call["num_processes"], call["process_id"]) == (2, 1)
    assert 29 <= call["initialization_timeout"] <= 30  # less the probe's time
    assert call["heartbeat_timeout_seconds"] == 100 and "local_device_ids" not in call


@pytest.mark.parametrize("env, fragment", [
    ({"JPHANTOM_NUM_PROCESSES": "two", "JPHANTOM_PROCESS_ID": "0"}, "JPHANTOM_NUM_PROCESSES='two'"),
    ({"JPHANTOM_NUM_PROCESSES": "2", "JPHANTOM_PROCESS_ID": "2"}, "process_id=2 is out of range"),
    ({"JPHANTOM_NUM_PROCESSES": "2", "JPHANTOM_PROCESS_ID": "0",
      "JAX_COORDINATOR_ADDRESS": "127.0.0.1:abc"}, "JAX_COORDINATOR_ADDRESS=127.0.0.1:abc"),
])
def test_initialize_from_env_names_the_variable(jax_calls, env, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        distributed.initialize_from_env(env)
    assert jax_calls == []


def test_initialize_refuses_an_unknown_platform_before_jax_is_called(jax_calls):
    """It returned None, jax_platforms set to a name no backend has; now a ConfigError naming
    the accepted ones, and jax untouched."""
    with pytest.raises(ConfigError, match="platform='nonsense' is not a jax platform"):
        distributed.initialize("127.0.0.1:1234", 2, 1, platform="nonsense")
    assert jax_calls == []


def test_jax_errors_become_python_errors_naming_the_settings(monkeypatch):
    def no_cluster(**kwargs):
        raise ValueError("coordinator_address should be defined.")

    def fails(**kwargs):
        raise RuntimeError("UNKNOWN: Failed to start RPC server")

    monkeypatch.setattr(jax.distributed, "initialize", no_cluster)
    with pytest.raises(ConfigError, match="jax found no cluster to join.*jphantom launch"):
        distributed.initialize()
    monkeypatch.setattr(jax.distributed, "initialize", fails)
    with pytest.raises(RuntimeError, match="num_processes=2.*Failed to start RPC server"):
        distributed.initialize(num_processes=2)
    assert not distributed.is_initialized()


def test_initialize_after_jax_started_is_refused():
    jax.devices()  # the backend is up in the test process
    with pytest.raises(RuntimeError, match="before any JAX calls"):
        distributed.initialize(f"127.0.0.1:{free_port()}", 2, 0, initialization_timeout=1)
    assert not distributed.is_initialized()
    distributed.shutdown()  # a no-op when not initialised


# --------------------------------------------------------------------------------------------------
# Every bad coordinator setting ends as a Python error in a real process, never a signal.
# --------------------------------------------------------------------------------------------------

BAD = {  # name: (initialize's arguments, error type, fragment of its message)
    "process 0, port abc": ('"127.0.0.1:abc", 2, 0', "ConfigError", "port 'abc'"),
    "port 99999": ('"127.0.0.1:99999", 2, 0', "ConfigError", "port '99999'"),
    "process id out of range": ('"127.0.0.1:{free}", 2, 2', "ConfigError", "process_id=2"),
    "num_processes 0": ('"127.0.0.1:{free}", 0, 0', "ConfigError", "num_processes=0"),
    "process 0, port taken": ('"127.0.0.1:{silent}", 2, 0', "ConfigError", "port {silent}"),
    "not a coordinator (answers)": ('"127.0.0.1:{garbage}", 2, 1, initialization_timeout=2',
                                    "ConfigError", "127.0.0.1:{garbage}: what listens there"),
    "not a coordinator (silent)": ('"127.0.0.1:{silent}", 2, 1, initialization_timeout=1',
                                   "RuntimeError", "127.0.0.1:{silent}: no jax coordinator"),
    "no coordinator": ('"127.0.0.1:{free}", 2, 1, initialization_timeout=1', "RuntimeError",
                       "127.0.0.1:{free}: no jax coordinator answered within 1 s"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_setting_is_a_python_error_in_a_real_process(case):
    arguments, kind, fragment = BAD[case]
    with server(b"garbage garbage\n") as garbage, server(None) as silent:
        ports = dict(free=free_port(), garbage=garbage, silent=silent)
        code = ("from jphantom.runtime import distributed\n"
                f"distributed.initialize({arguments.format(**ports)}, platform='cpu')")
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(),
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, (result.returncode, result.stderr)  # not -11 / -6: no signal
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"jphantom.errors.{kind}" if kind == "ConfigError" else kind), last
    assert fragment.format(**ports) in last
    assert time.monotonic() - start < 10


def test_bad_environment_is_a_python_error_in_a_real_process():
    env = clean_env({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:abc", "JPHANTOM_NUM_PROCESSES": "2",
                     "JPHANTOM_PROCESS_ID": "0"})
    code = "from jphantom.runtime import distributed; distributed.initialize_from_env()"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "JAX_COORDINATOR_ADDRESS='127.0.0.1:abc'" in result.stderr


# --------------------------------------------------------------------------------------------------
# jphantom launch.
# --------------------------------------------------------------------------------------------------


def test_child_env_and_command():
    base = {"PATH": "/bin", "SLURM_PROCID": "5", "OMPI_COMM_WORLD_RANK": "1",
            "JAX_COORDINATOR_PORT": "1", "JPHANTOM_DISTRIBUTED": "1", "JAX_PLATFORMS": "cpu"}
    env = launch.child_env(1, 2, 5555, devices_per_process=4, timeout=30, accelerator=True,
                           base=base)
    assert env == {"PATH": "/bin", "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                   "JAX_COORDINATOR_ADDRESS": "127.0.0.1:5555", "JPHANTOM_NUM_PROCESSES": "2",
                   "JPHANTOM_PROCESS_ID": "1", "JPHANTOM_DEVICES_PER_PROCESS": "4",
                   "JAX_LOCAL_DEVICE_IDS": "4,5,6,7", "JPHANTOM_INIT_TIMEOUT": "30"}
    assert "JAX_LOCAL_DEVICE_IDS" not in launch.child_env(1, 2, 5555, devices_per_process=4,
                                                          base=base)
    assert launch.child_command(["--", "jphantom", "train"]) == [sys.executable, "-m",
                                                                 "jphantom.cli", "train"]
    assert launch.child_command(["python", "-c", "1"]) == ["python", "-c", "1"]


def test_launch_runs_every_rank_with_its_own_id(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "7")  # must not reach the children
    code = ("import os; e = os.environ; print(e['JPHANTOM_PROCESS_ID'], e['JPHANTOM_NUM_PROCESSES'],"
            " e['JAX_COORDINATOR_ADDRESS'], 'SLURM_PROCID' in e)")
    port = free_port()
    launch.launch(["--", sys.executable, "-c", code], 3, port=port)
    lines = sorted(capsys.readouterr().out.splitlines())
    assert lines == [f"[{r}] {r} 3 127.0.0.1:{port} False" for r in range(3)]


def test_launch_stops_the_others_when_one_fails(capsys, tmp_path):
    up = tmp_path / "up0"  # rank 1 fails once rank 0 has printed (no race with its start-up)
    code = ("import os, sys, time\nrank = os.environ['JPHANTOM_PROCESS_ID']\nprint('up', rank, "
            f"flush=True)\nif rank == '0': open({str(up)!r}, 'w').close()\n"
            f"if rank == '1':\n    while not os.path.exists({str(up)!r}): time.sleep(0.02)\n"
            "    sys.exit(3)\ntime.sleep(120)")
    start = time.monotonic()
    status = cli.main(["launch", "-n", "2", "--", sys.executable, "-c", code])
    assert status == 1 and time.monotonic() - start < launch.STOP_S + 10
    captured = capsys.readouterr()
    assert sorted(captured.out.splitlines()) == ["[0] up 0", "[1] up 1"]
    assert captured.err.strip() == ("jphantom: error: launch: process 1 of 2 exited with status 3; "
                                    "stopped the others; its output is above, prefixed [1]")


def test_a_failed_launch_ends_what_its_processes_started(tmp_path, capsys):
    """Each rank leads a process group: when rank 1 fails, rank 0's own child (a grandchild of
    the launcher) is stopped with it, not left orphaned."""
    pid_file = tmp_path / "grandchild.pid"
    code = ("import os, subprocess, sys, time\nrank = os.environ['JPHANTOM_PROCESS_ID']\n"
            "if rank == '0':\n"
            "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"    open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "    time.sleep(120)\n"
            "else:\n"
            f"    while not os.path.exists({str(pid_file)!r}): time.sleep(0.05)\n"
            "    sys.exit(3)")
    assert cli.main(["launch", "-n", "2", "--", sys.executable, "-c", code]) == 1
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(grandchild, 9)
        pytest.fail("the grandchild outlived the launch")
    capsys.readouterr()


def test_launch_deadline_stops_every_process(capsys):
    start = time.monotonic()
    status = cli.main(["launch", "-n", "2", "--deadline", "1", "--", sys.executable, "-c",
                       "import time; time.sleep(120)"])
    assert status == 1 and time.monotonic() - start < launch.STOP_S + 10
    assert "--deadline 1 s passed; stopped all 2 processes" in capsys.readouterr().err


def test_shrunk_meshes_lose_data_ranks_in_proportion():
    argv = ["train", "--mesh", "data=4,model=2", "--steps", "3"]
    assert launch.shrunk(argv, 4, 2) == ["train", "--mesh", "data=2,model=2", "--steps", "3"]
    assert launch.shrunk(["train", "--mesh=data=2,model=2"], 2, 1) == ["train",
                                                                        "--mesh=data=1,model=2"]
    assert launch.shrunk(argv, 4, 3)[2] == "data=3,model=2"  # 4 x 3 / 4 = 3 data ranks
    assert launch.shrunk(["train", "--mesh", "data=2,model=2"], 4, 3) is None
    assert launch.shrunk(["train", "--mesh", "model=4"], 2, 1) is None  # no data axis
    assert launch.shrunk(["train", "--config", "run.toml"], 2, 1) is None  # no --mesh


def test_a_restart_goes_on_without_the_failed_process_when_the_mesh_shrinks(capsys):
    """--min-processes 1: the first start (2 processes, data=2) fails in process 1; the restart
    runs 1 process with data=1 (each prints what it was given)."""
    code = ("import os, sys\ne = os.environ\nprint(e['JPHANTOM_NUM_PROCESSES'], sys.argv[1:])\n"
            "sys.exit(3 if e['JPHANTOM_NUM_PROCESSES'] == '2' and e['JPHANTOM_PROCESS_ID'] == '1'"
            " else 0)")
    assert cli.main(["launch", "-n", "2", "--max-restarts", "1", "--min-processes", "1", "--",
                     sys.executable, "-c", code, "--mesh", "data=2,model=2"]) == 0
    captured = capsys.readouterr()
    assert "[0] 1 ['--mesh', 'data=1,model=2']" in captured.out.splitlines()
    assert ("launch: process 1 of 2 exited with status 3; stopped the others; restart 1 of 1 "
            "with 1 processes (--mesh data=1,model=2)") in captured.err


def test_a_configuration_error_is_not_restarted(capsys):
    code = "import os, sys; sys.exit(2 if os.environ['JPHANTOM_PROCESS_ID'] == '1' else 0)"
    assert cli.main(["launch", "-n", "2", "--max-restarts", "3", "--", sys.executable, "-c",
                     code]) == 1
    err = capsys.readouterr().err
    assert "restart 1" not in err and "a configuration error: a restart would meet it again" in err


@pytest.mark.parametrize("argv, fragment", [
    (["-n", "2", "--min-processes", "3", "--max-restarts", "1", "--", "x"],
     "--min-processes 3 is more than --num-processes 2"),
    (["-n", "2", "--min-processes", "1", "--", "x"], "give --max-restarts N too"),
    (["-n", "2", "--port", "99999", "--", "x"], "--port 99999 is not a port in 1..65535"),
    (["-n", "0", "--", "x"], "--num-processes=0"),
    (["-n", "2", "--timeout", "0", "--", "x"], "--timeout=0"),
    (["-n", "2", "--deadline", "0", "--", "x"], "--deadline=0"),
    (["-n", "2"], "no command given"),
    (["-n", "1", "--", "/nonexistent/program"], "cannot start '/nonexistent/program'"),
])
def test_launch_rejects_bad_settings_in_one_line(capsys, argv, fragment):
    assert cli.main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err


def test_launch_refuses_more_processes_than_the_machine_runs_before_starting_any(
        capsys, monkeypatch):
    """-n 100000 started threads for 96 s, then failed; now one line and exit 2 at once, the
    limit derived from the cores (8 each) and the memory (256 MiB each)."""
    import jphantom.runtime.launch as launch_module

    started = []
    monkeypatch.setattr(launch_module, "_run_once", lambda *a, **k: started.append(a))
    limit = launch_module.max_processes()
    assert 1 <= limit <= launch_module.PROCESSES_PER_CPU * (os.cpu_count() or 1)
    assert cli.main(["launch", "-n", "100000", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--num-processes 100000 is more than this machine runs: " \
        f"at most {limit}" in err and f"give -n {limit} or fewer" in err, err
    assert cli.main(["launch", "-n", str(limit + 1), "--", "true"]) == 2 and started == []


# --------------------------------------------------------------------------------------------------
# Real multi-process jax.
# --------------------------------------------------------------------------------------------------


def load_worker_module():
    spec = importlib.util.spec_from_file_location("_distributed_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_process_reference(worker):
    """Loss and grads on this process's 8 simulated devices: the same code path, one process."""
    from helpers import oracle_loss_and_grads
    from jphantom.runtime.mesh import first_devices, make_mesh

    config, x, target = worker.problem()
    mesh = make_mesh({"model": config["num_shards"]}, first_devices(config["num_shards"]))
    _, step, params = worker.build(mesh)
    loss, grads = jax.jit(step.value_and_grad())(params, x, target)
    # Sanity: the reference itself agrees with the dense oracle (the plain FFN on one device).
    dense_loss, _ = oracle_loss_and_grads(step, params, x, target)
    np.testing.assert_allclose(float(loss), float(dense_loss), rtol=1e-5)
    return np.asarray(loss), {k: np.asarray(v) for k, v in worker.flat_names(grads).items()}


def describe(procs, logs) -> str:
    return "\n".join(
        f"--- process {i} (rc={proc.returncode}) stderr:\n{log}"
        for i, (proc, log) in enumerate(zip(procs, logs))
    )


@pytest.mark.slow
def test_two_processes_match_single_process(tmp_path):
    jax.devices()  # make sure the in-process reference below runs on 8 devices
    if jax.device_count() < 8:
        pytest.skip(f"the single-process reference needs 8 devices, have {jax.device_count()}")
    num_processes, local_devices = 2, 4
    coordinator = f"127.0.0.1:{free_port()}"
    outputs = [tmp_path / f"process{i}.npz" for i in range(num_processes)]
    env = clean_env(local_devices=local_devices)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), coordinator, str(i), str(num_processes),
             str(local_devices), str(outputs[i])],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for i in range(num_processes)
    ]
    try:
        # Compute the reference while the workers start up.
        loss_ref, grads_ref = single_process_reference(load_worker_module())
        logs = []
        for proc in procs:
            try:
                logs.append(proc.communicate(timeout=WORKER_TIMEOUT_S)[1])
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                logs = [p.communicate()[1] for p in procs]
                pytest.fail(
                    f"workers did not finish in {WORKER_TIMEOUT_S} s\n" + describe(procs, logs)
                )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert all(p.returncode == 0 for p in procs), describe(procs, logs)
    for index, path in enumerate(outputs):
        got = np.load(path)
        assert int(got["process_count"]) == num_processes
        context = f"process {index}\n" + describe(procs, logs)
        np.testing.assert_allclose(got["loss"], loss_ref, rtol=1e-5, err_msg=context)
        expected_names = {f"grad/{name}" for name in grads_ref}
        assert set(got.files) - {"loss", "process_count"} == expected_names
        for name, want in grads_ref.items():  # stacked over depth: [L, ...]
            have = got[f"grad/{name}"]
            assert have.dtype == np.float32 and have.shape == want.shape, (name, have.shape)
            # rtol 1e-5 per element; elements that nearly cancel (|g| << max|g|) are compared
            # at 1e-5 of the tensor's scale, since the cross-process (gloo) reduce-scatter sums
            # in a different order than the single-process one (float32 rounding ~1e-9 there).
            np.testing.assert_allclose(
                have,
                want,
                rtol=1e-5,
                atol=1e-5 * float(np.abs(want).max()),
                err_msg=f"grad {name!r}, {context}",
            )


@pytest.mark.slow  # about 4 s alone, but 150 s under make test's two loaded workers (Gloo)
def test_launch_joins_the_processes_into_one_jax_run():
    code = textwrap.dedent("""
        import numpy as np
        from jphantom.runtime import distributed
        assert distributed.initialize_from_env()
        import jax
        from jax.experimental import multihost_utils
        ranks = multihost_utils.process_allgather(np.array([jax.process_index()]), tiled=True)
        # one write of the whole line (Gloo's C++ logging shares the descriptor)
        print(f"rank {jax.process_index()} of {jax.process_count()} devices "
              f"{jax.device_count()} local {jax.local_device_count()} ranks {ranks.tolist()}",
              flush=True)
        distributed.shutdown()
    """)
    result = subprocess.run(
        [sys.executable, "-m", "jphantom.cli", "launch", "-n", "2", "--devices-per-process", "2",
         "--timeout", "60", "--", sys.executable, "-c", code],
        cwd=REPO, env=clean_env(local_devices=8), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        assert f"[{rank}] rank {rank} of 2 devices 4 local 2 ranks [0, 1]" in result.stdout


KILLED = textwrap.dedent("""
    import sys, time
    import numpy as np
    from jphantom.runtime import distributed
    distributed.initialize(sys.argv[1], 2, int(sys.argv[2]), local_device_count=1,
                           initialization_timeout=60, heartbeat_timeout_seconds={heartbeat},
                           platform="cpu")
    from jax.experimental import multihost_utils
    for step in range(100_000):
        multihost_utils.process_allgather(np.array([step]))
        print("step", step, flush=True)
        time.sleep(0.05)
""")


@pytest.mark.slow
def test_a_killed_process_stops_its_peer_within_the_heartbeat_timeout():
    heartbeat = 3
    coordinator = f"127.0.0.1:{free_port()}"
    code = KILLED.format(heartbeat=heartbeat)
    procs = [subprocess.Popen([sys.executable, "-c", code, coordinator, str(rank)], cwd=REPO,
                              env=clean_env(local_devices=1), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        for line in procs[1].stdout:  # both are running collectives together
            if line.startswith("step 3"):
                break
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            _, err = procs[0].communicate(timeout=heartbeat + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 still runs {heartbeat + 30} s after its peer was killed")
        waited = time.monotonic() - killed_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    assert procs[0].returncode != 0
    assert waited < heartbeat + 15, waited  # jax's default heartbeat timeout is 100 s
    assert "heartbeat timeout" in err or "another task died" in err, err[-3000:]


def test_process_0_refuses_an_address_that_does_not_reach_its_host():
    """Process 0 with a coordinator address of another host: jax's own client aborted the process
    (SIGABRT, rc 134) after ~20 s, its timeout ignored; now one ConfigError within seconds."""
    start = time.monotonic()
    with pytest.raises(ConfigError, match="does not reach this host"):
        distributed.initialize(f"10.255.255.1:{free_port()}", 2, 0, initialization_timeout=5)
    assert time.monotonic() - start < 10


def test_process_0_skips_a_peer_probing_before_its_own_check_connects():
    """Process 1 may probe for the coordinator (sending gRPC's preface) just as process 0's check
    listens on the port: that connection is skipped, not taken for another listener (a flaky
    'another listener answered' of `jphantom launch`); with no token at all it still refuses."""
    import socket

    from jphantom.runtime import coordinator

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        address = listener.getsockname()
        token = b"0123456789abcdef"
        with socket.create_connection(address) as peer, socket.create_connection(address) as own:
            peer.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            own.sendall(token)
            coordinator._accept_token(listener, token, 2.0)
        with socket.create_connection(address) as peer:
            peer.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            with pytest.raises(OSError, match="another listener answered"):
                coordinator._accept_token(listener, token, 0.5)


def test_process_0_finds_its_token_behind_peers_slow_to_write():
    """On a loaded machine a peer's probe may connect and then not be scheduled to send its
    preface: such silent connections are read side by side, so the check's own token is found at
    once (each one used to hold the window, then the launch failed as a configuration error,
    exit 2, which `launch --max-restarts` does not retry)."""
    import socket

    from jphantom.runtime import coordinator

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(coordinator._BACKLOG)
        address = listener.getsockname()
        token = b"0123456789abcdef"
        silent = [socket.create_connection(address) for _ in range(3)]
        try:
            with socket.create_connection(address) as own:
                own.sendall(token[:5])  # in two parts, too
                own.sendall(token[5:])
                start = time.monotonic()
                coordinator._accept_token(listener, token, 5.0)
                assert time.monotonic() - start < 2.0
        finally:
            for peer in silent:
                peer.close()


def test_a_probe_connected_to_itself_retries_instead_of_blaming_the_address(monkeypatch):
    """A peer probing a local port before process 0 listens can be handed that port as its own
    (a TCP self-connect): it read its own preface and called the address 'not a jax coordinator'
    (exit 2), and held the port process 0 then failed to bind. Now it closes and retries."""
    import socket

    from jphantom.runtime import coordinator

    port = free_port()

    def self_connected(address, timeout=None):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.connect(("127.0.0.1", port))  # simultaneous open: connected to itself
        return sock

    monkeypatch.setattr(coordinator.socket, "create_connection", self_connected)
    with pytest.raises(RuntimeError, match="no jax coordinator answered.*connection to itself"):
        coordinator.probe_coordinator(f"127.0.0.1:{port}", 0.5)
