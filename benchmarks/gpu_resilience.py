"""One GPU: a run's failure paths on the device a user trains on (the device check of
the resilience paths).

Three checks, each a ``python -m jphantom train`` process of its own:

``memory``      a Llama whose compiled step needs more than the device holds (S = 16384, batch
                128, hidden 2048): ``train`` must end with exit 2 and one line naming the compiled
                step's figures against the device's ``memory_stats()['bytes_limit']``, before the
                first step allocates (no ``RESOURCE_EXHAUSTED``); we record the seconds to that line
``preempt``     a small Llama trained for many steps; SIGTERM once 3 steps are in metrics.jsonl:
                exit 143, a checkpoint of the step reached, results.json with ``stopped_by``;
                ``--resume`` finishes the run
``reference``   the same run uninterrupted, twice: its final validation loss against the resumed
                one's, and against itself (how far two runs of one program drift on the device)

On CPU (``--small``) the same checks run against host memory, at smaller shapes.

Usage::

    PYTHONPATH=. python benchmarks/gpu_resilience.py --out DIR     # one GPU, about a minute
    PYTHONPATH=. python benchmarks/gpu_resilience.py --deterministic --out DIR2  # deterministic ops
    python benchmarks/gpu_resilience.py --small --out /tmp/r        # CPU

Writes ``DIR/gpu_resilience.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# needs far more than 141 GiB per device: activations of 128 x 16384 x 2048 alone are 16 GiB each
HUGE = ["--layers", "4", "--hidden", "2048", "--heads", "16", "--seq-len", "16384", "--batch", "128",
        "--vocab", "32000"]
HUGE_SMALL = ["--layers", "2", "--hidden", "1024", "--heads", "8", "--seq-len", "8192", "--batch",
              "256", "--vocab", "4096"]
RUN = ["--layers", "2", "--hidden", "256", "--heads", "4", "--seq-len", "256", "--batch", "8",
       "--vocab", "4096"]
RUN_SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len", "16", "--batch", "4",
             "--vocab", "256"]


def _train(*flags, **popen):
    command = [sys.executable, "-m", "jphantom", "train", "--model", "llama", *flags, "--no-progress"]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, **popen)


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def memory(huge) -> dict:
    start = time.monotonic()
    proc = _train(*huge, "--steps", "2", "--out", "/tmp/jphantom-gpu-resilience-huge")
    _, err = proc.communicate(timeout=600)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return {"flags": huge, "exit": proc.returncode, "seconds": round(time.monotonic() - start, 1),
            "lines": len(lines), "last_line": lines[-1] if lines else "",
            "resource_exhausted": "RESOURCE_EXHAUSTED" in err,
            # which check refused it: the estimate before compiling, or the compiled step's analysis
            "check": "compiled" if "compiled step" in err else "estimate",
            "ok": proc.returncode == 2 and "needs" in (lines[-1] if lines else "")
            and "RESOURCE_EXHAUSTED" not in err}


def preempt(run, folder: Path) -> dict:
    steps = ["--steps", "300", "--eval-every", "300", "--eval-batches", "2", "--precision", "bf16"]
    ck, out, ref = folder / "ck", folder / "out", folder / "reference"
    proc = _train(*run, *steps, "--checkpoint-dir", str(ck), "--out", str(out))
    start = time.monotonic()
    while len(_metrics(out)) < 3 and proc.poll() is None and time.monotonic() - start < 300:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=300)
    stopped_s = time.monotonic() - sent
    reached = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    record = {"flags": run + steps, "exit": proc.returncode, "seconds_to_stop": round(stopped_s, 2),
              "last_line": err.strip().splitlines()[-1] if err.strip() else "",
              "steps_done": reached.get("steps_done"), "stopped_by": reached.get("stopped_by"),
              "checkpoint_steps": (reached.get("checkpoints") or {}).get("steps")}
    resumed = _train(*run, *steps, "--checkpoint-dir", str(ck), "--out", str(out), "--resume")
    _, err = resumed.communicate(timeout=600)
    record["resume_exit"] = resumed.returncode
    uninterrupted = _train(*run, *steps, "--out", str(ref))
    _, err2 = uninterrupted.communicate(timeout=600)
    record["reference_exit"] = uninterrupted.returncode
    # the same uninterrupted run again: how far two runs of one program drift apart on this device
    again = _train(*run, *steps, "--out", str(folder / "again"))
    again.communicate(timeout=600)
    if again.returncode == 0 and uninterrupted.returncode == 0:
        record["run_to_run_abs_difference"] = abs(
            json.loads((folder / "again" / "results.json").read_text())["final_validation_loss"]
            - json.loads((ref / "results.json").read_text())["final_validation_loss"])
    if resumed.returncode == 0 and uninterrupted.returncode == 0:
        a = json.loads((out / "results.json").read_text())["final_validation_loss"]
        b = json.loads((ref / "results.json").read_text())["final_validation_loss"]
        record.update(resumed_final_validation_loss=a, reference_final_validation_loss=b,
                      abs_difference=abs(a - b))
    else:
        record["stderr_tail"] = (err + err2)[-2000:]
    record["ok"] = (proc.returncode == 143 and record["stopped_by"] == "SIGTERM"
                    and record["checkpoint_steps"] == [record["steps_done"]]
                    and record.get("abs_difference") is not None)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="CPU shapes")
    parser.add_argument("--deterministic", action="store_true",
                        help="XLA_FLAGS=--xla_gpu_deterministic_ops=true for every run")
    args = parser.parse_args(argv)
    if args.deterministic:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_deterministic_ops=true").strip()
    args.out.mkdir(parents=True, exist_ok=True)
    import jax

    device = jax.devices()[0]
    result = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    result["memory"] = (memory(HUGE_SMALL if args.small else HUGE) if not args.deterministic
                        else {"ok": True, "skipped": "--deterministic runs the preemption only"})
    print(json.dumps(result["memory"]), flush=True)
    result["preempt"] = preempt(RUN_SMALL if args.small else RUN, args.out / "runs")
    print(json.dumps(result["preempt"]), flush=True)
    (args.out / "gpu_resilience.json").write_text(json.dumps(result, indent=1))
    ok = result["memory"]["ok"] and result["preempt"]["ok"]
    print(f"{result['device']}: memory check {'ok' if result['memory']['ok'] else 'FAILED'}, "
          f"preemption {'ok' if result['preempt']['ok'] else 'FAILED'}; wrote "
          f"{args.out / 'gpu_resilience.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
