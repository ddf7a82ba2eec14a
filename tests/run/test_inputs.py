"""Bad input never costs work: each of these is one line on stderr and exit status 2 before
anything is built, compiled or written (inputs that used to be tracebacks, silent or a
near-hang)."""

import pytest

from jphantom import cli
from helpers import child_env

LM = ["--layers", "1", "--hidden", "16", "--heads", "2", "--steps", "1", "--no-progress"]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "binary.dat").write_bytes(b"\x00\x01\x02\xff\xfe binary")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "both.toml").write_text("hidden = 64\n[model]\nhidden = 128\n")
    (tmp_path / "text.txt").write_text("some text\n" * 10)
    return tmp_path


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--out", "/proc/x", *LM], "out='/proc/x': '/proc' is not a folder this process"),
    (["train", "--save-gpt2", "/proc/x", "--out", "{t}/o", *LM], "save_hf='/proc/x'"),
    (["train", "--config", "{t}/binary.dat"], "is not a text (TOML) file"),
    (["train", "--config", "{t}/both.toml", "--out", "{t}/o"],
     "'hidden' is set twice, 64 and [model] hidden = 128"),
    (["train", "--data", "{t}/binary.dat", "--out", "{t}/o", *LM],
     "binary.dat' is not UTF-8 text (byte 3 is 0xff)"),
    (["train", "--data", "{t}/empty.txt", "--out", "{t}/o", *LM], "empty.txt' is empty"),
    (["train", "--context-attention", "all-gather", "--out", "{t}/o", *LM],
     "--context-attention applies to a mesh with a context axis"),
    (["train", "--no-load-balance", "--out", "{t}/o", *LM],
     "--no-load-balance applies to a mesh with a context axis"),
    (["train", "--model", "ffn", "--save-hf", "{t}/hf", "--out", "{t}/o"],
     "the ffn family has no Hugging Face format"),
    (["train", "--model", "ffn", "--heads", "2", "--out", "{t}/o"],
     "--heads does not apply to --model ffn; it applies to gpt2, llama"),
    (["tokenize", "{t}/empty.txt", "--out", "{t}/e.bin"], "empty.txt' is empty"),
    (["tokenize", "{t}/binary.dat", "--out", "{t}/b.bin"], "is not UTF-8 text"),
    (["tokenize", "{t}/text.txt", "--out", "/proc/x.bin"], "--out '/proc/x.bin': cannot write"),
    (["schedule", "--stages", "1000", "--microbatches", "1000"], "1,000,000 forward tasks"),
    (["train", "--model", "ffn", "--attention", "cudnn", "--out", "{t}/o"],
     "--attention cudnn does not apply to --model ffn: it has no attention"),
    (["train", "--model", "ffn", "--mesh", "context=2", "--out", "{t}/o"],
     "--mesh context=2 does not apply to --model ffn: it has no sequence to split"),
    (["train", "--moe-every", "1", "--dropless", "--capacity-factor", "2", "--out", "{t}/o",
      *LM], "--capacity-factor 2 does not apply with --dropless"),
    (["train", "--mesh", "stage=2,expert=2", "--moe-every", "2", "--layers", "2", "--strategy",
      "tensor", "--out", "{t}/o"], "--layers 2 with --moe-every 2 makes 1 group(s) of 2 blocks"),
])
def test_bad_input_is_one_line_before_any_work(argv, fragment, files, capsys):
    argv = [a.format(t=files) for a in argv]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert fragment in captured.err and captured.err.count("\n") == 1, captured.err
    assert not (files / "o").exists() and not (files / "hf").exists()


def test_tensorboard_with_an_out_folder_is_accepted():
    """``--tensorboard --out DIR`` used to be refused always: the built run copied the train
    section with ``out=None``."""
    pytest.importorskip("tensorboardX", reason="TensorBoard events need tensorboardX")
    from jphantom.config import RunConfig

    config = RunConfig.from_flags(tensorboard=True, out="out/tb", layers=1, hidden=16, heads=2)
    built = config.build()  # refused here before the fix
    assert (config.train.tensorboard, config.train.out) == (True, "out/tb")
    assert built.program.model_name == "gpt2" and dict(built.step.mesh.shape) == dict(built.mesh.shape)


def test_a_huge_capacity_factor_is_capped_at_the_tokens():
    """--capacity-factor 1e9 used to overflow into a traceback: an expert never takes more than
    the rank's T tokens, so the capacity is min(ceil(f T k / E), T)."""
    from jphantom.nn.routing import MoEConfig

    assert MoEConfig(16, 4, 2, 1e9).capacity(32) == 32
    assert MoEConfig(16, 4, 2, 1.0).capacity(32) == 16


@pytest.mark.slow  # a whole train run (test budget); the capacity rule above is the fix
def test_a_huge_capacity_factor_trains(tmp_path):
    assert cli.main(["train", "--capacity-factor", "1e9", "--moe-every", "1", *LM, "--out",
                     str(tmp_path / "o")]) == 0


def test_a_step_larger_than_the_device_is_one_line_before_anything_is_allocated(tmp_path,
                                                                                capsys):
    """The compiled step's own memory analysis (attention scores included: 64 x 2 heads x
    65536^2 float32) against the host's memory per simulated device, before the state exists;
    the estimate alone used to say it fits."""
    assert cli.main(["train", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq-len",
                     "65536", "--batch", "64", "--steps", "1", "--no-progress", "--out",
                     str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "XLA's memory analysis" in err and "temporaries" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_float_token_arrays_in_the_api_are_named():
    import numpy as np

    from jphantom.config import RunConfig

    config = RunConfig.from_flags(layers=1, hidden=16, heads=2, seq_len=8, batch=4, out=None)
    built = config.build()
    state = built.program.init(built.step)
    tokens = np.zeros((4, 8), np.float32)
    with pytest.raises(Exception, match="tokens are float32 values: a language model takes "
                                        "integer token ids"):
        built.step(state, tokens, tokens.astype(np.int32))


def test_float16_loss_scaling_on_bfloat16_parameters_is_refused():
    """It used to keep bfloat16 master weights without a word."""
    import optax

    import jphantom
    from jphantom.errors import ConfigError
    from flax import nnx

    from jphantom.models.llama import Llama, LlamaConfig, lm_loss

    model = Llama(LlamaConfig(vocab_size=32, hidden=16, intermediate=32, layers=1, heads=2,
                              kv_heads=2, dtype="bfloat16"), rngs=nnx.Rngs(0))
    from jphantom.runtime.mesh import MeshConfig, first_devices

    mesh = MeshConfig.parse("model=1").build(first_devices(1))
    with pytest.raises(ConfigError, match="parameters are bfloat16"):
        jphantom.make_train_step(model, mesh, optax.sgd(0.1), lm_loss, precision="float16")


def test_step_init_names_what_a_params_tree_lacks():
    """A params tree missing a subtree (or with a leaf of another shape) used to end in a
    tree-structure traceback from jax.device_put."""
    import jax
    import optax
    from flax import nnx

    import jphantom
    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import MeshConfig, first_devices
    from jphantom.models.llama import Llama, LlamaConfig, lm_loss

    model = Llama(LlamaConfig(vocab_size=32, hidden=16, intermediate=32, layers=1, heads=2,
                              kv_heads=2), rngs=nnx.Rngs(0))
    mesh = MeshConfig.parse("model=1").build(first_devices(1))
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), lm_loss)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    first = next(iter(params))
    lacking = {k: v for k, v in params.items() if k != first}
    with pytest.raises(ConfigError, match=rf"missing \d+ parameter\(s\) the model has \(\['{first}'\]"):
        step.init(lacking)
    (path, leaf), *_ = jax.tree_util.tree_flatten_with_path(params)[0]
    wrong = jax.tree_util.tree_map_with_path(lambda p, a: a[..., :1] if p == path else a, params)
    with pytest.raises(ConfigError, match=r"given to step.init has shape"):
        step.init(wrong)
    assert jax.tree.structure(step.init(params).params) == jax.tree.structure(params)


@pytest.mark.slow
def test_a_mesh_that_leaves_a_process_without_devices_is_one_line(capsys):
    """launch -n 3 with a mesh of 8 of the 12 devices: process 2 holds none (it used to fail
    with `ValueError: min() arg is an empty sequence`)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "jphantom", "launch", "-n", "3", "--devices-per-process",
               "4", "--", "jphantom", "train", "--strategy", "tensor", "--mesh", "data=8", *LM,
               "--out", "/tmp/unused-jphantom-out"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env=child_env())
    assert done.returncode == 1
    assert "process(es) 2 hold none of them" in done.stderr and "Traceback" not in done.stderr


def test_every_mixture_of_experts_gets_its_moe_line():
    """Qwen3-MoE and Mixtral (experts in every block, no capacity) printed no ``MoE:`` line where
    GPT-2's routed blocks did."""
    from types import SimpleNamespace

    from jphantom.cli.train import _moe_line

    qwen3_moe = SimpleNamespace(params=21632, moe=None, model={
        "name": "qwen3_moe", "experts": 4, "top_k": 2, "hidden": 16, "intermediate": 64,
        "layers": 1})
    assert _moe_line(qwen3_moe) == ("MoE: every block, 4 experts, top-2, 15,488 active "
                                    "parameters; dropless (no token-expert assignment dropped)")
    assert _moe_line(SimpleNamespace(params=10, moe=None,
                                     model={"name": "llama", "experts": 0})) is None


def test_forward_fn_and_a_user_loss_name_float_ids_and_a_wrong_params_tree():
    """Float token ids under a user's loss_fn (or make_forward_fn) used to end in jax's
    "indices must have an integer type"; a wrong params= in jax's device_put tree-prefix error."""
    import numpy as np
    import optax
    from flax import nnx

    import jphantom
    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import MeshConfig, first_devices
    from jphantom.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=32, hidden=16, intermediate=32, layers=1, heads=2,
                              kv_heads=2), rngs=nnx.Rngs(0))
    mesh = MeshConfig.parse("model=1").build(first_devices(1))
    tokens = np.zeros((2, 8), np.float32)
    float_ids = "batch array 0 holds float32 values where the model looks up integer ids"
    with pytest.raises(ConfigError, match=float_ids):
        jphantom.make_forward_fn(model, mesh)(tokens)
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.1), lambda m, x, y: m.loss(x, y))
    with pytest.raises(ConfigError, match=float_ids):
        step(step.init(), tokens, tokens.astype(np.int32))
    with pytest.raises(ConfigError, match=r"the parameters given to make_forward_fn's params= "
                                          r"are not the model's: missing \d+ parameter"):
        jphantom.make_forward_fn(model, mesh, params={"a": np.zeros(3)})


def test_a_truncated_llama_checkpoint_is_one_line(tmp_path):
    """The Llama loader reads through GPT-2's reader: a truncated model.safetensors used to be a
    26-line SafetensorError."""
    from flax import nnx

    from jphantom.errors import ConfigError
    from jphantom.models.llama import Llama, LlamaConfig
    from jphantom.models.llama.hf import load_hf, save_hf

    save_hf(tmp_path, Llama(LlamaConfig(vocab_size=32, hidden=16, intermediate=32, layers=1,
                                        heads=2, kv_heads=2), rngs=nnx.Rngs(0)))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match=r"cannot read .*model.safetensors as safetensors: "):
        load_hf(tmp_path)


def test_step_init_beyond_a_devices_memory_is_refused_with_the_estimate(monkeypatch):
    """A width-2**20 phantom FFN's init used to die in RESOURCE_EXHAUSTED (137 GB) with no
    estimate: the parameters and optimizer state are counted from the abstract state (nothing
    allocated) and refused by name above what a device holds (here a limit the test sets)."""
    import optax

    from jphantom.registry import program
    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import first_devices
    from jphantom.models.ffn import FFNConfig
    from jphantom.step import memory

    built = program.build(FFNConfig(width=64, depth=2, ghost_width=2), "phantom", "model=2")
    step = built.train_step(built.mesh.build(first_devices(2)), optax.adam(1e-3))
    monkeypatch.setattr(memory, "device_memory", lambda mesh: (2**14, "a test's limit"))
    creators = []
    monkeypatch.setattr(type(step), "_creator", lambda *a: creators.append(a))
    with pytest.raises(ConfigError, match=r"step.init: the parameters \(.* GiB\) and optimizer "
                                          r"state \(.* GiB\) need .* GiB per device, before "
                                          r".* one device holds \(a test's limit\): shard the "
                                          r"optimizer state \(zero=1"):
        built.init(step)
    assert not creators  # refused before the parameters' creation was even compiled


@pytest.mark.parametrize("rate", [-0.1, float("nan")])
def test_a_negative_or_nan_learning_rate_jphantom_can_read_is_refused_at_init(rate):
    """optax.sgd(-0.1) trained by gradient ascent without a word. A rate in an
    inject_hyperparams state is read at init; a plain transformation's is in a closure."""
    import optax

    from jphantom.registry import program
    from jphantom.errors import ConfigError
    from jphantom.runtime.mesh import first_devices
    from jphantom.models.ffn import FFNConfig

    built = program.build(FFNConfig(width=8, depth=1), "dense", "model=1")
    mesh = built.mesh.build(first_devices(1))
    optimizer = optax.chain(optax.clip(1.0), optax.inject_hyperparams(optax.sgd)(learning_rate=rate))
    with pytest.raises(ConfigError, match=f"the optimizer's learning_rate is {rate:g} "
                                          r"\(its optax.inject_hyperparams state.*\): give a "
                                          "positive, finite learning rate"):
        built.init(built.train_step(mesh, optimizer))
    good = optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(0.0, 0.1, 4))
    built.init(built.train_step(mesh, good))  # a warm-up from 0 is fine


def test_the_cli_drops_only_the_cuda_plugins_start_up_lines(capfd):
    """Without a GPU the CUDA plugin of jphantom[aot] logs 'Could not find cuda drivers' at
    jax's start (tests/compile/test_aot.py runs the command); every other line written then is kept."""
    import os

    from jphantom.cli.quiet import filtered_stderr, missing_gpu

    with filtered_stderr():
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are "
                    b"written to STDERR\nI0000 cudart_stub.cc:31] Could not find cuda drivers "
                    b"on your machine, GPU will not be used.\nsomething else\n")
    assert capfd.readouterr().err == "something else\n"
    assert not missing_gpu({"JAX_PLATFORMS": "cuda"})  # the user's choice is kept


def test_the_cli_drops_only_the_rocm_plugins_declining_record():
    """Without /dev/kfd, jphantom[rocm]'s plugin declines with a logged traceback at every jax
    start: that record, and no other, is dropped."""
    import logging

    from jphantom.rocm.shim import LOGGER, PluginDeclined

    def record(message, *args):
        return logging.LogRecord(LOGGER, logging.ERROR, __file__, 1, message,
                                 args, None)

    declined = record("Jax plugin configuration error: Exception when calling %s.initialize()",
                      "jax_plugins.xla_rocm7")
    other = record("Jax plugin configuration error: Exception when calling %s.initialize()",
                   "jax_plugins.xla_cuda12")
    assert [PluginDeclined().filter(r) for r in (declined, other)] == [False, True]


def test_the_plan_states_the_configurations_dtd_rule():
    """plans.megatron(dtd=True) on a model without routed MoE layers: the one dtd rule
    (jphantom.registry.strategies.check_dtd), with its one message."""
    from flax import nnx

    import jphantom
    from jphantom.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dtd \(--dtd, duplicate token dropping\) applies to "
                                          "routed MoE blocks"):
        jphantom.plans.megatron(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), dtd=True)
