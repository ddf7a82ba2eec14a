"""The one run configuration: what ``train``, ``inspect``, ``compare`` and ``plan`` read.

A :class:`RunConfig` nests four frozen sections, each validated on construction (types by
annotation, never coerced by truthiness; ranges and choices by name; the sections against each
other), without jax: configuration is data. :func:`build` (``config.build()``) is the explicit
next step every command takes before it reads data: it builds the run's
:class:`jphantom.program.Program`, its jax mesh and its step (nothing is compiled), which checks
every shape against the mesh::

    RunConfig(model=ModelConfig(name="llama", layers=2), parallel=ParallelConfig(
        strategy="tensor", mesh="data=2,model=4"), step=StepConfig(zero=1),
        train=TrainConfig(batch=16, steps=100))
    RunConfig.from_flags(model="llama", strategy="tensor", mesh="data=2,model=4", zero=1)

``from_flags`` takes the flat names of the command line (every flag is a field of one section;
``--model`` is ``model.name``); a TOML file (``--config``) may use the same flat names or the
sections (``[model]``, ``[parallel]``, ``[step]``, ``[train]``).

============  ==========================================================================
section       fields
============  ==========================================================================
``model``     the model family (``ffn``, ``gpt2`` -- alias ``transformer`` --, ``llama``) and
              its shape; MoE; a Hugging Face checkpoint to start from
``parallel``  the strategy, the mesh, sequence parallelism, DTD, the pipeline schedule
``step``      ZeRO stage, accumulation, clipping, precision, activation checkpointing, CAC
``train``     batch, steps, optimizer and schedule, evaluation, target loss, seed, data, outputs,
              checkpoints
============  ==========================================================================
"""

import dataclasses
import functools
import math
import os
import typing
from pathlib import Path

from jphantom.errors import ConfigError

OPTIMIZERS = ("adamw", "adam", "sgd")
LR_SCHEDULES = ("constant", "cosine")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def _check_types(section) -> None:
    """Every field of ``section`` has its annotated type: ``int`` (not bool), ``float`` (an int
    is accepted and converted), ``bool``, ``str``, ``X | None``; the error names the field."""
    hints = typing.get_type_hints(type(section))
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        kind = hints[field.name]
        args = typing.get_args(kind)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), kind) if args else kind
        if value is None:
            if optional:
                continue
            raise ConfigError(f"{field.name} is required (got None)")
        ok = {int: isinstance(value, int) and not isinstance(value, bool),
              float: isinstance(value, (int, float)) and not isinstance(value, bool),
              bool: isinstance(value, bool),
              str: isinstance(value, str)}.get(base, True)
        if not ok:
            raise ConfigError(f"{field.name}={value!r} must be {base.__name__}"
                              f"{' or None' if optional else ''}, not {type(value).__name__}")
        if base is float and isinstance(value, int):
            object.__setattr__(section, field.name, float(value))
        if base is float and not math.isfinite(getattr(section, field.name)):
            raise ConfigError(f"{field.name}={value!r} must be a finite number")


def _at_least(section, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if value is not None and value < minimum:
            raise ConfigError(f"{name}={value!r} must be at least {minimum}")


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r}; use one of {', '.join(map(str, choices))}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model: ``name`` (a family of :mod:`jphantom.families`'s registry: ``ffn``, seed
    000's FFN of ``width`` x ``depth``; ``gpt2``; ``llama`` (Mixtral with ``moe_every=1``);
    ``mistral``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``gemma3``; or a user's registered family)
    and its shape. A field the family does not read, set away from its default, is refused."""

    name: str = "gpt2"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int | None = None  # Llama family: key/value heads (grouped-query attention)
    intermediate: int | None = None  # Llama family: MLP width (default 8h/3 rounded up to 32)
    seq_len: int = 128
    vocab: int = 256
    width: int = 256  # ffn
    depth: int = 2  # ffn
    ghost_width: int | None = None  # phantom: k ghost neurons per rank (and token)
    dtype: str = "float32"
    moe_every: int = 0  # every n-th block a mixture of experts (0: none)
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    dropless: bool = False
    sliding_window: int | None = None  # mistral, gemma3: the attention window W
    from_hf: str | None = None  # a Hugging Face checkpoint directory of the family to start from

    def __post_init__(self):
        from jphantom import families

        _check_types(self)
        family = families.get(self.name)
        object.__setattr__(self, "name", family.name)
        _at_least(self, 1, "layers", "hidden", "heads", "kv_heads", "intermediate", "seq_len",
                  "vocab", "width", "depth", "ghost_width", "experts", "top_k", "sliding_window")
        _at_least(self, 0, "moe_every")
        _choice("dtype", self.dtype, DTYPES)
        if not self.capacity_factor > 0:
            raise ConfigError(f"capacity_factor={self.capacity_factor} must be > 0")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        specific = {name for f in families.families().values() for name in f.accepted}
        for name in sorted(specific - set(family.accepted) - {"name"}):
            if getattr(self, name) != defaults[name]:
                takers = [f.name for f in families.families().values() if name in f.accepted]
                raise ConfigError(f"--{name.replace('_', '-')} does not apply to --model "
                                  f"{family.name}; it applies to {', '.join(takers)}")
        if family.check is not None:
            family.check(self)

    @property
    def family(self):
        """The registered :class:`jphantom.families.Family` of ``name``."""
        from jphantom import families

        return families.get(self.name)

    def family_config(self, strategy: str):
        """The model family's configuration (:class:`~jphantom.models.ffn.FFNConfig`,
        :class:`~jphantom.models.gpt2.TransformerConfig`,
        :class:`~jphantom.models.llama.LlamaConfig`, ...) for ``strategy``: the family's
        ``from_flags`` (a phantom GPT-2 has an untied head: its feature-split activations would
        all-reduce a tied head's logits)."""
        from jphantom.program import get

        return self.family.from_flags(self, get(strategy).family == "phantom")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: ``strategy`` (:data:`jphantom.program.NAMES`), ``mesh`` (default
    ``model=1`` for dense, else ``model=<all devices>``), Megatron sequence parallelism, DTD,
    with a ``stage`` axis the pipeline ``schedule``, ``microbatches`` per step and data rank
    (default: the stages) and ``virtual_stages`` (interleaved 1F1B), and with a ``context``
    axis the ``context_attention`` (``ring`` or ``all-gather``) and ``load_balance``."""

    strategy: str = "dense"
    mesh: str | None = None
    sequence_parallel: bool = False
    dtd: bool = False
    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1
    context_attention: str = "ring"  # with a context axis: ring or all-gather attention
    load_balance: bool = True  # with a context axis: the load-balanced causal layout
    collective_matmul: bool = False  # SP's all-gathers / reduce-scatters as rings under GEMMs

    def __post_init__(self):
        from jphantom.nn.attention import ALGORITHMS
        from jphantom.pipeline.schedule import ALL_SCHEDULES
        from jphantom.program import get

        _check_types(self)
        get(self.strategy)
        _choice("schedule", self.schedule, ALL_SCHEDULES)
        _choice("context_attention", self.context_attention, ALGORITHMS)
        _at_least(self, 1, "microbatches", "virtual_stages")
        if self.collective_matmul and not self.sequence_parallel:
            raise ConfigError("--collective-matmul overlaps sequence parallelism's all-gathers "
                              "and reduce-scatters with the GEMMs: add --sequence-parallel")
        self.declared_mesh()

    def declared_mesh(self):
        """The mesh as given (``mesh``, or ``model=1`` for ``dense``), parsed and validated; None
        when it is left to the devices (``model=<all of them>``: :meth:`mesh_config`). Reads
        nothing but the configuration."""
        from jphantom.mesh import MeshConfig

        if self.mesh is not None:
            return MeshConfig.parse(self.mesh)
        if self.strategy == "dense":
            return MeshConfig.parse("model=1")
        return None

    def mesh_config(self):
        from jphantom.mesh import MeshConfig

        if self.mesh is not None:
            return MeshConfig.parse(self.mesh)
        if self.strategy == "dense":
            return MeshConfig.parse("model=1")
        import jax

        return MeshConfig.of({"model": jax.device_count()})


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The training step's options (:class:`jphantom.TrainStep`): the ZeRO stage of ``data``,
    gradient accumulation, global-norm clipping, the precision policy, activation checkpointing
    per block, ``cac`` (Singh's communication-aware checkpointing:
    ``remat=collectives_saveable``) and the ``attention`` kernel (``auto``: cuDNN's flash
    attention on NVIDIA GPUs in bf16/fp16, XLA's path elsewhere; ``xla``; ``cudnn``)."""

    zero: int = 0
    accumulate: int = 1
    clip_norm: float | None = None
    precision: str = "float32"
    remat: str = "none"
    cac: bool = False
    attention: str = "auto"  # the attention kernel: auto (cuDNN where it runs), xla, cudnn

    def __post_init__(self):
        from jphantom.nn.attention import IMPLEMENTATIONS
        from jphantom.precision import NAMES as PRECISIONS
        from jphantom.remat import POLICIES, with_cac

        _check_types(self)
        _choice("zero", self.zero, (0, 1, 2, 3))
        _at_least(self, 1, "accumulate")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(f"clip_norm={self.clip_norm} must be > 0 (or left out)")
        _choice("precision", self.precision, tuple(PRECISIONS))
        _choice("remat", self.remat, tuple(POLICIES))
        _choice("attention", self.attention, IMPLEMENTATIONS)
        with_cac(self.remat, self.cac)

    @property
    def step_remat(self) -> str:
        from jphantom.remat import with_cac

        return with_cac(self.remat, self.cac)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training run: global ``batch`` (sequences or rows), ``steps``, the optimizer and its
    schedule (linear warm-up, then constant or cosine to 0.1x), evaluation, an optional
    ``target_loss`` to stop at (held-out loss, checked at each evaluation), the seed, the
    ``data`` (a text file, a token file or a folder of them: :mod:`jphantom.data.tokens`) and the
    ``tokenizer`` text goes through (:func:`jphantom.data.tokenizers.load_tokenizer`; ``None``:
    bytes), the ``out`` folder (``None``: write nothing), a Hugging Face directory to save into,
    Orbax checkpoints, and what is reported per step (:mod:`jphantom.metrics`): the gradient norm
    (``grad_norm``, recorded by the optimizer; ``jphantom train`` turns it on) and TensorBoard
    events (``tensorboard``, into ``out/tensorboard``)."""

    batch: int = 16
    steps: int = 300
    optimizer: str = "adamw"
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    adam_b2: float = 0.95  # GPT-3 / Megatron's beta2: adapts faster than 0.999 in short runs
    warmup_steps: int = 10
    lr_schedule: str = "constant"
    eval_every: int = 50
    eval_batches: int = 8
    target_loss: float | None = None
    seed: int = 0
    data: str | None = None  # a text file, token file or folder; default: the Python stdlib
    tokenizer: str | None = None  # "bpe", a tokenizer.json, a tiktoken file or name; None: bytes
    out: str | None = "out/train"
    save_hf: str | None = None
    checkpoint_dir: str | None = None
    save_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    progress: bool = True
    grad_norm: bool = False  # record the gradients' global norm (one more reduction per step)
    tensorboard: bool = False
    on_nonfinite: str = "stop"  # a non-finite loss: stop, skip the update, or rollback
    step_timeout: float | None = None  # seconds; None: off with one process, else automatic

    def __post_init__(self):
        _check_types(self)
        _at_least(self, 1, "batch", "steps", "eval_every", "eval_batches", "keep_checkpoints")
        _at_least(self, 0, "warmup_steps", "seed", "save_every")
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate={self.learning_rate} must be > 0")
        if self.weight_decay < 0 or not 0 <= self.adam_b2 < 1:
            raise ConfigError("weight_decay must be >= 0 and adam_b2 in [0, 1)")
        if self.target_loss is not None and not self.target_loss > 0:
            raise ConfigError(f"target_loss={self.target_loss} must be > 0 (or left out)")
        from jphantom.resilience import NONFINITE

        _choice("on_nonfinite", self.on_nonfinite, NONFINITE)
        if self.on_nonfinite == "rollback" and not (self.checkpoint_dir and self.save_every):
            raise ConfigError("--on-nonfinite rollback reloads the newest checkpoint: give "
                              "--checkpoint-dir DIR and --save-every N")
        if self.step_timeout is not None and not self.step_timeout > 0:
            raise ConfigError(f"step_timeout={self.step_timeout} must be > 0 seconds (or left "
                              "out: automatic with several processes, off with one)")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir")
        if self.save_every and not self.checkpoint_dir:
            raise ConfigError("--save-every needs --checkpoint-dir")
        if self.tensorboard:
            from jphantom.metrics import require_tensorboard

            require_tensorboard()
            if self.out is None:
                raise ConfigError("tensorboard=True writes into the out folder: give --out DIR")

    def check_paths(self) -> None:
        """What this run reads and writes, on this machine (:meth:`RunConfig.build` calls it,
        before anything is built): the output folders can be made and written (written at the
        end: checked first), ``data`` is readable, the tokenizer loads."""
        _check_paths(self.out, self.checkpoint_dir, self.save_hf, self.data, self.tokenizer)

    def schedule(self, total_steps: int | None = None):
        """The learning rate schedule (an optax schedule, or the constant rate): linear warm-up
        from 0 over ``warmup_steps`` (none for 0), then constant or cosine-decayed to 0.1x at
        ``steps``."""
        import optax

        lr, warmup = self.learning_rate, self.warmup_steps
        steps = total_steps or self.steps
        if self.lr_schedule == "cosine":
            return optax.warmup_cosine_decay_schedule(
                0.0 if warmup else lr, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.1)
        if warmup:
            return optax.join_schedules(
                [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])
        return lr

    def learning_rate_at(self, step: int) -> float:
        """The learning rate of update ``step`` (0-based: the first update is step 0)."""
        schedule = self.schedule()
        return float(schedule(step)) if callable(schedule) else float(schedule)

    def optimizer_transform(self, total_steps: int | None = None):
        """The optax optimizer on :meth:`schedule`; with ``grad_norm``, first
        :func:`jphantom.metrics.record_grad_norm` (the gradients' global norm kept in the
        optimizer state, read by :func:`jphantom.metrics.grad_norm_of`)."""
        import optax

        schedule = self.schedule(total_steps)
        if self.optimizer == "adamw":
            optimizer = optax.adamw(schedule, b2=self.adam_b2, weight_decay=self.weight_decay)
        elif self.optimizer == "adam":
            optimizer = optax.adam(schedule, b2=self.adam_b2)
        else:
            optimizer = optax.sgd(schedule)
        if self.grad_norm:
            from jphantom.metrics import record_grad_norm

            optimizer = optax.chain(record_grad_norm(), optimizer)
        return optimizer


@functools.lru_cache(maxsize=64)  # once per process and set of paths: build() runs it each time
def _check_paths(out, checkpoint_dir, save_hf, data, tokenizer) -> None:
    for name, value in (("out", out), ("checkpoint_dir", checkpoint_dir), ("save_hf", save_hf)):
        if value is not None:
            _writable_folder(name, value)
    if data is not None:
        _readable_data(data)
    if tokenizer is not None:
        from jphantom.data.tokenizers import load_tokenizer

        load_tokenizer(tokenizer)  # on this machine, readable, its library installed


def _readable_data(value: str) -> None:
    """``--data`` is a readable file (text or tokens) or a folder of token files."""
    data = Path(value)
    if data.is_dir():
        if not any(data.glob("*.bin")):
            raise ConfigError(f"data={value!r} is a folder without .bin token files: write them "
                              "with `jphantom tokenize`, or give a text file")
        return
    if not data.is_file() or not os.access(data, os.R_OK):
        raise ConfigError(f"data={value!r} is not a readable file or folder: give a text file, a "
                          "token file (.bin) or a folder of them (or leave --data out for the "
                          "Python standard library's sources)")
    if data.suffix != ".bin":
        from jphantom.data.tokens import check_text_file

        check_text_file("data", data)


def check_vocabulary(config: "RunConfig") -> None:
    """Before anything is built or compiled: the data and tokenizer apply to a language model,
    and its vocabulary holds every id they give (the tokenizer's ids; a token file's largest id
    among its first 16M tokens per file; 256 for bytes); a ConfigError naming the fix."""
    train = config.train
    if config.model.name == "ffn":
        if train.data is not None or train.tokenizer is not None:
            raise ConfigError("--data and --tokenizer feed language models (--model gpt2 or "
                              "llama); the FFN trains on Seal et al.'s teacher: leave them out")
        return
    from jphantom.data import tokens

    if train.tokenizer is not None:
        from jphantom.data.tokenizers import load_tokenizer

        need = load_tokenizer(train.tokenizer).vocab_size
        what = f"tokenizer={train.tokenizer!r} ({need} ids)"
    elif train.data is not None and tokens.is_token_data(train.data):
        train_files, validation_files = tokens.token_files(train.data)
        need = tokens.max_token([f.tokens() for f in train_files + validation_files]) + 1
        what = f"the token ids of data={train.data!r} (up to {need - 1})"
    else:
        need, what = 256, "byte-level text (256 ids)"
    vocab = config.family_config().vocab_size
    if vocab < need:
        if config.model.from_hf:
            raise ConfigError(f"the checkpoint's vocabulary ({vocab}) is smaller than {what}: "
                              "use the tokenizer the checkpoint was trained with")
        raise ConfigError(f"vocab={vocab} is smaller than {what}: pass --vocab {need} (or more)")


def _writable_folder(name: str, value: str) -> None:
    """``value`` is a folder or can be made one: not an existing file, and its nearest existing
    ancestor a folder this process can write in."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name}={value!r} is an existing file: give a folder")
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or not _can_create(
            parent):
        raise ConfigError(f"{name}={value!r}: {str(parent)!r} is not a folder this process can "
                          "write in: pick another path")


def _can_create(folder: Path) -> bool:
    """Whether a folder can be made in ``folder`` (tried: ``os.access`` says yes for root in
    /proc or on a read-only mount)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jphantom-probe-", dir=folder))
    except OSError:
        return False
    return True


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "step": StepConfig,
            "train": TrainConfig}
# flat name (CLI flag, flat TOML key) -> (section, field); --model is model.name
FLAT: dict[str, tuple[str, str]] = {
    **{f.name: (section, f.name) for section, cls in SECTIONS.items()
       for f in dataclasses.fields(cls) if f.name != "name"},
    "model": ("model", "name"),
}
ALIASES = {"from_gpt2": "from_hf", "save_gpt2": "save_hf"}  # GPT-2's names for the same thing


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run: the four sections (module docstring)."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    step: StepConfig = dataclasses.field(default_factory=StepConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self):
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"RunConfig.{name} must be a {cls.__name__}")
        if self.parallel.dtd and not self.model.moe_every:
            raise ConfigError("--dtd (duplicate token dropping) applies to MoE blocks: add "
                              "--moe-every N")
        if self.parallel.sequence_parallel and self.parallel.strategy != "tensor":
            raise ConfigError("--sequence-parallel applies to --strategy tensor (Megatron-SP)")
        declared = self.parallel.declared_mesh()  # None: model=<every device> (no other axis)
        if declared is None or declared.size("context") == 1:
            for flag, value, default in (("--context-attention", self.parallel.context_attention,
                                          "ring"),
                                         ("--no-load-balance", self.parallel.load_balance, True)):
                if value != default:
                    raise ConfigError(f"{flag} applies to a mesh with a context axis (context=C, "
                                      "C > 1): add one to --mesh, or leave the flag out")
        if self.train.save_hf is not None and self.model.family.save_hf is None:
            raise ConfigError(f"--save-hf: the {self.model.name} family has no Hugging Face "
                              "format; leave --save-hf out")
        if self.model.dtype == "float16" and self.train.optimizer != "sgd":
            raise ConfigError("dtype='float16' with an adaptive optimizer underflows Adam's "
                              "epsilon (1e-8 is 0 in float16): use --precision float16 (float32 "
                              "master weights), bfloat16, or --optimizer sgd")
        if declared is not None and "stage" in declared.shape:
            if self.parallel.strategy == "dense":
                raise ConfigError("strategy 'dense' does not run inside pipeline stages: use "
                                  "'tensor' or 'phantom' (with model=1 for no tensor "
                                  "parallelism), or 'gspmd'")
            if self.step.accumulate != 1:
                raise ConfigError(f"--accumulate {self.step.accumulate} does not apply to a "
                                  "pipelined step: pipelines accumulate through --microbatches "
                                  "(per data rank); leave --accumulate out")
        phantom = self.parallel.strategy.startswith("phantom")
        if phantom and self.model.ghost_width is None:
            raise ConfigError(f"--strategy {self.parallel.strategy} needs --ghost-width K (k "
                              "ghost neurons per rank, Seal et al.), e.g. 8")
        # what needs neither jax's devices nor a file: the family runs the strategy, its own
        # shape rules, a language model's mesh axes (the shapes against the mesh: build())
        from jphantom import program as programs

        family = self.model.family
        programs.check_runs(family.name, self.parallel.strategy)
        if not self.model.from_hf:
            self.family_config()
        if family.program == "lm" and declared is not None:
            programs.check_lm_mesh(programs.get(self.parallel.strategy).name, declared)

    @classmethod
    def from_flags(cls, **flags) -> "RunConfig":
        """From flat names (CLI flags, flat TOML keys): each goes to its section."""
        sections: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in flags.items():
            key = ALIASES.get(key, key)
            if key not in FLAT:
                raise ConfigError(f"unknown setting {key!r}; known: {sorted(FLAT)}")
            section, field = FLAT[key]
            if field in sections[section] and sections[section][field] != value:
                raise ConfigError(f"{key} is given twice with different values "
                                  f"({sections[section][field]!r}, {value!r})")
            sections[section][field] = value
        return cls(**{name: SECTIONS[name](**values) for name, values in sections.items()})

    def flat(self) -> dict:
        """The flat names and values (what ``results.json`` records as ``config``)."""
        out = {}
        for flat, (section, field) in FLAT.items():
            out[flat] = getattr(getattr(self, section), field)
        return out

    def to_json(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    # -- what the run builds ----------------------------------------------------------------------

    def family_config(self):
        return self.model.family_config(self.parallel.strategy)

    def program(self):
        """The model under the strategy on the mesh (:func:`jphantom.program.build`): validates
        every shape against the mesh; builds nothing concrete."""
        return self.build().program

    def pipeline(self, program=None):
        """The pipeline of a mesh with a ``stage`` axis (``None`` without one), validated, the
        per-data-rank batch checked against the micro-batches."""
        return _pipeline(self.parallel, self.train, program)

    def optimizer(self):
        return _optimizer(self.train, self.step)

    def train_step(self, program, mesh, optimizer=None):
        """The :class:`jphantom.TrainStep` of ``program`` on ``mesh`` with this run's step
        options (nothing compiled)."""
        return _train_step(self, program, mesh, optimizer or self.optimizer())

    def build(self) -> "Built":
        """The program, jax mesh and step of this run (nothing compiled), shared by the runs
        that differ only in their seed, outputs or stopping rule: every shape, axis and option
        is checked against the mesh here, and the paths it reads and writes
        (:meth:`TrainConfig.check_paths`), before any data is read (:func:`build`)."""
        self.train.check_paths()
        train = dataclasses.replace(self.train, seed=0, target_loss=None, out=None,
                                    checkpoint_dir=None, save_every=0, resume=False,
                                    progress=False, save_hf=None, eval_every=1, eval_batches=1,
                                    tensorboard=False, step_timeout=None,
                                    on_nonfinite="skip" if self.train.on_nonfinite == "skip"
                                    else "stop")
        from jphantom.mesh import available_devices

        return _build(self.model, self.parallel, self.step, train, available_devices())


def build(config: RunConfig) -> "Built":
    """What ``config`` runs, built (:meth:`RunConfig.build`): the explicit step between the
    configuration (data) and the work."""
    return config.build()


@dataclasses.dataclass(frozen=True)
class Built:
    """What a run builds before it reads data: the program, the jax mesh, the step (a
    :class:`jphantom.TrainStep`), its jitted evaluation functions and the batch shardings."""

    program: object
    mesh: object
    step: object
    loss: object
    metrics: object | None
    shardings: tuple


def _pipeline(parallel: ParallelConfig, train: TrainConfig, program=None):
    from jphantom.pipeline.runner import pipeline_for

    mesh = program.mesh if program is not None else parallel.mesh_config()
    return pipeline_for(mesh, train.batch, schedule=parallel.schedule,
                        microbatches=parallel.microbatches,
                        virtual_stages=parallel.virtual_stages)


def pipeline_summary(pipeline, mesh) -> dict:
    """What ``results.json`` and ``inspect`` report of a step's pipeline: the schedule, the
    micro-batches (per data rank), the virtual stages per device and the stages of ``mesh``."""
    return {"schedule": pipeline.schedule, "microbatches": pipeline.microbatches,
            "virtual_stages": pipeline.virtual_stages, "stages": mesh.size("stage")}


def _optimizer(train: TrainConfig, step: StepConfig):
    import optax

    optimizer = dataclasses.replace(train, grad_norm=False).optimizer_transform()
    if step.clip_norm is not None:  # exact: the update sees the global gradients
        optimizer = optax.chain(optax.clip_by_global_norm(step.clip_norm), optimizer)
    if train.grad_norm:  # the norm before clipping, as Megatron and torchtitan log it
        from jphantom.metrics import record_grad_norm
        optimizer = optax.chain(record_grad_norm(), optimizer)
    if train.on_nonfinite == "skip":  # a non-finite gradient: no update, counted in the state
        optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=2 ** 30)
    return optimizer


def _train_step(config, program, mesh, optimizer):
    return program.train_step(mesh, optimizer, zero=config.step.zero,
                              accumulate=config.step.accumulate,
                              precision=config.step.precision, remat=config.step.step_remat,
                              pipeline=_pipeline(config.parallel, config.train, program),
                              attention=config.step.attention)


@functools.lru_cache(maxsize=16)
def _build(model: ModelConfig, parallel: ParallelConfig, step: StepConfig,
           train: TrainConfig, devices: tuple) -> Built:
    from jphantom import program as programs

    mesh_config = parallel.mesh_config()
    if mesh_config.device_count > len(devices):
        raise ConfigError(f"mesh {mesh_config} needs {mesh_config.device_count} devices but "
                          f"{len(devices)} are available: pass --devices "
                          f"{mesh_config.device_count} to simulate them on CPU, or a smaller "
                          "mesh")
    used = devices[:mesh_config.device_count]
    idle = sorted({d.process_index for d in devices} - {d.process_index for d in used})
    if idle:  # a process with no device of the mesh has no part of the step to run
        processes = len({d.process_index for d in devices})
        raise ConfigError(f"mesh {mesh_config} uses {len(used)} of the {len(devices)} devices of "
                          f"{processes} processes; process(es) {', '.join(map(str, idle))} hold "
                          "none of them: give the mesh every process's devices, or start fewer "
                          "processes")
    options = {}
    if parallel.sequence_parallel:
        options["sequence_parallel"] = True
    if parallel.dtd:
        options["dtd"] = True
    if parallel.collective_matmul:
        options["collective_matmul"] = True
    if parallel.mesh_config().size("context") > 1:
        options["context_attention"] = parallel.context_attention
        options["load_balance"] = parallel.load_balance
    if model.name != "ffn" and parallel.strategy.startswith("phantom"):
        options["ghost_width"] = model.ghost_width  # LlamaConfig holds no k: the plan takes it
    if model.from_hf:
        from jphantom.models import hf
        options["model"] = hf.load(model.from_hf)
    program = programs.build(model.family_config(parallel.strategy), parallel.strategy,
                             mesh_config, **options)
    mesh = program.mesh.build(devices[:program.mesh.device_count])
    config = _Sections(model, parallel, step, train)
    train_step = _train_step(config, program, mesh, _optimizer(train, step))
    _check_batch(train.batch, train_step, program.mesh)
    metrics = None
    if program.metrics_fn is not None and train_step.pipeline is None:
        metrics = train_step.metrics(program.metrics_fn)
    return Built(program, mesh, train_step, train_step.loss(), metrics,
                 train_step.batch_shardings(2))


def _check_batch(batch: int, train_step, mesh) -> None:
    """The global ``batch`` splits evenly over the mesh axes its rows are split on (``data``;
    ``expert`` / ``z`` where the model has them) and each rank's share over the accumulation
    micro-batches (a pipeline's micro-batches: :func:`jphantom.pipeline.runner.pipeline_for`)."""
    spec = train_step.batch_shardings(2)[0].spec  # (inputs, targets): rows split alike
    rows = spec[0] if len(spec) else None
    axes = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    ranks = math.prod(mesh.size(a) for a in axes)
    if batch % ranks:
        named = " x ".join(axes)
        word = "axis" if len(axes) == 1 else "axes"
        raise ConfigError(f"batch={batch} is not divisible by the {named} {word} ({ranks}) of mesh "
                          f"{mesh}: every {named} rank takes batch/{ranks} rows; pick a multiple "
                          f"of {ranks}")
    if train_step.pipeline is None and (batch // ranks) % train_step.accumulate:
        raise ConfigError(f"the per-data-rank batch {batch // ranks} is not divisible by "
                          f"accumulate={train_step.accumulate} (batch={batch} over {ranks} "
                          f"rank(s)): pick a batch that is a multiple of "
                          f"{ranks * train_step.accumulate}")


@dataclasses.dataclass(frozen=True)
class _Sections:
    model: ModelConfig
    parallel: ParallelConfig
    step: StepConfig
    train: TrainConfig


def load_toml(path: str) -> dict:
    """Flat settings from a TOML file: flat keys (``-`` or ``_``) and/or sections (``[model]``,
    ``[parallel]``, ``[step]``, ``[train]``); a value of the wrong type is refused by name when
    the configuration is built."""
    import tomllib

    try:
        with open(path, "rb") as handle:
            raw = tomllib.load(handle)
    except OSError as error:
        raise ConfigError(f"cannot read --config {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path} is not a text (TOML) file") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"--config {path} is not valid TOML: {error}") from None
    flat: dict = {}
    for key, value in raw.items():
        key = key.replace("-", "_")
        if key in SECTIONS and isinstance(value, dict):
            for inner, inner_value in value.items():
                inner = inner.replace("-", "_")
                fields = {f.name for f in dataclasses.fields(SECTIONS[key])}
                if inner not in fields:
                    raise ConfigError(f"--config {path}: [{key}] has no setting {inner!r}; "
                                      f"known: {sorted(fields)}")
                name = "model" if (key, inner) == ("model", "name") else inner
                if name in flat and flat[name] != inner_value:
                    raise ConfigError(f"--config {path}: {name!r} is set twice, {flat[name]!r} "
                                      f"and [{key}] {inner} = {inner_value!r}: keep one")
                flat[name] = inner_value
        else:
            if key in flat and flat[key] != value:
                raise ConfigError(f"--config {path}: {key!r} is set twice, {flat[key]!r} and "
                                  f"{value!r}: keep one")
            flat[key] = value
    unknown = sorted(set(flat) - set(FLAT) - set(ALIASES))
    if unknown:
        raise ConfigError(f"--config {path}: unknown settings {unknown}; known: {sorted(FLAT)}")
    return flat
