"""The one run configuration: what ``train``, ``inspect``, ``compare`` and ``plan`` read.

A :class:`RunConfig` nests four frozen sections, each validated on construction (types by
annotation, never coerced by truthiness; ranges and choices by name; the sections against each
other), without jax: configuration is data. :func:`build` (``config.build()``) is the explicit
next step every command takes before it reads data: it builds the run's
:class:`jphantom.registry.program.Program`, its jax mesh and its step (nothing is compiled), which checks
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

The modules: :mod:`~jphantom.config.sections` (the four sections, each field's default and
help), :mod:`~jphantom.config.run_config` (:class:`RunConfig`),
:mod:`~jphantom.config.built` (what it builds), :mod:`~jphantom.config.paths` (what it reads
and writes on this machine) and :mod:`~jphantom.config.load` (a ``--config`` TOML file).
"""

from jphantom.config.built import Built, build, pipeline_summary
from jphantom.config.load import load_toml
from jphantom.config.paths import check_vocabulary
from jphantom.config.run_config import RunConfig
from jphantom.config.sections import (ALIASES, DTYPES, FLAT, LR_SCHEDULES, OPTIMIZERS, SECTIONS,
                                      ModelConfig, ParallelConfig, StepConfig, TrainConfig,
                                      field_of, setting)

__all__ = ["ALIASES", "DTYPES", "FLAT", "LR_SCHEDULES", "OPTIMIZERS", "SECTIONS", "Built",
           "ModelConfig", "ParallelConfig", "RunConfig", "StepConfig", "TrainConfig", "build",
           "check_vocabulary", "field_of", "load_toml", "pipeline_summary", "setting"]
