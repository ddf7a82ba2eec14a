"""Where `make test`'s time goes: the fast suite under a pytest plugin that sums jax's
compile-phase events (tracing, lowering to MLIR, XLA's backend compile, the compilation cache's
hits) and the time Python's cyclic garbage collector runs, per xdist worker, then prints the
sums over the workers. The README's Testing section quotes its numbers.

    python benchmarks/suite_time.py            # the interpreter that runs it runs the suite
    python benchmarks/suite_time.py --out DIR  # per-worker JSON and the sums in DIR

It runs the whole fast suite (10-17 minutes on 2 cores): never beside another suite or benchmark.
Before and after the suite it times a fixed compile (:func:`reference_compile`) in two fresh
processes at once, so that two runs' walls can be read against the machine's speed at the time:
on this 2-core VM the same suite's CPU seconds varied by 1.68x within an hour.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
EVENTS = {"/jax/core/compile/backend_compile_duration": "backend compile",
          "/jax/core/compile/jaxpr_trace_duration": "tracing",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering to MLIR"}


class Plugin:
    """Sums jax's duration events and the collector's pauses in this worker; writes them at the
    session's end to ``$SUITE_TIME_OUT/<worker>.json``."""

    def __init__(self):
        import jax

        self.sums, self.counts = collections.defaultdict(float), collections.Counter()
        self.gc_seconds, self._gc_start = 0.0, None
        # per test (setup, call and teardown): wall seconds, backend seconds, compile requests
        self.tests = collections.defaultdict(lambda: [0.0, 0.0, 0])
        self.programs = collections.defaultdict(lambda: [0.0, 0])  # backend s, compiles by name
        self._test, self._test_start = None, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        gc.callbacks.append(self._gc)

    def _duration(self, event, duration, fun_name="", **_):
        self.sums[event] += duration
        self.counts[event] += 1
        if event == "/jax/core/compile/backend_compile_duration":
            self.programs[fun_name][0] += duration
            self.programs[fun_name][1] += 1
            if self._test is not None:
                self.tests[self._test][1] += duration
                self.tests[self._test][2] += 1

    def pytest_runtest_logstart(self, nodeid, location):
        self._test, self._test_start = nodeid, time.perf_counter()

    def pytest_runtest_logfinish(self, nodeid, location):
        self.tests[nodeid][0] += time.perf_counter() - self._test_start
        self._test = None

    def _event(self, event, **_):
        self.counts[event] += 1

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_seconds += time.perf_counter() - self._gc_start
            self.counts[f"gc generation {info['generation']}"] += 1

    def pytest_sessionfinish(self, session, exitstatus):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "controller")
        out = pathlib.Path(os.environ["SUITE_TIME_OUT"]) / f"{worker}.json"
        out.write_text(json.dumps({"sums": self.sums, "counts": self.counts,
                                   "gc_seconds": self.gc_seconds, "tests": self.tests,
                                   "programs": self.programs},
                                  indent=1))


def pytest_configure(config):
    """Loaded with ``-p suite_time``: register the plugin in each process that runs tests."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(Plugin(), "suite_time_sums")


def summary(folder: pathlib.Path, top: int = 25) -> dict:
    """The per-worker files of ``folder`` summed: seconds per phase, compile requests, the
    compilation cache's hits and the collector's seconds and collections; then the ``top``
    files by wall seconds, each with its backend seconds and compiles (from the per-test
    records, where the workers wrote them), and the ``top`` programs by backend seconds (jax's
    ``fun_name``: the jitted function's name)."""
    sums, counts, gc_seconds = collections.Counter(), collections.Counter(), 0.0
    files = collections.defaultdict(lambda: [0.0, 0.0, 0])
    programs = collections.defaultdict(lambda: [0.0, 0])
    for path in sorted(folder.glob("gw*.json")):
        data = json.loads(path.read_text())
        sums.update(data["sums"])
        counts.update(data["counts"])
        gc_seconds += data["gc_seconds"]
        for totals, key, records in ((files, lambda nodeid: nodeid.split("::")[0], "tests"),
                                     (programs, lambda name: name, "programs")):
            for name, record in data.get(records, {}).items():
                totals[key(name)] = [a + b for a, b in zip(totals[key(name)], record)]
    longest = sorted(files.items(), key=lambda item: -item[1][0])[:top]
    costliest = sorted(programs.items(), key=lambda item: -item[1][0])[:top]
    return {**{name: round(sums[event], 1) for event, name in EVENTS.items()},
            "compile requests": counts["/jax/compilation_cache/compile_requests_use_cache"],
            "cache hits": counts["/jax/compilation_cache/cache_hits"],
            "garbage collector s": round(gc_seconds, 1),
            "collections": {k: v for k, v in counts.items() if k.startswith("gc generation")},
            "longest files (wall s, backend s, compiles)": {
                name: [round(wall, 1), round(backend, 1), compiles]
                for name, (wall, backend, compiles) in longest},
            "costliest programs (backend s, compiles)": {
                name: [round(backend, 1), compiles] for name, (backend, compiles) in costliest}}


def _environment(**extra: str) -> dict[str, str]:
    """This process's environment with ``extra`` and ``benchmarks/`` on the path (this module
    is the plugin ``-p suite_time`` and the reference compile's import)."""
    path = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, **extra, "PYTHONPATH": path}


def reference_compile(repeats: int = 5) -> float:
    """The median seconds of ``repeats`` compiles of one fixed program (a training step of four
    transformer blocks, width 32, float32, each compile a new function so that no cache serves
    it), in this process: the machine's compile speed, which the suite's time follows."""
    import jax
    import jax.numpy as jnp

    def block(w, x):
        h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        a = jax.nn.softmax((h @ w["q"]) @ (h @ w["k"]).swapaxes(-1, -2), -1) @ (h @ w["v"])
        x = x + a @ w["o"]
        return x + jax.nn.silu(x @ w["up"]) @ w["down"]

    def step(lr):
        def update(ws, x):
            loss = lambda ws: jnp.mean(functools.reduce(lambda x, w: block(w, x), ws, x) ** 2)
            value, grads = jax.value_and_grad(loss)(ws)
            return value, jax.tree.map(lambda w, g: w - lr * g, ws, grads)
        return update

    w = {n: jax.ShapeDtypeStruct((32, 32), jnp.float32) for n in ("q", "k", "v", "o", "up", "down")}
    x = jax.ShapeDtypeStruct((2, 16, 32), jnp.float32)
    seconds = []
    for i in range(repeats):
        lowered = jax.jit(step(1e-3 * (i + 1))).lower([w] * 4, x)
        start = time.perf_counter()
        lowered.compile()
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[len(seconds) // 2]


def reference_seconds(processes: int = 2) -> float:
    """:func:`reference_compile` in ``processes`` fresh processes at once (the suite's two
    workers), with the suite's LLVM ``-O0``: the mean of their medians. Both cores busy is what
    the suite sees: on this VM one compile took 0.56-0.63 s alone and 0.77-0.81 s beside another."""
    env = _environment(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    command = [sys.executable, "-c", "import suite_time; print(suite_time.reference_compile())"]
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(processes)]
    outputs = [run.communicate()[0] for run in runs]
    if any(run.returncode for run in runs):
        raise RuntimeError("the reference compile failed")
    return sum(float(out.split()[-1]) for out in outputs) / processes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="folder for the per-worker JSON and summary.json (default: a "
                             "scratch folder)")
    args = parser.parse_args(argv)
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="suite_time-"))
    out.mkdir(parents=True, exist_ok=True)
    env = _environment(SUITE_TIME_OUT=str(out))
    before = reference_seconds()
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-n", "2",
                           "--dist", "loadfile", "-p", "suite_time", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    speed = (before, reference_seconds())  # the reference compile's seconds, before and after
    result = {"wall s": round(wall, 1), "exit": done.returncode,
              "python": sys.version.split()[0],
              "reference compile s (before, after)": [round(t, 3) for t in speed],
              "wall / reference compile": round(wall / (sum(speed) / 2)), **summary(out)}
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
