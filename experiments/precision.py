"""bf16 against float32 training: iterations to the float32 run's loss.

Cheng et al. (Sec. 1.2) trains in mixed precision: half-precision compute, float32 master weights and
optimizer state. This script trains the same model from the same initialisation and data twice
with ``jphantom train`` (:mod:`jphantom.loop.trainer`), ``--precision float32`` and ``--precision bf16``,
for the teacher FFN (Seal et al.'s task, ``jphantom.models.ffn``) and the GPT-2 transformer
(``jphantom.models.gpt2``, byte-level stdlib corpus), on
``data=2,model=2`` with the ``tensor`` strategy, and reports the validation step at which each run
first reaches the float32 run's final validation loss (+0.5%: the target), and their ratio
(the target: bf16 within 1.10x float32's iterations).

Run: ``.venv/bin/python experiments/precision.py`` (a few minutes on 2 CPU cores); writes
``experiments/results/precision/results.json``. ``--quick`` for the tests (into a scratch folder
unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from jphantom.analysis.machine import output_folder  # noqa: E402
from jphantom.config import RunConfig  # noqa: E402
from jphantom.loop.trainer import run  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "precision"
MODELS = {
    "ffn": dict(model="ffn", width=256, depth=4, batch=64),
    "transformer": dict(model="gpt2", layers=2, hidden=128, heads=4, seq_len=64, batch=16),
}


def first_at_or_below(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss <= target), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="30 steps, tiny models")
    parser.add_argument("--out", default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick: a scratch folder)")
    args = parser.parse_args(argv)
    args.out = output_folder(args.out, DEFAULT_OUT, quick=args.quick, name="precision")
    steps, every = (30, 5) if args.quick else (args.steps, args.eval_every)
    results = {"settings": {"steps": steps, "eval_every": every, "mesh": "data=2,model=2",
                            "strategy": "tensor", "tolerance": 0.005}, "models": {}}
    for name, shape in MODELS.items():
        if args.quick:
            shape = {**shape, **({"width": 32, "batch": 16} if name == "ffn" else
                                 {"hidden": 32, "seq_len": 16, "batch": 8})}
        curves = {}
        for precision in ("float32", "bf16"):
            with tempfile.TemporaryDirectory() as out:
                config = RunConfig.from_flags(**shape, strategy="tensor", mesh="data=2,model=2",
                                              steps=steps, eval_every=every,
                                              precision=precision, progress=False, out=out,
                                              seed=0)
                res = run(config)
                lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
            curve = [(m["step"], m["validation_loss"]) for m in map(json.loads, lines)
                     if m.get("validation_loss") is not None]
            curves[precision] = {"curve": curve, "final": res.final_validation_loss}
        target = curves["float32"]["final"] * 1.005
        reach = {p: first_at_or_below(c["curve"], target) for p, c in curves.items()}
        ratio = (reach["bf16"] / reach["float32"]) if reach["bf16"] and reach["float32"] else None
        results["models"][name] = {**curves, "target": target, "steps_to_target": reach,
                                   "bf16_over_float32": ratio}
        print(f"{name}: float32 final {curves['float32']['final']:.4f}, bf16 final "
              f"{curves['bf16']['final']:.4f}; steps to {target:.4f}: float32 {reach['float32']}, "
              f"bf16 {reach['bf16']} ({'n/a' if ratio is None else f'{ratio:.2f}x'})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
