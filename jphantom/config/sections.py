"""The four sections of a run's configuration: what each setting is, its default, its help.

:class:`ModelConfig`, :class:`ParallelConfig`, :class:`StepConfig` and :class:`TrainConfig` are
frozen dataclasses validated on construction without jax, flax or numpy (types by annotation,
ranges and choices by name, against vocabularies that import none of them: the model families'
registry, :mod:`jphantom.registry.program`'s strategies, :mod:`jphantom.registry.attention_choices`, ...). Every
field carries its command-line help in its metadata (:func:`setting`): ``jphantom train``'s flags
are built from them (:mod:`jphantom.cli.parser`), so the words live here once. :data:`FLAT` maps
each flat name (a flag, a flat TOML key) to its section and field.
"""

import dataclasses
import math
import typing

from jphantom.registry import strategies
from jphantom.config import paths
from jphantom.errors import ConfigError
from jphantom.registry.dtypes import DTYPES
from jphantom.registry.nonfinite import NONFINITE

OPTIMIZERS = ("adamw", "adam", "sgd")
LR_SCHEDULES = ("constant", "cosine")


def setting(default, help: str, *, flag: str | None = None, aliases: tuple[str, ...] = ()):
    """A section's field: its ``default`` and, in its metadata, its command-line ``help``, the
    flat ``flag`` name where it differs from the field's (``--model`` is ``model.name``) and the
    flat ``aliases`` the same setting also answers to (``--from-gpt2`` is ``--from-hf``)."""
    metadata = {"help": help}
    if flag is not None:
        metadata["flag"] = flag
    if aliases:
        metadata["aliases"] = tuple(aliases)
    return dataclasses.field(default=default, metadata=metadata)


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


def _family_fields(cls):
    """``cls`` (the model section's common fields) with the fields the model families declare
    (:class:`jphantom.registry.families.Field`, :func:`jphantom.registry.families.section_fields`), each's help
    prefixed with the families that read it where not all do, made a frozen dataclass."""
    from jphantom.registry import families

    declared = families.section_fields()
    everyone = set(families.names())
    for name, (field, readers) in declared.items():
        text = field.help if set(readers) >= everyone else f"{', '.join(readers)}: {field.help}"
        cls.__annotations__[name] = field.type
        setattr(cls, name, setting(field.default, text))
    cls.FAMILY_FIELDS = tuple(field for field, _ in declared.values())
    return dataclasses.dataclass(frozen=True)(cls)


@_family_fields
class ModelConfig:
    """The model: ``name`` (a family of :mod:`jphantom.registry.families`'s registry: ``ffn``, seed
    000's FFN of ``width`` x ``depth``; ``gpt2``; ``llama`` (Mixtral with ``moe_every=1``);
    ``mistral``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``gemma3``; or a user's registered family)
    and its shape. The fields every language model reads are written here; the others (``width``,
    ``depth``, ``ghost_width``, ``kv_heads``, ``intermediate``, ``sliding_window``, the MoE
    settings) are the families' declarations (:attr:`jphantom.registry.families.Family.fields`), added with
    their defaults, help and least values when this class is made (``FAMILY_FIELDS``). A field the
    family does not read, set away from its default, is refused by name."""

    name: str = setting(
        "gpt2", "the model family: ffn (Seal et al.'s teacher task), gpt2 (alias transformer), "
        "llama (Mixtral with --moe-every 1), mistral, qwen2, qwen3, qwen3_moe, gemma3, or a "
        "family registered with jphantom.registry.families.register; the language models on byte-level "
        "text unless --data and --tokenizer say otherwise; with --from-hf and no --model, the "
        "checkpoint's model_type chooses it", flag="model")
    layers: int = setting(4, "transformer blocks")
    hidden: int = setting(256, "transformer width h")
    heads: int = setting(4, "attention heads")
    seq_len: int = setting(128, "tokens per sequence")
    vocab: int = setting(256, "vocabulary size (256 for bytes)")
    dtype: str = setting("float32", "float32, bfloat16, float16 or float64")
    from_hf: str | None = setting(
        None, "start from a Hugging Face directory (config.json + model.safetensors; GPT-2, "
        "Llama, Mixtral, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3); its config.json's "
        "model_type chooses the family unless --model is given, which must read it (alias "
        "--from-gpt2)", aliases=("from_gpt2",))

    def __post_init__(self):
        from jphantom.registry import families

        _check_types(self)
        family = families.get(self.name)
        object.__setattr__(self, "name", family.name)
        _at_least(self, 1, "layers", "hidden", "heads", "seq_len", "vocab")
        for field in self.FAMILY_FIELDS:
            field.check(getattr(self, field.name))
        _choice("dtype", self.dtype, DTYPES)
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
        """The registered :class:`jphantom.registry.families.Family` of ``name``."""
        from jphantom.registry import families

        return families.get(self.name)

    def family_config(self, strategy: str):
        """The model family's configuration (:class:`~jphantom.models.ffn.FFNConfig`,
        :class:`~jphantom.models.gpt2.TransformerConfig`,
        :class:`~jphantom.models.llama.LlamaConfig`, ...) for ``strategy``: the family's
        ``from_flags`` (a phantom GPT-2 has an untied head: its feature-split activations would
        all-reduce a tied head's logits)."""
        from jphantom.registry.strategies import get

        return self.family.from_flags(self, get(strategy).needs_ghost_width)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: ``strategy`` (:data:`jphantom.registry.strategies.NAMES`), ``mesh`` (default
    ``model=1`` for dense, else ``model=<all devices>``), Megatron sequence parallelism, DTD,
    with a ``stage`` axis the pipeline ``schedule``, ``microbatches`` per step and data rank
    (default: the stages), ``virtual_stages`` (interleaved 1F1B), ``unroll_layers`` and
    ``accumulate_grads_in`` (:class:`jphantom.pipeline.config.PipelineConfig`'s), and with a
    ``context``
    axis the ``context_attention`` (``ring`` or ``all-gather``) and ``load_balance``."""

    strategy: str = setting(
        "dense", "parallel strategy: " + ", ".join(strategies.NAMES))
    mesh: str | None = setting(
        None, "mesh axes, e.g. data=2,model=4; add stage=P to pipeline the step over P stages "
        "(tensor, phantom, pmm3d; gspmd with --schedule gpipe), e.g. stage=2,data=2,model=2; "
        "expert=G splits MoE experts; pmm3d runs on data, expert, z, y, x, e.g. "
        "data=2,z=2,y=1,x=2 (default model=1 for dense, else model=<all devices>)")
    sequence_parallel: bool = setting(
        False, "transformer under tensor: Megatron sequence parallelism")
    dtd: bool = setting(
        False, "MoE under tensor (TED): duplicate token dropping, all-to-all bytes / model axis")
    schedule: str = setting(
        "1f1b", "with a stage axis: the pipeline schedule, gpipe, 1f1b, interleaved-1f1b, zb-h1 "
        "or zb-v (see `jphantom schedule`)")
    microbatches: int | None = setting(
        None, "with a stage axis: micro-batches per step on each data rank; batch / data must be "
        "a multiple (default: the number of stages)")
    virtual_stages: int = setting(
        1, "with a stage axis and interleaved-1f1b: model chunks per device")
    unroll_layers: int | None = setting(
        None, "with a stage axis: a model chunk of at most this many layers runs them unrolled, "
        "not under lax.scan (0: always scanned; default: the pipeline's, 8)")
    accumulate_grads_in: str | None = setting(
        None, "with a stage axis: the dtype the pipeline sums each gradient in across its "
        "micro-batches, float32 (Megatron's main_grad) or compute (the dtype it is computed in: "
        "bf16 under --precision bf16 --master-weights sharded, as NeMo's distributed Adam with "
        "grad_sync_dtype bf16; half the gradient buffers; default: the pipeline's, float32)")
    context_attention: str = setting(
        "ring", "with a context=C mesh axis (the sequence split over C devices): ring (K/V "
        "passed around the ring, the default) or all-gather attention")
    load_balance: bool = setting(
        True, "with a context axis: the load-balanced causal layout (rank r holds chunks r and "
        "2C-1-r; --no-load-balance: contiguous chunks)")
    collective_matmul: bool = setting(
        False, "with --sequence-parallel: each all-gather and reduce-scatter over the model axis "
        "as p-1 ring steps under the GEMMs of the chunks at hand (collective matmul; the same "
        "bytes)")

    def __post_init__(self):
        from jphantom.registry.attention_choices import ALGORITHMS
        from jphantom.pipeline.schedule import ALL_SCHEDULES
        from jphantom.registry.strategies import check_collective_matmul, get

        _check_types(self)
        get(self.strategy)
        _choice("schedule", self.schedule, ALL_SCHEDULES)
        _choice("context_attention", self.context_attention, ALGORITHMS)
        _at_least(self, 1, "microbatches", "virtual_stages")
        _at_least(self, 0, "unroll_layers")
        if self.accumulate_grads_in is not None:
            from jphantom.pipeline.config import GRAD_SUMS

            _choice("accumulate_grads_in", self.accumulate_grads_in, GRAD_SUMS)
        check_collective_matmul(self.collective_matmul, self.sequence_parallel)
        self.declared_mesh()

    def declared_mesh(self):
        """The mesh as given (``mesh``, or ``model=1`` for ``dense``), parsed and validated; None
        when it is left to the devices (``model=<all of them>``: :meth:`mesh_config`). Reads
        nothing but the configuration."""
        from jphantom.runtime.mesh import MeshConfig
        from jphantom.registry.strategies import get

        if self.mesh is not None:
            return MeshConfig.parse(self.mesh)
        if get(self.strategy).one_device:
            return MeshConfig.parse("model=1")
        return None

    def mesh_config(self):
        from jphantom.runtime.mesh import MeshConfig
        from jphantom.registry.strategies import get

        if self.mesh is not None:
            return MeshConfig.parse(self.mesh)
        if get(self.strategy).one_device:
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

    zero: int = setting(
        0, "ZeRO stage of the data axis (tensor or phantom, a mesh with data=D): 0 plain data "
        "parallelism, 1 optimizer state, 2 + gradients (with --accumulate, each micro-batch's "
        "reduce-scattered into float32 shards), 3 + parameters sharded over data (default 0)")
    accumulate: int = setting(
        1, "gradient accumulation: micro-batches per step, one gradient reduction per step; "
        "batch / data must be a multiple (pipelines: use --microbatches; default 1)")
    clip_norm: float | None = setting(
        None, "clip the gradients to this global norm, computed over all shards (default: no "
        "clipping)")
    precision: str = setting(
        "float32", "mixed precision: float32, bf16 or float16 compute with float32 master "
        "weights and optimizer state (float16 with loss scaling)")
    master_weights: str = setting(
        "replicated", "where the float32 master weights live: replicated (the parameters, on "
        "every data rank) or sharded (Megatron's distributed optimizer: float32 master and Adam "
        "moments in ZeRO-1's shards over data (x context), bf16 parameters all-gathered once per "
        "step, bf16 "
        "gradients reduce-scattered; needs --precision bf16 or fp8, --zero 1 or 2)")
    remat: str | None = setting(
        None, "activation checkpointing per layer, named for what it keeps (default none): none, "
        "nothing_saveable, dots_saveable, collectives_saveable (keeps collective outputs: a "
        "recompute repeats no collective), dots_collectives_saveable, dots_attention_saveable "
        "(MaxText's minimal_flash), qkv_saveable (MaxText's save_qkv_proj), "
        "dots_but_mlp_in_saveable (MaxText's save_dot_except_mlpwi) or "
        "all_but_attention_core_saveable (Megatron's selective recompute)")
    cac: bool = setting(
        False, "communication-aware checkpointing (Singh's thesis): --remat collectives_saveable")
    attention: str = setting(
        "auto", "the attention kernel: auto (cuDNN's flash attention on NVIDIA GPUs in bf16 or "
        "fp16, XLA's path elsewhere; the choice is printed), xla, or cudnn (an error where cuDNN "
        "cannot run)")

    def __post_init__(self):
        from jphantom.registry.attention_choices import IMPLEMENTATIONS
        from jphantom.step.precision import NAMES as PRECISIONS
        from jphantom.step.remat import NAMES as REMATS, with_cac

        _check_types(self)
        _choice("zero", self.zero, (0, 1, 2, 3))
        _at_least(self, 1, "accumulate")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(f"clip_norm={self.clip_norm} must be > 0 (or left out)")
        _choice("precision", self.precision, tuple(PRECISIONS))
        _choice("master_weights", self.master_weights, ("replicated", "sharded"))
        if self.remat is not None:
            _choice("remat", self.remat, REMATS)
        _choice("attention", self.attention, IMPLEMENTATIONS)
        with_cac(self.remat, self.cac)

    @property
    def step_remat(self) -> str:
        from jphantom.step.remat import with_cac

        return with_cac(self.remat, self.cac)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training run: global ``batch`` (sequences or rows), ``steps``, the optimizer and its
    schedule (linear warm-up, then constant or cosine to 0.1x), evaluation, an optional
    ``target_loss`` to stop at (held-out loss, checked at each evaluation), the seed, the
    ``data`` (a text file, a token file or a folder of them: :mod:`jphantom.data.tokens`) and the
    ``tokenizer`` text goes through (:func:`jphantom.data.tokenizers.load_tokenizer`; ``None``:
    bytes), the ``out`` folder (``None``: write nothing), a Hugging Face directory to save into,
    Orbax checkpoints, and what is reported per step (:mod:`jphantom.costs.metrics`): the gradient norm
    (``grad_norm``, recorded by the optimizer; ``jphantom train`` turns it on) and TensorBoard
    events (``tensorboard``, into ``out/tensorboard``)."""

    batch: int = setting(16, "global batch (sequences or rows)")
    steps: int = setting(300, "optimizer steps")
    optimizer: str = setting("adamw", "adamw, adam or sgd")
    learning_rate: float = setting(3e-3, "peak learning rate")
    weight_decay: float = setting(1e-4, "AdamW weight decay")
    adam_b2: float = setting(0.95, "Adam's second-moment decay beta2")
    warmup_steps: int = setting(10, "linear warm-up steps")
    lr_schedule: str = setting("constant", "learning rate after warm-up: constant or cosine")
    eval_every: int = setting(50, "validate every N steps")
    eval_batches: int = setting(8, "validation batches per evaluation")
    target_loss: float | None = setting(
        None, "stop once the validation loss reaches this (checked at each evaluation)")
    seed: int = setting(0, "random seed")
    data: str | None = setting(
        None, "what to train on: a text file, a token file (.bin: llm.c's with a header or "
        "nanoGPT's uint16 tokens; `jphantom tokenize` writes them), a dataset file (.jsonl, "
        ".json, .parquet, .arrow: rows of text, prompt/completion or messages, tokenised with "
        "--tokenizer or the --from-hf checkpoint's tokenizer.json) or a folder of token or "
        "dataset files (the validation split: a file or folder of the data folder named by the "
        "word val, valid, validation, dev or eval, test ones left out, one rule for both) "
        "(default: the Python "
        "standard library's sources as bytes)")
    tokenizer: str | None = setting(
        None, "the tokenizer text goes through: bpe (the bundled byte-level BPE, 1024 ids), a "
        "Hugging Face tokenizer.json (or its folder), a .tiktoken file, or a tiktoken encoding "
        "name already in tiktoken's cache; nothing downloads; --vocab must be at least its size "
        "(default: none, bytes)")
    val_data: str | None = setting(
        None, "with dataset files: the validation rows, a dataset file or a folder of them "
        "(default: the --data folder's validation files, those with a file or folder named val, "
        "valid, validation, dev or eval, else the last one percent of the rows, at least one)")
    chat_template: str | None = setting(
        None, "with dataset files: the Jinja chat template rows of messages are rendered with, "
        "a .jinja file or a tokenizer_config.json (default: the --from-hf checkpoint's "
        "chat_template.jinja or tokenizer_config.json, else the --tokenizer folder's)")
    loss_on: str | None = setting(
        None, "with dataset files: the tokens the loss is taken on: assistant (the assistant "
        "turns of conversations), completion (the completion of prompt/completion rows) or all "
        "(default, as TRL's SFTTrainer: completion for prompt/completion rows, all for messages "
        "and text)")
    pack: bool = setting(
        False, "with dataset files: pack the documents into rows of --seq-len (each attends "
        "only within itself, positions restart; a document crossing a row's end goes on in the "
        "next) instead of one document per row, truncated to --seq-len and padded (default: "
        "padded)")
    refuse_lost_text: bool = setting(
        False, "with dataset files: refuse the data when the tokenizer cannot represent some of "
        "its characters (it drops them) instead of a warning naming the count and the first "
        "row (default: warn)")
    out: str | None = setting("out/train", "output folder")
    save_hf: str | None = setting(
        None, "save the trained model as a Hugging Face directory (alias --save-gpt2)",
        aliases=("save_gpt2",))
    checkpoint_dir: str | None = setting(
        None, "save Orbax checkpoints (asynchronous, atomic) into this folder")
    save_every: int = setting(
        0, "with --checkpoint-dir: save every N steps, and at the end (0: only at the end)")
    keep_checkpoints: int = setting(3, "with --checkpoint-dir: keep the newest K checkpoints")
    resume: bool = setting(
        False, "continue from the newest checkpoint in --checkpoint-dir (state, history, data "
        "position), on this run's mesh (tensor and dense-shaped models may change mesh)")
    progress: bool = setting(True, "show a progress bar")
    grad_norm: bool = setting(
        False, "record the gradients' global norm every step in metrics.jsonl (one more "
        "reduction per step) (default: on for train)")
    tensorboard: bool = setting(
        False, "also write the per-step metrics as TensorBoard events into OUT/tensorboard "
        "(needs pip install tensorboardX) (default: off)")
    on_nonfinite: str = setting(
        "stop", "a non-finite loss or state (the names of make_train_step's on_nonfinite): warn "
        "(go on, one line the first time), skip (the update is dropped and counted; 10 in a row "
        "stop the run), stop (one line naming the newest checkpoint, the last good state) or "
        "rollback (reload the newest checkpoint whose recorded loss and parameters are finite "
        "and skip the batch; 5 rollbacks without a new checkpoint stop the run; needs "
        "--checkpoint-dir and --save-every); checkpoints are written only from a finite state "
        "whose recorded losses are finite (default stop)")
    step_timeout: float | None = setting(
        None, "seconds a step (after the first, which compiles) or an evaluation may take; past "
        "it every process exits 124 with one line (a stuck rank or collective; default: off with "
        "one process, with several max(300 s, 50 x the slowest step) once two steps ran)")

    def __post_init__(self):
        _check_types(self)
        _at_least(self, 1, "batch", "steps", "eval_every", "eval_batches", "keep_checkpoints")
        _at_least(self, 0, "warmup_steps", "seed", "save_every")
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.loss_on is not None:
            from jphantom.data.documents import LOSS_ON

            _choice("loss_on", self.loss_on, LOSS_ON)
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate={self.learning_rate} must be > 0")
        if self.weight_decay < 0 or not 0 <= self.adam_b2 < 1:
            raise ConfigError("weight_decay must be >= 0 and adam_b2 in [0, 1)")
        if self.target_loss is not None and not self.target_loss > 0:
            raise ConfigError(f"target_loss={self.target_loss} must be > 0 (or left out)")
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
            from jphantom.costs.metrics import require_tensorboard

            require_tensorboard()
            if self.out is None:
                raise ConfigError("tensorboard=True writes into the out folder: give --out DIR")

    def check_paths(self) -> None:
        """What this run reads and writes, on this machine (:meth:`RunConfig.build` calls it,
        before anything is built): the output folders can be made and written (written at the
        end: checked first), ``data`` is readable, the tokenizer loads."""
        paths.check_paths(self.out, self.checkpoint_dir, self.save_hf, self.data,
                          self.tokenizer)
        paths.check_document_options(self.data, self.pack, self.loss_on, self.chat_template,
                                     self.val_data, self.refuse_lost_text)

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
        """The optax rule on :meth:`schedule` (``adamw``, ``adam`` or ``sgd``); the run's
        optimizer is assembled around it in one place
        (:func:`jphantom.config.built.optimizer_of`: clipping, the gradient norm)."""
        import optax

        schedule = self.schedule(total_steps)
        if self.optimizer == "adamw":
            return optax.adamw(schedule, b2=self.adam_b2, weight_decay=self.weight_decay)
        if self.optimizer == "adam":
            return optax.adam(schedule, b2=self.adam_b2)
        return optax.sgd(schedule)


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "step": StepConfig,
            "train": TrainConfig}
# flat name (CLI flag, flat TOML key) -> (section, field); --model is model.name (its "flag")
FLAT: dict[str, tuple[str, str]] = {
    **{f.name: (section, f.name) for section, cls in SECTIONS.items()
       for f in dataclasses.fields(cls) if "flag" not in f.metadata},
    **{f.metadata["flag"]: (section, f.name) for section, cls in SECTIONS.items()
       for f in dataclasses.fields(cls) if "flag" in f.metadata},
}
# another flat name -> the flat name it stands for (GPT-2's names for the same thing)
ALIASES = {alias: f.metadata.get("flag", f.name) for cls in SECTIONS.values()
           for f in dataclasses.fields(cls) for alias in f.metadata.get("aliases", ())}


def field_of(flat: str) -> dataclasses.Field:
    """The section's field behind the flat name ``flat`` (a key of :data:`FLAT`)."""
    section, name = FLAT[flat]
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
