"""The model-family registry (jphantom.registry.families): a family declared in this file, touching
no library file, runs through ``train``, ``inspect``, ``verify``, ``plan`` and ``compile``; every
zoo family is exact against its own one-device run under the strategies it declares (one cell
per family in ``make test``, the rest of the matrix in ``make test-all``); the CLI, the
configuration, the metrics and ``models.hf`` read the registry."""

import dataclasses
import json
from pathlib import Path

import jax
import optax
import pytest
from flax import nnx

from jphantom.costs import aot
from jphantom.cli import main
from jphantom.errors import ConfigError
from jphantom.registry import families

from conftest import require_devices

# ------------------------------------------------------------------------------------------------
# A user's family, declared here
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 64
    hidden: int = 16
    seq_len: int = 8
    dtype: str = "float32"


class ToyLM(nnx.Module):
    """An embedding, one residual GELU MLP and an untied head."""

    def __init__(self, config: ToyConfig, *, rngs: nnx.Rngs):
        self.config = config
        h, v = config.hidden, config.vocab_size
        self.embed = nnx.Embed(v, h, rngs=rngs)
        self.up = nnx.Linear(h, 4 * h, rngs=rngs)
        self.down = nnx.Linear(4 * h, h, rngs=rngs)
        self.head = nnx.Linear(h, v, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.down(jax.nn.gelu(self.up(x))))

    def loss(self, tokens, targets):
        return optax.softmax_cross_entropy_with_integer_labels(self(tokens), targets).mean()


def _toy_plan_shape(config):
    from jphantom.perf.axonn_model import GPTShape

    return GPTShape(1, config.hidden, 1, config.seq_len, config.vocab_size, model="toy")


TOY = families.Family(
    name="toy", description="a test's toy language model", config_type=ToyConfig, module=ToyLM,
    from_flags=lambda section, phantom: ToyConfig(section.vocab, section.hidden, section.seq_len,
                                                  section.dtype),
    common_flags=("hidden", "seq_len", "vocab", "dtype"), strategies=("dense", "gspmd", "tensor"),
    flops_per_token=lambda config, seq_len: 6 * (8 * config.hidden ** 2
                                                 + config.hidden * config.vocab_size),
    plan_shape=_toy_plan_shape)

TOY_FLAGS = ["--model", "toy", "--hidden", "16", "--seq-len", "8", "--vocab", "256"]


@pytest.fixture
def toy():
    families.register(TOY, replace=True)
    yield TOY
    families.unregister("toy")


def test_a_family_declared_in_a_test_trains_inspects_and_verifies(toy, tmp_path, capsys):
    require_devices(4)
    out = tmp_path / "run"
    assert main(["train", *TOY_FLAGS, "--strategy", "tensor", "--mesh", "data=2,model=2",
                 "--batch", "4", "--steps", "2", "--eval-every", "2",
                 "--eval-batches", "1", "--out", str(out), "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["model"]["name"] == "toy" and results["model"]["hidden"] == 16
    capsys.readouterr()
    assert main(["inspect", *TOY_FLAGS, "--strategy", "tensor", "--mesh", "data=2,model=2",
                 "--batch", "4", "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["strategy"] == "tensor" and inspected["collectives"]
    assert main(["verify", *TOY_FLAGS, "--strategy", "tensor", "--mesh", "data=2,model=2",
                 "--batch", "4", "--json"]) == 0
    verified = json.loads(capsys.readouterr().out)
    assert verified["ok"] and verified["worst"]["error"] <= 1e-5
    # what the family does not declare is refused by name, before anything is built
    for flags, match in ((["--strategy", "phantom", "--ghost-width", "2"], "ghost-width"),
                         (["--strategy", "pmm3d"], "does not run the model family 'toy'"),
                         (["--kv-heads", "2"], "kv-heads does not apply to --model toy")):
        assert main(["verify", *TOY_FLAGS, *flags, "--batch", "4"]) == 2
        assert match in capsys.readouterr().err


def test_a_family_owns_its_model_fields_and_the_flags_derive_from_them():
    """The model section's family-specific fields are the families' declarations (default, help
    prefixed with the families that read it, least value), so are inspect's flags; a field
    declared twice differently, a common name declared again, or a new field once the section
    is built is refused by name."""
    from jphantom.cli.step_defaults import INSPECT_FLAGS
    from jphantom.config import ModelConfig
    from jphantom.models.llama.family import SLIDING_WINDOW

    field = {f.name: f for f in dataclasses.fields(ModelConfig)}["sliding_window"]
    assert field.default is None and "sliding_window" in INSPECT_FLAGS
    assert field.metadata["help"] == "mistral, gemma3: " + SLIDING_WINDOW.help
    with pytest.raises(ConfigError, match="sliding_window=0 must be at least 1"):
        ModelConfig(name="mistral", sliding_window=0)
    with pytest.raises(ConfigError, match="--sliding-window does not apply to --model qwen2; "
                                          "it applies to mistral, gemma3"):
        ModelConfig(name="qwen2", sliding_window=8)
    late = dataclasses.replace(TOY, fields=(families.Field("rank", int, 4, "a late field"),))
    with pytest.raises(ConfigError, match=r"declares the model field\(s\) \['rank'\] after"):
        families.register(late, replace=True)
    twice = dataclasses.replace(TOY, fields=(dataclasses.replace(SLIDING_WINDOW, default=8),))
    with pytest.raises(ConfigError, match="'sliding_window' differently from family 'mistral'"):
        families.register(twice, replace=True)
    with pytest.raises(ConfigError, match="fields are jphantom.registry.families.Field declarations"):
        dataclasses.replace(TOY, fields=(families.Field("hidden", int, 4, "h"),))
    assert "toy" not in families.names()


def test_a_family_declared_in_a_test_is_planned(toy, capsys):
    assert main(["plan", *TOY_FLAGS, "--layers", "1", "--heads", "1", "--devices", "8",
                 "--batch", "8", "--json", "--top", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["assumptions"]["model"]["model"] == "toy"
    assert result["rows"]


@pytest.mark.skipif(aot.plugin_problem("gpu") is not None,
                    reason="needs the GPU compiler (make test-aot)")
def test_a_family_declared_in_a_test_compiles_for_h100(toy, tmp_path, capsys, monkeypatch):
    import os

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    assert main(["compile", "--target", "gpu:h100", *TOY_FLAGS, "--batch", "16",
                 "--strategy", "tensor", "--mesh", "data=1,model=8", "--out",
                 str(tmp_path / "c"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"] == "tensor"


# ------------------------------------------------------------------------------------------------
# The zoo through the registry
# ------------------------------------------------------------------------------------------------


def test_the_registry_names_the_zoo_and_its_checkpoints():
    assert families.names()[:8] == ("ffn", "gpt2", "llama", "mistral", "qwen2", "qwen3",
                                  "qwen3_moe", "gemma3")
    assert families.get("transformer").name == "gpt2" and families.get("gemma3_text").name == "gemma3"
    assert set(families.hf_types()) >= {"gpt2", "llama", "mixtral", "mistral", "qwen2", "qwen3",
                                      "qwen3_moe", "gemma3_text"}
    with pytest.raises(ConfigError, match="not a model family; use one of ffn, gpt2"):
        families.get("qwen4")
    with pytest.raises(ConfigError, match="registered already"):
        families.register(dataclasses.replace(families.get("qwen3")))
    from jphantom.config import RunConfig

    for name, kind in (("qwen3", "qwen3"), ("gemma3", "gemma3_text"), ("mistral", "mistral"),
                       ("llama", "llama")):
        config = RunConfig.from_flags(model=name, layers=2, hidden=64, heads=4, seq_len=32,
                                      vocab=128).family_config()
        assert config.model_type == kind and families.of_config(config).name == name


@pytest.mark.parametrize("name, expect", [
    ("qwen3", "qk_norm"), ("qwen2", "qkv_bias"), ("gemma3", "norm_offset"),
    ("qwen3_moe", "experts")])
def test_the_presets_from_flags(name, expect):
    from jphantom.config import RunConfig
    from jphantom.costs.metrics import flops_per_token

    moe = {"experts": 4} if name == "qwen3_moe" else {}
    config = RunConfig.from_flags(model=name, layers=6, hidden=64, heads=4, kv_heads=2,
                                  seq_len=32, vocab=128, **moe).family_config()
    assert getattr(config, expect)
    if name == "gemma3":  # five local layers for each global one
        assert config.layer_types[-1] == "full_attention" and config.layer_types.count(
            "sliding_attention") == 5
    assert flops_per_token(config, "tensor", 32) > 6 * config.vocab_size * config.hidden


def test_a_checkpoint_of_another_family_names_the_model_that_reads_it():
    from pathlib import Path

    from jphantom.config import RunConfig

    qwen3 = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen3"
    with pytest.raises(ConfigError, match="pass --model qwen3"):
        RunConfig.from_flags(model="llama", from_hf=str(qwen3)).family_config()
    with pytest.raises(ConfigError, match="pass --model qwen3"):
        RunConfig.from_flags(model="gpt2", from_hf=str(qwen3)).family_config()


QWEN2 = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2"


@pytest.mark.parametrize("command", ["train", "inspect", "compile", "verify"])
def test_from_hf_without_model_takes_the_family_its_config_names(command):
    """As transformers' AutoModel: the checkpoint's model_type chooses the family of every
    command's run; --model, or a --config file naming one, still decides."""
    from jphantom.cli import build_parser
    from jphantom.cli.parser import run_settings
    from jphantom.cli.step_defaults import COMPILE_MODEL, INSPECT_MODEL, step_settings
    from jphantom.cli.train import TRAIN_DEFAULTS
    from jphantom.config import RunConfig

    def settings(*flags):
        args = build_parser().parse_args([command, "--from-hf", str(QWEN2), *flags])
        if command in ("inspect", "compile"):
            return step_settings(args, INSPECT_MODEL if command == "inspect" else COMPILE_MODEL)
        return run_settings(args, TRAIN_DEFAULTS if command == "train" else None)

    found = settings()
    assert found["model"] == "qwen2"
    run = {k: v for k, v in found.items() if k != "strategy"}  # inspect's and compile's: a list
    assert RunConfig.from_flags(**run).family_config().hidden == 32  # the checkpoint's
    assert settings("--model", "gpt2")["model"] == "gpt2"  # refused when the run is built


# make test: the family and shape the checkpoint's config.json gives (the settings test above),
# a --from-hf run's training in test_hf_families.py
@pytest.mark.slow
def test_from_hf_trains_the_checkpoints_family(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--from-hf", str(QWEN2), "--seq-len", "16", "--batch", "2", "--steps",
                 "1", "--eval-every", "1", "--eval-batches", "1", "--no-progress", "--out",
                 str(out)]) == 0
    model = json.loads((out / "results.json").read_text())["model"]
    assert (model["name"], model["hidden"], model["layers"]) == ("qwen2", 32, 2)
    assert (f"model: qwen2, the family --from-hf {QWEN2}'s config.json names (model_type)"
            in capsys.readouterr().out.splitlines())


def test_a_model_that_disagrees_with_the_checkpoint_is_one_line(tmp_path, capsys):
    assert main(["train", "--model", "gpt2", "--from-hf", str(QWEN2), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (f"jphantom: error: --from-hf {QWEN2} holds a 'qwen2' checkpoint, which "
                   "--model gpt2 does not read: leave --model out (the checkpoint's model_type "
                   "chooses it) or pass --model qwen2\n")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text('{"model_type": "bert"}')
    assert main(["inspect", "--from-hf", str(bert)]) == 2
    assert "holds a 'bert' checkpoint (its config.json's model_type), which no model family " \
           "reads" in capsys.readouterr().err


@pytest.mark.slow  # make test: the checkpoint's shape in the settings (the test above it)
def test_inspect_from_hf_prints_the_checkpoints_shape(capsys):
    """The header is the loaded model's (2 layers of width 32, 8 heads), not the flags' defaults."""
    assert main(["inspect", "--from-hf", str(QWEN2), "--seq-len", "16", "--batch", "2",
                 "--strategy", "tensor", "--mesh", "model=2"]) == 0
    assert "qwen2 L=2, h=32, heads=8, S=16, V=256" in capsys.readouterr().out


# one cell per family in `make test`; the matrix of the strategies each declares in test-all
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--seq-len", "16",
         "--vocab", "64", "--batch", "8"]
CELLS = {  # family -> [(strategy, mesh, extra flags)], the first cell fast
    "llama": [("gspmd", "data=2,model=2", []), ("pmm3d", "z=2,x=2", []),
              ("tensor", "data=2,model=2", ["--zero", "3"])],
    "mistral": [("tensor", "data=2,model=2", ["--sequence-parallel", "--sliding-window", "4"]),
                ("gspmd", "data=2,model=2", ["--sliding-window", "4"]),
                ("pmm3d", "y=2,x=2", ["--sliding-window", "4"]),
                ("tensor", "stage=2,data=2", ["--sliding-window", "4", "--schedule", "zb-h1"])],
    "qwen2": [("pmm3d", "z=2,x=2", []), ("gspmd", "data=2,model=2", []),
              ("phantom", "model=2", ["--ghost-width", "2"]),
              ("tensor", "data=2,model=2", ["--zero", "2"])],
    "qwen3": [("gspmd", "data=2,model=2", []),
              ("tensor", "data=2,context=2", ["--context-attention", "all-gather"]),
              ("tensor", "data=2,model=2", ["--zero", "3", "--accumulate", "2"])],
    "qwen3_moe": [("tensor", "expert=2,model=2", ["--experts", "4"]),
                  ("gspmd", "data=2,model=2", ["--experts", "4"]),
                  ("tensor", "stage=2,expert=2", ["--experts", "4"])],
    "gemma3": [("gspmd", "data=2,model=2", ["--layers", "6", "--sliding-window", "4"]),
               ("tensor", "data=2,model=2", ["--sliding-window", "4", "--zero", "3"])],
}
# llama's and qwen3's first cells are slow too (test budget): llama has its own fast tests under
# every strategy (tests/models/test_llama.py), qwen3 its fast --from-hf run (tests/models/test_hf_families.py)
SLOW_FAMILIES = ("llama", "qwen3")
MATRIX = [pytest.param(name, *cell, id=f"{name}-{cell[0]}-{cell[1]}",
                       marks=() if i == 0 and name not in SLOW_FAMILIES else pytest.mark.slow)
          for name, cells in CELLS.items() for i, cell in enumerate(cells)]


@pytest.mark.parametrize("name, strategy, mesh, extra", MATRIX)
@pytest.mark.slow_cells(
    "qwen3_moe-tensor-expert=2,model=2", "gemma3-gspmd-data=2,model=2",
    "mistral-tensor-data=2,model=2")
def test_every_family_under_its_strategies_equals_its_one_device_run(name, strategy, mesh, extra,
                                                                     capsys):
    from jphantom.runtime.mesh import MeshConfig

    require_devices(MeshConfig.parse(mesh).device_count)
    flags = list(SMALL) + extra
    if "--layers" in extra:  # the family's own layer count replaces SMALL's
        i = flags.index("--layers")  # SMALL's
        del flags[i:i + 2]
    assert main(["verify", "--model", name, "--strategy", strategy, "--mesh", mesh, *flags,
                 "--json"]) == 0, capsys.readouterr()
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["worst"]["error"] <= 1e-5


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "gemma3"])
def test_families_with_head_norms_or_their_own_experts_do_not_declare_pmm3d(name, capsys):
    assert main(["verify", "--model", name, "--strategy", "pmm3d", "--mesh", "z=2,x=2",
                 *SMALL]) == 2
    assert f"does not run the model family {name!r}" in capsys.readouterr().err


def test_a_shape_flag_that_disagrees_with_the_checkpoint_is_refused():
    """--from-hf used to ignore an explicit --hidden (and record the flag's value)."""
    from pathlib import Path

    from jphantom.config import RunConfig

    qwen3 = str(Path(__file__).parents[1] / "fixtures" / "hf" / "qwen3")
    loaded = RunConfig.from_flags(model="qwen3", from_hf=qwen3).family_config()
    with pytest.raises(ConfigError, match=f"--hidden 128 disagrees with the --from-hf "
                                          f"checkpoint's hidden={loaded.hidden}"):
        RunConfig.from_flags(model="qwen3", from_hf=qwen3, hidden=128).family_config()
    same = RunConfig.from_flags(model="qwen3", from_hf=qwen3, hidden=loaded.hidden)
    assert same.family_config() == loaded


@pytest.mark.parametrize("shape, options", [
    ({}, {}),
    ({}, {"sequence_parallel": True, "collective_matmul": True}),
    ({"tied_head": False}, {}),
    ({"layers": 3, "moe_every": 3, "experts": 4}, {"sequence_parallel": True}),
    ({"moe_every": 2, "experts": 4}, {"dtd": True}),
])
def test_gpt2_declares_the_plan_the_walker_finds(shape, options):
    """GPT-2's plan hook (jphantom.models.gpt2.plan, declared by path) and the walker that
    recognises layers by type (plans.megatron) agree on every variant."""
    from flax import nnx

    from jphantom import plans
    from jphantom.registry import families
    from jphantom.models.gpt2 import GPT2, TransformerConfig

    config = TransformerConfig(vocab_size=32, seq_len=8, hidden=16, heads=2,
                               **{"layers": 2, **shape})
    model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    declared = families.get("gpt2").plan
    assert declared(model, **options) == plans.megatron(model, **options)


@pytest.mark.parametrize("shape, options", [
    ({}, {}),
    ({}, {"sequence_parallel": True, "collective_matmul": True}),
    ({"tie_word_embeddings": True, "kv_heads": 4}, {}),
    ({"qk_norm": True, "kv_heads": 1}, {"sequence_parallel": True}),
    ({"post_norms": True}, {"sequence_parallel": True, "collective_matmul": True}),
    ({"experts": 4}, {}),
    ({"experts": 4, "qk_norm": True}, {"sequence_parallel": True, "collective_matmul": True}),
])
def test_llama_declares_the_plan_the_walker_finds(shape, options):
    """The Llama family's plan hook (jphantom.models.llama.plan: Llama, Qwen's q/k norms, Gemma's
    post-norms, Mixtral's and Qwen3-MoE's experts, tied heads, fewer key/value heads) equals the
    walker's plan on every variant."""
    from flax import nnx

    from jphantom import plans
    from jphantom.registry import families
    from jphantom.models.llama import Llama, LlamaConfig

    config = LlamaConfig(**{"vocab_size": 32, "hidden": 16, "intermediate": 24, "layers": 2,
                            "heads": 4, "kv_heads": 2, "max_positions": 16, **shape})
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    declared = families.get("llama").plan
    assert declared(model, **options) == plans.megatron(model, **options)
