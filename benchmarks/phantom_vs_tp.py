"""Phantom parallelism against tensor parallelism and GSPMD: one jitted SGD step, 8 simulated CPU devices.

What it measures, in one process and one run, for every strategy (phantom fused, phantom-unfused,
tensor-t1, tensor (Megatron), gspmd) and every batch size:

- step time: median wall time of one training step (forward, backward, ``optax.sgd`` update) over
  ``--steps`` timed steps after ``--warmup`` untimed ones, each ended by ``block_until_ready``. The
  strategies run round-robin (one step each per round, the order rotating every round) so that load
  from other processes on the machine hits all of them alike;
- FLOPs per device: the GEMMs of the compiled step (``jphantom.analysis.compiled.gemm_flops``: every
  HLO ``dot``, counted as many times as its ``lax.scan`` loop runs; x num_shards for the whole step).
  XLA's ``cost_analysis()`` is kept next to it (``xla_flops_per_device``) but counts a loop body
  once, so it undercounts the scanned layers;
- collective bytes per device and step, parsed from the compiled HLO (:mod:`jphantom.analysis.hlo`);
- parameter count: every parameter of the model (``Program.param_count``: weights and biases, and
  phantom's stored own decompressor slot D^(j,j), masked; Table I counts the weights alone).

Reference matmul FLOP/s, measured in the same round-robin as the steps (so under the same load):

- ``matmul-1dev``: one jitted [M, M] @ [M, M] float32 product (M = ``--matmul-size``, 2048) on a
  single device; the XLA CPU runtime gives it the machine's whole intra-op thread pool;
- ``matmul-8way``: the same total FLOPs split as the 8 devices would run it: A is row-sharded over the
  8 devices and B replicated, so each device multiplies [M/8, M] @ [M, M] concurrently, with no
  communication (``jax.shard_map``). This is the ceiling of an 8-device step on this machine: the 8
  simulated devices share the host's cores, exactly like the training steps. Target (c) compares
  against it; the single-device figure is reported next to it.

Compile time: lower + compile wall time of a fresh ``--compile-depth``-layer (6) phantom training step
on the 8 devices (abstract parameters; median of ``--compile-repeats`` fresh functions).

Targets, each printed as measured value, target and PASS/MISS:
(a) phantom step time / gspmd step time <= 1.10 x their FLOP ratio, at every batch size;
(b) tensor-t1 step time <= 0.95 x gspmd step time, at every batch size;
(c) phantom step FLOP/s >= 85% of the reference matmul FLOP/s, at the largest batch (1024);
(d) compile of a 6-layer phantom step < 2 s.

Usage::

    python benchmarks/phantom_vs_tp.py                 # n=4096, depth 2, p=8, k=16, batch 256,1024
    python benchmarks/phantom_vs_tp.py --quick         # tiny sizes, a few seconds (used by a test)

Results: ``<out>/results.json`` and ``<out>/step_time.png`` (``--out``, default
``benchmarks/results/phantom_vs_tp/``; ``--quick``: a scratch folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

STRATEGIES = ("phantom", "phantom-unfused", "tensor-t1", "tensor", "gspmd")
REFERENCES = ("matmul-1dev", "matmul-8way")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "phantom_vs_tp"

# The targets.
FLOP_RATIO_SLACK = 1.10  # (a)
T1_VS_GSPMD = 0.95  # (b)
FLOPS_FRACTION = 0.85  # (c)
COMPILE_SECONDS = 2.0  # (d)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=None, help="n (default 4096; 256 with --quick)")
    parser.add_argument("--depth", type=int, default=2, help="layers L (default 2)")
    parser.add_argument("--ghost-width", type=int, default=None, help="k (default 16; 4 with --quick)")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices = p (default 8)")
    parser.add_argument("--batch", type=str, default=None,
                        help="comma-separated batch sizes (default 256,1024; 32 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per strategy (default 30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    parser.add_argument("--matmul-size", type=int, default=None, help="reference matmul M (default 2048)")
    parser.add_argument("--compile-depth", type=int, default=6, help="layers of the compile-time step")
    parser.add_argument("--compile-repeats", type=int, default=None, help="fresh compiles (default 3)")
    parser.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and few steps (width 256, batch 32, k 4): a smoke run")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "width": 256 if quick else 4096,
        "ghost_width": 4 if quick else 16,
        "batch": "32" if quick else "256,1024",
        "steps": 3 if quick else 30,
        "warmup": 1 if quick else 3,
        "matmul_size": 256 if quick else 2048,
        "compile_repeats": 1 if quick else 3,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    if not args.batches or min(args.batches) < 1:
        parser.error(f"--batch {args.batch!r}: give positive comma-separated sizes, e.g. 256,1024")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    from jphantom.analysis.machine import output_folder

    args.out = output_folder(args.out, DEFAULT_OUT, quick=quick, name="phantom_vs_tp")
    return args


# --------------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------------


def build_step(name, mesh, args, batch, key):
    """Initialise, place and compile one strategy's SGD step (``jphantom.analysis.timing``)."""
    from jphantom.analysis.timing import build_step as build

    return build(name, mesh, width=args.width, depth=args.depth, ghost_width=args.ghost_width,
                 batch=batch, learning_rate=args.lr, key=key)


def build_matmuls(mesh, size):
    """The two reference products of the module docstring: single device, and 8-way row-split."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jphantom.analysis.timing import Runner
    from jphantom.analysis.compiled import xla_flops as _flops

    p = mesh.shape["model"]
    rows = max(size // p, 1) * p
    ka, kb = jax.random.split(jax.random.PRNGKey(123))
    a = jax.random.normal(ka, (rows, size), jnp.float32)
    b = jax.random.normal(kb, (size, size), jnp.float32)
    matmul = lambda u, v: u @ v  # noqa: E731
    device0 = jax.devices()[0]
    single_args = (jax.device_put(a, device0), jax.device_put(b, device0))
    single = jax.jit(matmul).lower(*single_args).compile()
    split = jax.jit(jax.shard_map(matmul, mesh=mesh, in_specs=(P("model"), P()),
                                  out_specs=P("model")))
    split_args = (jax.device_put(a, NamedSharding(mesh, P("model"))),
                  jax.device_put(b, NamedSharding(mesh, P())))
    split = split.lower(*split_args).compile()
    flops = 2.0 * rows * size * size  # the whole product, both variants
    return [
        Runner("matmul-1dev", single, single_args, threads_state=False, flops_per_device=flops,
               devices=1),
        Runner("matmul-8way", split, split_args, threads_state=False, flops_per_device=flops / p,
               devices=p),
    ], {"size": size, "rows": rows, "flops": flops, "xla_flops_1dev": _flops(single),
        "xla_flops_8way_per_device": _flops(split)}


def measure_compile(args, batch, num_shards):
    """Lower + compile wall time of a fresh ``compile_depth``-layer phantom SGD step (abstract
    params): each repeat builds a new step (a new jitted function) for the same run."""
    from jphantom.analysis.compiled import compile_step
    from jphantom.config import RunConfig

    config = RunConfig.from_flags(model="ffn", strategy="phantom", mesh=f"model={num_shards}",
                                  width=args.width, depth=args.compile_depth, batch=batch,
                                  ghost_width=args.ghost_width, optimizer="sgd",
                                  learning_rate=args.lr, warmup_steps=0, out=None, progress=False)
    seconds = [compile_step(config)[1] for _ in range(max(args.compile_repeats, 1))]
    return {"depth": args.compile_depth, "batch": batch, "width": args.width,
            "seconds": seconds, "median_seconds": statistics.median(seconds)}


# --------------------------------------------------------------------------------------------------
# Targets and output
# --------------------------------------------------------------------------------------------------


def _check(name, description, measured, target, passed, unit="", relation="<="):
    return {"name": name, "description": description, "measured": measured, "target": target,
            "relation": relation, "pass": bool(passed), "unit": unit}


def evaluate_targets(rows, reference, compile_result):
    by = {(r["strategy"], r["batch"]): r for r in rows}
    batches = sorted({r["batch"] for r in rows})
    checks = []
    for b in batches:
        ph, gs = by[("phantom", b)], by[("gspmd", b)]
        time_ratio = ph["step_seconds"] / gs["step_seconds"]
        flop_ratio = ph["flops_per_device"] / gs["flops_per_device"]
        bound = FLOP_RATIO_SLACK * flop_ratio
        checks.append(_check(
            f"(a) B={b}", f"phantom/gspmd time <= {FLOP_RATIO_SLACK:.2f} x FLOP ratio "
            f"({flop_ratio:.4f}); time-ratio/FLOP-ratio = {time_ratio / flop_ratio:.3f}",
            time_ratio, bound, time_ratio <= bound))
    for b in batches:
        t1, gs = by[("tensor-t1", b)], by[("gspmd", b)]
        ratio = t1["step_seconds"] / gs["step_seconds"]
        checks.append(_check(f"(b) B={b}", f"tensor-t1/gspmd time <= {T1_VS_GSPMD:.2f}",
                             ratio, T1_VS_GSPMD, ratio <= T1_VS_GSPMD))
    big = batches[-1]
    ph = by[("phantom", big)]
    ref = reference["flops_per_second"]["matmul-8way"]
    single = reference["flops_per_second"]["matmul-1dev"]
    fraction = ph["flops_per_second"] / ref
    checks.append(_check(
        f"(c) B={big}", f"phantom FLOP/s / 8-way-split matmul FLOP/s >= {FLOPS_FRACTION:.2f} "
        f"(vs single-device matmul: {ph['flops_per_second'] / single:.3f})",
        fraction, FLOPS_FRACTION, fraction >= FLOPS_FRACTION, relation=">="))
    seconds = compile_result["median_seconds"]
    checks.append(_check(
        "(d)", f"{compile_result['depth']}-layer phantom step lower+compile < {COMPILE_SECONDS:g} s",
        seconds, COMPILE_SECONDS, seconds < COMPILE_SECONDS, unit="s", relation="<"))
    return checks


def format_table(result) -> str:
    cfg = result["config"]
    lines = [
        f"One training step (forward + backward + SGD), n={cfg['width']}, depth={cfg['depth']}, "
        f"p={cfg['num_shards']}, k={cfg['ghost_width']}, float32, {cfg['steps']} timed steps "
        f"(median, round-robin) after {cfg['warmup']} warm-up; {result['machine']['cpu_count']} CPU "
        f"cores host {cfg['num_shards']} simulated devices.",
        "",
    ]
    header = (f"{'batch':>6} {'strategy':<16}{'params':>12}{'GFLOP/step':>12}{'step ms':>10}"
              f"{'GFLOP/s':>9}{'coll MB/dev':>12}{'vs gspmd':>9}{'FLOP ratio':>11}  collectives")
    lines += [header, "-" * (len(header) + 24)]
    rows = result["rows"]
    for b in sorted({r["batch"] for r in rows}):
        gs = next(r for r in rows if r["batch"] == b and r["strategy"] == "gspmd")
        for r in (r for r in rows if r["batch"] == b):
            colls = ", ".join(f"{c['count']}x{c['kind']}" for c in r["collectives"]) or "none"
            lines.append(
                f"{b:>6} {r['strategy']:<16}{r['params']:>12,}{r['flops_step'] / 1e9:>12.3f}"
                f"{r['step_seconds'] * 1e3:>10.2f}{r['flops_per_second'] / 1e9:>9.1f}"
                f"{r['collective_bytes_per_device'] / 1e6:>12.3f}"
                f"{r['step_seconds'] / gs['step_seconds']:>9.3f}"
                f"{r['flops_per_device'] / gs['flops_per_device']:>11.4f}  {colls}")
    ref = result["reference"]
    lines += ["", f"Reference matmul, {ref['rows']}x{ref['size']} @ {ref['size']}x{ref['size']} float32 "
                  f"({ref['flops'] / 1e9:.2f} GFLOP):"]
    for name in REFERENCES:
        lines.append(f"  {name:<13}{ref['seconds'][name] * 1e3:>9.2f} ms "
                     f"{ref['flops_per_second'][name] / 1e9:>9.1f} GFLOP/s")
    comp = result["compile"]
    lines.append(f"Compile, {comp['depth']}-layer phantom step (n={comp['width']}, B={comp['batch']}): "
                 + ", ".join(f"{s:.2f}" for s in comp["seconds"]) + f" s (median {comp['median_seconds']:.2f} s)")
    lines += ["", "Targets:"]
    for c in result["targets"]:
        unit = c["unit"]
        lines.append(f"  {c['name']:<10} {'PASS' if c['pass'] else 'MISS'}  measured {c['measured']:.3f}{unit}"
                     f"  target {c['relation']} {c['target']:.3f}{unit}"
                     f"  -- {c['description']}")
    return "\n".join(lines)


def plot(result, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        sel = [r for r in rows if r["batch"] == b]
        ax.bar([r["strategy"] for r in sel], [r["step_seconds"] * 1e3 for r in sel],
               color=["C0", "C1", "C2", "C3", "C7"][: len(sel)])
        ax.set_title(f"batch {b}")
        ax.set_ylabel("median step time (ms)")
        ax.tick_params(axis="x", rotation=30)
    cfg = result["config"]
    fig.suptitle(f"n={cfg['width']}, depth={cfg['depth']}, p={cfg['num_shards']}, k={cfg['ghost_width']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from jphantom.runtime.mesh import make_mesh, simulate_cpu_devices

    simulate_cpu_devices(args.devices)  # before jax initialises its backends
    import jax

    from jphantom.analysis.timing import time_round_robin

    mesh = make_mesh({"model": args.devices})
    key = jax.random.PRNGKey(0)
    matmuls, reference = build_matmuls(mesh, args.matmul_size)
    rows, ref_times = [], {name: [] for name in REFERENCES}
    for batch in args.batches:
        runners, reports = [], []
        for name in STRATEGIES:
            runner, report = build_step(name, mesh, args, batch, key)
            runners.append(runner)
            reports.append(report)
        for m in matmuls:
            m.times = []
        medians = time_round_robin(runners + matmuls, args.steps, args.warmup)
        for m in matmuls:
            ref_times[m.name].extend(m.times)
        for runner, report in zip(runners, reports):
            report["step_seconds"] = medians[runner.name]
            report["step_seconds_all"] = runner.times
            report["flops_per_second"] = report["flops_step"] / medians[runner.name]
            rows.append(report)
        del runners  # free this batch's params before the next one
    reference["seconds"] = {name: statistics.median(ts) for name, ts in ref_times.items()}
    reference["flops_per_second"] = {name: reference["flops"] / s
                                     for name, s in reference["seconds"].items()}
    compile_result = measure_compile(args, max(args.batches), args.devices)
    result = {
        "config": {"width": args.width, "depth": args.depth, "num_shards": args.devices,
                   "ghost_width": args.ghost_width, "batches": args.batches, "dtype": "float32",
                   "steps": args.steps, "warmup": args.warmup, "lr": args.lr, "quick": args.quick,
                   "strategies": list(STRATEGIES)},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "jax": jax.__version__, "backend": jax.default_backend(),
                    "devices": jax.device_count()},
        "rows": rows,
        "reference": reference,
        "compile": compile_result,
    }
    result["targets"] = evaluate_targets(rows, reference, compile_result)
    print(format_table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    written = [out / "results.json"]
    if not args.no_plot and plot(result, out / "step_time.png"):
        written.append(out / "step_time.png")
    print("\nWrote " + ", ".join(str(w) for w in written))
    return result


if __name__ == "__main__":
    main()
