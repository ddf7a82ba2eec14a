"""Seal et al.'s main experiment: tensor parallelism vs phantom parallelism to the same target loss.

For every shard count p the dense model is trained with TP (``tensor-t1``, Seal et al.'s TP) and
phantom models with each ghost width k, on the same teacher data, optimizer, learning rate and batch, for several seeds. The result
is a table in the shape of Table I: parameters, iterations to the target, time per iteration,
collective bytes per iteration (from the compiled HLO), energy per iteration and to the target.

What is measured and what is modelled (see docs/methodology.md):

- iterations to target, loss curves and wall time per iteration: **measured** here;
- collective bytes per iteration: **exact**, parsed from the compiled step's HLO. Collective by
  collective, phantom moves k/(n/p) of T1's bytes (all-gather p*k*B vs n*B, reduce-scatter k*B vs
  (n/p)*B, Seal et al. Table II), and the table shows both that ratio and k/(n/p). Per iteration the
  total ratio is a little higher: phantom has L reduce-scatters (the first layer's Gamma_1 feeds
  dL/dC_1, Eq. 20) while T1 has L-1 (XLA drops the one that would only give dL/dx of the input), so
  total = k/(n/p) * L(p+1) / (L p + L - 1), e.g. 1.059 x k/(n/p) at L = 2, p = 8;
- energy: **modelled** with Eq. 1 unless a GPU meter is used: alpha = per-device FLOPs of the step
  (XLA's count) / this machine's measured single-device matmul rate; beta = Eq. 26 with Table III's
  Frontier constants applied to the step's collectives; A and B from :class:`PowerModel`.

Target loss: with ``target_loss=None`` every run trains for ``max_steps`` and keeps its full held-out
curve; the target is then the largest of the runs' best held-out losses, times ``1 + target_margin``,
so that every model compared reaches it, and iterations to target are read off the curves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jphantom.registry import strategies
from jphantom.analysis.inspect import inspect_step
from jphantom.config import RunConfig
from jphantom.data import Teacher, TeacherConfig
from jphantom.energy import NvmlEnergyMeter, PowerModel, energy_per_iteration, process_devices
from jphantom.errors import ConfigError, check_int
from jphantom.perf.comm_model import FRONTIER
from jphantom.nn.phantom.ops import max_ghost_width
from jphantom.nn.phantom.ops import param_count as phantom_param_count

TP_STRATEGY = "tensor-t1"


def auto_ghost_width(width: int, num_shards: int) -> int:
    """``--ghost-width auto``: one eighth of Seal et al.'s Eq. 8 bound (n/p)(1 - 1/p), at least 1.

    The paper does not say how it chose k per p; this rule keeps phantom well inside the region
    where it is smaller than the dense model at every p.
    """
    return max(1, int(max_ghost_width(width, num_shards) / 8))


# the base run of a comparison (``jphantom compare``'s defaults): Seal et al.'s FFN, Adam (optax's
# betas), no warm-up, at most ``steps`` steps, evaluated every ``eval_every``
BASE = dict(model="ffn", width=256, depth=2, batch=64, optimizer="adam", learning_rate=2e-3,
            warmup_steps=0, adam_b2=0.999, steps=300, eval_every=10, out=None, progress=False,
            strategy=TP_STRATEGY, mesh="model=1")


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """A sweep of the one run configuration: ``base`` (a :class:`jphantom.config.RunConfig` of
    the FFN: width, depth, batch, optimizer, learning rate, ``steps`` as the maximum,
    ``eval_every``, an optional ``target_loss``) trained with TP at each shard count in
    ``shards`` and with phantom at each shard count and ghost width (``ghost_widths``, or
    ``"auto"``), for every seed; the teacher has ``train_size`` / ``eval_size`` samples.
    Validated on construction without jax's devices or the file system (configuration is data);
    :meth:`build` checks the sweep against the devices."""

    base: RunConfig = dataclasses.field(default_factory=lambda: RunConfig.from_flags(**BASE))
    shards: tuple[int, ...] = (2, 4, 8)
    ghost_widths: tuple[int, ...] | str = (2, 4, 16)
    seeds: tuple[int, ...] = (0, 1, 2)
    target_margin: float = 0.02
    train_size: int = 1 << 14
    eval_size: int = 512

    def __post_init__(self):
        if not isinstance(self.base, RunConfig) or self.base.model.family.is_language_model:
            raise ConfigError("compare trains Seal et al.'s FFN: base must be a RunConfig with "
                              "model 'ffn'")
        for name in ("train_size", "eval_size"):
            check_int(name, getattr(self, name), 1)
        _check_list("shards", self.shards, 1)
        _check_list("seeds", self.seeds, 0)
        if isinstance(self.ghost_widths, str):
            if self.ghost_widths != "auto":
                raise ConfigError(f"ghost_widths={self.ghost_widths!r}: give integers or 'auto'")
        else:
            _check_list("ghost_widths", self.ghost_widths, 1)
        margin = self.target_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not (
                math.isfinite(margin) and margin >= 0):
            raise ConfigError(f"target_margin={margin!r} must be a finite number >= 0")

    def build(self) -> dict:
        """Every job of the sweep built (:meth:`jphantom.config.RunConfig.build`, nothing
        compiled), in :meth:`jobs`' order, once for all its seeds (they share one step): the
        devices hold the largest shard count and every run's shapes are valid (width divisible
        by every p, ...), before the first run trains. The explicit step after the
        configuration (data, touching neither jax's devices nor the file system); returns
        ``{(strategy, p, k): Built}``, which :func:`run_compare` trains with."""
        if jax.device_count() < max(self.shards):
            raise ConfigError(
                f"shards={self.shards} needs {max(self.shards)} devices, have {jax.device_count()}: "
                f"pass --devices {max(self.shards)} or fewer shards")
        return {job: self.run_config(*job, self.seeds[0]).build() for job in self.jobs()}

    @classmethod
    def from_flags(cls, *, shards=(2, 4, 8), ghost_widths=(2, 4, 16), seeds=(0, 1, 2),
                   target_margin=0.02, train_size=1 << 14, eval_size=512,
                   **flags) -> "CompareConfig":
        """A comparison whose base run is :data:`BASE` with ``flags`` (the run's flat names:
        ``width``, ``depth``, ``batch``, ``learning_rate``, ``steps``, ``eval_every``,
        ``target_loss``...) over it."""
        return cls(base=RunConfig.from_flags(**(BASE | flags)), shards=shards,
                   ghost_widths=ghost_widths, seeds=seeds, target_margin=target_margin,
                   train_size=train_size, eval_size=eval_size)

    @property
    def width(self) -> int:
        return self.base.model.width

    def jobs(self) -> list[tuple[str, int, int | None]]:
        """(strategy, p, k) of every run: TP at each p, then phantom at each p and k."""
        jobs = [(TP_STRATEGY, p, None) for p in self.shards]
        return jobs + [("phantom", p, k) for p in self.shards for k in self.ghost_widths_for(p)]

    def run_config(self, name: str, num_shards: int, ghost_width: int | None,
                   seed: int) -> RunConfig:
        base = self.base
        return dataclasses.replace(
            base, model=dataclasses.replace(base.model, ghost_width=ghost_width),
            parallel=dataclasses.replace(base.parallel, strategy=name,
                                         mesh=f"model={num_shards}"),
            train=dataclasses.replace(base.train, seed=seed, out=None, progress=False,
                                      eval_batches=1 << 30))

    def ghost_widths_for(self, num_shards: int) -> tuple[int, ...]:
        if self.ghost_widths == "auto":
            return (auto_ghost_width(self.width, num_shards),)
        return tuple(self.ghost_widths)

    def to_json(self) -> dict:
        return {"base": self.base.to_json(), "shards": list(self.shards),
                "ghost_widths": self.ghost_widths if isinstance(self.ghost_widths, str)
                else list(self.ghost_widths), "seeds": list(self.seeds),
                "target_margin": self.target_margin, "train_size": self.train_size,
                "eval_size": self.eval_size}


def table_one_params(strategy: str, width: int, depth: int, num_shards: int,
                     ghost_width: int | None) -> int:
    """Weights of the FFN as Seal et al.'s Table I counts them (biases excluded): n^2 L for TP,
    L (n^2/p + k n p) for phantom (:func:`jphantom.nn.phantom.ops.param_count`). The module's
    own count (``module_params``) adds the biases and, fused, the decompressor's unused own slot."""
    if not strategies.get(strategy).needs_ghost_width:
        return width * width * depth
    return phantom_param_count(width, ghost_width, num_shards, depth)


def _check_list(name, values, minimum):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ConfigError(f"{name}={values!r} must be a list of integers >= {minimum}")
    values = tuple(values)
    if not values:
        raise ConfigError(f"{name} is empty: give at least one value")
    for value in values:
        check_int(name, value, minimum)
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ConfigError(f"{name}={values} repeats {repeated}: give each value once")


def measure_matmul_rate(size: int = 1024, dtype=jnp.float32, repeats: int = 5) -> float:
    """Single-device matmul FLOP/s of this machine (2 size^3 FLOPs per product, median of repeats)."""
    device = jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    product = jax.jit(lambda u: u @ u)
    product(a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times)


def _curve(results) -> tuple[list, list]:
    """A run's held-out curve: the validation steps and losses of its :class:`RunResults`."""
    return results.history["validation_step"], results.history["validation_loss"]


def _first_reaching(steps, losses, target):
    for step, loss in zip(steps, losses):
        if loss <= target:
            return step
    return None


def _mean_or_none(values):
    return statistics.fmean(values) if values and all(v is not None for v in values) else None


def gpu_meter_factory(log=print):
    """``meter_factory`` for :func:`run_compare` on NVIDIA GPUs, or None (with the reason logged).

    Returns ``p -> NvmlEnergyMeter`` over this process's devices among the first p (those a run on
    p shards uses), matched to NVML by PCI bus id and read from NVML's energy counter (power
    sampling where a GPU has none), when jax runs on GPUs and NVML works; otherwise None, and the
    energy is modelled. With several processes each meters its own GPUs and the totals are summed.
    """
    if jax.default_backend() != "gpu":
        log(f"energy: modelled (jax backend is {jax.default_backend()!r}, no GPU to meter)")
        return None
    ok, why = NvmlEnergyMeter.available()
    if not ok:
        log(f"energy: modelled ({why})")
        return None
    log(f"energy: measured with NVML on {why}, training window only")
    return lambda num_shards: NvmlEnergyMeter(devices=process_devices(num_shards))


def run_compare(config: CompareConfig, *, built: dict | None = None,
                power: PowerModel = PowerModel(), progress: bool = True, log=print,
                meter_factory=None) -> dict:
    """Train every (strategy, p, k) for every seed (:func:`jphantom.loop.trainer.run`, the one training
    loop) and return ``{"config", "rows", ...}``.

    ``meter_factory``: ``p -> meter`` (see :func:`gpu_meter_factory`); each run is metered over its
    training window and the row's energy is then ``"measured"`` (the model's figures stay in the
    row under ``*_modelled``). Without it the energy is modelled. ``built``: what
    :meth:`CompareConfig.build` returned, where the caller has it (else built here, once per
    job)."""
    from jphantom.loop.trainer import check_memory, run

    if built is None:  # the devices and every run's shapes, before anything is trained
        built = config.build()
    base = config.base
    teacher = Teacher(TeacherConfig(width=config.width, train_size=config.train_size,
                                    eval_size=config.eval_size), jnp.dtype(base.model.dtype))
    jobs = config.jobs()
    for name, p, k in jobs:  # refuse what cannot fit before anything is trained
        check_memory(config.run_config(name, p, k, config.seeds[0]), built[name, p, k])
    matmul_rate = measure_matmul_rate()
    runs = {}
    bar = tqdm(total=len(jobs) * len(config.seeds), desc="training", disable=not progress)
    for name, p, k in jobs:
        for seed in config.seeds:
            result = run(config.run_config(name, p, k, seed), built=built[name, p, k],
                         teacher=teacher, meter=meter_factory(p) if meter_factory else None)
            runs.setdefault((name, p, k), []).append(result)
            bar.update()
    bar.close()

    if base.train.target_loss is None:
        floor = max(min(_curve(r)[1]) for results in runs.values() for r in results)
        target = floor * (1 + config.target_margin)
    else:
        target = base.train.target_loss

    rows = [_row(config, job, results, target, matmul_rate, power,
                 inspect_step(config.run_config(*job, config.seeds[0]), built=built[job]))
            for job, results in runs.items()]
    out = {
        "config": config.to_json() | {"tp_strategy": TP_STRATEGY},
        "target_loss": target,
        "target_rule": "given" if base.train.target_loss is not None else
        f"max over runs of the best held-out loss x (1 + {config.target_margin})",
        "power_model": dataclasses.asdict(power),
        "comm_model": FRONTIER.name,
        "matmul_flops_per_second_measured": matmul_rate,
        "device": str(jax.devices()[0].device_kind),
        "rows": rows,
    }
    out["ratios"] = _ratios(rows, config.width)
    out["small_p_phantom_vs_large_p_tp"] = _e9(rows)
    return out


def _row(config: CompareConfig, job: tuple, results: list, target: float, matmul_rate: float,
         power: PowerModel, report: dict) -> dict:
    """A row of the table: one (strategy, p, k)'s runs (``results``, one per seed) and its
    step's ``report`` (:func:`jphantom.analysis.inspect.inspect_step`): iterations to
    ``target``, measured and modelled time, collective bytes, energy."""
    name, p, k = job
    params = table_one_params(name, config.width, config.base.model.depth, p, k)
    iterations = [_first_reaching(*_curve(r), target) for r in results]
    reached = [i for i in iterations if i is not None]
    mean_iterations = _mean_or_none(iterations)
    alpha = report["flops"] / matmul_rate
    beta = FRONTIER.step_time_us(report["collectives"], p) * 1e-6
    modelled_per_iteration = energy_per_iteration(alpha, beta, power, devices=p)
    metered = [r.energy for r in results]
    if all(m is not None for m in metered):
        per_iteration = statistics.fmean(m["joules_per_step"] for m in metered)
        source = "measured"
    else:
        per_iteration, source = modelled_per_iteration, "modelled"
    step_seconds = [s for r in results for s in r.step_seconds]
    return {
        "strategy": name,
        "shards": p,
        "ghost_width": k,
        "params": params,
        "module_params": report["params"],
        "iterations_to_target": mean_iterations,
        "iterations_to_target_std": statistics.pstdev(reached) if len(reached) > 1 else 0.0,
        "iterations_per_seed": iterations,
        "seconds_per_iteration_measured": statistics.median(step_seconds) if step_seconds
        else math.nan,
        "compute_seconds_per_iteration_modelled": alpha,
        "comm_seconds_per_iteration_modelled": beta,
        "collective_bytes_per_iteration": report["collective_bytes"],
        "collectives": report["collectives"],
        "flops_per_device": report["flops"],
        "energy_per_iteration_j": per_iteration,
        "energy_total_j": None if mean_iterations is None else per_iteration * mean_iterations,
        "energy_source": source,
        "energy_per_iteration_j_modelled": modelled_per_iteration,
        "energy_meter": None if source == "modelled" else {
            "device_names": metered[0]["device_names"],
            "mean_watts": statistics.fmean(m["mean_watts"] for m in metered),
            "method": metered[0]["method"],  # "counter", "sampling" or "mixed"
            "metered_steps": [m["metered_steps"] for m in metered]},
        "proxy_params_x_iterations": None if mean_iterations is None
        else params * mean_iterations,
        "eval_curves": [{"steps": _curve(r)[0], "losses": _curve(r)[1]} for r in results],
    }


def _ratios(rows, width):
    tp = {r["shards"]: r for r in rows if not _phantom(r)}
    ratios = []
    for r in filter(_phantom, rows):
        base = tp[r["shards"]]
        div = lambda a, b: None if a is None or b in (None, 0) else a / b
        per_op = lambda row, kind: next((c["bytes"] / c["count"] for c in row["collectives"]
                                         if c["kind"] == kind), None)
        ratios.append({
            "shards": r["shards"], "ghost_width": r["ghost_width"],
            "params": div(r["params"], base["params"]),
            "iterations_to_target": div(r["iterations_to_target"], base["iterations_to_target"]),
            "collective_bytes_per_iteration": div(r["collective_bytes_per_iteration"],
                                                  base["collective_bytes_per_iteration"]),
            # Seal et al.'s k/(n/p) holds collective by collective (Table II); the per-iteration total
            # differs because T1 has no reduce-scatter for the input layer (module docstring).
            "bytes_per_collective": {kind: div(per_op(r, kind), per_op(base, kind))
                                     for kind in ("all-gather", "reduce-scatter")},
            "ghost_width_over_block": r["ghost_width"] * r["shards"] / width,
            "energy_per_iteration": div(r["energy_per_iteration_j"], base["energy_per_iteration_j"]),
            "energy_total": div(r["energy_total_j"], base["energy_total_j"]),
        })
    return ratios


def _phantom(row: dict) -> bool:
    """Whether a row trained a phantom model (its strategy's ghost width is part of the model),
    not the TP baseline."""
    return strategies.get(row["strategy"]).needs_ghost_width


def _e9(rows):
    """Seal et al.'s E9: the smallest-p phantom run (best of its k) against the largest-p TP run."""
    phantoms = [r for r in rows if _phantom(r) and r["energy_total_j"] is not None]
    tps = [r for r in rows if not _phantom(r)]
    if not phantoms or not tps:
        return None
    small_p = min(r["shards"] for r in phantoms)
    best = min((r for r in phantoms if r["shards"] == small_p), key=lambda r: r["energy_total_j"])
    big = max(tps, key=lambda r: r["shards"])
    if big["energy_total_j"] is None:
        return None
    time_to_target = lambda r: r["iterations_to_target"] * r["seconds_per_iteration_measured"]
    modelled_time = lambda r: r["iterations_to_target"] * (
        r["compute_seconds_per_iteration_modelled"] + r["comm_seconds_per_iteration_modelled"])
    return {
        "phantom": {"shards": best["shards"], "ghost_width": best["ghost_width"]},
        "tp": {"strategy": TP_STRATEGY, "shards": big["shards"]},
        "energy_ratio_tp_over_phantom": big["energy_total_j"] / best["energy_total_j"],
        "time_ratio_tp_over_phantom_modelled": modelled_time(big) / modelled_time(best),
        "time_ratio_tp_over_phantom_measured_cpu": time_to_target(big) / time_to_target(best),
    }


def format_table(result: dict) -> str:
    """Table I's shape: one line per (strategy, p, k), then phantom/TP ratios and E9."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = [
        f"Target held-out MSE {result['target_loss']:.4g} ({result['target_rule']}); energy is "
        + ("measured (NVML, training window only)" if all(
            r["energy_source"] == "measured" for r in result["rows"]) else
           f"modelled (Eq. 1, A={result['power_model']['busy_watts']:g} W, "
           f"B={result['power_model']['idle_watts']:g} W, comm by Eq. 26 {result['comm_model']})")
        + ".",
        "",
        f"{'strategy':<11}{'p':>3}{'k':>4}{'params':>10}{'iters':>8}{'±':>6}{'ms/iter':>9}"
        f"{'coll. KB/iter':>14}{'J/iter':>10}{'total J':>10}  source",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['strategy']:<11}{r['shards']:>3}{fmt(r['ghost_width'], 'd'):>4}{r['params']:>10,}"
            f"{fmt(r['iterations_to_target'], '.1f'):>8}{r['iterations_to_target_std']:>6.1f}"
            f"{r['seconds_per_iteration_measured'] * 1e3:>9.2f}"
            f"{r['collective_bytes_per_iteration'] / 1e3:>14.2f}"
            f"{r['energy_per_iteration_j']:>10.4f}{fmt(r['energy_total_j'], '.3f'):>10}"
            f"  {r['energy_source']}")
    missed = [f"{r['strategy']} p={r['shards']}" for r in result["rows"]
              if r["iterations_to_target"] is None]
    if missed:
        lines += ["", f"not reached: {', '.join(missed)} did not reach the target "
                      f"{result['target_loss']:.4g} in any seed's steps (give more steps, or a "
                      "higher --target-loss)"]
    lines += ["", "phantom / TP at the same p (bytes: per all-gather and per reduce-scatter, then the "
                  "iteration's total; k/(n/p) for reference):",
              f"{'p':>3}{'k':>4}{'params':>9}{'iters':>8}{'k/(n/p)':>9}{'AG':>8}{'RS':>8}"
              f"{'bytes':>8}{'J/iter':>8}{'total J':>9}"]
    for q in result["ratios"]:
        per_op = q["bytes_per_collective"]
        lines.append(f"{q['shards']:>3}{q['ghost_width']:>4}{fmt(q['params'], '.3f'):>9}"
                     f"{fmt(q['iterations_to_target'], '.3f'):>8}"
                     f"{q['ghost_width_over_block']:>9.4f}"
                     f"{fmt(per_op['all-gather'], '.4f'):>8}{fmt(per_op['reduce-scatter'], '.4f'):>8}"
                     f"{fmt(q['collective_bytes_per_iteration'], '.4f'):>8}"
                     f"{fmt(q['energy_per_iteration'], '.3f'):>8}{fmt(q['energy_total'], '.3f'):>9}")
    e9 = result["small_p_phantom_vs_large_p_tp"]
    if e9:
        lines += ["", f"E9: phantom p={e9['phantom']['shards']} k={e9['phantom']['ghost_width']} vs "
                      f"TP p={e9['tp']['shards']}: TP needs {e9['energy_ratio_tp_over_phantom']:.1f}x "
                      f"the energy (modelled), {e9['time_ratio_tp_over_phantom_modelled']:.2f}x the "
                      f"time (modelled), {e9['time_ratio_tp_over_phantom_measured_cpu']:.2f}x "
                      f"(measured on simulated CPU devices)"]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """comparison.png: iterations, bytes and energy vs p (Fig. 7a/b shape), and held-out curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    plotted = {0: [], 1: [], 2: [], 3: []}  # the values on each panel, to choose its y scale
    series = {}
    for r in rows:
        label = f"phantom k={r['ghost_width']}" if _phantom(r) else "TP (T1)"
        if result["config"]["ghost_widths"] == "auto" and _phantom(r):
            label = "phantom (auto k)"
        series.setdefault(label, []).append(r)
    for label, group in series.items():
        group = sorted(group, key=lambda r: r["shards"])
        p = [r["shards"] for r in group]
        style = "k-o" if label.startswith("TP") else "-s"
        for panel, key in enumerate(("iterations_to_target", "collective_bytes_per_iteration",
                                     "energy_total_j")):
            values = [math.nan if r[key] is None else r[key] for r in group]
            plotted[panel] += values
            axes[panel].plot(p, values, style, label=label)
    for ax, title in zip(axes[:3], ["iterations to target", "collective bytes / iteration (HLO)",
                                    "energy to target, J (modelled)"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("shards p")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    biggest = max(r["shards"] for r in rows)
    for r in rows:
        if r["shards"] == biggest:
            curve = r["eval_curves"][0]
            label = f"phantom k={r['ghost_width']}" if _phantom(r) else "TP"
            axes[3].plot(curve["steps"], curve["losses"], label=label)
            plotted[3] += curve["losses"]
    axes[3].axhline(result["target_loss"], color="grey", ls="--", label="target")
    plotted[3].append(result["target_loss"])
    for panel in (1, 2, 3):  # log scale only where there is something positive to show
        if any(math.isfinite(v) and v > 0 for v in plotted[panel]):
            axes[panel].set_yscale("log")
    for panel in (0, 2):
        if not any(math.isfinite(v) for v in plotted[panel]):
            axes[panel].text(0.5, 0.5, "no run reached the target", ha="center",
                             va="center", transform=axes[panel].transAxes)
    axes[3].set_title(f"held-out MSE, p={biggest}, seed 0")
    axes[3].set_xlabel("iteration")
    axes[3].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prepare_output_dir(out_dir) -> Path:
    """Create ``out_dir`` (a folder) and check that it can be written, so that a bad ``--out``
    fails before any training: an existing file, a folder without write permission, or a path
    whose parent cannot be created raise :class:`ConfigError`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {str(out_dir)!r} is an existing file; give a folder (it will "
                          "hold results.json and comparison.png)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".jphantom-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"--out {str(out_dir)!r} cannot be written: {error.strerror or error}; "
                          "give a writable folder") from None
    return out_dir


def write_outputs(result: dict, out_dir: Path) -> tuple[Path, Path]:
    """``results.json`` first (so it exists even if plotting fails), then ``comparison.png``."""
    out_dir = prepare_output_dir(out_dir)
    json_path, png_path = out_dir / "results.json", out_dir / "comparison.png"
    json_path.write_text(json.dumps(result, indent=2))
    plot(result, png_path)
    return json_path, png_path
