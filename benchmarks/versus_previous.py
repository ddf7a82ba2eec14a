"""This code against a previous version of jphantom, side by side in one run: every layout of
``make bench`` timed in two worker processes, one importing this tree and one a previous commit
(default: the last commit before the library was split into modules of one idea each),
alternating step by step.

Why two processes: two versions of one package cannot share an interpreter. The driver starts a
worker per version (same interpreter, same 8 simulated CPU devices, ``PYTHONPATH`` pointing at the
version's sources, extracted with ``git archive``); each worker builds and compiles every case
once, then the driver asks them in turn for one timed step of one case (``--steps`` rounds after
``--warmup``, the order of the two versions alternating each round), so that load from anything
else on the machine hits both alike. Only one worker runs at a time.

Each case is a layout ``make bench`` measures, at the benchmark's default sizes:
``phantom_vs_tp`` (FFN n=4096, L=2, model=8: phantom k=16, tensor-t1, tensor, gspmd),
``transformer_strategies`` (GPT-2 L=4, h=512, S=128, B=16 on data=2,model=4: tensor, tensor + SP,
phantom k=8, gspmd), ``zero_stages`` (FFN n=1024, L=8, B=256 under tensor on data=8: ZeRO 0-3),
``moe`` (GPT-2 with top-1 MoE every 2nd block, E=8, on expert=8, and dense on data=8) and ``pmm3d``
(GPT-2 on data=4,x=2 and tensor on data=8). ``--cases pipelines`` measures every pipeline
schedule instead (:func:`pipeline_cases`). Reported: median step time of each version, their
ratio (this / previous; the target: no case above 1.05), the compiled step's collective bytes
per device of each (they should agree), its temporary memory and whether the two versions
compiled the same program (``same_hlo``: the optimised HLO's hash, source metadata left out).

Compile time (``--compile-layers``, default 12; 0 skips it): a GPT-2 step of that many layers
(h=512, 8 heads, S=128, B=16, tensor on data=2,model=4, SGD) lowered and compiled on abstract
parameters, each version in a fresh process per round (a cold compile, as a user's first step),
the versions alternating over ``--compile-rounds`` rounds; the medians and their ratio (the
target: no slower).

Usage::

    python benchmarks/versus_previous.py                    # every case, 10 rounds
    python benchmarks/versus_previous.py --quick            # tiny sizes, a smoke run
    python benchmarks/versus_previous.py --previous HEAD~5  # another version
    python benchmarks/versus_previous.py --this HEAD        # the last commit, not the tree
    python benchmarks/versus_previous.py --cases pipelines  # every pipeline schedule instead
    python benchmarks/versus_previous.py --steps 0 --compile-layers 0  # same programs? untimed

Results: ``<out>/results.json`` and ``<out>/versus_previous.png`` (default
``benchmarks/results/versus_previous/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "versus_previous"
PREVIOUS = "b102f76"  # the last commit before the step, the CLI and the layers were split by idea
TARGET = 1.05


def cases(quick: bool) -> list[dict]:
    """The layouts of ``make bench`` (module docstring); ``quick``: tiny shapes."""
    ffn = dict(model="ffn", width=256 if quick else 4096, depth=2, batch=64 if quick else 256,
               optimizer="sgd")
    gpt = dict(model="gpt2", layers=1 if quick else 4, hidden=64 if quick else 512, heads=8,
               seq_len=16 if quick else 128, batch=4 if quick else 16, optimizer="adamw")
    zero = dict(model="ffn", width=64 if quick else 1024, depth=2 if quick else 8,
                batch=64 if quick else 256, optimizer="adamw")
    moe = dict(model="gpt2", layers=2 if quick else 4, hidden=32 if quick else 256, heads=4,
               seq_len=16 if quick else 128, batch=16 if quick else 32, optimizer="adamw")
    pmm = dict(model="gpt2", layers=2 if quick else 4, hidden=32 if quick else 256, heads=8,
               seq_len=16 if quick else 128, batch=16 if quick else 32, optimizer="adamw")
    out = [
        {**ffn, "bench": "phantom_vs_tp", "strategy": "phantom", "mesh": "model=8",
         "ghost_width": 4 if quick else 16},
        {**ffn, "bench": "phantom_vs_tp", "strategy": "tensor-t1", "mesh": "model=8"},
        {**ffn, "bench": "phantom_vs_tp", "strategy": "tensor", "mesh": "model=8"},
        {**ffn, "bench": "phantom_vs_tp", "strategy": "gspmd", "mesh": "model=8"},
        {**gpt, "bench": "transformer_strategies", "strategy": "tensor", "mesh": "data=2,model=4"},
        {**gpt, "bench": "transformer_strategies", "strategy": "tensor", "mesh": "data=2,model=4",
         "sequence_parallel": True},
        {**gpt, "bench": "transformer_strategies", "strategy": "phantom", "mesh": "data=2,model=4",
         "ghost_width": 2 if quick else 8},
        {**gpt, "bench": "transformer_strategies", "strategy": "gspmd", "mesh": "data=2,model=4"},
        *({**zero, "bench": "zero_stages", "strategy": "tensor", "mesh": "data=8,model=1",
           "zero": z} for z in (0, 1, 2, 3)),
        {**moe, "bench": "moe", "strategy": "tensor", "mesh": "expert=8,model=1", "moe_every": 2,
         "experts": 8, "top_k": 1, "capacity_factor": 1.25},
        {**moe, "bench": "moe", "strategy": "tensor", "mesh": "data=8,model=1"},
        {**pmm, "bench": "pmm3d", "strategy": "pmm3d", "mesh": "data=4,z=1,y=1,x=2"},
        {**pmm, "bench": "pmm3d", "strategy": "tensor", "mesh": "data=8,model=1"},
    ]
    return out


def pipeline_cases(quick: bool) -> list[dict]:
    """Every pipeline schedule on one GPT-2 (L=8, h=256, S=128, B=16; ``quick``: tiny), tensor
    parallelism inside the stages: on stage=2,data=2,model=2 with 4 micro-batches, and 1F1B and
    ZB-V on stage=4,model=2 with 8."""
    gpt = dict(model="gpt2", layers=8, hidden=32 if quick else 256, heads=4,
               seq_len=16 if quick else 128, batch=16, optimizer="adamw", strategy="tensor",
               bench="pipelines")
    two = dict(gpt, mesh="stage=2,data=2,model=2", microbatches=4)
    four = dict(gpt, mesh="stage=4,model=2", microbatches=8)
    return [dict(two, schedule="gpipe"), dict(two, schedule="1f1b"),
            dict(two, schedule="interleaved-1f1b", virtual_stages=2), dict(two, schedule="zb-h1"),
            dict(two, schedule="zb-v"), dict(four, schedule="1f1b"), dict(four, schedule="zb-v")]


def label(case: dict) -> str:
    extra = "".join(f" {k}={case[k]}" for k in ("schedule", "microbatches", "virtual_stages",
                                                 "zero", "moe_every", "ghost_width")
                    if case.get(k)) + (" +SP" if case.get("sequence_parallel") else "")
    return f"{case['bench']}: {case['model']} {case['strategy']} {case['mesh']}{extra}"


# --------------------------------------------------------------------------------------------------
# Worker: one version of jphantom, commands on stdin, JSON answers on stdout
# --------------------------------------------------------------------------------------------------


def _batch(case, shardings):
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    if case["model"] == "ffn":
        shape = (case["batch"], case["width"])
        arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    else:
        shape = (case["batch"], case["seq_len"])
        arrays = [rng.integers(0, 256, shape).astype(np.int32) for _ in range(2)]
    return tuple(jax.device_put(a, s) for a, s in zip(arrays, shardings))


RUN_FLAGS = dict(vocab=256, out=None, progress=False, warmup_steps=0, learning_rate=1e-4)


def _import_this_version() -> None:
    """Import jphantom from this version's sources (``JPHANTOM_SOURCE``, on ``PYTHONPATH``, set by
    :class:`Version`), whatever an editable install of another maps "jphantom" to; refuse
    another copy."""
    root = os.environ["JPHANTOM_SOURCE"]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    import jphantom

    if not str(Path(jphantom.__file__).resolve()).startswith(str(Path(root).resolve())):
        raise SystemExit(f"jphantom imported from {jphantom.__file__}, not {root}")


def build(case):
    """The case's step, compiled, through the run configuration (``RunConfig.build()``: the API
    of both versions compared)."""
    from jphantom.config import RunConfig

    flags = {k: v for k, v in case.items() if k not in ("bench",)}
    built = RunConfig.from_flags(**flags, **RUN_FLAGS).build()
    state = built.program.init(built.step)
    batch = _batch(case, built.shardings)
    compiled = built.step.lower(state, *batch).compile()
    return compiled, state, lambda state: compiled(state, *batch)


def hlo_fingerprint(text: str) -> str:
    """A hash of the optimised HLO without its source metadata (file names and lines, op names):
    two versions that compile the same program give the same fingerprint."""
    import hashlib
    import re

    text = re.sub(r",? metadata=\{[^}]*\}", "", text)
    # the tables of source files, functions and stack frames the instructions' metadata named
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?\n\n", "", text,
                  flags=re.S | re.M)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


COMPILE_CASE = dict(model="gpt2", hidden=512, heads=8, seq_len=128, batch=16, optimizer="sgd",
                    strategy="tensor", mesh="data=2,model=4")


def compile_worker(layers: int) -> int:
    """One cold compile of a ``layers``-deep GPT-2 step (this version's API); prints its seconds."""
    _import_this_version()
    import jax

    from jphantom.config import RunConfig

    built = RunConfig.from_flags(**COMPILE_CASE, layers=layers, **RUN_FLAGS).build()
    step = built.step
    batch = [jax.ShapeDtypeStruct((COMPILE_CASE["batch"], COMPILE_CASE["seq_len"]), "int32",
                                  sharding=s) for s in built.shardings]
    start = time.perf_counter()
    lowered = step.lower(step.abstract_state(), *batch)
    traced = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    print(json.dumps({"seconds": done - start, "lower_seconds": traced - start,
                      "xla_seconds": done - traced}), flush=True)
    return 0


def worker() -> int:
    _import_this_version()
    import jax

    from jphantom.analysis.hlo import collectives

    built = {}
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "exit":
            return 0
        key = command["case"]
        try:
            if command["do"] == "build":
                case = json.loads(key)
                start = time.perf_counter()
                compiled, state, run = build(case)
                seconds = time.perf_counter() - start
                text = compiled.as_text()
                found = [c for c in collectives(text) if not c.trivial]
                built[key] = [state, run]
                state, loss = run(state)  # one untimed step
                jax.block_until_ready(loss)
                built[key][0] = state
                memory = compiled.memory_analysis()
                answer = {"build_seconds": seconds,
                          "collective_bytes": sum(c.total_bytes for c in found),
                          "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
                          "hlo_fingerprint": hlo_fingerprint(text)}
            else:
                state, run = built[key]
                start = time.perf_counter()
                state, loss = run(state)
                jax.block_until_ready((state, loss))
                answer = {"seconds": time.perf_counter() - start}
                built[key][0] = state
        except Exception as error:  # reported, the driver decides
            answer = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        print(json.dumps(answer), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


class Version:
    def __init__(self, name: str, source: Path, devices: int):
        env = dict(os.environ, PYTHONPATH=str(source), JAX_PLATFORMS="cpu",
                   JPHANTOM_SOURCE=str(source),
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        self.name, self.source, self.env = name, source, env
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"], cwd=str(source),
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def compile_seconds(self, layers: int) -> dict:
        """A cold compile of a ``layers``-deep step in a fresh process of this version: seconds in
        all, to lower (trace, jphantom's Python) and in XLA's compiler."""
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compile-worker",
                              str(layers)], cwd=str(self.source), env=self.env,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited")
        return json.loads(line)

    def close(self):
        try:
            self.ask(do="exit")
        except (RuntimeError, BrokenPipeError):
            pass
        self.process.wait(timeout=60)


def _snapshot(ref: str, into: Path) -> Path:
    """``this`` version's sources: a git ref's (``git archive``), or with ``"tree"`` a copy of the
    working tree's ``jphantom/`` and ``benchmarks/`` taken now (edits made while the benchmark
    runs do not reach it)."""
    if ref != "tree":
        return _extract(ref, into)
    import shutil

    for folder in ("jphantom", "benchmarks"):
        shutil.copytree(ROOT / folder, into / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    return into


def _extract(ref: str, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--previous", default=PREVIOUS,
                        help=f"the git revision to compare with (default {PREVIOUS})")
    parser.add_argument("--this", default="tree",
                        help="this version: 'tree' (a copy of the working tree, default) or a git "
                             "ref")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (8)")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed rounds (default 10; 0: compare the programs only, untimed)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    parser.add_argument("--only", default=None, help="run the cases whose label contains this")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, 2 rounds; results go to a scratch folder")
    parser.add_argument("--cases", choices=("bench", "pipelines"), default="bench",
                        help="make bench's layouts (default), or every pipeline schedule")
    parser.add_argument("--compile-layers", type=int, default=12,
                        help="layers of the compile-time case (default 12; 0: skip it)")
    parser.add_argument("--compile-rounds", type=int, default=3,
                        help="cold compiles per version (default 3)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = min(args.steps, 2), 1
        args.compile_layers, args.compile_rounds = min(args.compile_layers, 2), 1
        if args.out == DEFAULT_OUT:
            args.out = Path(tempfile.mkdtemp(prefix="jphantom-versus-previous-"))
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker()
    if args.compile_worker is not None:
        return compile_worker(args.compile_worker)
    every = cases(args.quick) if args.cases == "bench" else pipeline_cases(args.quick)
    todo = [c for c in every if args.only is None or args.only in label(c)]
    with tempfile.TemporaryDirectory(prefix="jphantom-previous-") as scratch:
        previous = _extract(args.previous, Path(scratch) / "previous")
        this = _snapshot(args.this, Path(scratch) / "this")
        versions = [Version("this", this, args.devices), Version("previous", previous,
                                                                 args.devices)]
        try:
            rows = []
            for case in todo:
                key = json.dumps(case, sort_keys=True)
                row = {"case": label(case), **case}
                built = {v.name: v.ask(do="build", case=key) for v in versions}
                row.update({f"{name}_build": answer for name, answer in built.items()})
                if any("error" in a for a in built.values()):
                    rows.append(row)
                    print(f"{label(case):<70} skipped: {built}", flush=True)
                    continue
                row["same_hlo"] = (built["this"]["hlo_fingerprint"]
                                   == built["previous"]["hlo_fingerprint"])
                rows.append(row)
                programs = (f"bytes {built['this']['collective_bytes']:,} / "
                            f"{built['previous']['collective_bytes']:,}  temp "
                            f"{_mib(built['this'])} / {_mib(built['previous'])} MiB  same HLO: "
                            f"{row['same_hlo']}")
                if not args.steps:  # the programs only
                    print(f"{label(case):<70} {programs}", flush=True)
                    continue
                times = {v.name: [] for v in versions}
                for round_index in range(args.warmup + args.steps):
                    order = versions if round_index % 2 == 0 else versions[::-1]
                    for v in order:
                        answer = v.ask(do="time", case=key)
                        if round_index >= args.warmup:
                            times[v.name].append(answer["seconds"])
                medians = {name: statistics.median(t) for name, t in times.items()}
                row.update(this_seconds=medians["this"], previous_seconds=medians["previous"],
                           ratio=medians["this"] / medians["previous"], times=times)
                print(f"{label(case):<70} this {medians['this'] * 1e3:8.2f} ms  previous "
                      f"{medians['previous'] * 1e3:8.2f} ms  ratio {row['ratio']:.3f}  "
                      f"{programs}", flush=True)
            compile_time = None
            if args.compile_layers:
                runs = {v.name: [] for v in versions}
                for round_index in range(args.compile_rounds):
                    for v in (versions if round_index % 2 == 0 else versions[::-1]):
                        runs[v.name].append(v.compile_seconds(args.compile_layers))
                median = lambda name, key: statistics.median(r[key] for r in runs[name])
                compile_time = {"layers": args.compile_layers, **COMPILE_CASE, "runs": runs}
                for key in ("seconds", "lower_seconds", "xla_seconds"):
                    compile_time[f"this_{key}"] = median("this", key)
                    compile_time[f"previous_{key}"] = median("previous", key)
                compile_time["ratio"] = (compile_time["this_seconds"]
                                         / compile_time["previous_seconds"])
                print(f"compile of a {args.compile_layers}-layer step (medians of "
                      f"{args.compile_rounds}): this {compile_time['this_seconds']:.2f} s "
                      f"(lower {compile_time['this_lower_seconds']:.2f} + XLA "
                      f"{compile_time['this_xla_seconds']:.2f})  previous "
                      f"{compile_time['previous_seconds']:.2f} s (lower "
                      f"{compile_time['previous_lower_seconds']:.2f} + XLA "
                      f"{compile_time['previous_xla_seconds']:.2f})  ratio "
                      f"{compile_time['ratio']:.3f}", flush=True)
        finally:
            for v in versions:
                v.close()
    measured = [r["ratio"] for r in rows if "ratio" in r]
    from jphantom.analysis.machine import source_revision

    this = source_revision(ROOT) + " + working tree" if args.this == "tree" else args.this
    result = {"previous": args.previous, "this": this, "devices": args.devices,
              "steps": args.steps, "warmup": args.warmup, "target_ratio": TARGET,
              "worst_ratio": max(measured) if measured else None,
              "geometric_mean_ratio": statistics.geometric_mean(measured) if measured else None,
              "platform": platform.platform(), "compile": compile_time, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    _plot(rows, args.out / "versus_previous.png")
    if measured:
        print(f"worst ratio {max(measured):.3f}, geometric mean "
              f"{result['geometric_mean_ratio']:.3f} (target <= {TARGET}: "
              f"{'met' if max(measured) <= TARGET else 'missed'}); wrote {args.out}")
    return 0


def _mib(answer: dict) -> str:
    """A build's compiled temporary memory (XLA's memory analysis), in MiB."""
    temp = answer.get("temp_bytes")
    return "?" if temp is None else f"{temp / 2**20:.1f}"


def _plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if "ratio" in r]
    if not measured:
        return
    figure, axes = plt.subplots(figsize=(12, 0.35 * len(measured) + 1.5))
    axes.barh([r["case"] for r in measured], [r["ratio"] for r in measured], color="tab:blue")
    axes.axvline(1.0, color="grey", lw=1)
    axes.axvline(TARGET, color="tab:red", ls="--", lw=1, label=f"target {TARGET}")
    axes.set_xlabel("step time: this / previous")
    axes.invert_yaxis()
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    sys.exit(main())
