"""How right is ``jphantom.predict``? Its predictions from compiled programs, set against every
measurement we have and against published cluster runs; and Seal et al.'s phantom-versus-tensor
claim predicted at the paper's scale. CPU only: the programs are compiled for the GPU targets
ahead of time (``pip install 'jphantom[aot]'``, as ``make test-aot``), nothing runs.

Parts (``--parts``, all by default):

``gpu_step``   the 1.24B Llama of ``benchmarks/gpu_step.py`` (S = 4096, batch 4, bf16 and FP8)
               compiled here (jax's XLA, ahead of time) for one H200 as that script builds it,
               with the flags its run sets (an FP8 run's: cuBLAS-LT's FP8 call), simulated on
               ``h200.toml``, against the newest steps of that shape measured on a lent H200
               (``benchmarks/results/gpu_predict/gpu_predict.json``, its cases
               ``1.2b-s4096-b4-bf16`` and ``-fp8``, jax 0.11.2) and their NVML joules; the
               earlier ``benchmarks/gpu_step.py`` measurements (older code) are listed.
``published``  each run of ``benchmarks/published_runs.toml`` (MaxText, NeMo, Megatron-Bridge,
               torchtitan on 8-128 H100s): jphantom's equivalent layout (the same model, mesh,
               ZeRO stage, global batch, micro-batch as accumulation, precision, checkpointing)
               compiled for that many H100s and simulated on ``h100-sxm.toml`` (``--device``:
               another description, e.g. ``benchmarks/calibrate.py``'s of a card); predicted
               tokens/s per GPU over the published figure. A ratio is jphantom's predicted
               program against the peer's measured one: where the programs differ (kernels,
               FP8 recipe, overlap) is said per run.
``seal``       Seal et al.'s FFN (n = 16384, L = 2, Table I's k at p = 8-256 GPUs; and Fig. 6's
               n = 131072, k = 64 at p = 32-256), phantom and tensor parallelism compiled for
               p H100s (p / 8 nodes) and simulated: seconds and joules per iteration, phantom /
               TP, against the paper's measured per-epoch energy ratio (Table I) and the total to
               the fixed loss (times the paper's epoch ratio). The same programs priced on
               ``mi250x-gcd.toml`` (Frontier, the paper's machine; the program XLA compiled for
               an H100, priced on the MI250X's numbers: labelled so).

Writes ``--out`` (default ``benchmarks/results/predict``): ``predict_validation.json`` and
``predict_validation.png``, and prints the tables. About 10 minutes on 2 cores.

    .venv-aot/bin/python benchmarks/predict_validation.py [--parts gpu_step published seal]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import tomllib
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
GPU_STEP = dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256,
                seq_len=4096, batch=4)
GPU_PREDICT = "benchmarks/results/gpu_predict/gpu_predict.json"  # the device check's steps
REMAT = {"none": "none", "not stated": "none", "selective": "dots_saveable",
         "full": "nothing_saveable"}
# Seal et al. (Table I): p -> k of the phantom run, n = 16384, L = 2
TABLE_I = {8: (16, 74.6 / 181.2, 157 / 453), 16: (6, 158.0 / 333.6, 175 / 453),
           32: (4, 333.6 / 658.4, 267 / 453), 64: (2, 779.2 / 1281.6, 362 / 453),
           128: (2, 2131.2 / 2611.2, 488 / 453), 256: (4, 6950.4 / 6873.6, 232 / 453)}
SEAL_BATCH = 1024  # rows per iteration: Seal et al. do not give theirs (our choice)


def log(*args) -> None:
    print(*args, flush=True)


# ------------------------------------------------------------------------------------------------
# gpu_step: the one GPU step anyone has measured
# ------------------------------------------------------------------------------------------------


def compile_gpu_step(precision: str, target) -> tuple[str, dict]:
    """The optimised HLO of ``benchmarks/gpu_step.py``'s jphantom step (tied embeddings, the
    chunked loss, cuDNN attention, AdamW) compiled for ``target`` (one GPU), and its memory."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jphantom
    from jphantom.runtime import gpu_defaults
    from jphantom.runtime.mesh import MeshConfig, device_pool
    from jphantom.models.llama import Llama, LlamaConfig, lm_loss

    s = GPU_STEP
    config = LlamaConfig(vocab_size=s["vocab"], hidden=s["hidden"],
                         intermediate=s["intermediate"], layers=s["layers"], heads=s["heads"],
                         kv_heads=s["kv_heads"], max_positions=s["seq_len"],
                         tie_word_embeddings=True, rope_theta=500000.0)
    devices = target.devices()
    run_flags = gpu_defaults.current(precision=precision)  # as that run's process sets them
    flags, _ = gpu_defaults.merge_flags(os.environ.get("XLA_FLAGS", ""), run_flags)
    with device_pool(devices):
        model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
        mesh = MeshConfig.parse("model=1").build(devices[:1])
        step = jphantom.make_train_step(model, mesh, optax.adamw(3e-4, b2=0.95,
                                                                 weight_decay=0.1),
                                        lm_loss, precision=precision, attention="auto")
        batch = [jax.ShapeDtypeStruct((s["batch"], s["seq_len"]), jnp.int32, sharding=sh)
                 for sh in step.batch_shardings(2)]
        compiled = step.lower(step.abstract_state(), *batch).compile(
            compiler_options=gpu_defaults.compiler_options(flags, run_flags))
    m = compiled.memory_analysis()
    memory = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
              "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes}
    memory["peak"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    return compiled.as_text(), memory | {"config": config}


def part_gpu_step() -> dict:
    from jphantom.costs import aot
    from jphantom.costs.metrics import flops_per_token
    from jphantom.predict import format_prediction, load, predict

    measured = json.loads((ROOT / GPU_PREDICT).read_text())  # the newest steps of this shape
    runs = {p: next(r["measured"] for r in measured["cases"] if r["name"] == f"1.2b-s4096-b4-{p}")
            for p in ("bf16", "fp8")}
    earlier = sorted((ROOT / "benchmarks/results/gpu_step").glob("**/gpu_step.json"))
    device = load("h200")
    target = aot.Target.parse("gpu:h200", nodes=1, gpus_per_node=1)
    rows = []
    for precision in ("bf16", "fp8"):
        t0 = time.perf_counter()
        text, memory = compile_gpu_step(precision, target)
        compile_s = time.perf_counter() - t0
        tokens = GPU_STEP["batch"] * GPU_STEP["seq_len"]
        flops = flops_per_token(memory["config"], "dense", GPU_STEP["seq_len"]) * tokens
        p = predict(text, device, tokens_per_step=tokens, model_flops_per_step=flops,
                    peak_memory_bytes=memory["peak"])
        log(format_prediction(p, f"\ngpu_step, {precision}, compiled for one H200 in "
                                 f"{compile_s:.1f} s:"))
        run = runs[precision]
        step_s = run["step_seconds"]
        rows.append({
            "precision": precision, "predicted": p.as_dict(), "compile_seconds": compile_s,
            "measured_step_s": step_s, "measured_step_s_all": run["step_seconds_all"],
            "measured_peak_memory_bytes": run.get("peak_memory_bytes"),
            "measured_joules_per_token": run.get("joules_per_token"),
            "error_step": p.step_s / step_s - 1,
            "error_joules_per_token": (p.joules_per_token / run["joules_per_token"] - 1
                                       if run.get("joules_per_token") else None),
            "compiled_peak_bytes": memory["peak"],
        })
        log(f"measured {step_s:.4f} s (median; all {min(run['step_seconds_all']):.3f}-"
            f"{max(run['step_seconds_all']):.3f}); predicted {p.step_s:.4f} s: error "
            f"{rows[-1]['error_step']:+.1%}; J/token predicted {p.joules_per_token:.4f}, NVML "
            f"{run.get('joules_per_token') or float('nan'):.4f}")
    return {"device": "h200", "measured_on": measured["device"], "measured_jax": measured["jax"],
            "measured_by": f"{GPU_PREDICT} (cases 1.2b-s4096-b4-bf16 and -fp8, "
                           f"{measured['date']})",
            "other_measurements": [str(p.relative_to(ROOT)) for p in earlier], "rows": rows}


# ------------------------------------------------------------------------------------------------
# published: other frameworks' runs on H100 clusters
# ------------------------------------------------------------------------------------------------


def peer_policy(run: dict) -> str:
    """jphantom's recompute policy for the run: the one equal to the peer's own (``remat_policy``,
    :data:`jphantom.step.remat.PEERS`), else the nearest by the run's ``activation_checkpointing``."""
    from jphantom.step.remat import PEERS

    named = run.get("remat_policy")
    same = [ours for ours, theirs in PEERS.items() if named and theirs.endswith(" " + named)]
    return same[0] if same else REMAT[run["activation_checkpointing"]]


def published_flags(run: dict) -> dict:
    """jphantom's equivalent run of a published one (module docstring)."""
    axes = dict(item.split("=") for item in run["mesh"].split(","))
    data = int(axes.get("data", 1))
    flags = {"model": "llama", "layers": run["layers"], "hidden": run["hidden"],
             "heads": run["heads"], "kv_heads": run["kv_heads"],
             "intermediate": run["intermediate"], "vocab": run["vocab"],
             "seq_len": run["seq_len"], "batch": run["global_batch"], "optimizer": "adamw",
             "dtype": "float32", "precision": run["precision"], "mesh": run["mesh"],
             "remat": peer_policy(run), "strategy": "tensor"}
    if run.get("zero"):
        flags["zero"] = int(run["zero"])
    micro = run["global_batch"] // (data * run["micro_batch"])
    if "stage" in axes:  # Megatron's interleaved schedule: its VP, the run's virtual_stages
        virtual = run.get("virtual_stages", 1)
        flags["microbatches"] = micro
        flags["schedule"] = "interleaved-1f1b" if virtual > 1 else "1f1b"
        if virtual > 1:
            flags["virtual_stages"] = virtual
        if "context" in axes:  # jphantom runs ring attention outside pipelines only
            flags["context_attention"] = "all-gather"
        if run.get("grad_sync_dtype") == "bf16":  # the peer's bf16 gradient buffer
            flags["accumulate_grads_in"] = "compute"
    elif micro > 1:
        flags["accumulate"] = micro
    if "model" in axes:
        flags["sequence_parallel"] = True
    if ("distributed optimizer" in run["layout"] and run["precision"] in ("bf16", "fp8")
            and run.get("zero") == 1):
        flags["master_weights"] = "sharded"  # bf16 parameters, float32 master in the shards
    return flags


def memory_limit(report: dict) -> dict:
    """What a row's ``fits`` is judged against: the allocator's limit on the device
    (``XLA_PYTHON_CLIENT_MEM_FRACTION``, jphantom's 0.9 unless set; jphantom.costs.budget), and
    the fraction the compiled peak needs."""
    memory = report["memory"]
    return {"allocator_fraction": memory.get("allocator_fraction"),
            "limit_gib": memory["limit_bytes"] / 2**30,
            "fraction_needed": memory.get("fraction_needed")}


def partitions(flags: dict) -> bool:
    """Whether ZeRO-2 changes the run: ZeRO-1 (Megatron's distributed optimizer) accumulating
    micro-batches without a pipeline, whose float32 gradient accumulator ZeRO-2 keeps in shards
    (:meth:`jphantom.step.grads.LocalGradients.into_sinks`)."""
    return (flags.get("zero", 0) == 1 and flags.get("accumulate", 1) > 1
            and "schedule" not in flags)


def variant(flags: dict, update: dict, target, device, row: dict) -> dict:
    """The run compiled and predicted with ``update`` to its flags: fits, memory, prediction and
    ratio, or why jphantom refuses it."""
    from jphantom.costs import aot
    from jphantom.errors import ConfigError

    try:
        report = aot.compile_report({**flags, **update}, target, predict_on=device)
    except (ConfigError, ValueError) as error:
        return {"flags": update, "refused": str(error).split("\n")[0]}
    q = report["prediction"]
    return {"flags": update, "fits": report["memory"]["fits"], **memory_limit(report),
            "compiled_peak_gib": report["memory"]["peak_bytes"] / 2**30,
            "predicted_tokens_per_second_per_gpu": q["tokens_per_second_per_gpu"],
            "predicted_step_s": q["step_s"], "predicted_mfu": q["mfu"],
            "exposed_comm_s": q["exposed_comm_s"], "by_kind_s": q["by_kind_s"],
            "ratio": q["tokens_per_second_per_gpu"] / row["published_tokens_per_second_per_gpu"]}


def fitting_variant(flags: dict, target, device, row: dict) -> dict:
    """The first of ZeRO-3, then selective recomputation (``dots_attention_saveable``,
    MaxText's ``minimal_flash``: the GEMMs' and attention's outputs kept, the element-wise work
    recomputed) where the run recomputes less, then full recomputation (``nothing_saveable``),
    then ZeRO-3 with it, that fits the run's memory, with its prediction; the last tried when
    none fits."""
    from jphantom.costs import aot
    from jphantom.errors import ConfigError

    tries = []
    if flags.get("zero", 0) < 3:
        tries.append(("ZeRO-3 instead", {"zero": 3}))
    if flags["remat"] in ("none", "all_but_attention_core_saveable"):  # keep more than it
        tries.append(("selective recomputation (dots_attention_saveable) instead",
                      {"remat": "dots_attention_saveable"}))
    if flags["remat"] != "nothing_saveable":
        tries.append(("full recomputation instead", {"remat": "nothing_saveable"}))
        if flags.get("zero", 0) < 3:
            tries.append(("ZeRO-3 and full recomputation", {"zero": 3,
                                                            "remat": "nothing_saveable"}))
    out = {"change": "nothing left to try", "refused": "no variant"}
    for change, update in tries:
        try:
            report = aot.compile_report({**flags, **update}, target, predict_on=device)
        except (ConfigError, ValueError) as error:
            if "ratio" not in out:  # a compiled try that did not fit says more than a refusal
                out = {"change": change, "refused": str(error).split("\n")[0]}
            continue
        q = report["prediction"]
        out = {"change": change, "flags": update, "fits": report["memory"]["fits"],
               **memory_limit(report),
               "compiled_peak_gib": report["memory"]["peak_bytes"] / 2**30,
               "predicted_tokens_per_second_per_gpu": q["tokens_per_second_per_gpu"],
               "predicted_step_s": q["step_s"], "predicted_mfu": q["mfu"],
               "ratio": q["tokens_per_second_per_gpu"]
               / row["published_tokens_per_second_per_gpu"]}
        if out["fits"]:
            break
    return out


def memory_by_source(top_ops: list[dict], top: int = 8) -> list[dict]:
    """The step's memory-bound kernels (a prediction's ``top_ops``, every op) summed by the jax
    operation they come from (the last two parts of their source path, e.g.
    ``jvp()/reduce_max``: FP8's amax reductions), the ``top`` largest: seconds and executions
    per step."""
    sums: dict[str, list[float]] = {}
    for op in top_ops:
        if op["kind"] == "memory":
            row = sums.setdefault("/".join(op["source"].split("/")[-2:]) or op["op"], [0.0, 0])
            row[0] += op["seconds"]
            row[1] += op["count"]
    ranked = sorted(sums.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"source": k, "seconds": v[0], "executions": v[1]} for k, v in ranked]


def part_published(only: list[str] | None = None, device_name: str = "h100-sxm") -> dict:
    from jphantom.costs import aot
    from jphantom.errors import ConfigError
    from jphantom.predict import load

    runs = tomllib.loads((ROOT / "benchmarks/published_runs.toml").read_text())["run"]
    device = load(device_name)
    rows = []
    for run in runs:
        if only and run["id"] not in only:
            continue
        flags = published_flags(run)
        row = {"id": run["id"], "framework": run["framework"], "gpu": run["gpu"],
               "gpus": run["gpus"], "layout": run["layout"], "precision": run["precision"],
               "published_tokens_per_second_per_gpu": run["tokens_per_second_per_gpu"],
               "source": run["source"], "flags": flags}
        target = aot.Target.parse("gpu:h100", nodes=run["gpus"] // run["gpus_per_node"],
                                  gpus_per_node=run["gpus_per_node"])
        t0 = time.perf_counter()
        try:  # every op predicted, for the memory-bound ones by source
            report = aot.compile_report(flags, target, predict_on=device, top=10**6)
        except (ConfigError, ValueError) as error:
            row["refused"] = str(error).split("\n")[0]
            log(f"{run['id']}: jphantom refuses the equivalent layout: {row['refused']}")
            rows.append(row)
            continue
        p = report["prediction"]
        row |= {"compile_seconds": time.perf_counter() - t0,
                "predicted_tokens_per_second_per_gpu": p["tokens_per_second_per_gpu"],
                "predicted_step_s": p["step_s"], "predicted_mfu": p["mfu"],
                "exposed_comm_s": p["exposed_comm_s"], "hidden_comm_s": p["hidden_comm_s"],
                "compiled_peak_gib": report["memory"]["peak_bytes"] / 2**30,
                "fits": report["memory"]["fits"], **memory_limit(report),
                "joules_per_token": p["joules_per_token"],
                "kernels": report["kernels"]["gemms"] if "gemms" in report["kernels"] else None,
                "by_kind_s": p["by_kind_s"], "top_ops": [
                    {k: op[k] for k in ("op", "kind", "seconds", "count", "source")}
                    for op in p["top_ops"][:10]],
                "memory_by_source": memory_by_source(p["top_ops"])}
        row["ratio"] = (row["predicted_tokens_per_second_per_gpu"]
                        / row["published_tokens_per_second_per_gpu"])
        if not row["fits"]:  # what a jphantom user would run instead: the first that fits
            row["fitting"] = fitting_variant(flags, target, device, row)
        if partitions(flags):
            row["zero2"] = variant(flags, {"zero": 2}, target, device, row)
        log(f"{run['id']}: predicted {row['predicted_tokens_per_second_per_gpu']:,.0f} tok/s/GPU "
            f"(step {p['step_s']:.3f} s, MFU {p['mfu'] or 0:.1%}, exposed comm "
            f"{p['exposed_comm_s']:.3f} s, peak {row['compiled_peak_gib']:.1f} GiB"
            f"{'' if row['fits'] else ' DOES NOT FIT'} the {row['limit_gib']:.1f} GiB of "
            f"fraction {row['allocator_fraction']}, needs {row['fraction_needed']:.3f}) "
            "vs published "
            f"{run['tokens_per_second_per_gpu']:,.0f}: ratio {row['ratio']:.2f}")
        log("  memory-bound by source: " + ", ".join(
            f"{m['source']} {m['seconds']:.3f} s" for m in row["memory_by_source"][:6]))
        if "zero2" in row:
            z = row["zero2"]
            log("  ZeRO-2 (the same layout, each micro-batch's gradients reduce-scattered into "
                "float32 shards): " + (f"refused ({z['refused']})" if "ratio" not in z else
                                       f"peak {z['compiled_peak_gib']:.1f} GiB"
                                       f"{'' if z['fits'] else ' DOES NOT FIT'}, "
                                       f"{z['predicted_tokens_per_second_per_gpu']:,.0f} "
                                       f"tok/s/GPU, ratio {z['ratio']:.3f}"))
        if "fitting" in row:
            f = row["fitting"]
            log(f"  {f['change']}: " + (f"refused ({f['refused']})" if "ratio" not in f else
                                       f"peak {f['compiled_peak_gib']:.1f} GiB"
                                       f"{'' if f['fits'] else ' (still too big)'}, "
                                       f"{f['predicted_tokens_per_second_per_gpu']:,.0f} "
                                       f"tok/s/GPU, ratio {f['ratio']:.2f}"))
        rows.append(row)
    return {"device": device.name, "device_file": str(device.path or device_name),
            "rows": rows}


# ------------------------------------------------------------------------------------------------
# seal: phantom vs tensor parallelism at the paper's scale
# ------------------------------------------------------------------------------------------------


def part_seal() -> dict:
    from jphantom.costs import aot
    from jphantom.predict import load, predict

    h100, frontier = load("h100-sxm"), load("mi250x-gcd")
    cases = [(16384, 2, p, k) for p, (k, _, _) in TABLE_I.items()]
    cases += [(131072, 2, p, 64) for p in (32, 64, 128, 256)]
    rows = []
    for n, depth, p, k in cases:
        target = aot.Target.parse("gpu:h100", nodes=max(1, p // 8), gpus_per_node=min(8, p))
        pair = {}
        for strategy in ("tensor", "phantom"):
            flags = {"model": "ffn", "width": n, "depth": depth, "batch": SEAL_BATCH,
                     "strategy": strategy, "mesh": f"model={p}", "optimizer": "sgd",
                     "precision": "float32"}
            if strategy == "phantom":
                flags["ghost_width"] = k
            report = aot.compile_report(flags, target, hlo_out=f"/tmp/seal.{strategy}.hlo")
            text = Path(report["hlo_file"]).read_text()
            pair[strategy] = {}
            for name, device in (("h100", h100), ("mi250x_priced", frontier)):
                pr = predict(text, device, devices=p, gpus_per_node=min(
                    8, p), peak_memory_bytes=report["memory"]["peak_bytes"])
                pair[strategy][name] = {"step_s": pr.step_s, "compute_s": pr.compute_s,
                                        "exposed_comm_s": pr.exposed_comm_s,
                                        "joules": pr.joules_per_step,
                                        "peak_gib": report["memory"]["peak_bytes"] / 2**30}
        row = {"n": n, "L": depth, "p": p, "k": k, "runs": pair}
        for name in ("h100", "mi250x_priced"):
            t, ph = pair["tensor"][name], pair["phantom"][name]
            row[f"{name}_time_ratio"] = ph["step_s"] / t["step_s"]
            row[f"{name}_energy_ratio"] = ph["joules"] / t["joules"]
        if n == 16384:
            _, per_epoch, epochs = TABLE_I[p]
            row["paper_energy_per_epoch_ratio"] = per_epoch
            row["paper_epoch_ratio"] = epochs
            row["paper_total_energy_ratio"] = per_epoch * epochs
            for name in ("h100", "mi250x_priced"):
                row[f"{name}_total_energy_ratio"] = row[f"{name}_energy_ratio"] * epochs
        log(f"n={n} p={p:>3} k={k:>2}: phantom/TP time {row['h100_time_ratio']:.2f}, energy "
            f"{row['h100_energy_ratio']:.2f} per iteration on H100 (MI250X-priced "
            f"{row['mi250x_priced_energy_ratio']:.2f})"
            + (f"; paper per epoch {row['paper_energy_per_epoch_ratio']:.2f}, to the loss "
               f"{row['paper_total_energy_ratio']:.2f} vs predicted "
               f"{row['h100_total_energy_ratio']:.2f}" if n == 16384 else ""))
        rows.append(row)
    return {"batch_rows": SEAL_BATCH, "precision": "float32 (TF32 GEMMs on the GPU)",
            "rows": rows}


# ------------------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for row in results.get("gpu_step", {}).get("rows", []):
        ax.scatter(row["measured_step_s"], row["predicted"]["step_s"], s=60,
                   label=f"gpu_step {row['precision']} (H200)")
    lo, hi = 0.2, 0.45
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], alpha=0.15,
                    label="±15%")
    ax.set(xlabel="measured step s", ylabel="predicted step s", title="one GPU: measured")
    ax.legend(fontsize=8)
    ax = axes[1]
    pub = [r for r in results.get("published", {}).get("rows", []) if "ratio" in r]
    ax.barh([r["id"][:38] for r in pub], [r["ratio"] for r in pub])
    ax.axvline(1.0, color="k", lw=1)
    ax.set(xlabel="jphantom predicted / published tokens/s per GPU",
           title="published H100 runs (other frameworks)")
    ax.tick_params(axis="y", labelsize=7)
    ax = axes[2]
    seal = [r for r in results.get("seal", {}).get("rows", []) if r["n"] == 16384]
    if seal:
        ps = [r["p"] for r in seal]
        ax.plot(ps, [r["h100_energy_ratio"] for r in seal], "o-", label="predicted, H100")
        ax.plot(ps, [r["mi250x_priced_energy_ratio"] for r in seal], "s-",
                label="predicted, MI250X-priced")
        ax.plot(ps, [r["paper_energy_per_epoch_ratio"] for r in seal], "k^--",
                label="Seal et al. Table I (MI250X, measured)")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="GPUs p", ylabel="phantom / TP energy per iteration",
               title="n = 16384, L = 2")
        ax.legend(fontsize=8)
    fig.suptitle("jphantom.predict against measurements (all predictions modelled)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["gpu_step", "published", "seal"],
                        choices=["gpu_step", "published", "seal"])
    parser.add_argument("--runs", nargs="*", default=None, help="published run ids (default all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/predict"))
    parser.add_argument("--device", default="h100-sxm",
                        help="the description the published runs are priced on (a shipped name "
                             "or a file, e.g. benchmarks/calibrate.py's): default h100-sxm")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import jax

    results: dict = {"jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
                     "label": "predictions are modelled; measurements are named with their "
                              "device"}
    if "gpu_step" in args.parts:
        results["gpu_step"] = part_gpu_step()
    path = out / "predict_validation.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    if "published" in args.parts:
        results["published"] = part_published(args.runs, args.device)
        if args.runs and "published" in previous:  # some runs again: the others as they were
            fresh = {r["id"]: r for r in results["published"]["rows"]}
            results["published"]["rows"] = [fresh.pop(r["id"], r) for r in
                                            previous["published"]["rows"]] + list(fresh.values())
        ratios = [r["ratio"] for r in results["published"]["rows"] if "ratio" in r]
        if ratios:
            results["published"]["summary"] = {
                "runs": len(ratios), "median_ratio": statistics.median(ratios),
                "min_ratio": min(ratios), "max_ratio": max(ratios)}
    if "seal" in args.parts:
        results["seal"] = part_seal()
    merged = {**previous, **results}
    path.write_text(json.dumps(merged, indent=2, default=str))
    plot(merged, out / "predict_validation.png")
    log(f"\nwrote {path} and {out / 'predict_validation.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
