"""Mixture of experts at small scale (Singh's thesis ch. 7): dense vs MoE at equal active parameters, dropped
tokens over training, the all-to-all bytes with and without duplicate token dropping, and seed
004's memory bound (Eq. 7.4) against the measured model-state bytes.

1. **Training** (``jphantom train`` through :mod:`jphantom.loop.trainer`, the byte-level stdlib corpus): a
   GPT-2 (``jphantom.models.gpt2``) with every other block a top-1 MoE of 8 experts (Switch
   Transformer: each token visits one expert of the dense MLP's width, so the active parameters
   equal the dense model's plus the router) against the dense GPT of the same shape; validation
   cross-entropy (the auxiliary losses left out) and, for the MoE runs, the fraction of
   token-expert assignments dropped at each evaluation, with capacity factors 1.0 and 1.25.
   Experts on an ``expert=4`` axis.
2. **All-to-all bytes** per training step from the compiled HLO (trip counts applied), TED on
   ``data=2,expert=2,model=2``: plain, with DTD (Singh's thesis: the bytes fall by G_tensor = 2), and the
   phantom-parallel experts (each rank dispatches its h/p features: the same 1/p without DTD).
3. **Memory** (Adam, float32): the model-state bytes per device from the step's shardings
   (:func:`jphantom.analysis.compiled.state_bytes`: parameters, gradients and Adam's moments)
   against Eq. 7.4 evaluated with the per-device expert and non-expert parameter counts, once with
   TED's ZeRO-1 data-parallel degrees (the bound) and once with G_data = 1 (jphantom: ZeRO does not
   yet run beside an expert axis, so every rank keeps 4 + 4 + 8 bytes per parameter).

Run: ``.venv/bin/python experiments/moe.py`` (about 5 minutes on 2 CPU cores); writes
``experiments/results/moe/results.json`` and ``moe.png``. ``--quick`` for the tests (into a scratch
folder unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jphantom.analysis.compiled import build, state_bytes  # noqa: E402
from jphantom.analysis.inspect import inspect_step  # noqa: E402
from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.config import RunConfig  # noqa: E402
from jphantom.loop.trainer import run  # noqa: E402
from jphantom.step.zero import spec_axes  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "moe"
SHAPE = dict(model="gpt2", layers=4, hidden=64, heads=4, seq_len=64, batch=16)
RUNS = {  # name: (mesh, MoE fields)
    "dense": ("data=4,model=1", {}),
    "moe-cf1.25": ("expert=4,model=1", dict(moe_every=2, experts=8, top_k=1,
                                            capacity_factor=1.25)),
    "moe-cf1.0": ("expert=4,model=1", dict(moe_every=2, experts=8, top_k=1,
                                           capacity_factor=1.0)),
}


def train(shape, steps, every) -> dict:
    out = {}
    for name, (mesh, moe) in RUNS.items():
        with tempfile.TemporaryDirectory() as folder:
            config = RunConfig.from_flags(**shape, **moe, strategy="tensor", mesh=mesh,
                                          steps=steps, eval_every=every, progress=False,
                                          out=folder, seed=0)
            res = run(config)
        hist = res.history
        # the TransformerConfig's count: the router and the k experts a token visits
        active = config.family_config().param_count(active=True)
        out[name] = {"mesh": mesh, **moe, "params": res.params, "active_params": active,
                     "validation_step": hist["validation_step"],
                     "validation_loss": hist["validation_loss"],
                     "dropped_fraction": hist["dropped_fraction"],
                     "final_validation_loss": res.final_validation_loss,
                     "median_step_seconds": res.median_step_seconds}
        dropped = hist["dropped_fraction"]
        print(f"{name:11s} on {mesh}: {res.params:,} params "
              f"({out[name]['active_params']:,} active), final validation "
              f"{res.final_validation_loss:.4f} nats/token"
              + (f", dropped {100 * dropped[0]:.1f}% -> {100 * dropped[-1]:.1f}%" if dropped
                 else ""), flush=True)
    return out


def all_to_all_bytes(shape) -> dict:
    out = {}
    for name, strategy, dtd in (("ted", "tensor", False), ("ted+dtd", "tensor", True),
                                ("phantom-experts", "phantom", False)):
        config = RunConfig.from_flags(**shape, strategy=strategy, mesh="data=2,expert=2,model=2",
                                      dtd=dtd, moe_every=2, experts=8, top_k=1,
                                      ghost_width=4 if strategy == "phantom" else None,
                                      optimizer="sgd", out=None, progress=False)
        report = inspect_step(config)
        by_kind = defaultdict(int)
        for row in report["collectives"]:
            by_kind[row["kind"]] += row["bytes"]
        out[name] = {"all_to_all_bytes": by_kind["all-to-all"],
                     "collective_bytes": report["collective_bytes"], "by_kind": dict(by_kind)}
        print(f"{name:15s}: all-to-all {by_kind['all-to-all']:,} B per device per step, "
              f"all collectives {report['collective_bytes']:,} B", flush=True)
    out["dtd_ratio"] = out["ted"]["all_to_all_bytes"] / out["ted+dtd"]["all_to_all_bytes"]
    print(f"DTD divides the all-to-all bytes by {out['dtd_ratio']:.3f} (G_tensor = 2)")
    return out


def memory(shape) -> dict:
    """Eq. 7.4 against the measured model-state bytes on data=2,expert=2,model=2 (G = 8)."""
    config = RunConfig.from_flags(**shape, strategy="tensor", mesh="data=2,expert=2,model=2",
                                  moe_every=2, experts=8, top_k=1, optimizer="adam",
                                  warmup_steps=0, out=None, progress=False)
    program, mesh, step = build(config)
    measured = state_bytes(step)
    counts = {"exp": 0, "nonexp": 0}
    for leaf, spec_ in zip(step.layout.shapes, step.param_specs):
        axes = spec_axes(spec_)
        local = math.prod(leaf.shape) // math.prod(mesh.shape[a] for a in axes)
        counts["exp" if "expert" in axes else "nonexp"] += local
    g_tensor, g_expert, g_data = (mesh.shape[a] for a in ("model", "expert", "data"))
    g_nonexp, g_exp = g_data * g_expert, g_data  # data-parallel degrees (Eq. 7.1)
    zero1 = (4 + 12 / g_nonexp) * counts["nonexp"] + (4 + 12 / g_exp) * counts["exp"]
    plain = 16 * (counts["nonexp"] + counts["exp"])
    out = {"np_gpu_nonexp": counts["nonexp"], "np_gpu_exp": counts["exp"],
           "g_tensor": g_tensor, "g_expert": g_expert, "g_data_exp": g_exp,
           "g_data_nonexp": g_nonexp, "eq_7_4_zero1_bytes": zero1, "eq_7_4_no_zero_bytes": plain,
           "measured_model_state_bytes": measured["model_state_bytes"], "measured": measured}
    print(f"Eq. 7.4: NP_gpu nonexp {counts['nonexp']:,}, exp {counts['exp']:,}; bound with ZeRO-1 "
          f"{zero1:,.0f} B, without ZeRO {plain:,} B; measured {measured['model_state_bytes']:,} B "
          f"(Adam, float32)", flush=True)
    return out


def plot(results, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_ax, drop_ax, bytes_ax) = plt.subplots(1, 3, figsize=(15, 4))
    for name, run_ in results["training"].items():
        loss_ax.plot(run_["validation_step"], run_["validation_loss"], "o-", ms=3, label=name)
        if run_["dropped_fraction"]:
            drop_ax.plot(run_["validation_step"], [100 * d for d in run_["dropped_fraction"]],
                         "o-", ms=3, label=name)
    loss_ax.set(xlabel="step", ylabel="validation cross-entropy (nats/token)",
                title="dense vs MoE at equal active parameters")
    drop_ax.set(xlabel="step", ylabel="dropped assignments (%)", title="tokens over capacity")
    names = ["ted", "ted+dtd", "phantom-experts"]
    bytes_ax.bar(names, [results["all_to_all"][n]["all_to_all_bytes"] / 1e3 for n in names])
    bytes_ax.set(ylabel="all-to-all kB per device per step",
                 title="TED on data=2,expert=2,model=2")
    for ax in (loss_ax, drop_ax):
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="a few steps of a tiny model")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="moe")
    shape, steps, every = SHAPE, args.steps, args.eval_every
    if args.quick:
        shape, steps, every = {**SHAPE, "layers": 2, "hidden": 32, "seq_len": 16, "batch": 8}, 4, 2
    results = {"settings": {"shape": shape, "steps": steps, "eval_every": every,
                            "strategy": "tensor", "devices": jax.device_count()},
               "training": train(shape, steps, every), "all_to_all": all_to_all_bytes(shape),
               "memory": memory(shape)}
    dense, moe = results["training"]["dense"], results["training"]["moe-cf1.25"]
    results["moe_over_dense_validation"] = (moe["final_validation_loss"]
                                            / dense["final_validation_loss"])
    print(f"MoE (cf 1.25) / dense final validation loss: {results['moe_over_dense_validation']:.4f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "moe.png")
    print(f"wrote {out / 'results.json'} and {out / 'moe.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
