"""Collective micro-benchmark on this machine, fitted with Eq. 26 next to Table III's Frontier constants.

Seal et al. Sec. 3.4 models one collective among p ranks with a message of m floats as

    (26)  t(m, p) = c1 · log2 p + c2 · m + c3                                   [microseconds]

and Table III fits it per collective on Frontier (RCCL, MI250X GCDs, m = 2^2..2^26, p = 2..256).
This script measures the same four collectives here and fits the same model
(``jphantom.perf.comm_model.fit``, relative least squares, RMSE in log2 μs as Table III reports it).

What is timed: one jitted ``jax.shard_map`` function per (kind, p, m) whose body is a single
collective over a 1-D mesh axis of p devices, float32. m is Table II's per-rank message, the m of
``jphantom.perf.comm_model.message_floats`` (checked against each compiled function's result buffer):

    kind            per-rank input -> result     HLO op it compiles to
    all-gather      [m]      -> [p·m]            all-gather       lax.all_gather(tiled)
    reduce-scatter  [p·m]    -> [m]              reduce-scatter   lax.psum_scatter(tiled)
    all-reduce      [m]      -> [m]              all-reduce       lax.psum
    broadcast       [m]      -> [m]              all-reduce       lax.psum of a one-hot-masked buffer

Broadcast: ``lax.pbroadcast`` (HLO collective-broadcast) has no CPU lowering in jax 0.10 ("MLIR
translation rule for primitive 'pbroadcast' not found for platform cpu"), so broadcast is written as
jax documents pbroadcast's meaning: every rank but the root zeroes its buffer and the buffers are
summed, ``psum(where(axis_index == 0, x, 0))``. That compiles to an all-reduce (after a select), so
on CPU broadcast moves all-reduce's bytes and its fit should match all-reduce's; on Frontier RCCL's
real broadcast moves half as much (Table III: c2 1.12e-3 against all-reduce's 2.56e-3). The HLO
collective ops of every function are recorded in the JSON (``hlo_ops``).

Transports:

- ``simulated``: p simulated CPU devices in this process (``--xla_force_host_platform_device_count``).
  The "network" is a memcpy through shared memory between threads of one process, and all p devices
  share this machine's cores: it shows XLA's CPU collective code path and the cost of p devices
  contending for a few cores, not any interconnect.
- ``gloo``: p local processes with one CPU device each, joined by ``jphantom.runtime.distributed.initialize``
  over 127.0.0.1; collectives go through gloo over TCP loopback, a real transport (kernel sockets,
  copies, serialisation), though with no wire: bandwidth is memory and CPU bound.

Each timing: compile, ``--warmup`` untimed calls, then ``--repeats`` timed calls, each ended by
``block_until_ready``; the recorded time is the median. In gloo mode every process times every call
after a tiny all-reduce barrier, the time of a call is the slowest rank's (a collective is done when
its last rank is), and process 0 gathers all ranks' times and writes them. Messages at or above
``--large-from`` floats (2^18 by default) get ``--large-repeats`` (3) timed calls and one warm-up,
so that the full sweep takes a few minutes: a gloo reduce-scatter of m = 2^22 among 8 processes
reduces 8 · 128 MiB over loopback and takes seconds per call here. Every size also times the same
shard_map call with no collective in it (``x + 1``, kind ``no-collective``, not fitted): the
dispatch and output-write floor that c3 absorbs on CPU.

Every result is checked (rank r's input is filled with r + 1): on the first call and on the last
timed call. A wrong result is recorded (``wrong_elements``, ``wrong_results``) and reported, not
raised: jax 0.10's gloo reduce-scatter intermittently leaves the tail of rank 0's result wrong
(jax-ml/jax#40830), already at m = 2^14 floats with p = 2 here.

Usage::

    python experiments/collectives.py                  # m = 2^2..2^22, p = 2,4,8, both transports
    python experiments/collectives.py --quick          # m = 2^2,2^6,2^10,2^14, p = 2,4, ~10 s
    python experiments/collectives.py --sizes 10,20 --shards 2,4 --transports gloo --repeats 20

Results: ``<out>/results.json`` (every timed call, medians, fits, Table III) and
``<out>/collectives.png`` (``--out``, default ``experiments/results/collectives/``; ``--quick``: a
scratch folder).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.runtime import distributed
from jphantom.analysis import hlo
from jphantom.analysis.machine import output_folder
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import first_devices, make_mesh, simulate_cpu_devices
from jphantom.perf.comm_model import FRONTIER, CollectiveCost, fit, message_floats, rmse_log2_us

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "collectives"
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "broadcast")
TRANSPORTS = ("simulated", "gloo")
FLOOR = "no-collective"  # reference rows: the same jitted shard_map call with no collective in it
AXIS = "model"  # one mesh axis over the p ranks (a name from jphantom.runtime.mesh.AXES)
ROOT = 0  # broadcast source rank
WORKER_TIMEOUT_S = 900


# --------------------------------------------------------------------------------------------------
# The collectives: one per-device function each; m is Table II's per-rank message.
# --------------------------------------------------------------------------------------------------


def all_gather(x):  # x: [m], this rank's contribution
    return lax.all_gather(x, AXIS, tiled=True)  # [p·m]  all-gather: each rank sends m


def reduce_scatter(x):  # x: [p·m], this rank's addends for every rank
    return lax.psum_scatter(x, AXIS, tiled=True)  # [m]  reduce-scatter: this rank's summed share m


def all_reduce(x):  # x: [m]
    return lax.psum(x, AXIS)  # [m]  all-reduce of the whole buffer m


def broadcast(x):  # x: [m], only the root's counts
    from_root = jnp.where(lax.axis_index(AXIS) == ROOT, x, jnp.zeros_like(x))
    return lax.psum(from_root, AXIS)  # [m]  all-reduce of a one-hot-masked buffer = root's x everywhere


def no_collective(x):  # x: [m]
    return x + 1  # [m]  no communication: the dispatch and output write every call pays (c3's floor)


PER_DEVICE = {
    "all-gather": all_gather,
    "reduce-scatter": reduce_scatter,
    "all-reduce": all_reduce,
    "broadcast": broadcast,
    FLOOR: no_collective,
}
INPUT_PER_RANK = {"all-gather": 1, "reduce-scatter": "p", "all-reduce": 1, "broadcast": 1, FLOOR: 1}


def input_floats(kind: str, m: int, p: int) -> int:
    """Per-rank input length for a per-rank message of m floats (see the module docstring)."""
    return m * (p if INPUT_PER_RANK[kind] == "p" else 1)


def expected_local(kind: str, rank: int, m: int, p: int) -> np.ndarray:
    """What rank ``rank`` must hold after ``kind`` when rank r's input is filled with r + 1."""
    if kind == "all-gather":
        return np.repeat(np.arange(1, p + 1, dtype=np.float32), m)
    if kind == "broadcast":
        return np.full(m, ROOT + 1, np.float32)
    if kind == FLOOR:
        return np.full(m, rank + 2, np.float32)
    return np.full(m, p * (p + 1) / 2, np.float32)  # reduce-scatter, all-reduce: sum of r + 1


# --------------------------------------------------------------------------------------------------
# Timing, the same code in both transports.
# --------------------------------------------------------------------------------------------------


def sizes_from(spec: Sequence[int]) -> list[int]:
    """Message sizes 2^lo, 2^(lo+step), ..., 2^hi floats from (lo, hi[, step])."""
    if len(spec) not in (2, 3):
        raise ConfigError(f"--sizes {spec}: give min,max or min,max,step exponents, e.g. --sizes 2,22")
    lo, hi, step = (*spec, 1)[:3]
    if not (0 <= lo <= hi <= 30 and step >= 1):
        raise ConfigError(
            f"--sizes {','.join(map(str, spec))}: need 0 <= min <= max <= 30 exponents and step >= 1, "
            "e.g. --sizes 2,22 for m = 2^2..2^22 floats"
        )
    return [2**e for e in range(lo, hi + 1, step)]


def repeats_for(m: int, args) -> tuple[int, int]:
    """(warm-up calls, timed calls) for a message of m floats."""
    if m >= args.large_from:
        return min(args.warmup, 1), min(args.repeats, args.large_repeats)
    return args.warmup, args.repeats


def make_input(kind: str, m: int, mesh) -> jax.Array:
    """Global input whose shard on rank r is filled with r + 1 (built per shard: no global copy)."""
    p = mesh.shape[AXIS]
    local = input_floats(kind, m, p)
    sharding = NamedSharding(mesh, P(AXIS))

    def shard(index):
        rank = index[0].start // local
        return np.full(local, rank + 1, np.float32)

    return jax.make_array_from_callback((p * local,), sharding, shard)


def check_result(kind: str, out: jax.Array, m: int, p: int) -> tuple[int, str | None]:
    """Compare every addressable shard with what the collective must produce.

    Returns (number of wrong elements, description of the first wrong shard or None). Wrong results
    are recorded, not raised: gloo's reduce-scatter on jax 0.10 intermittently corrupts the tail of
    rank 0's result (jax-ml/jax#40830), and the run should still report its times and how often.
    """
    wrong_total, detail = 0, None
    for piece in out.addressable_shards:
        rank = (piece.index[0].start or 0) // piece.data.shape[0]
        got = np.asarray(piece.data)
        want = expected_local(kind, rank, m, p)
        if got.shape != want.shape:
            raise RuntimeError(f"{kind} p={p} m={m}: rank {rank} holds shape {got.shape}, want {want.shape}")
        wrong = np.flatnonzero(got != want)
        if wrong.size:
            wrong_total += int(wrong.size)
            detail = detail or (
                f"{kind} p={p} m={m}: rank {rank} holds a wrong result at {wrong.size} of {got.size} "
                f"elements (indices {wrong[0]}..{wrong[-1]}): got {got[wrong[:3]]}, want {want[wrong[:3]]}"
            )
    return wrong_total, detail


def time_collectives(mesh, sizes, args, *, barrier=None, progress=None) -> list[dict]:
    """Time every kind at every size on ``mesh``; one dict per (kind, m) with this process's times.

    Sizes are the outer loop so that load from other processes on the machine hits all kinds alike.
    ``barrier`` (gloo) runs before every timed call so that all ranks start together. Each size also
    times the same call with no collective in it (kind ``no-collective``), the floor c3 absorbs.
    """
    p = mesh.shape[AXIS]
    functions = {
        kind: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
        for kind, fn in PER_DEVICE.items()
        if kind in args.kinds or kind == FLOOR
    }
    rows = []
    for m in sizes:
        warmup, repeats = repeats_for(m, args)
        for kind, fn in functions.items():
            x = make_input(kind, m, mesh)
            compiled = fn.lower(x).compile()
            found = hlo.collectives(compiled.as_text())
            out = compiled(x)
            out.block_until_ready()
            result_bytes = out.addressable_shards[0].data.nbytes
            if kind != FLOOR and message_floats(kind, result_bytes, p) != m:  # Table II's m
                raise RuntimeError(f"{kind}: result of {result_bytes} B is not a message of m={m}")
            checks = [check_result(kind, out, m, p)]  # the first call's result ...
            for _ in range(warmup):
                compiled(x).block_until_ready()
            times = []
            for _ in range(repeats):
                if barrier is not None:
                    barrier()
                del out
                start = time.perf_counter()
                out = compiled(x)
                out.block_until_ready()
                times.append((time.perf_counter() - start) * 1e6)
            checks.append(check_result(kind, out, m, p))  # ... and the last timed call's
            rows.append(
                {
                    "kind": kind,
                    "p": p,
                    "m": m,
                    "hlo_ops": sorted({c.kind for c in found}),
                    "times_us": times,
                    "wrong_elements": sum(n for n, _ in checks),
                    "wrong_detail": next((d for _, d in checks if d), None),
                }
            )
            del x, out
            if progress is not None and kind != FLOOR:
                progress.update(1)
    return rows


def sample(transport: str, row: dict) -> dict:
    row = dict(row, transport=transport)
    row["median_us"] = statistics.median(row["times_us"])
    return row


def run_simulated(shards, sizes, args) -> list[dict]:
    """p simulated CPU devices of this process: sub-meshes of the first p of ``jax.devices()``."""
    from tqdm.auto import tqdm

    have = jax.device_count()
    if max(shards) > have:
        raise ConfigError(
            f"simulated transport needs {max(shards)} devices for --shards {shards}, this process has "
            f"{have}: run the script itself (it simulates max(--shards) CPU devices) or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={max(shards)} before jax starts"
        )
    samples = []
    with tqdm(total=len(shards) * len(sizes) * len(args.kinds), desc="simulated", unit="cfg") as bar:
        for p in shards:
            mesh = make_mesh({AXIS: p}, first_devices(p))
            bar.set_postfix(p=p)
            rows = time_collectives(mesh, sizes, args, progress=bar)
            samples += [sample("simulated", row) for row in rows]
    return samples


# --------------------------------------------------------------------------------------------------
# gloo: p local processes over 127.0.0.1, this script in --worker mode.
# --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The parent's environment for a one-CPU-device worker: no inherited device count or jax/cluster
    settings (the test process simulates 8 devices), CPU only, jphantom importable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JPHANTOM_", "SLURM_", "OMPI_", "PMI_", "JAX_"))
    }
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=1"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def worker_argv(args, coordinator: str, rank: int, p: int, out: Path) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        coordinator,
        str(rank),
        str(p),
        str(out),
        "--sizes",
        ",".join(map(str, args.sizes)),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--large-from",
        str(args.large_from),
        "--large-repeats",
        str(args.large_repeats),
        "--kinds",
        ",".join(args.kinds),
    ]


def run_gloo(shards, args) -> list[dict]:
    """For each p, launch p worker processes (one CPU device each) and read process 0's results."""
    samples = []
    env = worker_env()
    with tempfile.TemporaryDirectory(prefix="collectives-gloo-") as tmp:
        for p in shards:
            out = Path(tmp) / f"p{p}.json"
            logs = [Path(tmp) / f"p{p}-rank{r}.log" for r in range(p)]
            coordinator = f"127.0.0.1:{free_port()}"
            procs = []
            try:
                for rank in range(p):
                    # Process 0 shows its progress bar on our stderr; the others log to files.
                    stderr = None if rank == 0 else open(logs[rank], "w")
                    procs.append(
                        subprocess.Popen(
                            worker_argv(args, coordinator, rank, p, out),
                            cwd=REPO,
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=stderr,
                        )
                    )
                    if stderr is not None:
                        stderr.close()
                deadline = time.monotonic() + WORKER_TIMEOUT_S
                for proc in procs:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"gloo p={p}: workers did not finish in {WORKER_TIMEOUT_S} s\n" + _logs(procs, logs)
                ) from None
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
            if any(proc.returncode != 0 for proc in procs) or not out.exists():
                raise RuntimeError(
                    f"gloo p={p}: a worker failed (exit 134 = a peer never reached the coordinator)\n"
                    + _logs(procs, logs)
                )
            samples += [sample("gloo", row) for row in json.loads(out.read_text())]
    return samples


def _logs(procs, logs) -> str:
    return "\n".join(
        f"--- rank {r} (rc={proc.returncode}): "
        + (logs[r].read_text()[-3000:] if r > 0 and logs[r].exists() else "(stderr shown above)")
        for r, proc in enumerate(procs)
    )


def worker(args) -> None:
    """One gloo rank: join, time everything on the p-process mesh, process 0 writes all ranks' times."""
    coordinator, rank, p, out = args.worker
    distributed.initialize(coordinator, int(p), int(rank), local_device_count=1,
                           initialization_timeout=120, platform="cpu")
    from jax.experimental import multihost_utils
    from tqdm.auto import tqdm

    mesh = make_mesh({AXIS: int(p)})
    token = jax.make_array_from_callback(
        (int(p),), NamedSharding(mesh, P(AXIS)), lambda index: np.ones(1, np.float32)
    )
    sync = jax.jit(jax.shard_map(all_reduce, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    sync(token).block_until_ready()

    def barrier():
        sync(token).block_until_ready()

    sizes = sizes_from(args.sizes)
    total = len(sizes) * len(args.kinds)
    with tqdm(total=total, desc=f"gloo p={p}", unit="cfg", disable=int(rank) != 0) as bar:
        rows = time_collectives(mesh, sizes, args, barrier=barrier, progress=bar)
    # Every rank ran the same calls in the same order: gather the flat list of times.
    mine = np.asarray([t for row in rows for t in row["times_us"]], np.float32)
    every = np.asarray(multihost_utils.process_allgather(mine, tiled=False)).reshape(int(p), -1)
    wrong = np.asarray([row["wrong_elements"] for row in rows], np.int32)
    wrong_by_rank = np.asarray(multihost_utils.process_allgather(wrong, tiled=False)).reshape(int(p), -1)
    if int(rank) == 0:
        at = 0
        for index, row in enumerate(rows):
            row["wrong_elements_by_rank"] = wrong_by_rank[:, index].tolist()
            row["wrong_elements"] = int(wrong_by_rank[:, index].sum())
            n = len(row["times_us"])
            by_rank = every[:, at : at + n].astype(float)
            at += n
            row["times_us_by_rank"] = by_rank.tolist()
            row["times_us"] = by_rank.max(axis=0).tolist()  # a call ends when its slowest rank does
        Path(out).write_text(json.dumps(rows))
    distributed.shutdown()


# --------------------------------------------------------------------------------------------------
# Fit, table, JSON, plot.
# --------------------------------------------------------------------------------------------------


def cost_dict(cost: CollectiveCost) -> dict:
    return {"c1": cost.c1, "c2": cost.c2, "c3": cost.c3, "rmse_log2_us": cost.rmse_log2_us}


def medians(samples: list[dict], transport: str, kind: str, p: int | None = None) -> list[tuple]:
    """(m, p, median μs) of one transport and kind (and group size p, if given), sorted by m."""
    return sorted(
        (s["m"], s["p"], s["median_us"])
        for s in samples
        if s["transport"] == transport and s["kind"] == kind and p in (None, s["p"])
    )


def fit_all(samples: list[dict], transports, kinds) -> dict:
    """Eq. 26 per transport and kind (relative least squares on the medians), plus how well Table
    III's Frontier constants describe the same medians."""
    fits = {}
    for transport in transports:
        fits[transport] = {}
        for kind in kinds:
            points = medians(samples, transport, kind)
            cost = fit(points, relative=True)
            fits[transport][kind] = cost_dict(cost) | {
                "samples": len(points),
                "frontier_rmse_log2_us_on_these": rmse_log2_us(FRONTIER.cost(kind), points),
            }
    return fits


def floors(samples: list[dict]) -> dict:
    """Median μs of the no-collective call at the smallest m: {transport: {p: μs}}."""
    smallest = min(s["m"] for s in samples)
    table = {}
    for s in samples:
        if s["kind"] == FLOOR and s["m"] == smallest:
            table.setdefault(s["transport"], {})[s["p"]] = s["median_us"]
    return table


def format_table(fits: dict, kinds, floor_us: dict) -> str:
    lines = [
        "Eq. 26 fits, t = c1*log2(p) + c2*m + c3 [us], m in floats (relative least squares on medians)",
        f"{'collective':<15} {'source':<10} {'c1 [us]':>10} {'c2 [us/float]':>14} {'c3 [us]':>10} "
        f"{'RMSE[log2 us]':>14} {'Frontier RMSE here':>19}",
    ]
    for kind in kinds:
        frontier = FRONTIER.cost(kind)
        lines.append(
            f"{kind:<15} {'Frontier':<10} {frontier.c1:>10.2f} {frontier.c2:>14.3e} {frontier.c3:>10.2f} "
            f"{frontier.rmse_log2_us:>14.2f} {'':>19}"
        )
        for transport, by_kind in fits.items():
            c = by_kind[kind]
            lines.append(
                f"{'':<15} {transport:<10} {c['c1']:>10.2f} {c['c2']:>14.3e} {c['c3']:>10.2f} "
                f"{c['rmse_log2_us']:>14.2f} {c['frontier_rmse_log2_us_on_these']:>19.2f}"
            )
    for transport, by_p in floor_us.items():
        cells = ", ".join(f"p={p}: {us:.0f}" for p, us in sorted(by_p.items()))
        lines.append(f"no-collective call (dispatch floor), {transport}: {cells} us")
    return "\n".join(lines)


def plot(samples: list[dict], fits: dict, kinds, path: Path) -> None:
    """Time vs m, one panel per kind: medians per (transport, p), their Eq. 26 fits, Table III's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    shards = sorted({s["p"] for s in samples})
    colors = {p: plt.get_cmap("viridis")(0.85 * i / max(1, len(shards) - 1)) for i, p in enumerate(shards)}
    markers = {"simulated": "o", "gloo": "^"}
    styles = {"simulated": "-", "gloo": "--"}
    sizes = sorted({s["m"] for s in samples})
    grid = np.geomspace(sizes[0], sizes[-1], 64)
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), sharex=True, squeeze=False)
    for ax, kind in zip(axes.flat, kinds):
        for transport, by_kind in fits.items():
            cost = by_kind[kind]
            for p in shards:
                points = medians(samples, transport, kind, p)
                if not points:
                    continue
                m, _, t = zip(*points)
                ax.plot(m, t, markers[transport], color=colors[p], ms=5, alpha=0.8, label=f"{transport} p={p}")
                model = cost["c1"] * math.log2(p) + cost["c2"] * grid + cost["c3"]
                ax.plot(grid, np.where(model > 0, model, np.nan), styles[transport], color=colors[p], lw=1)
            floor = medians(samples, transport, FLOOR, shards[-1])  # the same call, no collective
            if floor:
                m, _, t = zip(*floor)
                label = f"{transport} p={shards[-1]}, no collective"
                ax.plot(m, t, markers[transport], color="0.6", ms=3, mfc="none", label=label)
        frontier = FRONTIER.cost(kind)
        for p in shards:
            model = frontier.c1 * math.log2(p) + frontier.c2 * grid + frontier.c3
            ax.plot(grid, model, ":", color=colors[p], lw=1, alpha=0.6)
        ax.set(xscale="log", yscale="log", title=kind, xlabel="m [floats per rank]", ylabel="time [μs]")
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    handles += [Line2D([], [], color="k", ls=ls) for ls in ("-", "--", ":")]
    labels += ["Eq. 26 fit, simulated", "Eq. 26 fit, gloo", "Table III Frontier"]
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle("Collectives on this machine vs. Eq. 26 (points: medians; lines: fits)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# CLI.
# --------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _names(allowed):
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(allowed)}")
        return names

    return parse


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--sizes", type=_ints, default=[2, 22], help="min,max[,step] exponents of m (floats per rank); 2,22")
    add("--shards", type=_ints, default=[2, 4, 8], help="group sizes p; default 2,4,8")
    add("--transports", type=_names(TRANSPORTS), default=list(TRANSPORTS), help="simulated,gloo")
    add("--kinds", type=_names(KINDS), default=list(KINDS), help=",".join(KINDS))
    add("--repeats", type=int, default=10, help="timed calls per point (median taken); default 10")
    add("--warmup", type=int, default=2, help="untimed calls per point after compile; default 2")
    add("--large-from", type=int, default=2**18, help="m (floats) from which --large-repeats apply")
    add("--large-repeats", type=int, default=3, help="timed calls per point for m >= --large-from")
    add("--quick", action="store_true", help="m = 2^2,2^6,2^10,2^14, p = 2,4, 10 repeats, both transports")
    add("--out", type=Path, default=None,
        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    add("--worker", nargs=4, metavar=("COORDINATOR", "RANK", "P", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.shards, args.repeats, args.warmup = [2, 14, 4], [2, 4], 10, 1
    try:
        sizes = sizes_from(args.sizes)
    except ConfigError as error:
        parser.error(str(error))
    if len(sizes) < 2:
        parser.error(f"--sizes {args.sizes}: need at least two message sizes to fit c2")
    if any(p < 2 for p in args.shards) or len(set(args.shards)) < 2:
        parser.error(f"--shards {args.shards}: need two or more distinct group sizes p >= 2 to fit c1, c3")
    if args.repeats < 1 or args.warmup < 0 or args.large_repeats < 1:
        parser.error("--repeats and --large-repeats must be >= 1, --warmup >= 0")
    args.kinds = [k for k in KINDS if k in args.kinds]  # Table III's order
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the sweep, fit Eq. 26, print the table and write results.json + collectives.png under --out.

    The simulated transport uses sub-meshes of this process's devices: call it from a process that
    already has max(--shards) CPU devices (the ``__main__`` entry point simulates them).
    """
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="collectives")
    sizes = sizes_from(args.sizes)
    started = time.perf_counter()
    load_start = os.getloadavg()[0]  # other work on the machine shows up in every time below
    samples = []
    if "simulated" in args.transports:
        samples += run_simulated(args.shards, sizes, args)
    if "gloo" in args.transports:
        samples += run_gloo(args.shards, args)
    fits = fit_all(samples, args.transports, args.kinds)
    floor_us = floors(samples)
    table = format_table(fits, args.kinds, floor_us)
    print(table)
    wrong = [
        {k: s[k] for k in ("transport", "kind", "p", "m", "wrong_elements", "wrong_detail")}
        for s in samples
        if s["wrong_elements"]
    ]
    for w in wrong:
        print(f"WRONG RESULT ({w['transport']}): {w['wrong_detail'] or w}", file=sys.stderr)
    if wrong:
        print(
            f"{len(wrong)} of {len(samples)} timed points returned wrong values (checked: first and "
            "last call); gloo reduce-scatter is known to corrupt rank 0's tail on jax 0.10 "
            "(jax-ml/jax#40830)",
            file=sys.stderr,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    results = {
        "experiment": "collectives",
        "paper": "Seal et al. Sec. 3.4, Eq. 26, Table III",
        "model": "t(m, p) = c1*log2(p) + c2*m + c3 [us], m = floats per rank (Table II), float32",
        "config": {
            "sizes": sizes,
            "shards": args.shards,
            "transports": args.transports,
            "kinds": args.kinds,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "large_from": args.large_from,
            "large_repeats": args.large_repeats,
            "quick": args.quick,
        },
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "jax": jax.__version__,
        },
        "load_average_1min": {"start": load_start, "end": os.getloadavg()[0]},
        "wall_s": time.perf_counter() - started,
        "fits": fits,
        "frontier": {kind: cost_dict(FRONTIER.cost(kind)) for kind in args.kinds},
        "no_collective_floor_us": {
            transport: {str(p): us for p, us in by_p.items()} for transport, by_p in floor_us.items()
        },
        "table": table,
        "wrong_results": wrong,
        "samples": samples,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(samples, fits, args.kinds, args.out / "collectives.png")
    wrote = f"{args.out / 'results.json'} and {args.out / 'collectives.png'}"
    print(f"wrote {wrote} in {results['wall_s']:.1f} s")
    return results


if __name__ == "__main__":
    cli = sys.argv[1:]
    if "--worker" not in cli:
        # Entry point: simulate max(--shards) CPU devices before jax starts (workers get theirs from
        # jphantom.runtime.distributed.initialize instead).
        simulate_cpu_devices(max(parse_args(cli).shards))
    main(cli)
