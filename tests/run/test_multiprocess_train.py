"""``jphantom launch`` + ``jphantom train`` across processes: 2 processes x 4 devices
train phantom and the tensor-parallel GPT exactly as 1 process x 8 devices, step for step, loss
and parameters; process 0 alone writes the outputs."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import child_env

# SGD: Adam would turn the rounding noise of gradients that are exactly zero in exact arithmetic
# (the GPT's key bias: softmax ignores it) into lr-sized steps of either sign
COMMON = ["--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--no-progress",
          "--optimizer", "sgd", "--learning-rate", "0.1", "--save-every", "4"]
RUNS = {
    "phantom": ["--model", "ffn", "--strategy", "phantom", "--ghost-width", "2",
                "--mesh", "data=2,model=4", "--width", "32", "--batch", "16"],
    "tensor-gpt": ["--model", "transformer", "--strategy", "tensor", "--mesh", "data=2,model=4",
                   "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16",
                   "--batch", "8"],
}


def _run(command, cwd):
    env = child_env()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def _params(folder):
    import orbax.checkpoint as ocp

    path = folder / "ckpt" / "4" / "state"
    checkpointer = ocp.StandardCheckpointer()
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one_device),
                          checkpointer.metadata(path).item_metadata.tree)
    return jax.tree.map(np.asarray, checkpointer.restore(path, target)["params"])


@pytest.mark.slow  # two trainings, three processes each: ~25 s
@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_train_exactly_as_one(name, tmp_path):
    train = ["train", *RUNS[name], *COMMON]
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, "-m", "jphantom.cli", *train, "--devices", "8", "--out", str(one),
          "--checkpoint-dir", str(one / "ckpt")], tmp_path)
    launched = _run([sys.executable, "-m", "jphantom.cli", "launch", "-n", "2",
                     "--devices-per-process", "4", "--", "jphantom", *train, "--out", str(two),
                     "--checkpoint-dir", str(two / "ckpt")], tmp_path)
    assert launched.stdout.count("wrote ") == 1  # process 0 alone
    a = json.loads((one / "results.json").read_text())
    b = json.loads((two / "results.json").read_text())
    assert len(b["devices"]) == 8
    np.testing.assert_allclose(b["history"]["train_loss"], a["history"]["train_loss"], rtol=1e-6)
    pa, pb = _params(one), _params(two)
    for path, x in jax.tree_util.tree_flatten_with_path(pa)[0]:  # norm-wise relative, 1e-6
        y = pb
        for key in path:
            y = y[key.key]
        assert np.max(np.abs(y - x)) <= 1e-6 * max(np.max(np.abs(x)), 1e-30), path
