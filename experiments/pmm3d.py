"""AxoNN's 3D parallel matrix multiply at small scale (Singh's thesis ch. 5): every (G_x, G_y, G_z, G_data)
grid of the simulated devices, HLO bytes against Eqs. 5.1-5.5, the model's ranking against measured
step times, and the planner's choices at the dissertation's scale.

1. **FFN, every grid** (Seal et al.'s FFN, ``jphantom.models.ffn``, under ``--strategy pmm3d``: the
   :class:`jphantom.nn.pmm3d.Pmm3dLinear` layers; width 64, depth 4, batch 64, SGD): the compiled
   training step's collectives by
   kind and mesh axis (trip counts applied) against :func:`jphantom.perf.axonn_model.
   layer_collectives` summed over the layers (the model's own implementation of Singh's thesis §1.3's
   table, independent of the test's): all-gathers and reduce-scatters over z, all-reduces over y
   and x (layer 0's input-gradient all-reduce is absent: the input needs no gradient), all-reduce
   over data (plus the biases, which the model leaves out).
2. **GPT, every grid** (GPT-2, ``jphantom.models.gpt2``, under ``plans.pmm3d``; L = 2, h = 64,
   8 heads, S = 32, batch 16, AdamW): measured step time
   (median of round-robin rounds, one process) against the model's Σ Eq. 5.6 on a notional machine
   (4 devices per node, Perlmutter's bandwidths, float32 messages); precision@k, Spearman's rank
   correlation and the regret of the model's top pick. On simulated CPU devices there is no
   network: a step's time follows its FLOPs, copies and thread scheduling, not bandwidth, so the
   ranking by the HLO's collective bytes (the volume the model prices) is reported beside it.
3. **The planner** (``jphantom plan``): top choices for GPT-20B on 32 and GPT-40B on 64 Perlmutter
   GPUs (Singh's Fig. 5.2 validation cases).

Run: ``.venv/bin/python experiments/pmm3d.py`` (8 devices, about 5 minutes on 2 CPU cores) and
``--devices 16`` (35 grids); writes ``experiments/results/pmm3d/results-<devices>.json`` and
``pmm3d-<devices>.png``. ``--quick`` for the tests (into a scratch folder unless ``--out`` is
given).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path


def _devices_from_argv(argv) -> int:
    for i, arg in enumerate(argv):
        if arg == "--devices" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--devices="):
            return int(arg.split("=", 1)[1])
    return 8


os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count="
                                   f"{_devices_from_argv(sys.argv)}")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jphantom.analysis.hlo import collectives  # noqa: E402
from jphantom.analysis.compiled import compile_step  # noqa: E402
from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.analysis.timing import build_run_step, time_round_robin  # noqa: E402
from jphantom.config import RunConfig  # noqa: E402
from jphantom.perf import axonn_model as am  # noqa: E402
from jphantom.planner import plan  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "pmm3d"


def grids(devices: int) -> list[am.Grid]:
    return am.configurations(devices)


def hlo_totals(config: RunConfig) -> Counter:
    """(kind, axes) -> per-device result elements of the run's compiled step on abstract
    parameters (trivial groups out)."""
    compiled, _ = compile_step(config)
    axes_of = config.program().mesh.shape
    found = Counter()
    for op in collectives(compiled.as_text()):
        axes = op.mesh_axes(axes_of)
        if axes:
            found[op.kind, axes] += op.elements * op.count
    return found


def ffn_check(grid: am.Grid, width: int, depth: int, rows: int) -> dict:
    config = RunConfig.from_flags(model="ffn", strategy="pmm3d", mesh=str(grid), width=width,
                                  depth=depth, batch=rows, optimizer="sgd", learning_rate=0.1,
                                  warmup_steps=0, out=None, progress=False)
    found = hlo_totals(config)
    output_axis = config.program().batch_specs[1][1]  # x after a normal last layer, else y
    model = Counter()
    for index in range(depth):
        layer = am.LayerShape(rows // grid.data, width, width, transposed=bool(index % 2))
        for c in am.layer_collectives(layer, grid):
            if c.group > 1 and not (index == 0 and c.equation.startswith("Eq. 5.4")):
                model[c.kind, (c.axis,)] += c.buffer
    loss_axes = tuple(a for a in ("data", "z", "y", "x") if grid.sizes[am.AXES.index(a)] > 1
                      and a in ("data", "z", output_axis))
    if len(loss_axes) == 1:  # the loss's scalar all-reduce shares its group with one of them
        found["all-reduce", loss_axes] -= 1
    compared = {}
    for key in sorted(set(model) | {k for k in found if k[1] != ("z",) or k[0] != "all-reduce"}):
        if key[0] == "all-reduce" and key[1] in (("z",), ("data",)) or len(key[1]) > 1:
            continue  # bias and loss all-reduces: not in the model (see below)
        compared[f"{key[0]} {','.join(key[1])}"] = {"hlo": found.get(key, 0),
                                                     "model": model.get(key, 0)}
    data_hlo = found.get(("all-reduce", ("data",)), 0)
    data_model = model.get(("all-reduce", ("data",)), 0)
    return {"grid": str(grid), "compared": compared,
            "data_all_reduce": {"hlo": data_hlo, "model_weights": data_model},
            "exact": all(v["hlo"] == v["model"] for v in compared.values())}


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 2 else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="four grids, tiny shapes")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="pmm3d")
    devices = args.devices
    if jax.device_count() < devices:
        raise SystemExit(f"needs {devices} devices; run with --devices {devices} from the start")
    all_grids = grids(devices)
    if args.quick:
        all_grids = [g for g in all_grids if g.sizes in ((8, 1, 1, 1), (1, 1, 8, 1),
                                                         (2, 2, 2, 1), (1, 1, 1, 8))]
    results = {"devices": devices, "platform": jax.devices()[0].platform}

    # 1. the FFN's HLO against the model
    ffn = [ffn_check(g, 64, 4, 64) for g in all_grids]
    results["ffn"] = ffn
    exact = sum(r["exact"] for r in ffn)
    print(f"FFN (width 64, depth 4, batch 64): HLO collectives equal Eqs. 5.1-5.4's buffers on "
          f"{exact} of {len(ffn)} grids", flush=True)

    # 2. the GPT: measured step time against the model
    shape = dict(vocab_size=256, seq_len=32, hidden=64, heads=max(8, devices), layers=2)
    if args.quick:
        shape.update(hidden=32, seq_len=16)
    batch = 16
    flags = dict(model="gpt2", vocab=shape["vocab_size"], seq_len=shape["seq_len"],
                 hidden=shape["hidden"], heads=shape["heads"], layers=shape["layers"],
                 batch=batch, out=None, progress=False)
    config = RunConfig.from_flags(**flags, strategy="pmm3d", mesh=str(all_grids[0])
                                  ).family_config()
    gpt = am.GPTShape(layers=config.layers, hidden=config.hidden, heads=config.heads,
                      seq_len=config.seq_len, vocab_size=config.vocab_size)
    topology = am.Topology.perlmutter()
    rng = np.random.default_rng(0)
    host = [rng.integers(0, 256, (batch, config.seq_len)).astype(np.int32) for _ in range(2)]
    runners, rows = [], {}
    for grid in all_grids:
        runner, report = build_run_step(
            RunConfig.from_flags(**flags, strategy="pmm3d", mesh=str(grid)), tuple(host),
            label=str(grid), optimizer=optax.adamw(1e-3))
        runners.append(runner)
        tokens = batch * config.seq_len // grid.data
        predicted = am.predict(am.gpt_layers(gpt, tokens, lm_head=True), grid, topology,
                               bytes_per_element=4)
        rows[str(grid)] = {"grid": grid.sizes, "predicted_seconds": predicted["total"],
                           "predicted_by_axis": predicted["by_axis"],
                           "hlo_collective_bytes": report["collective_bytes_per_device"],
                           "gemm_flops_per_device": report["flops_per_device"]}
        print(f"  compiled {grid}", flush=True)
    times = time_round_robin(runners, args.steps, 1)
    for label, row in rows.items():
        row["measured_seconds"] = times[label]
    names = list(rows)
    measured = [rows[n]["measured_seconds"] for n in names]
    predicted = [rows[n]["predicted_seconds"] for n in names]
    volume = [rows[n]["hlo_collective_bytes"] for n in names]
    k = min(10, max(1, len(names) // 2))
    top = lambda values: set(np.argsort(values)[:k])
    summary = {
        "k": k,
        "precision_at_k_model": len(top(predicted) & top(measured)) / k,
        "precision_at_k_volume": len(top(volume) & top(measured)) / k,
        "spearman_model_vs_measured": spearman(predicted, measured),
        "spearman_volume_vs_measured": spearman(volume, measured),
        "spearman_model_vs_volume": spearman(predicted, volume),
        "regret_model_top1": measured[int(np.argmin(predicted))] / min(measured),
        "measured_best": names[int(np.argmin(measured))],
        "model_best": names[int(np.argmin(predicted))],
    }
    results["gpt"] = {"shape": shape, "batch": batch, "topology": topology.as_dict(),
                      "rows": rows, "summary": summary}
    print(f"GPT L={config.layers} h={config.hidden} S={config.seq_len} batch {batch}, "
          f"{len(names)} grids:")
    print(f"{'grid':24}{'measured ms':>12}{'model ms':>10}{'HLO kB/dev':>12}")
    for n in sorted(names, key=lambda n: rows[n]["measured_seconds"]):
        r = rows[n]
        print(f"{n:24}{r['measured_seconds'] * 1e3:>12.2f}{r['predicted_seconds'] * 1e3:>10.4f}"
              f"{r['hlo_collective_bytes'] / 1e3:>12.1f}")
    print(f"precision@{k}: model {summary['precision_at_k_model']:.2f}, HLO volume "
          f"{summary['precision_at_k_volume']:.2f}; Spearman model/measured "
          f"{summary['spearman_model_vs_measured']:.3f}, volume/measured "
          f"{summary['spearman_volume_vs_measured']:.3f}, model/volume "
          f"{summary['spearman_model_vs_volume']:.3f}; regret of the model's pick "
          f"{summary['regret_model_top1']:.3f}x (simulated devices: no network)", flush=True)

    # 3. the planner at the dissertation's scale
    results["planner"] = {}
    for name, model, count in (("GPT-20B", am.GPT_20B, 32), ("GPT-40B", am.GPT_40B, 64)):
        found = plan(model, count, batch=512, memory_gib=40)
        best = found.top
        results["planner"][name] = {"devices": count, "top": [
            {"strategy": r.strategy, "mesh": r.mesh, "comm_s": r.comm_s, "fits": r.fits}
            for r in found.rows[:10]]}
        print(f"plan {name} on {count} Perlmutter GPUs: {best.strategy} {best.mesh} "
              f"({best.comm_s:.3f} s modelled communication)")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results-{devices}.json").write_text(json.dumps(results, indent=1))
    _plot(results, out / f"pmm3d-{devices}.png")
    print(f"wrote {out / f'results-{devices}.json'} and {out / f'pmm3d-{devices}.png'}")
    return 0


def _plot(results, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["gpt"]["rows"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in rows.items():
        left.scatter(r["predicted_seconds"] * 1e3, r["measured_seconds"] * 1e3, s=12)
        right.scatter(r["hlo_collective_bytes"] / 1e3, r["measured_seconds"] * 1e3, s=12)
        for ax, x in ((left, r["predicted_seconds"] * 1e3), (right, r["hlo_collective_bytes"] / 1e3)):
            ax.annotate(name.replace("data=", "d").replace(",z=", " z").replace(",y=", " y")
                        .replace(",x=", " x"), (x, r["measured_seconds"] * 1e3), fontsize=6)
    s = results["gpt"]["summary"]
    left.set(xlabel="model: Σ Eq. 5.6 (ms, notional 4 devices per node)",
             ylabel="measured step (ms, simulated CPU devices)",
             title=f"Spearman {s['spearman_model_vs_measured']:.2f}")
    right.set(xlabel="HLO collective kB per device", ylabel="measured step (ms)",
              title=f"Spearman {s['spearman_volume_vs_measured']:.2f}")
    figure.suptitle(f"pmm3d grids of {results['devices']} devices")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
