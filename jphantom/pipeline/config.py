"""How a step is pipelined, as data: the schedule and its sizes (:class:`PipelineConfig`), the
pipeline a mesh and batch give (:func:`pipeline_for`), and the model cut for it (:class:`Stages`).
Validated before anything compiles; the executor is :mod:`jphantom.pipeline.runner`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from jphantom.errors import ConfigError, check_int
from jphantom.pipeline.schedule import ALL_SCHEDULES, SPLIT_SCHEDULES, chunks_of

STAGE_AXIS = "stage"
GRAD_SUMS = ("float32", "compute")  # PipelineConfig.accumulate_grads_in


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How a step is pipelined: the schedule, micro-batches per step (per data rank) and virtual
    stages per device (``interleaved-1f1b`` only). The split-backward schedules (``zb-h1``,
    ``zb-v``) split each backward into B and W (:mod:`jphantom.pipeline.split`).

    ``unroll_layers``: a model chunk of at most this many layers runs them unrolled, as
    Megatron-LM's Python loop over a chunk's layers does, instead of under ``lax.scan`` (0:
    always scanned). Scanned, a task took its chunk out of the stage's [V, ...] stack as a
    copy (a loop's operand is a buffer) and each layer sliced it again; unrolled, each layer's
    slice is taken from the stack at once. NeMo's Llama3.1-70B layout (4 layers a chunk,
    compiled for 64 H100, predicted): 21.2 -> 19.8 s a step, 72.8 -> 71.1 GiB.

    ``accumulate_grads_in``: the dtype the executor sums each gradient in across the step's
    micro-batches. ``float32`` (Megatron-LM's ``main_grad``, which it forces under bf16) or
    ``compute``: the dtype the task computes it in, bf16 under a bf16 precision with the
    master weights sharded (NeMo's distributed Adam with ``grad_sync_dtype: bf16`` and a
    contiguous gradient buffer, as its Llama3.1-70B recipe runs): half the gradient buffers and
    their adds, each micro-batch's gradient rounded to bf16 as it is added."""

    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    bubble_fill: float = 0.0  # what idle slots send; tests use NaN
    unroll_layers: int = 8
    accumulate_grads_in: str = "float32"

    def __post_init__(self):
        if self.schedule not in ALL_SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; use one of "
                              f"{', '.join(ALL_SCHEDULES)}")
        check_int("microbatches", self.microbatches)
        check_int("virtual_stages", self.virtual_stages)
        check_int("unroll_layers", self.unroll_layers, minimum=0)
        if self.accumulate_grads_in not in GRAD_SUMS:
            raise ConfigError(f"accumulate_grads_in={self.accumulate_grads_in!r}: use one of "
                              f"{', '.join(GRAD_SUMS)}")
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise ConfigError(f"virtual_stages={self.virtual_stages} applies to 'interleaved-1f1b' "
                              f"only, not {self.schedule!r}: pass --schedule interleaved-1f1b or "
                              "--virtual-stages 1")

    @property
    def split(self) -> bool:
        """Whether the schedule splits each backward into B and W (zero-bubble)."""
        return self.schedule in SPLIT_SCHEDULES

    @property
    def local_chunks(self) -> int:
        """Model chunks per device: the virtual stages, or 2 for ``zb-v``'s V placement."""
        return self.virtual_stages * chunks_of(self.schedule, 1)

    def check(self, stages: int, units: int, unit_name: str = "layers") -> None:
        """Raise ConfigError where this pipeline cannot cut a model of ``units`` on ``stages``."""
        chunks = stages * self.local_chunks
        if units % chunks:
            per = (f"stages x virtual stages = {stages} x {self.virtual_stages}"
                   if self.schedule != "zb-v" else f"2 x stages = 2 x {stages} (zb-v's chunks)")
            raise ConfigError(f"{unit_name}={units} is not divisible by {per}: every model chunk "
                              f"needs the same number of {unit_name}; pick a multiple of {chunks}")
        if self.schedule == "interleaved-1f1b" and self.microbatches % stages:
            raise ConfigError(f"interleaved-1f1b needs microbatches divisible by the {stages} "
                              f"stages (as Megatron-LM does), got microbatches={self.microbatches}: "
                              f"use a multiple of {stages}")

    def check_batch(self, batch: int) -> None:
        if batch % self.microbatches:
            raise ConfigError(f"the per-data-rank batch {batch} is not divisible by "
                              f"microbatches={self.microbatches}: pick a batch that is a multiple of "
                              f"{self.microbatches}, or fewer micro-batches")


def pipeline_for(mesh, batch: int, *, schedule: str = "1f1b", microbatches: int | None = None,
                 virtual_stages: int = 1, unroll_layers: int | None = None,
                 accumulate_grads_in: str | None = None) -> PipelineConfig | None:
    """The pipeline a step on ``mesh`` (a MeshConfig) runs: ``None`` without a ``stage`` axis (then
    the settings must keep their defaults), else the validated :class:`PipelineConfig`
    (``microbatches`` defaults to the number of stages, ``unroll_layers`` and
    ``accumulate_grads_in`` to :class:`PipelineConfig`'s), the per-data-rank ``batch`` checked
    against the micro-batches -- before anything compiles."""
    if STAGE_AXIS not in mesh.shape:
        given = [f"--{flag} {value}" for flag, value, default in (
            ("schedule", schedule, "1f1b"), ("microbatches", microbatches, None),
            ("virtual-stages", virtual_stages, 1), ("unroll-layers", unroll_layers, None),
            ("accumulate-grads-in", accumulate_grads_in, None))
            if value != default]
        if given:
            raise ConfigError(f"{' '.join(given)} only apply to a pipelined step, but mesh {mesh} "
                              f"has no stage axis: add stage=N to the mesh (e.g. --mesh "
                              f"stage=2,{mesh}) or leave the pipeline settings out")
        return None
    if microbatches is not None:
        check_int("microbatches", microbatches)
    given = {name: value for name, value in (("unroll_layers", unroll_layers),
                                             ("accumulate_grads_in", accumulate_grads_in))
             if value is not None}
    config = PipelineConfig(schedule, microbatches or mesh.size(STAGE_AXIS), virtual_stages,
                            **given)
    data = mesh.size("data")
    try:
        config.check_batch(batch // data)
    except ConfigError as error:
        raise ConfigError(f"batch={batch} over data={data}: {error}") from None
    return config


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model cut for pipelining (module docstring): ``units`` stacked blocks, called
    ``unit_name`` in errors, and the three per-rank functions (:mod:`jphantom.pipeline.runner`'s docstring)."""

    units: int
    unit_name: str
    first: Callable[[Any, jax.Array], jax.Array]
    body: Callable[[Any, jax.Array, jax.Array], jax.Array]
    last: Callable[[Any, jax.Array, jax.Array, int], jax.Array]
    # A chunk's parameters as ``body`` computes with them (the compute precision's cast): done
    # before ``jax.vjp``, so that the pullback's residuals hold the cast weights as the chunk's
    # own parameters (recast at the backward, not stashed per micro-batch); None: as stored.
    prepare: Callable[[Any], Any] | None = None
    # > 0: ``body`` takes its chunk as this many per-layer parameter trees (a list, each a slice
    # of the stack), not the stack [Lc, ...] (:meth:`jphantom.pipeline.runner._Step.layered`)
    layers: int = 0

