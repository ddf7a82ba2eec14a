"""``jphantom launch`` + ``jphantom train`` across processes (issue 12): 2 processes x 4 devices
train the tensor-parallel GPT exactly as 1 process x 8 devices, step for step, loss and
parameters; process 0 alone writes the outputs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

TRAIN = ["jphantom", "train", "--model", "transformer", "--strategy", "tensor",
         "--mesh", "data=2,model=4", "--layers", "2", "--hidden", "32", "--heads", "4",
         "--seq-len", "16", "--batch", "8", "--steps", "4", "--eval-every", "2",
         "--eval-batches", "1", "--no-progress", "--optimizer", "sgd", "--learning-rate", "0.1"]
# SGD: Adam would turn the rounding noise of gradients that are exactly zero in exact arithmetic
# (the key bias: softmax ignores it) into lr-sized steps of either sign


def _run(command, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


@pytest.mark.slow  # two trainings, three processes: ~40 s
def test_two_processes_train_the_tensor_gpt_exactly_as_one(tmp_path):
    from safetensors.numpy import load_file

    one = tmp_path / "one"
    _run([sys.executable, "-m", "jphantom.cli", *TRAIN[1:], "--devices", "8", "--out", str(one),
          "--save-gpt2", str(one / "gpt2")], tmp_path)
    two = tmp_path / "two"
    launched = _run([sys.executable, "-m", "jphantom.cli", "launch", "-n", "2",
                     "--devices-per-process", "4", "--", *TRAIN, "--out", str(two),
                     "--save-gpt2", str(two / "gpt2")], tmp_path)
    assert launched.stdout.count("wrote ") == 1  # process 0 alone
    a = json.loads((one / "results.json").read_text())
    b = json.loads((two / "results.json").read_text())
    assert len(b["devices"]) == 8
    np.testing.assert_allclose(b["history"]["train_loss"], a["history"]["train_loss"], rtol=1e-6)
    pa, pb = load_file(one / "gpt2" / "model.safetensors"), load_file(
        two / "gpt2" / "model.safetensors")
    assert set(pa) == set(pb)
    for name in pa:  # norm-wise relative, float32 1e-6
        scale = max(float(np.max(np.abs(pa[name]))), 1e-30)
        assert float(np.max(np.abs(pb[name] - pa[name]))) <= 1e-6 * scale, name
