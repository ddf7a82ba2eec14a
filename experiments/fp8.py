"""FP8 against bf16 training: how closely the FP8 run's loss curve follows bf16's.

``--precision fp8`` (:mod:`jphantom.step.fp8`: the GEMMs of the blocks' linear layers on E4M3 operands
forward and E5M2 output gradients backward, per-tensor current scaling; bf16 elsewhere, float32
master weights and AdamW state) against ``--precision bf16``, the same Llama (2 layers, hidden
128, 4 heads, S = 64, byte-level standard-library text) from the same initialisation and
batches, under Megatron tensor parallelism on ``data=2,model=2`` (8 simulated CPU devices: the
FP8 GEMMs are emulated exactly, the operands widened). Reported: both validation curves, the
largest relative gap |fp8 - bf16| / bf16 over the evaluations, the final losses, and the same
for the training loss (the mean over each evaluation window).

    python experiments/fp8.py            # 300 steps, about 3 minutes on 2 cores
    python experiments/fp8.py --quick    # 20 steps, a tiny model (the test's case)

Writes ``experiments/results/fp8/results.json`` and ``curves.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.config import RunConfig  # noqa: E402
from jphantom.loop.trainer import run  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "fp8"
MODEL = dict(model="llama", layers=2, hidden=128, heads=4, seq_len=64, batch=16)
QUICK = dict(model="llama", layers=2, hidden=32, heads=4, seq_len=16, batch=8)


def curves(shape: dict, steps: int, every: int) -> dict:
    out = {}
    for precision in ("bf16", "fp8"):
        with tempfile.TemporaryDirectory() as folder:
            config = RunConfig.from_flags(**shape, strategy="tensor", mesh="data=2,model=2",
                                          steps=steps, eval_every=every, eval_batches=4,
                                          precision=precision, progress=False, out=folder,
                                          seed=0, warmup_steps=10, learning_rate=3e-3)
            final = run(config).final_validation_loss
            lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines]
        validation = [(r["step"], r["validation_loss"]) for r in rows
                      if r.get("validation_loss") is not None]
        train = [(r["step"], r["train_loss"]) for r in rows if "train_loss" in r]
        out[precision] = {"validation": validation, "train": train, "final": final}
    return out


def gaps(result: dict) -> dict:
    """Largest relative gaps of the FP8 run from the bf16 run: at every evaluation, and of the
    training loss averaged over each evaluation window."""
    val = max(abs(f - b) / b for (_, f), (_, b) in zip(result["fp8"]["validation"],
                                                        result["bf16"]["validation"]))
    every = result["bf16"]["validation"][0][0]
    window = lambda rows, end: [loss for step, loss in rows if end - every < step <= end]
    train = max(abs(sum(window(result["fp8"]["train"], s)) - sum(window(result["bf16"]["train"],
                                                                          s)))
                / sum(window(result["bf16"]["train"], s))
                for s, _ in result["bf16"]["validation"])
    return {"validation_max_relative_gap": val, "train_window_max_relative_gap": train,
            "final_bf16": result["bf16"]["final"], "final_fp8": result["fp8"]["final"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for precision, style in (("bf16", "-"), ("fp8", "--")):
        steps, losses = zip(*result[precision]["validation"])
        ax.plot(steps, losses, style, label=f"{precision} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title("FP8 vs bf16 (emulated on CPU), Llama 2 x 128, tensor data=2,model=2",
                 fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="20 steps, a tiny model")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    out = Path(output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="fp8"))
    shape, steps, every = ((QUICK, 20, 5) if args.quick else
                           (MODEL, args.steps, args.eval_every))
    result = curves(shape, steps, every)
    summary = gaps(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"settings": {"model": shape, "steps": steps, "eval_every": every,
                      "strategy": "tensor", "mesh": "data=2,model=2"},
         "summary": summary, "curves": result}, indent=1) + "\n")
    plot(result, out / "curves.png")
    print(f"bf16 final {summary['final_bf16']:.4f}, fp8 final {summary['final_fp8']:.4f}; "
          f"largest relative gap: validation {100 * summary['validation_max_relative_gap']:.2f}%, "
          f"training (per window) {100 * summary['train_window_max_relative_gap']:.2f}%")
    print(f"wrote {out}/results.json and curves.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
