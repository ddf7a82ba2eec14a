"""The memory a GPU run gets, and the budget XLA compiles its step to.

**The allocator's limit.** On a GPU, jax's allocator may take
``XLA_PYTHON_CLIENT_MEM_FRACTION`` of each device's memory: of ``cudaMemGetInfo``'s total,
which XLA's target descriptions hold as ``device_memory_size``. jphantom's GPU runs set the
fraction to 0.9 where the environment does not
(:data:`jphantom.runtime.gpu_defaults.ENVIRONMENT`); jax's own default is 0.75. A step's
compiled peak fits the run when it is at most this limit (:func:`allocator_bytes`), not the
device's whole memory.

**XLA's budget.** jax passes the allocator's limit to XLA with every compilation
(``ExecutableBuildOptions.device_memory_size``, set from the device's ``bytes_limit`` by jaxlib's
``PyClient`` compile in ``xla/python/py_client.cc``). XLA's GPU
scheduler and its rematerialisation pass then aim at the budget of ``GetSchedulerMemoryLimit`` in
XLA's ``gpu_hlo_schedule.cc``::

    (limit - inputs - outputs + aliased) x --xla_gpu_memory_limit_slop_factor / 100  (default 95)

**Without a GPU** there is no allocator. XLA falls back to 80% of the description's memory, a
smaller budget than the run's compile gets, so an ahead-of-time compile rematerialises more than
the run's would. :func:`runtime_slop_factor` gives the slop factor that makes the ahead-of-time
budget the run's. :func:`io_bytes` estimates the inputs and outputs before compiling, from the
step's abstract arguments. The compiled program's own figures
(``memory_analysis()``: arguments + outputs - aliased) then check the estimate.

With ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` jax's allocator has no limit to pass. XLA's 80% then
holds on the GPU too, and :func:`memory_fraction` returns None.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

import numpy as np

from jphantom.errors import ConfigError

XLA_SLOP_PERCENT = 95      # --xla_gpu_memory_limit_slop_factor's default (debug_options_flags.cc)
XLA_FALLBACK_PERCENT = 80  # of the description's memory when no limit is passed
JAX_DEFAULT_FRACTION = 0.75  # jax's allocator without XLA_PYTHON_CLIENT_MEM_FRACTION
SLOP_FLAG = "--xla_gpu_memory_limit_slop_factor"


def memory_fraction(jphantom_defaults: bool, environ: Mapping[str, str] | None = None
                    ) -> float | None:
    """The fraction of each GPU's memory the run's allocator takes. It comes from
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` where set, else jphantom's GPU default where
    ``jphantom_defaults`` (:mod:`jphantom.runtime.gpu_defaults`), else jax's 0.75. It is None
    under ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``, which has no limit. Raises
    :class:`ConfigError` for a value that is not a fraction."""
    from jphantom.runtime.gpu_defaults import ENVIRONMENT

    environ = os.environ if environ is None else environ
    if environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return None
    name = "XLA_PYTHON_CLIENT_MEM_FRACTION"
    text = environ.get(name) or (ENVIRONMENT[name] if jphantom_defaults else None)
    if text is None:
        return JAX_DEFAULT_FRACTION
    try:
        fraction = float(text)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction <= 1:
        raise ConfigError(f"{name}={text!r}: give the fraction of each GPU's memory jax's "
                          "allocator may take, above 0 and at most 1 (e.g. 0.9)")
    return fraction


def allocator_bytes(device_bytes: int, fraction: float | None) -> int:
    """The allocator's limit on a device of ``device_bytes``: the memory a step's peak must fit
    (the whole device under the platform allocator, ``fraction`` None)."""
    return device_bytes if fraction is None else int(device_bytes * fraction)


def scheduler_budget(limit_bytes: int, io: int, slop_percent: int = XLA_SLOP_PERCENT) -> int:
    """XLA's scheduling and rematerialisation budget for a program whose inputs and outputs,
    aliased ones once, take ``io`` bytes, under a memory limit of ``limit_bytes``."""
    return max(0, limit_bytes - io) * slop_percent // 100


def runtime_slop_factor(device_bytes: int, fraction: float | None, io: int,
                        slop_percent: int = XLA_SLOP_PERCENT) -> int:
    """The slop factor that gives an ahead-of-time compile, whose limit is XLA's fallback of 80%
    of ``device_bytes``, the budget the run's compile gets from its allocator (``fraction`` of
    the device). With the platform allocator (``fraction`` None) the run falls back too, and the
    factor is unchanged."""
    if fraction is None:
        return slop_percent
    fallback = device_bytes * XLA_FALLBACK_PERCENT // 100 - io
    if fallback <= 0:
        return slop_percent
    return max(1, round(slop_percent * (allocator_bytes(device_bytes, fraction) - io) / fallback))


def io_bytes(arguments, args_info, outputs) -> int:
    """Per-device bytes of a step's inputs and outputs, aliased ones once (XLA's
    ``total_io_size``), estimated before compiling. ``arguments`` are the abstract arguments,
    with shardings. ``args_info`` is ``lowered.args_info`` (which are donated). ``outputs`` is
    ``lowered.out_info``. An output of a donated argument's shape and dtype is that argument's
    buffer. Any other output takes its sharding's shard, or the whole array where the lowering
    has not decided its sharding yet. XLA also counts the tuples' pointer tables, a few bytes per
    leaf, left out here."""
    import jax

    def shard_bytes(struct, sharding) -> int:
        shape = struct.shape if sharding is None else sharding.shard_shape(struct.shape)
        return math.prod(shape) * np.dtype(struct.dtype).itemsize

    arguments = jax.tree.leaves(arguments)
    donated: dict[tuple, list] = {}
    for struct, info in zip(arguments, jax.tree.leaves(args_info), strict=True):
        if info.donated:
            donated.setdefault((tuple(struct.shape), np.dtype(struct.dtype)), []).append(struct)
    total = sum(shard_bytes(a, a.sharding) for a in arguments)
    for out in jax.tree.leaves(outputs):
        pool = donated.get((tuple(out.shape), np.dtype(out.dtype)))
        if pool:
            pool.pop()  # shares the argument's buffer: counted once, with the arguments
        else:
            total += shard_bytes(out, getattr(out, "sharding", None))
    return total


def compiled_io_bytes(memory: Mapping[str, int]) -> int:
    """XLA's ``total_io_size`` from a compiled program's memory analysis
    (:func:`jphantom.analysis.compiled.compiled_memory`; 0 for a figure it lacks)."""
    return (memory.get("argument_bytes", 0) + memory.get("output_bytes", 0)
            - memory.get("alias_bytes", 0))


def slop_from_flags(xla_flags: str) -> int:
    """The slop factor ``xla_flags`` sets (XLA's default where it does not)."""
    for word in xla_flags.split():
        if word.startswith(SLOP_FLAG + "="):
            try:
                return int(word.split("=", 1)[1])
            except ValueError:
                raise ConfigError(f"{word}: XLA's slop factor is a whole percent "
                                  f"({SLOP_FLAG}=95)") from None
    return XLA_SLOP_PERCENT


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """A GPU run's memory: the device's bytes (its description's ``device_memory_size``), the
    fraction the run's allocator takes (:func:`memory_fraction`) and XLA's slop factor. It gives an
    ahead-of-time compile the run's budget (:meth:`compiler_options`) and says whether a compiled
    peak fits the run (:meth:`report`)."""

    device_bytes: int
    fraction: float | None
    slop_percent: int = XLA_SLOP_PERCENT

    @classmethod
    def of(cls, device_bytes: int, jphantom_defaults: bool, xla_flags: str) -> "GpuMemory":
        return cls(device_bytes, memory_fraction(jphantom_defaults), slop_from_flags(xla_flags))

    @property
    def limit_bytes(self) -> int:
        return allocator_bytes(self.device_bytes, self.fraction)

    def compiler_options(self, lowered, arguments) -> dict[str, int]:
        """The slop factor, as a compile option, that makes XLA's budget for ``lowered`` (whose
        abstract ``arguments`` give its inputs) the run's."""
        io = io_bytes(arguments, lowered.args_info, lowered.out_info)
        return {SLOP_FLAG.lstrip("-"): runtime_slop_factor(self.device_bytes, self.fraction, io,
                                                           self.slop_percent)}

    def report(self, peak: int, memory: Mapping[str, int]) -> dict:
        """``fits``: the compiled ``peak`` within the allocator's limit; the limit, the fraction,
        the fraction the peak needs, and XLA's budget from the compiled inputs and outputs."""
        io = compiled_io_bytes(memory) if "argument_bytes" in memory else None
        return {"allocator_fraction": self.fraction, "limit_bytes": self.limit_bytes,
                "fraction_needed": peak / self.device_bytes,
                "scheduler_budget_bytes": None if io is None else
                scheduler_budget(self.limit_bytes, io, self.slop_percent),
                "fits": peak <= self.limit_bytes}


__all__ = ["GpuMemory", "JAX_DEFAULT_FRACTION", "SLOP_FLAG", "XLA_FALLBACK_PERCENT",
           "XLA_SLOP_PERCENT", "allocator_bytes", "compiled_io_bytes", "io_bytes",
           "memory_fraction", "runtime_slop_factor", "scheduler_budget", "slop_from_flags"]
