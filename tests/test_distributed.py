"""jphantom.distributed: cluster resolution from the environment, and a real 2-process run on CPU.

The multi-process test starts two worker processes (tests/_distributed_worker.py) with 4 CPU
devices each, joined through jax.distributed with gloo collectives into one 8-device mesh, and
checks that the phantom FFN's loss and every gradient equal the single-process result on 8
simulated devices.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from jphantom import distributed
from jphantom.distributed import ClusterSpec, first_host, resolve_cluster
from jphantom.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_distributed_worker.py")
WORKER_TIMEOUT_S = 120


# --------------------------------------------------------------------------------------------------
# resolve_cluster: pure, reads only the mapping it is given.
# --------------------------------------------------------------------------------------------------


def test_explicit_arguments_need_no_environment():
    spec = resolve_cluster("10.0.0.1:1234", 4, 3, env={})
    assert spec == ClusterSpec(
        "10.0.0.1:1234",
        4,
        3,
        sources=(
            ("coordinator_address", "argument coordinator_address"),
            ("num_processes", "argument num_processes"),
            ("process_id", "argument process_id"),
        ),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.process_id = 0


def test_jphantom_variables():
    env = {
        "JPHANTOM_COORDINATOR": "head:9999",
        "JPHANTOM_NUM_PROCESSES": "2",
        "JPHANTOM_PROCESS_ID": "1",
    }
    spec = resolve_cluster(env=env)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("head:9999", 2, 1)
    assert spec.source_of("process_id") == "JPHANTOM_PROCESS_ID"


def test_arguments_override_environment():
    env = {"JPHANTOM_COORDINATOR": "head:9999", "JPHANTOM_NUM_PROCESSES": "2"}
    env |= {"JPHANTOM_PROCESS_ID": "1", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}
    spec = resolve_cluster("other:1", None, 0, env=env)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("other:1", 2, 0)
    assert spec.source_of("num_processes") == "JPHANTOM_NUM_PROCESSES"


def slurm_env(**extra):
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[01-08]",
    }
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_slurm():
    spec = resolve_cluster(env=slurm_env(JPHANTOM_PORT="23456"))
    assert spec.coordinator_address == "gpu07:23456"
    assert (spec.num_processes, spec.process_id, spec.local_process_id) == (4, 3, 1)
    assert spec.source_of("coordinator_address") == "SLURM_STEP_NODELIST"
    assert spec.source_of("process_id") == "SLURM_PROCID"


def test_slurm_port_defaults_and_job_nodelist_fallback():
    # No JPHANTOM_PORT: per-job port like jax's own SLURM detection.
    assert resolve_cluster(env=slurm_env()).coordinator_address == f"gpu07:{4242 % 4096 + 61440}"
    # No job id either: the fixed default; no step nodelist: the job nodelist.
    spec = resolve_cluster(env=slurm_env(SLURM_JOB_ID=None, SLURM_STEP_NODELIST=None))
    assert spec.coordinator_address == f"gpu01:{distributed.DEFAULT_PORT}"
    assert spec.source_of("coordinator_address") == "SLURM_JOB_NODELIST"
    # An explicit coordinator wins over the nodelist.
    spec = resolve_cluster(env=slurm_env(JPHANTOM_COORDINATOR="login:1"))
    assert spec.coordinator_address == "login:1" and spec.process_id == 3


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node07", "node07"),
        ("node07,node09", "node07"),
        ("node[01-04]", "node01"),
        ("node[001,007-015],host2", "node001"),
        ("rack-a[3],rack-b[1-2]", "rack-a3"),
        (" n1 ", "n1"),
    ],
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_openmpi():
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "JPHANTOM_COORDINATOR": "rank0host:7000",
    }
    spec = resolve_cluster(env=env)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == (
        "rank0host:7000",
        3,
        2,
    )
    assert spec.local_process_id == 0
    assert spec.source_of("num_processes") == "OMPI_COMM_WORLD_SIZE"


def test_openmpi_without_coordinator_says_how_to_fix():
    with pytest.raises(ConfigError) as info:
        resolve_cluster(env={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    message = str(info.value)
    assert "coordinator_address" in message and "JPHANTOM_COORDINATOR" in message
    assert "mpirun -x" in message
    assert "num_processes (" not in message and "process_id (" not in message


def test_nothing_found_lists_every_missing_value():
    with pytest.raises(ConfigError) as info:
        resolve_cluster(env={})
    message = str(info.value)
    for needed in ("coordinator_address (", "num_processes (", "process_id ("):
        assert needed in message
    for variable in ("JPHANTOM_COORDINATOR", "JPHANTOM_NUM_PROCESSES", "JPHANTOM_PROCESS_ID"):
        assert variable in message
    assert "SLURM_PROCID" in message and "OMPI_COMM_WORLD_RANK" in message


def test_only_the_missing_values_are_listed():
    with pytest.raises(ConfigError) as info:
        resolve_cluster(num_processes=2, env={"JPHANTOM_PROCESS_ID": "0"})
    message = str(info.value)
    assert "coordinator_address (" in message
    assert "num_processes (" not in message and "process_id (" not in message


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (("h:1", 2, 2), {}, "process_id=2"),
        (("h:1", 0, 0), {}, "num_processes=0"),
        (("h", 2, 0), {}, "no port"),
        (
            (None, None, None),
            {
                "JPHANTOM_COORDINATOR": "h:1",
                "JPHANTOM_NUM_PROCESSES": "two",
                "JPHANTOM_PROCESS_ID": "0",
            },
            "JPHANTOM_NUM_PROCESSES='two'",
        ),
    ],
)
def test_invalid_values(args, env, fragment):
    with pytest.raises(ConfigError, match=fragment):
        resolve_cluster(*args, env=env)


def test_initialize_reads_os_environ_and_reports_missing(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("JPHANTOM_", "SLURM_", "OMPI_")):
            monkeypatch.delenv(name)
    with pytest.raises(ConfigError, match="missing: coordinator_address"):
        distributed.initialize()
    assert not distributed.is_initialized()


def test_initialize_after_jax_started_is_refused():
    jax.devices()  # the backend is up in the test process
    with pytest.raises(RuntimeError, match="before any jax computation"):
        distributed.initialize("127.0.0.1:1", 2, 1, timeout_s=1, platform="cpu")
    assert not distributed.is_initialized()
    distributed.shutdown()  # a no-op when not initialised


# --------------------------------------------------------------------------------------------------
# Real processes.
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(local_devices: int) -> dict[str, str]:
    """The parent's environment without its device count, cluster variables or jax settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JPHANTOM_", "SLURM_", "OMPI_", "PMI_", "JAX_"))
    }
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={local_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def load_worker_module():
    spec = importlib.util.spec_from_file_location("_distributed_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def single_process_reference(worker):
    """Loss and grads on this process's 8 simulated devices: the same code path, one process."""
    from jphantom.mesh import first_devices, make_mesh
    from jphantom.sharding import dense, phantom

    config, x, target = worker.problem()
    mesh = make_mesh({"model": config["num_shards"]}, first_devices(config["num_shards"]))
    params = phantom.init(jax.random.PRNGKey(0), **config)
    step = jax.jit(jax.value_and_grad(worker.loss_fn), static_argnums=3)
    loss, grads = step(params, x, target, mesh)
    # Sanity: the reference itself agrees with the dense oracle.
    dense_out = np.asarray(dense.forward(phantom.dense_equivalent(params), x))
    dense_loss = np.mean((dense_out - target) ** 2)
    np.testing.assert_allclose(float(loss), dense_loss, rtol=1e-5)
    return np.asarray(loss), {k: np.asarray(v) for k, v in grads.items()}


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
    env = worker_env(local_devices)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                coordinator,
                str(i),
                str(num_processes),
                str(local_devices),
                str(outputs[i]),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
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
        for name, want in grads_ref.items():  # stacked over depth: [L, p, ...]
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


@pytest.mark.slow
def test_unreachable_coordinator_raises_instead_of_aborting():
    """jax 0.10 aborts the process when the coordinator never answers; initialize() raises first."""
    code = textwrap.dedent(
        f"""
        from jphantom import distributed
        try:
            distributed.initialize("127.0.0.1:{free_port()}", 2, 1, 2, timeout_s=1, platform="cpu")
        except RuntimeError as err:
            print("RAISED", err)
        print("INITIALIZED", distributed.is_initialized())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=worker_env(2),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "RAISED" in result.stdout, result.stdout + result.stderr
    assert "process_id=1" in result.stdout and "127.0.0.1:" in result.stdout
    assert "timeout 1 s" in result.stdout
    assert "INITIALIZED False" in result.stdout
