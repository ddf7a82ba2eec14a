"""``jphantom train`` (jphantom.loop.trainer) and ``jphantom inspect --model transformer``, end to end at
tiny sizes: outputs, TOML settings, and bad input refused before anything compiles."""

import json

import pytest

from jphantom import cli
from jphantom.errors import ConfigError
from jphantom.config import RunConfig, load_toml

from helpers import exit_code

# The README's first run (its model, shapes and mesh) for 3 steps: the suite's compilation cache
# serves the steps tests/test_docs.py compiled for the README (the step count is not in them)
TINY = ["--model", "gpt2", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
        "--batch", "8", "--steps", "3", "--eval-every", "2", "--eval-batches", "1",
        "--no-progress"]


def test_train_transformer_writes_results_metrics_and_curves(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", "--strategy", "tensor", "--mesh", "data=2,model=4",
                     "--sequence-parallel", *TINY, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["strategy"] == "tensor" and results["mesh"] == "data=2,model=4"
    assert results["history"]["validation_step"] == [2, 3]
    assert results["final_validation_loss"] == results["history"]["validation_loss"][-1]
    assert 2.9 < results["unigram_cross_entropy"] < 3.6  # nats per byte of the stdlib corpus
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert all(line["tokens_per_second"] > 0 for line in lines)
    assert (out / "curves.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "unigram cross-entropy" in printed and "ratio" in printed


def test_train_settings_come_from_toml_and_flags_override(tmp_path):
    """The settings ``jphantom train`` builds its run from (a TOML file training end to end:
    tests/test_docs.py::test_example_toml_trains)."""
    from jphantom.cli.parser import run_settings
    from jphantom.cli.train import TRAIN_DEFAULTS

    toml = tmp_path / "run.toml"
    toml.write_text('model = "ffn"\nstrategy = "phantom"\nghost-width = 2\nwidth = 32\n'
                    'mesh = "model=4"\nsteps = 2\nbatch = 8\neval_every = 1\n'
                    'eval_batches = 1\nprogress = false\nlearning_rate = 0.5\n')
    args = cli.build_parser().parse_args(["train", "--config", str(toml), "--learning-rate",
                                          "0.01"])
    config = RunConfig.from_flags(**run_settings(args, TRAIN_DEFAULTS)).flat()
    assert (config["model"], config["ghost_width"], config["width"]) == ("ffn", 2, 32)
    assert config["learning_rate"] == 0.01  # the flag wins over the file
    with pytest.raises(ConfigError, match="unknown settings \\['colour'\\]"):
        toml.write_text('colour = "blue"\n')
        load_toml(str(toml))


@pytest.mark.parametrize("settings, message", [
    (dict(strategy="tensor", mesh="model=8", heads=4), "heads=4 is not divisible"),
    (dict(strategy="phantom", mesh="model=4"), "needs ghost_width"),
    (dict(batch=0), "batch=0 must be at least 1"),
    (dict(strategy="tensor", mesh="data=3,model=1", batch=16),
     "batch=16 is not divisible by the data axis"),
    (dict(mesh="pipeline=2"), "unknown mesh axis 'pipeline'"),
    (dict(dtype="float16"), "float16"),
    (dict(learning_rate=float("inf")), "learning_rate=inf"),
    (dict(model="cnn"), "model='cnn'"),
    (dict(mesh="model=16", strategy="tensor"), "needs 16 devices"),
    (dict(from_gpt2="x", strategy="phantom", ghost_width=2), "x/config.json not found"),
])
def test_bad_run_settings_are_refused_before_training(settings, message):
    """``RunConfig.from_flags`` takes the command line's flat names (``from_gpt2`` is GPT-2's
    name for ``from_hf``); each bad value is refused by name on construction."""
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_flags(**settings).build()  # construction, or the explicit build


def test_cli_train_reports_a_bad_setting_in_one_line(tmp_path, capsys):
    code = cli.main(["train", "--strategy", "tensor", "--mesh", "model=8", "--heads", "3",
                     "--hidden", "24", "--out", str(tmp_path / "x")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("jphantom: error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()  # nothing ran


def test_inspect_transformer_groups_collectives_by_mesh_axis(capsys):
    assert cli.main(["inspect", "--model", "transformer", "--layers", "2", "--hidden", "16",
                     "--heads", "4", "--seq-len", "8", "--vocab", "32", "--batch", "4",
                     "--strategy", "tensor", "--mesh", "data=2,model=4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {(row["kind"], tuple(row["axes"])): row for row in report["collectives"]}
    tokens, hidden = 2 * 8, 16  # per data rank: batch 4 / data 2, seq 8
    model_all_reduce = rows[("all-reduce", ("model",))]
    # per block 2 forward + 2 backward of B*S*h (x 2 blocks, loop trip counts applied), embedding,
    # head, and 3 per-token scalars of the vocabulary-parallel cross-entropy
    assert model_all_reduce["count"] == 4 * 2 + 2 + 3 - 1  # XLA fuses the head's and one scalar's
    assert model_all_reduce["bytes"] == 4 * (tokens * hidden * (4 * 2 + 2) + 3 * tokens)
    assert rows[("all-reduce", ("data",))]["count"] == 1  # one gradient reduction per step


@pytest.mark.parametrize("flag, value, message", [
    ("--out", "{file}/results", "is not a folder this process can write in"),
    ("--checkpoint-dir", "{file}", "is an existing file"),
    ("--save-hf", "{file}/hf", "is not a folder this process can write in"),
    ("--data", "{tmp}/missing.txt", "is not a readable file"),
])
def test_paths_are_checked_before_anything_trains(tmp_path, capsys, flag, value, message):
    """An output folder that cannot be written (under a file) or a data file that is missing is
    one line and exit 2 before the model is built, not a traceback after the run."""
    existing = tmp_path / "a_file"
    existing.write_text("x")
    value = value.format(file=existing, tmp=tmp_path)
    argv = ["train", "--model", "gpt2", "--layers", "1", "--hidden", "16", "--heads", "2",
            "--seq-len", "8", "--steps", "1", "--no-progress", "--out", str(tmp_path / "out"),
            flag, value]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out" / "results.json").exists()


def test_inspect_validates_what_train_validates(capsys):
    """``inspect`` builds the same RunConfig as ``train``: a mesh, ZeRO or schedule the strategy
    cannot use is the same one-line error, never a silent one-device report."""
    argv = ["--strategy", "dense", "--mesh", "data=8", "--zero", "3", "--devices", "8"]
    assert exit_code(["inspect", *argv]) == 2
    inspect_error = capsys.readouterr().err.strip()
    assert exit_code(["train", *argv, "--no-progress", "--out", "none"]) == 2
    assert capsys.readouterr().err.strip() == inspect_error
    assert len(inspect_error.splitlines()) == 1 and "runs on one device" in inspect_error


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_inspect_labels_cpu_bytes_of_16_bit_collectives_and_an_empty_breakdown(capsys):
    """Honest labels: a bfloat16 step compiled for CPU says its collectives' bytes are the CPU
    program's (XLA:CPU upcasts 16-bit collectives); --breakdown without a data axis says there
    is nothing to break down instead of timing nothing."""
    gpt = ["inspect", "--model", "gpt2", "--strategy", "tensor", "--layers", "1", "--hidden", "16",
           "--heads", "4", "--seq-len", "8", "--batch", "8", "--devices", "8"]
    assert cli.main([*gpt, "--mesh", "data=2,model=4", "--precision", "bf16", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert len(notes) == 1 and "XLA:CPU" in notes[0]
    assert cli.main([*gpt, "--mesh", "model=4", "--breakdown"]) == 0
    printed = capsys.readouterr().out
    assert "nothing to break down" in printed and "breakdown tensor:" not in printed


def test_a_user_callback_sees_every_step_stops_the_run_and_adds_to_the_results(tmp_path):
    """Trainer(config, callbacks=[...]): the user's callback gets each step's record after the
    built-in ones (metrics.jsonl has the line already), its request_stop ends the run after that
    step with a checkpoint of it, and on_train_end may add to results.json."""
    from jphantom.loop.callbacks import Callback
    from jphantom.loop.trainer import Trainer

    class StopAt(Callback):
        def __init__(self):
            self.seen, self.closed = [], False

        def on_train_start(self, trainer):
            assert trainer.first_step == 0 and trainer.state is not None

        def on_step_end(self, trainer, record):
            self.seen.append(record["step"])
            assert len((trainer.out / "metrics.jsonl").read_text().splitlines()) == record["step"]
            if record["step"] == 2:
                trainer.request_stop("StopAt(2)")

        def on_train_end(self, trainer, results):
            results.extra["seen"] = list(self.seen)

        def close(self):
            self.closed = True

    config = RunConfig.from_flags(model="gpt2", layers=1, hidden=16, heads=4, seq_len=16,
                                  batch=4, vocab=256, steps=50, eval_every=50, eval_batches=1,
                                  out=str(tmp_path / "out"), progress=False,
                                  checkpoint_dir=str(tmp_path / "ck"))
    stop = StopAt()
    results = Trainer(config, callbacks=[stop]).fit()
    assert stop.seen == [1, 2] and stop.closed
    assert results.stopped_by == "StopAt(2)" and results.steps_done == 2
    assert not results.interrupted and results.checkpoints["steps"] == [2]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["seen"] == [1, 2]
    with pytest.raises(ConfigError, match="subclass Callback"):
        Trainer(config, callbacks=[lambda trainer, record: None])


def test_a_run_configuration_is_pure_data(monkeypatch):
    """Constructing a RunConfig validates it without jax's devices or the file system (a missing
    --from-hf folder is found by build(), the explicit next step); it pickles and compares by
    value."""
    import pickle

    import jax

    def no_devices(*args, **kwargs):
        raise AssertionError("a configuration asked jax for its devices")

    for name in ("devices", "device_count", "local_devices"):
        monkeypatch.setattr(jax, name, no_devices)
    config = RunConfig.from_flags(model="llama", strategy="tensor", mesh="data=2,model=2",
                                  layers=2, hidden=32, heads=4, kv_heads=2, from_hf="/nowhere")
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(ConfigError, match="heads=4 is not a multiple of kv_heads=3"):
        RunConfig.from_flags(model="llama", kv_heads=3)  # the family's own rules: no jax either
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="config.json not found"):
        config.build()


# constructs what the command line constructs, in a process of its own (one: fast)
NO_JAX = """
import sys

from jphantom.registry import families
from jphantom.config import ModelConfig, RunConfig, load_toml

for name in families.names(aliases=True):
    RunConfig(model=ModelConfig(name=name))
RunConfig.from_flags(model="llama", strategy="tensor", mesh="data=2,model=2", layers=2,
                     hidden=32, heads=4, kv_heads=2, zero=1, precision="bf16",
                     remat="collectives_saveable", attention="xla", save_hf="out/hf")
RunConfig.from_flags(model="qwen3", strategy="tensor", mesh="data=2,context=2",
                     context_attention="all-gather", accumulate=2, clip_norm=1.0)
RunConfig.from_flags(model="ffn", strategy="phantom", mesh="stage=2,model=2", ghost_width=4,
                     schedule="zb-h1", on_nonfinite="skip", optimizer="sgd")
RunConfig.from_flags(**load_toml(sys.argv[1]))
print(sorted(name for name in ("jax", "flax", "numpy") if name in sys.modules))
"""


def test_constructing_a_configuration_imports_neither_jax_nor_flax(tmp_path):
    """Configuration is data: a fresh process that constructs the model section of
    every registered family and the run configurations around them (every section, a TOML
    file's settings) imports neither jax, flax nor numpy; they come with ``build()``."""
    import subprocess
    import sys

    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nname = "mistral"\nsliding_window = 4\n[parallel]\n'
                    'strategy = "pmm3d"\nmesh = "z=2,x=2"\n[train]\nbatch = 8\n')
    done = subprocess.run([sys.executable, "-c", NO_JAX, str(toml)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"constructing a configuration imported {done.stdout}"


def test_a_train_command_builds_its_configuration_once(tmp_path, monkeypatch):
    """``jphantom train`` builds the program and step once (``RunConfig.build``: the command
    checks the shapes with it and the Trainer trains with the same ``Built``), where the command,
    the Trainer and its memory check used to build three times."""
    from jphantom import cli

    calls = []
    build = RunConfig.build
    monkeypatch.setattr(RunConfig, "build", lambda self: calls.append(self) or build(self))
    assert cli.main(["train", "--model", "ffn", "--strategy", "tensor", "--width", "8",
                     "--mesh", "model=2", "--batch", "8", "--steps", "2", "--eval-every", "2",
                     "--no-progress", "--out", str(tmp_path / "out")]) == 0
    assert len(calls) == 1

