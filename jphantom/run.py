"""``jphantom train``: train the FFN (seed 000's teacher task) or the GPT transformer (a byte-level
text corpus) under any strategy and mesh, with progress, metrics, curves and results.

A :class:`RunConfig` holds every setting (each CLI flag is a field; ``--config FILE.toml`` supplies
any of them, flags override) and validates all of them on construction, building the model
configuration, the mesh and the strategy's program, so that nothing compiles or trains on bad
input. :func:`run` then writes into ``out``:

- ``metrics.jsonl``: one line per step (``step``, ``train_loss``, ``tokens_per_second``) and per
  validation (``validation_loss``);
- ``curves.png``: training and validation loss against steps;
- ``results.json``: ``config``, ``final_validation_loss``, ``best_validation_loss``, the step
  time, parameters, for the text corpus ``unigram_cross_entropy`` and the ratio (nats/token), and
  on a mesh with a ``stage`` axis ``pipeline`` (schedule, micro-batches, virtual stages, stages);
  ``step``: the ZeRO stage, the accumulation micro-batches and the clipping norm.

Pipeline parallelism: a ``stage=P`` axis in ``mesh`` pipelines the step (strategies ``tensor`` and
``phantom``) with ``schedule`` (``gpipe``, ``1f1b``, ``interleaved-1f1b``),
``microbatches`` per step and data rank (default: ``P``) and ``virtual_stages`` (interleaved only).
The learning-rate schedule is ``lr_schedule`` (``--lr-schedule``).

The step (strategies ``tensor`` and ``phantom``, any mesh with a ``data`` axis): ``zero`` is the
ZeRO stage of the ``data`` axis (0: plain data parallelism; 1: optimizer state, 2: + gradients,
3: + parameters sharded over ``data``; :mod:`jphantom.sharding.zero`), ``accumulate`` the gradient
accumulation micro-batches per step (one gradient reduction per step; pipelines accumulate through
``microbatches`` instead), ``clip_norm`` the global gradient norm to clip to (over all shards;
``None``: no clipping).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import tomllib
from pathlib import Path

import jax
import numpy as np
import optax
from tqdm.auto import tqdm

from jphantom import strategies
from jphantom.errors import ConfigError, TrainingDiverged, check_int
from jphantom.mesh import MeshConfig, first_devices
from jphantom.pipeline.runner import PipelineConfig, pipeline_for
from jphantom.step import check_step_options
from jphantom.pipeline.schedule import SCHEDULES as PIPELINE_SCHEDULES

MODELS = ("ffn", "transformer", "gpt2", "llama")
MODULE_MODELS = ("gpt2", "llama")  # NNX modules trained by jphantom.make_train_step
MODULE_STRATEGIES = ("dense", "gspmd", "tensor", "phantom", "pmm3d")  # --model llama's
OPTIMIZERS = ("adamw", "adam", "sgd")
LR_SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run. Every field is a ``jphantom train`` flag (``_`` -> ``-``)."""

    model: str = "transformer"
    strategy: str = "dense"
    mesh: str | None = None  # default: model=1 for dense, model=<all devices> otherwise
    sequence_parallel: bool = False
    ghost_width: int | None = None
    # pipeline (only with a stage axis in mesh)
    schedule: str = "1f1b"
    microbatches: int | None = None  # per step and data rank; default: the number of stages
    virtual_stages: int = 1
    # the step: ZeRO stage of the data axis, gradient accumulation, global-norm clipping
    zero: int = 0
    accumulate: int = 1
    clip_norm: float | None = None
    precision: str = "float32"  # the step's policy: float32, bf16 or float16 (float32 master)
    remat: str = "none"  # activation checkpointing per layer: jphantom.remat.POLICIES
    # transformer
    moe_every: int = 0  # every n-th block a mixture of experts (0: none)
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    dropless: bool = False
    dtd: bool = False
    cac: bool = False
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int | None = None  # llama: key/value heads (grouped-query attention; default heads)
    intermediate: int | None = None  # llama: SwiGLU width (default 8h/3 rounded up to 32)
    seq_len: int = 128
    vocab: int = 256
    data: str | None = None  # a text file; default: the Python standard library's sources
    # FFN
    width: int = 256
    depth: int = 2
    # training
    batch: int = 16
    steps: int = 300
    optimizer: str = "adamw"
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    adam_b2: float = 0.95  # GPT-3 / Megatron's beta2: adapts faster than optax's 0.999 in short runs
    warmup_steps: int = 10
    lr_schedule: str = "constant"  # after the linear warm-up: "constant" or "cosine" (to 0.1x)
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0
    dtype: str = "float32"
    out: str = "out/train"
    from_gpt2: str | None = None
    save_gpt2: str | None = None
    from_hf: str | None = None  # llama: a Hugging Face Llama / Mixtral directory to start from
    save_hf: str | None = None  # llama: save the trained model as a Hugging Face directory
    # checkpoints (Orbax): every save_every steps into checkpoint_dir, the last keep_checkpoints kept
    checkpoint_dir: str | None = None
    save_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    progress: bool = True

    def __post_init__(self):
        if self.model not in MODELS:
            raise ConfigError(f"model={self.model!r}; use one of {MODELS}")
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "width", "depth", "batch",
                     "steps", "eval_every", "eval_batches"):
            check_int(name, getattr(self, name))
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("save_every", self.save_every, 0)
        check_int("keep_checkpoints", self.keep_checkpoints)
        if (self.save_every or self.resume) and not self.checkpoint_dir:
            raise ConfigError("--save-every and --resume need --checkpoint-dir DIR (where the "
                              "checkpoints live)")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"lr_schedule={self.lr_schedule!r}; use one of {LR_SCHEDULES}")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r}; use one of "
                              f"{PIPELINE_SCHEDULES}")
        if self.microbatches is not None:
            check_int("microbatches", self.microbatches)
        check_int("virtual_stages", self.virtual_stages)
        check_int("zero", self.zero, 0)
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer={self.optimizer!r}; use one of {OPTIMIZERS}")
        for name in ("learning_rate",):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name}={value!r} must be a positive number")
        if not (isinstance(self.adam_b2, (int, float)) and 0 < self.adam_b2 < 1):
            raise ConfigError(f"adam_b2={self.adam_b2!r} must be in (0, 1), e.g. 0.95")
        if not (isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay)
                and self.weight_decay >= 0):
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be a number >= 0")
        if self.dtype == "float16" and self.optimizer != "sgd":
            raise ConfigError("dtype='float16' with an adaptive optimizer underflows Adam's epsilon "
                              "(1e-8 is 0 in float16): use bfloat16, or --optimizer sgd")
        if (self.from_gpt2 or self.save_gpt2) and self.model != "gpt2" and (
                self.model != "transformer" or self.strategy not in ("dense", "gspmd", "tensor")):
            raise ConfigError("--from-gpt2/--save-gpt2 hold a dense GPT-2: use --model transformer "
                              "with --strategy dense, gspmd or tensor")
        if self.model == "transformer" and self.data is not None and not Path(self.data).is_file():
            raise ConfigError(f"data={self.data!r} is not a readable file: give a text file or "
                              "leave it out for the standard-library corpus")
        out = Path(self.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"out={self.out!r} is an existing file: give a folder")
        if self.model in MODULE_MODELS:
            self._check_module_run()
            return
        for name in ("kv_heads", "intermediate", "from_hf", "save_hf"):
            if getattr(self, name) is not None:
                raise ConfigError(f"--{name.replace('_', '-')} applies to --model llama or gpt2")
        check_step_options(self.program(), self.batch, accumulate=self.accumulate,
                           clip_norm=self.clip_norm, precision=self.precision,
                           remat=self.step_remat)

    def _check_module_run(self) -> None:
        """--model llama / gpt2: what the module step takes, checked before anything is built."""
        if self.strategy not in MODULE_STRATEGIES:
            raise ConfigError(f"--model {self.model} runs the strategies {MODULE_STRATEGIES} "
                              f"(plans applied to the NNX model), not {self.strategy!r}")
        if self.model == "gpt2":
            if self.moe_every or self.dtd or self.dropless:
                raise ConfigError("--model gpt2 has no mixture of experts: use --model llama "
                                  "--moe-every 1 (Mixtral), or --model transformer")
            for name in ("kv_heads", "intermediate"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"--{name.replace('_', '-')} applies to --model llama")
            if self.from_gpt2 and self.from_hf:
                raise ConfigError("give one of --from-gpt2 and --from-hf")
            if self.from_gpt2:  # GPT-2's name for the same thing
                object.__setattr__(self, "from_hf", self.from_gpt2)
            if self.save_gpt2 and not self.save_hf:
                object.__setattr__(self, "save_hf", self.save_gpt2)
        elif self.moe_every not in (0, 1) or self.dtd or self.dropless:
            raise ConfigError("--model llama's mixture of experts is Mixtral's: --moe-every 1 "
                              "(every block; dropless by construction, no --dtd/--dropless)")
        if self.sequence_parallel and self.strategy != "tensor":
            raise ConfigError("--sequence-parallel applies to --strategy tensor")
        if self.strategy == "phantom" and self.ghost_width is None:
            raise ConfigError("--strategy phantom needs --ghost-width K, e.g. 8")
        if self.model == "llama" and (self.from_gpt2 or self.save_gpt2):
            raise ConfigError("--from-gpt2/--save-gpt2 are GPT-2's: use --from-hf/--save-hf")
        for name in ("from_hf",):
            value = getattr(self, name)
            if value is not None and not (Path(value) / "config.json").is_file():
                raise ConfigError(f"--from-hf {value}: no config.json there")
        mesh = self.mesh_config()
        if mesh.device_count > jax.device_count():
            raise ConfigError(f"mesh {mesh} needs {mesh.device_count} devices but "
                              f"{jax.device_count()} are available: pass --devices "
                              f"{mesh.device_count} to simulate them on CPU, or a smaller mesh")
        if self.strategy == "dense" and mesh.size("model") != 1:
            raise ConfigError("--strategy dense keeps every layer whole: use model=1")
        grid = [axis for axis in ("x", "y", "z") if axis in mesh.shape]
        if grid and self.strategy != "pmm3d":
            raise ConfigError(f"mesh axes {grid} are pmm3d's: use --strategy pmm3d, or data, "
                              "stage, expert and model axes")
        if self.strategy == "pmm3d" and (set(mesh.shape) - {"data", "x", "y", "z"}
                                         or self.moe_every):
            raise ConfigError("--strategy pmm3d runs on data, z, y, x (no experts), e.g. "
                              "--mesh data=2,z=2,y=1,x=2")
        if "expert" in mesh.shape and not self.moe_every:
            raise ConfigError("an expert axis splits Mixtral's experts: add --moe-every 1")
        config = self.module_config()
        if self.model == "gpt2" and self.seq_len > config.seq_len:
            raise ConfigError(f"seq_len={self.seq_len} exceeds the checkpoint's "
                              f"{config.seq_len} positions: pass --seq-len {config.seq_len} or less")
        model_axis = mesh.size("x") if self.strategy == "pmm3d" else mesh.size("model")
        heads, what = ((config.kv_heads, "kv_heads") if self.model == "llama"
                       else (config.heads, "heads"))
        if heads % model_axis:
            raise ConfigError(f"{what}={heads} is not divisible by model={model_axis}: each "
                              "rank needs whole (key/value) heads")
        ranks = mesh.size("data") * mesh.size("expert") * mesh.size("z")
        if self.batch % (ranks * self.accumulate):
            raise ConfigError(f"batch={self.batch} is not divisible by data x expert={ranks} x "
                              f"accumulate={self.accumulate}")
        if self.moe_every and self.experts % mesh.size("expert"):
            raise ConfigError(f"experts={self.experts} is not divisible by expert="
                              f"{mesh.size('expert')}")
        self.pipeline_config()

    def module_config(self):
        """The NNX model's configuration: a :class:`~jphantom.models.llama.LlamaConfig`, or for
        GPT-2 a :class:`~jphantom.models.transformer.TransformerConfig` (an untied head under
        phantom, whose feature-split activations would all-reduce the logits of a tied one)."""
        if self.model == "llama":
            return self.llama_config()
        from jphantom.models import gpt2
        from jphantom.models.transformer import TransformerConfig
        if self.from_hf:
            config = gpt2.config_from_hf(_read_json(Path(self.from_hf) / "config.json"))
            return dataclasses.replace(config, dtype=self.dtype)
        return TransformerConfig(vocab_size=self.vocab, seq_len=self.seq_len, hidden=self.hidden,
                                 heads=self.heads, layers=self.layers, dtype=self.dtype,
                                 tied_head=self.strategy != "phantom")

    def llama_config(self):
        from jphantom.models.llama import LlamaConfig, config_from_hf
        if self.from_hf:
            return dataclasses.replace(
                config_from_hf(_read_json(Path(self.from_hf) / "config.json")), dtype=self.dtype)
        intermediate = self.intermediate or -(-8 * self.hidden // 3 // 32) * 32
        return LlamaConfig(vocab_size=self.vocab, hidden=self.hidden, intermediate=intermediate,
                           layers=self.layers, heads=self.heads,
                           kv_heads=self.kv_heads or self.heads, max_positions=self.seq_len,
                           experts=self.experts if self.moe_every else 0, top_k=self.top_k,
                           dtype=self.dtype)

    @property
    def step_remat(self) -> str:
        """The checkpoint policy of the step (``cac``: collectives_saveable)."""
        from jphantom.remat import with_cac
        return with_cac(self.remat, self.cac)

    # -- derived objects ------------------------------------------------------------------------

    def mesh_config(self) -> MeshConfig:
        if self.mesh is not None:
            return MeshConfig.parse(self.mesh)
        if self.strategy == "dense":
            return MeshConfig.parse("model=1")
        return MeshConfig.of({"model": jax.device_count()})

    def pipeline_config(self) -> PipelineConfig | None:
        """The pipeline of a mesh with a ``stage`` axis (``None`` without one); validated, with the
        per-data-rank batch checked against the micro-batches."""
        return pipeline_for(self.mesh_config(), self.batch, schedule=self.schedule,
                            microbatches=self.microbatches, virtual_stages=self.virtual_stages)

    def model_config(self):
        if self.model == "ffn":
            from jphantom.models.ffn import FFNConfig
            return FFNConfig(self.width, self.depth, self.ghost_width, self.dtype)
        from jphantom.models.transformer import TransformerConfig, moe_fields
        if self.from_gpt2:
            from jphantom.models import gpt2
            config = gpt2.config_from_hf(_read_json(Path(self.from_gpt2) / "config.json"))
            return dataclasses.replace(config, ghost_width=self.ghost_width, dtype=self.dtype,
                                       seq_len=min(config.seq_len, self.seq_len))
        return TransformerConfig(vocab_size=self.vocab, seq_len=self.seq_len, hidden=self.hidden,
                                 heads=self.heads, layers=self.layers, ghost_width=self.ghost_width,
                                 dtype=self.dtype,
                                 tied_head=not strategies.get(self.strategy).family == "phantom",
                                 **moe_fields(self.moe_every, self.experts, self.top_k,
                                              self.capacity_factor, self.dropless))

    def program(self):
        mesh = self.mesh_config()
        if mesh.device_count > jax.device_count():
            raise ConfigError(f"mesh {mesh} needs {mesh.device_count} devices but "
                              f"{jax.device_count()} are available: pass --devices "
                              f"{mesh.device_count} to simulate them on CPU, or a smaller mesh")
        strategies.check_batch(mesh, self.batch, self.model,
                               moe=bool(self.moe_every or self.dtd))
        return strategies.get(self.strategy).program(self.model_config(), mesh,
                                                     sequence_parallel=self.sequence_parallel,
                                                     pipeline=self.pipeline_config(),
                                                     zero=self.zero, dtd=self.dtd)

    def optimizer_transform(self) -> optax.GradientTransformation:
        warmup = max(self.warmup_steps, 1)
        if self.lr_schedule == "cosine":
            schedule = optax.warmup_cosine_decay_schedule(
                0.0, self.learning_rate, warmup, max(self.steps, warmup + 1),
                end_value=self.learning_rate * 0.1)
        else:
            schedule = optax.join_schedules(
                [optax.linear_schedule(0.0, self.learning_rate, warmup),
                 optax.constant_schedule(self.learning_rate)], [warmup])
        if self.optimizer == "adamw":
            return optax.adamw(schedule, b2=self.adam_b2, weight_decay=self.weight_decay)
        if self.optimizer == "adam":
            return optax.adam(schedule, b2=self.adam_b2)
        return optax.sgd(schedule)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from None


def load_toml(path: str) -> dict:
    """Settings from a TOML file: keys are ``RunConfig`` fields (``-`` or ``_``)."""
    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except OSError as error:
        raise ConfigError(f"cannot read --config {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {path} is not valid TOML: {error}") from None
    names = {f.name for f in dataclasses.fields(RunConfig)}
    settings = {key.replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise ConfigError(f"--config {path}: unknown settings {unknown}; known: {sorted(names)}")
    return settings


# --------------------------------------------------------------------------------------------------
# Data sources: batches as host arrays, placed by the caller
# --------------------------------------------------------------------------------------------------


class _TextSource:
    def __init__(self, config: RunConfig, seq_len: int):
        from jphantom.data.text import TextConfig, TextCorpus
        self.corpus = TextCorpus(TextConfig(path=config.data, seq_len=seq_len, seed=config.seed))
        self.batch, self.eval_batches = config.batch, config.eval_batches
        self.tokens_per_batch = config.batch * seq_len

    def train(self, step):
        return self.corpus.train_batch(step, self.batch)

    def validation(self):
        return self.corpus.validation_batches(self.batch, self.eval_batches)

    def describe(self):
        return self.corpus.describe()


class _TeacherSource:
    def __init__(self, config: RunConfig):
        from jphantom.data import Teacher, TeacherConfig
        self.teacher = Teacher(TeacherConfig(width=config.width, seed=config.seed),
                               jax.numpy.dtype(config.dtype))
        self.batch, self.eval_batches = config.batch, config.eval_batches
        self.tokens_per_batch = config.batch

    def train(self, step):
        return self.teacher.train_batch(step, self.batch)

    def validation(self):
        for index, pair in enumerate(self.teacher.eval_batches(self.batch)):
            if index >= self.eval_batches:
                return
            yield pair

    def describe(self):
        return {"source": "seed 000 teacher", **dataclasses.asdict(self.teacher.config)}


class _ModuleProgram:
    """``--model llama``: the NNX model under a plan (``tensor``: :func:`jphantom.plans.megatron`,
    ``phantom``: :func:`jphantom.plans.phantom`), trained by :func:`jphantom.make_train_step`;
    the attributes the run loop reads of a :class:`jphantom.step.Program`."""

    def __init__(self, config: RunConfig, mesh):
        from flax import nnx

        from jphantom import plans
        from jphantom.models import hf
        from jphantom.models.gpt2_nnx import GPT2
        from jphantom.models.llama import Llama, lm_loss
        from jphantom.train_step import make_train_step

        module_config = config.module_config()
        family = Llama if config.model == "llama" else GPT2

        def planned(model):
            if config.strategy == "tensor":
                plans.parallelize(model, mesh, plans.megatron(
                    model, sequence_parallel=config.sequence_parallel))
            elif config.strategy == "phantom":
                plans.parallelize(model, mesh,
                                  plans.phantom(model, ghost_width=config.ghost_width))
            elif config.strategy == "gspmd":  # the same plan as annotations; jit's collectives
                plans.annotate(model, mesh, plans.megatron(model))
            elif config.strategy == "pmm3d":
                for axis in ("x", "y", "z"):
                    if axis not in mesh.shape:
                        raise ConfigError("--strategy pmm3d needs x, y and z in --mesh "
                                          "(size 1 where unused), e.g. data=2,z=2,y=1,x=2")
                plans.parallelize(model, mesh, plans.pmm3d(model))
            return model

        if config.from_hf:
            self.create, model = None, planned(hf.load(config.from_hf))
        else:  # built abstract; step.init creates every parameter in its shards
            self.create = lambda: planned(family(module_config, rngs=nnx.Rngs(config.seed)))
            model = nnx.eval_shape(self.create)
        optimizer = config.optimizer_transform()
        if config.clip_norm is not None:  # exact: the update sees the global gradients
            optimizer = optax.chain(optax.clip_by_global_norm(config.clip_norm), optimizer)
        pipeline = config.pipeline_config()
        self.step = make_train_step(model, mesh, optimizer, lm_loss, zero=config.zero,
                                    accumulate=config.accumulate, precision=config.precision,
                                    remat=config.step_remat, pipeline=pipeline,
                                    spmd="gspmd" if config.strategy == "gspmd" else "shard_map")
        self.mesh, self.zero, self.config = config.mesh_config(), config.zero, module_config
        self.param_count = sum(math.prod(s.shape) for s in self.step.layout.shapes)
        self.options = ({} if pipeline is None else
                        {"pipeline": dataclasses.asdict(pipeline),
                         "stages": self.mesh.size("stage")})
        self.loss = self.step.loss()

    def init(self):
        state = self.step.init(create=self.create)
        return state.params, state.opt_state

    def step_fn(self, params, opt_state, *batch):
        from jphantom.train_step import TrainState

        state, loss = self.step(TrainState(params, opt_state), *batch)
        return state.params, state.opt_state, loss

    def batch_shardings(self, mesh):
        from jax.sharding import NamedSharding

        return (NamedSharding(self.step.mesh, self.step.batch_spec),) * 2

    def save_hf(self, path, params, opt_state) -> None:
        from jphantom import plans
        from jphantom.models import hf
        from jphantom.train_step import TrainState

        model = self.step.model(TrainState(params, opt_state))
        hf.save(path, plans.dense_equivalent(model))


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def run(config: RunConfig) -> dict:
    """Train as configured; returns (and writes) the results dictionary."""
    from jphantom.step import init_params, make_loss_fn, make_metrics_fn, make_train_step
    from jphantom.train import init_optimizer_state

    out = Path(config.out)
    writer = jax.process_index() == 0  # process 0 alone writes logs and results
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    module = config.model in MODULE_MODELS
    if module:
        mesh_config = config.mesh_config()
        mesh = mesh_config.build(first_devices(mesh_config.device_count))
        program = _ModuleProgram(config, mesh)
        model_config = program.config
    else:
        program = config.program()
        mesh_config = program.mesh
        mesh = mesh_config.build(first_devices(mesh_config.device_count))
        model_config = config.model_config()
    if config.model != "ffn":
        source = _TextSource(config, config.seq_len if module else model_config.seq_len)
        if model_config.vocab_size < source.corpus.vocab_size:
            raise ConfigError(f"vocab={model_config.vocab_size} is smaller than the byte corpus's "
                              f"{source.corpus.vocab_size}: use --vocab 256")
    else:
        source = _TeacherSource(config)
    if module:
        params, opt_state = program.init()
        step_fn, loss_fn = program.step_fn, program.loss
    else:
        if config.from_gpt2:
            from jphantom.models import gpt2
            _, dense = gpt2.load(config.from_gpt2)
            dense = {**dense, "wpe": dense["wpe"][: model_config.seq_len]}
            params = jax.device_put(dense, program.shardings(mesh))
        else:
            params = init_params(program, mesh, jax.random.PRNGKey(config.seed))
        optimizer = config.optimizer_transform()
        # per-rank programs: the moments in their (ZeRO-sharded) shards
        opt_state = (init_optimizer_state(program, mesh, optimizer, params) if program.manual
                     else optimizer.init(params))
        step_fn = make_train_step(program, mesh, optimizer, accumulate=config.accumulate,
                                  clip_norm=config.clip_norm, precision=config.precision,
                                  remat=config.step_remat)
        loss_fn = make_loss_fn(program, mesh)
    checkpointer = None
    if config.checkpoint_dir:
        from jphantom.checkpoint import Checkpointer
        checkpointer = Checkpointer(config.checkpoint_dir, save_every=config.save_every,
                                    keep=config.keep_checkpoints)
    moe = not module and getattr(model_config, "moe", None) is not None
    metrics_fn = make_metrics_fn(program, mesh) if moe else None
    shardings = program.batch_shardings(mesh)
    place = lambda pair: tuple(jax.device_put(np.asarray(a), s) for a, s in zip(pair, shardings))

    def validate():
        """Mean validation loss (MoE: the cross-entropy, without the auxiliary losses) and the
        fraction of token-expert assignments dropped."""
        if metrics_fn is None:
            return float(np.mean([float(loss_fn(params, *place(pair)))
                                  for pair in source.validation()])), None
        found = [jax.device_get(metrics_fn(params, *place(pair))) for pair in source.validation()]
        dropped = sum(int(m["dropped"]) for m in found) / sum(int(m["assignments"]) for m in found)
        return float(np.mean([float(m["cross_entropy"]) for m in found])), dropped

    history = {"step": [], "train_loss": [], "validation_step": [], "validation_loss": [],
               "dropped_fraction": []}
    first = 0
    if config.resume:  # the state, the history and the data stream's position (the step)
        params, opt_state, meta = checkpointer.restore(params, opt_state)
        first, history = meta["step"], meta["history"]
        if first >= config.steps:
            raise ConfigError(f"the checkpoint is at step {first}, not before steps="
                              f"{config.steps}: ask for more steps to continue")
    metrics = (out / "metrics.jsonl").open("a" if config.resume else "w") if writer else None
    step_seconds = []
    bar = tqdm(total=config.steps, desc=f"{config.model} {config.strategy} {mesh_config}",
               disable=not config.progress, unit="step")
    start = time.perf_counter()
    try:
        for index in range(first, config.steps):
            batch = place(source.train(index))
            tick = time.perf_counter()
            params, opt_state, loss = step_fn(params, opt_state, *batch)
            loss = float(loss)
            elapsed = time.perf_counter() - tick
            if index > 0:  # the first step compiles
                step_seconds.append(elapsed)
            if not math.isfinite(loss):
                raise TrainingDiverged(
                    f"training loss is {loss} at step {index + 1} ({config.model}, "
                    f"{config.strategy}, dtype {config.dtype}, learning_rate="
                    f"{config.learning_rate:g}): lower the learning rate or check the data")
            rate = source.tokens_per_batch / elapsed
            record = {"step": index + 1, "train_loss": loss, "tokens_per_second": rate}
            history["step"].append(index + 1)
            history["train_loss"].append(loss)
            if (index + 1) % config.eval_every == 0 or index + 1 == config.steps:
                record["validation_loss"], dropped = validate()
                if dropped is not None:
                    record["dropped_fraction"] = dropped
                    history["dropped_fraction"].append(dropped)
                history["validation_step"].append(index + 1)
                history["validation_loss"].append(record["validation_loss"])
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
            if checkpointer is not None and (checkpointer.due(index + 1)
                                             or index + 1 == config.steps):
                checkpointer.save(index + 1, params, opt_state,
                                  {"history": json.loads(json.dumps(history))})
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}",
                            val=f"{history['validation_loss'][-1]:.3f}"
                            if history["validation_loss"] else "-")
            bar.update()
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
        if checkpointer is not None:
            checkpointer.close()
    results = {
        "config": config.to_json(),
        "mesh": str(mesh_config),
        "devices": [str(d) for d in mesh.devices.flat],
        "params": program.param_count,
        "final_validation_loss": history["validation_loss"][-1],
        "best_validation_loss": min(history["validation_loss"]),
        "median_step_seconds": float(np.median(step_seconds)) if step_seconds else None,
        "wall_seconds": time.perf_counter() - start,
        "data": source.describe(),
        "history": history,
        "loss_units": "nats per token" if config.model != "ffn" else "MSE",
    }
    results["step"] = {"zero": program.zero, "accumulate": config.accumulate,
                       "clip_norm": config.clip_norm, "precision": config.precision,
                       "remat": config.step_remat}
    if moe:
        results["moe"] = {"moe_every": model_config.moe_every, "experts": model_config.experts,
                          "top_k": model_config.top_k,
                          "capacity_factor": model_config.capacity_factor, "dtd": config.dtd,
                          "active_params": model_config.param_count(active=True),
                          "final_dropped_fraction": history["dropped_fraction"][-1]}
    pipeline = program.options.get("pipeline")
    if pipeline is not None:
        results["pipeline"] = {"schedule": pipeline["schedule"],
                               "microbatches": pipeline["microbatches"],
                               "virtual_stages": pipeline["virtual_stages"],
                               "stages": program.options["stages"]}
    if module:
        results["module"] = {"model": config.model, **dataclasses.asdict(model_config)}
    if config.model != "ffn":
        unigram = source.corpus.unigram_cross_entropy()
        results["unigram_cross_entropy"] = unigram
        results["validation_over_unigram"] = results["final_validation_loss"] / unigram
    if checkpointer is not None:
        results["checkpoints"] = {"directory": str(checkpointer.directory),
                                  "steps": checkpointer.all_steps(), "resumed_from": first}
    if writer:
        (out / "results.json").write_text(json.dumps(results, indent=2))
        _plot(history, out / "curves.png", results)
    if config.save_hf and writer:
        program.save_hf(config.save_hf, params, opt_state)
    if config.save_gpt2 and writer and not module:
        from jphantom.models import gpt2
        gpt2.save(config.save_gpt2, model_config, jax.device_get(params))
    return results


def _plot(history, path: Path, results) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(history["step"], history["train_loss"], label="train", alpha=0.6)
    axes.plot(history["validation_step"], history["validation_loss"], "o-", label="validation")
    if "unigram_cross_entropy" in results:
        axes.axhline(results["unigram_cross_entropy"], color="grey", ls="--", label="unigram")
        axes.axhline(0.8 * results["unigram_cross_entropy"], color="grey", ls=":",
                     label="0.80 x unigram")
    axes.set_xlabel("step")
    axes.set_ylabel(results["loss_units"])
    config = results["config"]
    axes.set_title(f"{config['model']} / {config['strategy']} on {results['mesh']}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
