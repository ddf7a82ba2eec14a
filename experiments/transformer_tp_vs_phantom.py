"""Seal et al.'s FFN claims on a GPT transformer: dense, Megatron TP, Megatron TP + SP and phantom.

Seal et al. train only FFNs (n = 16384, L = 2, Table I) and claims that phantom parallelism reaches the
loss of the tensor-parallel FFN with fewer parameters (1/p + kp/n of TP's), less communication
(k/(n/p) of TP's bytes per collective) and less energy (0.14-0.88x TP's to the target); its
conclusion proposes the transformer as future work: every projection is a matrix applied to t token
columns, "the phantom parallel substitution extends naturally". jphantom has that transformer
(the GPT-2 model ``jphantom.models.gpt2`` under ``jphantom.plans.phantom``: QKV, attention
output, MLP up/down and the LM head are :class:`jphantom.nn.PhantomLinear` layers, the LayerNorms
all-reduce per-token sums). This script trains, on the byte-level Python-stdlib corpus with the
same data, optimizer and schedule for every run:

- ``dense``: the GPT on one device (``model=1``), the single-device reference;
- ``tensor``: Megatron column/row TP on ``model=p`` (same dense model, tied head);
- ``tensor + SP``: Megatron with sequence parallelism (all-reduces split into reduce-scatter +
  all-gather; the LayerNorms and residuals on S/p tokens);
- ``phantom k=...``: the phantom GPT on ``model=p`` for each ghost width k (a different, smaller
  model: p is part of it, and its LM head is untied).

and records, per run: the validation curve (nats/token), final and best validation loss, parameters,
measured median step time, and for one step, from the compiled step's optimized HLO
(``jphantom.analysis.inspect.inspect_step``, SGD; the collectives and GEMMs of an AdamW step are the
same: the update runs element-wise on the global arrays after the ``shard_map``, adding neither a
collective nor a GEMM): the collective bytes per device (exact, loop trip counts applied), the
collectives by kind and the GEMM FLOPs per device.

Energy is **modelled**, exactly as ``jphantom.loop.compare`` models it (Eq. 1 of Seal et al., per step, summed
over the devices of the run): e = devices x (A x alpha + B x beta), alpha = GEMM FLOPs per device /
this machine's measured single-device matmul rate (``jphantom.loop.compare.measure_matmul_rate``),
beta = Eq. 26 with Table III's Frontier constants on the step's HLO collectives, A = 560 W and
B = 90 W (``jphantom.energy.PowerModel``). The measured step time is recorded but not used as alpha:
here the p "devices" are threads sharing 2 CPU cores, so one step's wall time is all p devices' work
one after another, and a collective is a memcpy; there is no GPU to meter. The cumulative modelled
energy at a validation point after s steps is s x e (Eq. 2). Dense runs on 1 device, so its energy
has devices = 1 and no beta.

Two loss targets are read off the validation curves: the tensor-parallel run's final validation loss
("TP's loss", the paper's target: the dense model's loss, reached by TP), and the largest best
validation loss over all runs ("common", reached by every run, as ``jphantom compare`` picks it). For
each run: steps and modelled energy to the first validation point at or below each target (within
0.1%: float32 rounding differs between strategies computing the same model).

Usage::

    python experiments/transformer_tp_vs_phantom.py          # L=2, h=128, 8 heads, S=64, B=16,
                                                             # 150 steps, p=8, k=2,4,8 (~10 min)
    python experiments/transformer_tp_vs_phantom.py --quick  # L=2, h=32, S=16, B=8, 6 steps, k=2:
                                                             # 4 compiled runs, about a minute

``--quick`` keeps two blocks: with one, XLA inlines the blocks' one-trip loops and the CPU compiler
drops ``jax.checkpoint``'s optimization barrier before its CSE, which merges the backward's
sequence-parallel regathers into the forward's gathers (4L+2 all-gathers instead of the 6L+2 that
JAX emits and :mod:`jphantom.costs.inventory` counts), so tensor + SP would not measure its design.

Results: ``<out>/results.json`` (config, every run with its curves, bytes, FLOPs and modelled energy,
the targets, the phantom/TP ratios, the paper's claims next to ours), ``<out>/transformer_tp_vs_
phantom.png`` (validation loss vs step, and vs cumulative modelled energy) and each run's own
``results.json``, ``metrics.jsonl`` and ``curves.png`` under ``<out>/runs/<name>/``; default
``experiments/results/transformer_tp_vs_phantom/`` (``--quick``: a scratch folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]

DEFAULT_OUT = REPO / "experiments" / "results" / "transformer_tp_vs_phantom"
PNG_NAME = "transformer_tp_vs_phantom.png"
# A validation loss within this relative margin of a target reaches it: dense, tensor and tensor + SP
# compute the same model in a different float32 order, so their losses differ in the 5th digit.
REACH_TOLERANCE = 1e-3


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Dense, Megatron TP, TP + SP and phantom GPTs: validation loss vs steps and vs "
                    "modelled energy, with exact collective bytes (Seal et al.'s FFN claims on a "
                    "transformer).",
        epilog=__doc__.split("Usage::")[1].split("Results:")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, help="transformer blocks L (default 2)")
    parser.add_argument("--hidden", type=int, help="h (default 128; 32 with --quick)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8; divisible "
                        "by --shards)")
    parser.add_argument("--seq-len", type=int, help="S (default 64; 16 with --quick)")
    parser.add_argument("--batch", type=int, help="sequences per step B (default 16; 8 with --quick)")
    parser.add_argument("--steps", type=int, help="training steps per run (default 150; 6 with --quick)")
    parser.add_argument("--eval-every", type=int, help="validation every this many steps "
                        "(default 25; 3 with --quick)")
    parser.add_argument("--eval-batches", type=int, help="validation batches (default 8; 2 with "
                        "--quick)")
    parser.add_argument("--shards", type=int, default=8, help="model axis p (default 8)")
    parser.add_argument("--ghost-widths", type=str, help="comma-separated phantom k (default 2,4,8; "
                        "2 with --quick)")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="AdamW (default 3e-3)")
    parser.add_argument("--warmup-steps", type=int, help="linear warm-up (default 10; 2 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data order (default 0)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, about a minute (tests)")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"layers": 2, "hidden": 32 if quick else 128,
                "seq_len": 16 if quick else 64, "batch": 8 if quick else 16,
                "steps": 6 if quick else 150, "eval_every": 3 if quick else 25,
                "eval_batches": 2 if quick else 8, "ghost_widths": "2" if quick else "2,4,8",
                "warmup_steps": 2 if quick else 10}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.ghost_list = tuple(int(v) for v in args.ghost_widths.split(","))
    except ValueError:
        parser.error("--ghost-widths takes comma-separated integers, e.g. 2,4,8")
    if len(set(args.ghost_list)) != len(args.ghost_list) or min(args.ghost_list) < 1:
        parser.error(f"--ghost-widths {args.ghost_widths}: give each k >= 1 once")
    if args.shards < 2:
        parser.error("--shards must be >= 2 (p = 1 is the dense run, always included)")
    from jphantom.analysis.machine import output_folder

    args.out = output_folder(args.out, DEFAULT_OUT, quick=quick,
                             name="transformer_tp_vs_phantom")
    return args


# --------------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------------


class Job(NamedTuple):  # not a dataclass: the tests load this file without a sys.modules entry
    name: str  # folder name and label key
    label: str
    strategy: str
    mesh: str
    sequence_parallel: bool = False
    ghost_width: int | None = None

    @property
    def devices(self) -> int:
        from jphantom.runtime.mesh import MeshConfig
        return MeshConfig.parse(self.mesh).device_count


def jobs(args) -> list[Job]:
    p = args.shards
    out = [Job("dense", "dense (1 device)", "dense", "model=1"),
           Job("tensor", f"tensor (Megatron, p={p})", "tensor", f"model={p}"),
           Job("tensor-sp", f"tensor + SP (p={p})", "tensor", f"model={p}", sequence_parallel=True)]
    out += [Job(f"phantom-k{k}", f"phantom k={k} (p={p})", "phantom", f"model={p}", ghost_width=k)
            for k in args.ghost_list]
    return out


def run_config(args, job: Job, out: Path):
    from jphantom.config import RunConfig
    return RunConfig.from_flags(
        model="gpt2", strategy=job.strategy, mesh=job.mesh,
        sequence_parallel=job.sequence_parallel, ghost_width=job.ghost_width, layers=args.layers,
        hidden=args.hidden, heads=args.heads, seq_len=args.seq_len, vocab=256, batch=args.batch,
        steps=args.steps, optimizer="adamw", learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps, lr_schedule="constant", eval_every=args.eval_every,
        eval_batches=args.eval_batches, seed=args.seed, dtype="float32",
        out=str(out / "runs" / job.name), progress=True)


def inspect(config) -> dict:
    """One compiled step of the run ``config`` with SGD: exact collective bytes and GEMM FLOPs
    per device."""
    import optax

    from jphantom.analysis.inspect import inspect_step
    return inspect_step(config, optax.sgd(config.train.learning_rate))


def largest_buffer_bytes(report: dict, kind: str) -> int | None:
    """Bytes of the largest single result buffer of a collective of ``kind`` in the step: one
    collective of the paper's accounting (XLA may combine several into one tuple-shaped op, e.g.
    Megatron's [B, S, h] all-reduce with a [B, S] one, so an op's total is not one collective)."""
    from jphantom.analysis.hlo import DTYPE_BYTES
    sizes = [math.prod(dims) * DTYPE_BYTES[dtype] for op in report["collective_ops"]
             if op["kind"] == kind for dtype, dims in op["shapes"]]
    return max(sizes) if sizes else None


def first_reaching(steps, losses, target):
    for step, loss in zip(steps, losses):
        if loss <= target * (1 + REACH_TOLERANCE):
            return step
    return None


def modelled_energy(report: dict, devices: int, matmul_rate: float, power) -> dict:
    """Eq. 1 per step as ``jphantom.loop.compare`` models it (see the module docstring)."""
    from jphantom.energy import energy_per_iteration
    from jphantom.perf.comm_model import FRONTIER
    alpha = report["flops"] / matmul_rate
    beta = FRONTIER.step_time_us(report["collectives"], devices) * 1e-6 if devices > 1 else 0.0
    # Eq. 26's latency terms, count x (c1 log2 p + c3), apart from the bandwidth terms c2 m
    latency = sum(row["count"] * (FRONTIER.cost(row["kind"]).c1 * math.log2(devices)
                                  + FRONTIER.cost(row["kind"]).c3)
                  for row in report["collectives"]) * 1e-6 if devices > 1 else 0.0
    return {"compute_seconds_per_step_modelled": alpha, "comm_seconds_per_step_modelled": beta,
            "comm_latency_seconds_per_step_modelled": latency,
            "energy_per_step_j": energy_per_iteration(alpha, beta, power, devices=devices)}


# --------------------------------------------------------------------------------------------------
# Paper vs ours
# --------------------------------------------------------------------------------------------------


def load_fixed_loss():
    """``experiments/fixed_loss.py`` (Table I and its ratios), loaded by path."""
    spec = importlib.util.spec_from_file_location("experiment_fixed_loss",
                                                  Path(__file__).with_name("fixed_loss.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def paper_claims() -> dict:
    """Seal et al.'s FFN numbers (Table I: n = 16384, L = 2, p = 8..256, one k per p) as ranges."""
    fixed_loss = load_fixed_loss()
    n = 16384
    table = fixed_loss.TABLE_ONE
    ratios = fixed_loss.paper_rows()
    span = lambda values: [min(values), max(values)]
    return {
        "source": "Seal et al. Table I (FFN, n = 16384, L = 2, p = 8..256) and Eq. 8; ratios phantom/TP",
        "table_one": [{"shards": p, "ghost_width": k} for p, k, *_ in table],
        "params_ratio": span([1 / p + k * p / n for p, k, *_ in table]),
        "bytes_per_collective_ratio": span([k / (n / p) for p, k, *_ in table]),
        "iterations_to_target_ratio": span([r["iterations_ratio"] for r in ratios]),
        "energy_per_iteration_ratio": span([r["energy_per_iteration_ratio"] for r in ratios]),
        "energy_to_target_ratio": span([r["energy_total_ratio"] for r in ratios]),
        "claims": {
            "params": "phantom has fewer parameters than TP's dense FFN iff k < (n/p)(1 - 1/p) "
                      "(Eq. 8); 1/p + kp/n of them per layer",
            "communication": "each phantom collective moves k/(n/p) of the corresponding TP one",
            "loss": "phantom reaches TP's loss (Table I: in 0.35-1.08x TP's epochs)",
            "energy": "phantom reaches it with less energy (Table I: 0.14-0.88x)",
            "transformer": "Sec. VII: the substitution extends naturally to self-attention; "
                           "communication-to-computation ratio asymptotically that of the FFN",
        },
    }


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def phantom_ratios(runs: list[dict], hidden: int, shards: int) -> list[dict]:
    """Each phantom run against tensor and tensor + SP (and dense for parameters)."""
    by_name = {r["name"]: r for r in runs}
    tensor, sp, dense = by_name["tensor"], by_name["tensor-sp"], by_name["dense"]
    out = []
    for r in runs:
        if r["strategy"] != "phantom":
            continue
        k = r["ghost_width"]
        out.append({
            "name": r["name"],
            "ghost_width": k,
            "params_vs_dense": _ratio(r["params"], dense["params"]),
            "bytes_per_step_vs_tensor": _ratio(r["collective_bytes_per_step"],
                                               tensor["collective_bytes_per_step"]),
            "bytes_per_step_vs_tensor_sp": _ratio(r["collective_bytes_per_step"],
                                                  sp["collective_bytes_per_step"]),
            # the largest collective of each: phantom's all-gather [B S p k] vs Megatron's
            # all-reduce [B S h]; phantom's reduce-scatter [B S k] vs SP's [B S h/p]
            "all_gather_vs_tensor_all_reduce": _ratio(r["largest_collective_bytes"]["all-gather"],
                                                      tensor["largest_collective_bytes"]["all-reduce"]),
            "reduce_scatter_vs_sp_reduce_scatter": _ratio(
                r["largest_collective_bytes"]["reduce-scatter"],
                sp["largest_collective_bytes"]["reduce-scatter"]),
            "k_over_h_per_p": k / (hidden / shards),
            "collectives_per_step": r["collective_count_per_step"],
            "tensor_collectives_per_step": tensor["collective_count_per_step"],
            "flops_vs_tensor": _ratio(r["flops_per_device_per_step"],
                                      tensor["flops_per_device_per_step"]),
            "energy_per_step_vs_tensor": _ratio(r["energy_per_step_j"], tensor["energy_per_step_j"]),
            "energy_per_step_vs_tensor_sp": _ratio(r["energy_per_step_j"], sp["energy_per_step_j"]),
            "final_loss_minus_tensor": r["final_validation_loss"] - tensor["final_validation_loss"],
            "steps_to_tp_loss_vs_tensor": _ratio(r["to_tp_loss"]["steps"],
                                                 tensor["to_tp_loss"]["steps"]),
            "energy_to_tp_loss_vs_tensor": _ratio(r["to_tp_loss"]["energy_j"],
                                                  tensor["to_tp_loss"]["energy_j"]),
            "energy_to_common_vs_tensor": _ratio(r["to_common"]["energy_j"],
                                                 tensor["to_common"]["energy_j"]),
            "energy_to_common_vs_tensor_sp": _ratio(r["to_common"]["energy_j"],
                                                    sp["to_common"]["energy_j"]),
        })
    return out


def paper_vs_ours(paper: dict, ratios: list[dict], steps: int) -> list[dict]:
    """One row per claim: the paper's range, ours (range over k) and whether ours agrees."""
    def span(key):
        values = [q[key] for q in ratios if q[key] is not None]
        return [min(values), max(values)] if values else None

    def every(key, test):
        values = [q[key] for q in ratios]
        return all(v is not None and test(v) for v in values) if values else None

    reached = [q for q in ratios if q["steps_to_tp_loss_vs_tensor"] is not None]
    return [
        {"claim": "fewer parameters", "metric": "phantom / dense params",
         "paper": paper["params_ratio"], "ours": span("params_vs_dense"),
         "holds": every("params_vs_dense", lambda v: v < 1)},
        {"claim": "less communication per collective, k/(n/p)",
         "metric": "largest all-gather vs Megatron's all-reduce; reduce-scatter vs SP's "
                   "(ours: k/(h/p))",
         "paper": paper["bytes_per_collective_ratio"], "ours": span("all_gather_vs_tensor_all_reduce"),
         "ours_vs_sp": span("reduce_scatter_vs_sp_reduce_scatter"),
         "ours_formula": span("k_over_h_per_p"),
         "holds": every("all_gather_vs_tensor_all_reduce", lambda v: v < 1)},
        {"claim": "less communication per step", "metric": "phantom / tensor bytes per step (HLO)",
         "paper": "k/(n/p) x L(p+1)/(Lp+L-1) (one reduce-scatter more than T1)",
         "ours": span("bytes_per_step_vs_tensor"), "ours_vs_sp": span("bytes_per_step_vs_tensor_sp"),
         "holds": every("bytes_per_step_vs_tensor", lambda v: v < 1)},
        {"claim": "less energy per iteration", "metric": "phantom / tensor modelled J per step",
         "paper": paper["energy_per_iteration_ratio"], "ours": span("energy_per_step_vs_tensor"),
         "ours_vs_sp": span("energy_per_step_vs_tensor_sp"),
         "holds": every("energy_per_step_vs_tensor", lambda v: v < 1)},
        {"claim": "reaches TP's loss", "metric": f"phantom reaches tensor's final validation loss "
                                                f"within {steps} steps (steps ratio where it does)",
         "paper": paper["iterations_to_target_ratio"], "ours": span("steps_to_tp_loss_vs_tensor"),
         "reached": [q["ghost_width"] for q in reached],
         "not_reached": [q["ghost_width"] for q in ratios if q not in reached],
         "holds": bool(ratios) and len(reached) == len(ratios)},
        {"claim": "less energy to TP's loss", "metric": "phantom / tensor modelled J to tensor's "
                                                       "final validation loss",
         "paper": paper["energy_to_target_ratio"], "ours": span("energy_to_tp_loss_vs_tensor"),
         "ours_common_target": span("energy_to_common_vs_tensor"),
         "holds": (every("energy_to_tp_loss_vs_tensor", lambda v: v < 1) if reached else False)},
    ]


# --------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------


def format_table(result: dict) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [f"{'run':<24}{'params':>10}{'final val':>10}{'best val':>10}{'ms/step':>9}"
             f"{'coll. KB':>10}{'colls':>6}{'MFLOP/dev':>10}{'comm ms':>8}{'J/step':>9}"
             f"{'steps→TP':>9}{'J→TP':>9}{'J→common':>10}"]
    for r in result["runs"]:
        lines.append(
            f"{r['label']:<24}{r['params']:>10,}{r['final_validation_loss']:>10.4f}"
            f"{r['best_validation_loss']:>10.4f}{fmt(r['median_step_seconds_measured'] and 1e3 * r['median_step_seconds_measured'], '.1f'):>9}"
            f"{r['collective_bytes_per_step'] / 1e3:>10.1f}{r['collective_count_per_step']:>6}"
            f"{r['flops_per_device_per_step'] / 1e6:>10.1f}"
            f"{1e3 * r['comm_seconds_per_step_modelled']:>8.2f}{r['energy_per_step_j']:>9.4f}"
            f"{fmt(r['to_tp_loss']['steps'], 'd'):>9}{fmt(r['to_tp_loss']['energy_j'], '.2f'):>9}"
            f"{fmt(r['to_common']['energy_j'], '.2f'):>10}")
    lines.append(f"(validation loss in nats/token; unigram {result['unigram_cross_entropy']:.4f}; "
                 f"TP's loss {result['targets']['tp_loss']:.4f}, common "
                 f"{result['targets']['common']:.4f}; energy modelled: Eq. 1, A = "
                 f"{result['power_model']['busy_watts']:g} W, B = "
                 f"{result['power_model']['idle_watts']:g} W, comm by Eq. 26 "
                 f"{result['comm_model']} ('comm ms', modelled); matmul rate "
                 f"{result['matmul_flops_per_second_measured'] / 1e9:.1f} GFLOP/s measured)")
    fmt_range = lambda v: ("-" if v is None else f"{v[0]:.4g}-{v[1]:.4g}" if isinstance(v, list)
                           else str(v))
    lines += ["", f"{'phantom / TP':<48}{'paper (FFN, Table I)':<28}{'ours (transformer)':<22}holds"]
    for row in result["paper_vs_ours"]:
        paper = row["paper"] if isinstance(row["paper"], list) else "formula"
        lines.append(f"{row['claim']:<48}{fmt_range(paper):<28}{fmt_range(row['ours']):<22}"
                     f"{row['holds']}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = {"dense": ("k", "-", "o"), "tensor": ("tab:blue", "-", "s"),
              "tensor-sp": ("tab:cyan", "--", "^")}
    phantoms = [r for r in result["runs"] if r["strategy"] == "phantom"]
    colours = plt.get_cmap("autumn")([0.1 + 0.6 * i / max(len(phantoms) - 1, 1)
                                      for i in range(len(phantoms))])
    for index, r in enumerate(phantoms):
        styles[r["name"]] = (colours[index], "-", "D")
    for r in result["runs"]:
        colour, line, marker = styles[r["name"]]
        h = r["history"]
        axes[0].plot(h["validation_step"], h["validation_loss"], ls=line, marker=marker,
                     color=colour, label=r["label"], ms=4)
        axes[1].plot(h["cumulative_energy_j_modelled"], h["validation_loss"], ls=line,
                     marker=marker, color=colour, label=r["label"], ms=4)
    for ax in axes:
        ax.axhline(result["unigram_cross_entropy"], color="grey", ls=":", lw=1, label="unigram")
        ax.axhline(result["targets"]["tp_loss"], color="tab:blue", ls=":", lw=1,
                   label="TP's final loss")
        ax.set_ylabel("validation loss, nats/token")
    axes[0].set_xlabel("step")
    axes[0].set_title("validation loss vs step", fontsize=10)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("cumulative energy, J (modelled: Eq. 1, Frontier A/B, Eq. 26 Table III)")
    axes[1].set_title("validation loss vs cumulative modelled energy", fontsize=10)
    axes[0].legend(fontsize=7)
    c = result["config"]
    fig.suptitle(f"GPT L={c['layers']}, h={c['hidden']}, heads={c['heads']}, S={c['seq_len']}, "
                 f"B={c['batch']}, p={c['shards']}, AdamW {c['learning_rate']:g}, "
                 f"byte-level stdlib corpus", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    from jphantom.runtime.mesh import ensure_devices

    ensure_devices(args.shards)  # simulated CPU devices unless jax already has enough
    from jphantom.costs.inventory import collective_inventory
    from jphantom.analysis.machine import machine_info
    from jphantom.loop.compare import measure_matmul_rate
    from jphantom.energy import PowerModel
    from jphantom.perf.comm_model import FRONTIER
    from jphantom.loop.trainer import run
    from jphantom.nn.phantom.ops import max_ghost_width

    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    job_list = jobs(args)
    configs = [run_config(args, job, args.out) for job in job_list]  # validates all before training
    bound = max_ghost_width(args.hidden, args.shards)
    above = [k for k in args.ghost_list if k >= bound]
    if above:
        print(f"note: k = {above} not below Seal et al.'s Eq. 8 bound (h/p)(1-1/p) = {bound:g}: those "
              "phantom models are not smaller than the dense one")
    power = PowerModel()
    matmul_rate = measure_matmul_rate()

    runs = []
    for job, config in zip(job_list, configs):
        report = inspect(config)
        trained = run(config)
        energy = modelled_energy(report, job.devices, matmul_rate, power)
        history = trained.history
        history["cumulative_energy_j_modelled"] = [s * energy["energy_per_step_j"]
                                                   for s in history["validation_step"]]
        inventory = None
        if job.strategy != "dense":
            inventory = collective_inventory(
                config.family_config(), job.strategy, config.parallel.mesh_config(), args.batch,
                sequence_parallel=job.sequence_parallel)
        runs.append({
            "name": job.name,
            "label": job.label,
            "strategy": job.strategy,
            "sequence_parallel": job.sequence_parallel,
            "ghost_width": job.ghost_width,
            "mesh": trained.mesh,
            "devices": job.devices,
            "params": trained.params,
            "final_validation_loss": trained.final_validation_loss,
            "best_validation_loss": trained.best_validation_loss,
            "median_step_seconds_measured": trained.median_step_seconds,
            "wall_seconds_measured": trained.wall_seconds,
            "collective_bytes_per_step": report["collective_bytes"],
            "collective_count_per_step": sum(c["count"] for c in report["collectives"]),
            "collectives": report["collectives"],
            "largest_collective_bytes": {kind: largest_buffer_bytes(report, kind) for kind in
                                         ("all-gather", "reduce-scatter", "all-reduce")},
            "collective_inventory_elements": inventory,
            "flops_per_device_per_step": report["flops"],
            **energy,
            "energy_source": "modelled",
            "history": history,
        })
    unigram = trained.unigram_cross_entropy

    by_name = {r["name"]: r for r in runs}
    targets = {"tp_loss": by_name["tensor"]["final_validation_loss"],
               "common": max(r["best_validation_loss"] for r in runs)}
    for r in runs:
        h = r["history"]
        for key, target in (("to_tp_loss", targets["tp_loss"]), ("to_common", targets["common"])):
            steps = first_reaching(h["validation_step"], h["validation_loss"], target)
            r[key] = {"steps": steps,
                      "energy_j": None if steps is None else steps * r["energy_per_step_j"]}

    paper = paper_claims()
    ratios = phantom_ratios(runs, args.hidden, args.shards)
    result = {
        "config": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads,
                   "seq_len": args.seq_len, "vocab": 256, "batch": args.batch, "steps": args.steps,
                   "eval_every": args.eval_every, "eval_batches": args.eval_batches,
                   "shards": args.shards, "ghost_widths": list(args.ghost_list),
                   "optimizer": "adamw", "learning_rate": args.learning_rate,
                   "warmup_steps": args.warmup_steps, "lr_schedule": "constant", "seed": args.seed,
                   "dtype": "float32", "quick": args.quick,
                   "runs": [j._asdict() for j in job_list]},
        "machine": machine_info(),
        "eq8": {"bound": bound, "formula": "(h/p)(1 - 1/p), Seal et al. Eq. 8 with n = h",
                "ghost_widths_below": [k for k in args.ghost_list if k < bound],
                "ghost_widths_not_below": above},
        "energy_source": "modelled",
        "energy_model": "Eq. 1 per step, summed over the run's devices: devices x (A alpha + B "
                        "beta); alpha = GEMM FLOPs per device (HLO) / measured matmul rate; beta = "
                        "Eq. 26 with Table III (Frontier) on the step's HLO collectives; cumulative "
                        "= steps x per step (Eq. 2). As jphantom.loop.compare.",
        "power_model": dataclasses.asdict(power),
        "comm_model": FRONTIER.name,
        "matmul_flops_per_second_measured": matmul_rate,
        "unigram_cross_entropy": unigram,
        "loss_units": "nats per token",
        "targets": targets | {"rule": {"tp_loss": "tensor's final validation loss",
                                       "common": "max over runs of the best validation loss"},
                              "reach_tolerance_relative": REACH_TOLERANCE},
        "runs": runs,
        "phantom_ratios": ratios,
        "paper": paper,
    }
    result["paper_vs_ours"] = paper_vs_ours(paper, ratios, args.steps)
    result["wall_seconds"] = time.perf_counter() - started
    print(format_table(result))
    json_path, png_path = args.out / "results.json", args.out / PNG_NAME
    json_path.write_text(json.dumps(result, indent=2))
    plot(result, png_path)
    print(f"wrote {json_path} and {png_path} ({result['wall_seconds']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
