"""One run's configuration: the four sections together (:class:`RunConfig`), checked against
each other without jax, from the flat names of the command line (:meth:`RunConfig.from_flags`),
and the door to what it builds (:meth:`RunConfig.build`, :mod:`jphantom.config.built`)."""

import dataclasses

from jphantom.registry import strategies
from jphantom.config.built import (Built, build_cached, optimizer_of, pipeline_of,
                                   train_step_of)
from jphantom.config.sections import (ALIASES, FLAT, SECTIONS, ModelConfig, ParallelConfig,
                                      StepConfig, TrainConfig)
from jphantom.errors import ConfigError


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
        strategy = self.parallel.strategy
        strategies.check_dtd(strategy, self.parallel.dtd,
                             routed_experts=bool(self.model.moe_every))
        strategies.check_sequence_parallel(strategy, self.parallel.sequence_parallel,
                                           has_sequence=self.model.family.program == "lm")
        declared = self.parallel.declared_mesh()  # None: model=<every device> (no other axis)
        if declared is None or declared.size("context") == 1:
            for flag, value, default in (("--context-attention", self.parallel.context_attention,
                                          "ring"),
                                         ("--no-load-balance", self.parallel.load_balance, True)):
                if value != default:
                    raise ConfigError(f"{flag} applies to a mesh with a context axis (context=C, "
                                      "C > 1): add one to --mesh, or leave the flag out")
        if self.train.save_hf is not None and not self.model.family.declares("save_hf"):
            raise ConfigError(f"--save-hf: the {self.model.name} family has no Hugging Face "
                              "format; leave --save-hf out")
        if self.model.dtype == "float16" and self.train.optimizer != "sgd":
            raise ConfigError("dtype='float16' with an adaptive optimizer underflows Adam's "
                              "epsilon (1e-8 is 0 in float16): use --precision float16 (float32 "
                              "master weights), bfloat16, or --optimizer sgd")
        from jphantom.step.precision import Precision

        Precision.named(self.step.precision).check_master([self.model.dtype])
        if declared is not None and "stage" in declared.shape:
            strategies.check_stage(strategy, True)
            if self.step.accumulate != 1:
                raise ConfigError(f"--accumulate {self.step.accumulate} does not apply to a "
                                  "pipelined step: pipelines accumulate through --microbatches "
                                  "(per data rank); leave --accumulate out")
        strategies.check_ghost_width(strategy, self.model.ghost_width)
        self._check_model_on_mesh(declared)
        # what needs neither jax's devices nor a file: the family runs the strategy, its own
        # shape rules, a language model's mesh axes (the shapes against the mesh: build())
        from jphantom.registry import program as programs

        family = self.model.family
        programs.check_runs(family.name, self.parallel.strategy)
        if not self.model.from_hf:
            self.family_config()
        if family.program == "lm" and declared is not None:
            programs.check_lm_mesh(programs.get(self.parallel.strategy).name, declared)

    def _check_model_on_mesh(self, declared) -> None:
        """What the model has against what the mesh and step split: attention (a kernel, a
        context axis) and, with a stage axis, whole MoE groups per pipeline chunk."""
        model = self.model
        if model.family.program != "lm":  # the FFN: no attention, no sequence
            if self.step.attention != "auto":
                raise ConfigError(f"--attention {self.step.attention} does not apply to --model "
                                  f"{model.name}: it has no attention; leave --attention out")
            if declared is not None and declared.size("context") > 1:
                raise ConfigError(f"--mesh context={declared.size('context')} does not apply to "
                                  f"--model {model.name}: it has no sequence to split; drop "
                                  "context from --mesh")
        if (declared is None or "stage" not in declared.shape or not model.moe_every
                or "moe_every" not in model.family.accepted or model.layers % model.moe_every):
            return
        from jphantom.pipeline.config import PipelineConfig

        stages = declared.size("stage")
        chunks = stages * PipelineConfig(self.parallel.schedule, stages,
                                         self.parallel.virtual_stages).local_chunks
        groups = model.layers // model.moe_every
        if groups % chunks:
            raise ConfigError(
                f"--layers {model.layers} with --moe-every {model.moe_every} makes {groups} "
                f"group(s) of {model.moe_every} blocks (the last an MoE block), and each of the "
                f"{chunks} pipeline chunks holds the same number of whole groups: pick --layers "
                f"a multiple of {model.moe_every * chunks}")

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
        """The model under the strategy on the mesh (:func:`jphantom.registry.program.build`): validates
        every shape against the mesh; builds nothing concrete."""
        return self.build().program

    def pipeline(self, program=None):
        """The pipeline of a mesh with a ``stage`` axis (``None`` without one), validated, the
        per-data-rank batch checked against the micro-batches."""
        return pipeline_of(self.parallel, self.train, program)

    def optimizer(self):
        return optimizer_of(self.train, self.step)

    def train_step(self, program, mesh, optimizer=None):
        """The :class:`jphantom.TrainStep` of ``program`` on ``mesh`` with this run's step
        options (nothing compiled)."""
        return train_step_of(self, program, mesh, optimizer or self.optimizer())

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
        from jphantom.runtime.mesh import available_devices

        return build_cached(self.model, self.parallel, self.step, train, available_devices())
