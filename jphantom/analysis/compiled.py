"""The compiled training step and what it says: the step ``train`` runs for a
:class:`jphantom.config.RunConfig`, built the same way and compiled on abstract parameters (nothing
allocated), and the readers of the executable: GEMM FLOPs from the optimized HLO's ``dot`` ops
(loop trip counts applied), XLA's ``cost_analysis()`` FLOPs, ``memory_analysis()``, the collectives
normalised, and the per-device bytes of the parameters, gradients and optimizer state from their
shardings. :mod:`jphantom.analysis.inspect` reports them, :mod:`jphantom.analysis.memory` checks
them against a device, :mod:`jphantom.analysis.timing` runs them side by side.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from jphantom.analysis.hlo import dot_flops, normalise_replica_groups
from jphantom.config import RunConfig

_MEMORY_FIELDS = ("argument", "output", "temp", "alias", "generated_code")


def build(config: RunConfig, optimizer=None, built=None):
    """The run's program, jax mesh and :class:`jphantom.TrainStep` (nothing compiled): what
    ``train`` builds (:meth:`RunConfig.build`'s, or ``built`` where the caller has it), or with
    ``optimizer`` the same step of that optax optimizer."""
    b = built if built is not None else config.build()
    if optimizer is None:
        return b.program, b.mesh, b.step
    return b.program, b.mesh, config.train_step(b.program, b.mesh, optimizer)


def abstract_batch(config: RunConfig, program, step) -> tuple:
    """``ShapeDtypeStruct``s of the batch with their shardings: FFN rows of ``width`` features,
    language models ``[batch, seq_len]`` token ids (inputs and targets)."""
    if config.model.family.is_language_model:
        seq = min(config.model.seq_len, getattr(program.config, "seq_len", config.model.seq_len))
        shape, dtype = (config.train.batch, seq), "int32"
    else:
        shape, dtype = (config.train.batch, config.model.width), config.model.dtype
    return tuple(jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=s)
                 for s in step.batch_shardings(2))


def normalise_collectives(found):
    """``found`` with :func:`normalise_replica_groups` applied to every collective's groups, so
    that ``hlo.summarize(found, axes=...)`` can map GSPMD's collectives onto mesh axes too."""
    return [dataclasses.replace(c, replica_groups=normalise_replica_groups(c.replica_groups))
            for c in found]


def compile_step(config: RunConfig, optimizer=None):
    """Lower and compile the run's training step on abstract parameters; returns ``(compiled,
    seconds_to_compile)``."""
    program, mesh, step = build(config, optimizer)
    return compile_built(config, program, step)


def compile_built(config, program, step, compiler_options: dict | None = None, *,
                  options_for=None):
    """Lower and compile ``step`` (of ``program``, built for ``config``) on abstract parameters
    and batch, with XLA's ``compiler_options`` (flag name -> value, for this compilation alone:
    :func:`jphantom.runtime.gpu_defaults.compiler_options`). ``options_for(lowered, arguments)``
    adds options decided from the lowered program (:meth:`jphantom.costs.budget.GpuMemory.
    compiler_options`). Returns ``(compiled, seconds_to_lower_and_compile)``."""
    start = time.perf_counter()
    arguments = (step.abstract_state(), *abstract_batch(config, program, step))
    lowered = step.lower(*arguments)
    if options_for is not None:
        compiler_options = {**(compiler_options or {}), **options_for(lowered, arguments)}
    compiled = lowered.compile(compiler_options=compiler_options) if compiler_options else \
        lowered.compile()
    return compiled, time.perf_counter() - start


def xla_flops(compiled) -> float:
    """FLOPs of a compiled executable as XLA's ``cost_analysis()`` counts them (per device for an
    SPMD program; element-wise work included). XLA counts the body of a ``while`` loop once,
    whatever its trip count, so for layers under ``lax.scan`` this undercounts: use
    :func:`gemm_flops` for a step's FLOPs."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def gemm_flops(compiled) -> int:
    """GEMM FLOPs per device of a compiled executable, every ``dot`` counted as many times as its
    loop runs (``hlo.dot_flops``; 2 per multiply-add, element-wise work left out)."""
    return dot_flops(compiled.as_text())[0]


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes from ``compiled.memory_analysis()``: ``temp_bytes`` (XLA's scratch: the
    activations, residuals and buffers live during the step), ``argument_bytes`` (parameters,
    optimizer state, batch), ``output_bytes``, ``alias_bytes`` (outputs sharing an argument's
    buffer) and ``generated_code_bytes``; also under XLA's own names (``temp_size_in_bytes``...).
    Empty where the backend reports nothing."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    values = {field: int(getattr(stats, f"{field}_size_in_bytes", 0)) for field in _MEMORY_FIELDS}
    return ({f"{field}_bytes": value for field, value in values.items()}
            | {f"{field}_size_in_bytes": value for field, value in values.items()})


def per_device_bytes(structs) -> int:
    """Bytes one device holds of a tree of sharded abstract arrays: per leaf, its shard's size
    (``sharding.shard_shape``) times its item size."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(structs))


def state_bytes(step) -> dict[str, int]:
    """Per-device bytes of the training state from its shardings: ``params_bytes``,
    ``gradient_bytes`` (the gradients the optimizer sees: the parameters' layout for ZeRO 0 and 1,
    whose all-reduce leaves the whole gradient on every data rank, ZeRO-sharded for ZeRO 2 and 3),
    ``optimizer_bytes`` (the optimizer's state: 0 for SGD) and ``zero``."""
    from jax.sharding import NamedSharding

    state = step.abstract_state()
    grads = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(step.mesh, spec))
             for a, spec in zip(step.layout.shapes, step.grad_specs)]
    out = {"params_bytes": per_device_bytes(state.params), "gradient_bytes": per_device_bytes(grads),
           "optimizer_bytes": per_device_bytes(state.opt_state), "zero": step.zero,
           "master_weights": getattr(step, "master_weights", "replicated")}
    out["model_state_bytes"] = sum(out[k] for k in ("params_bytes", "gradient_bytes",
                                                    "optimizer_bytes"))
    out.update(zero_formula_bytes(step, state.params))
    return out


def zero_formula_bytes(step, params) -> dict[str, float]:
    """ZeRO's model-state bytes per device for Adam (Cheng et al. Sec. 1.4, Table 1), with P the
    parameters per model-parallel rank (the ``data`` axis aside) and N the data-parallel degree
    (``data`` x ``context``: the ranks holding the same weights, which ZeRO shards over):
    Cheng et al.'s mixed-precision figures (2-byte parameters and gradients, 12 bytes of float32
    master weights and moments): 16P, 4P + 12P/N, 2P + 14P/N, 16P/N; and jphantom's, whose float32
    parameters are the master weights (no separate copy: the compute dtype is a cast inside the
    step): 4P parameters + 4P gradients + 8P moments = 16P, 8P + 8P/N, 4P + 12P/N, 16P/N. Only
    meaningful for Adam-like optimizers (two moments). ``master_weights="sharded"`` (ZeRO-1) is
    Cheng et al.'s own: 2P bf16 parameters and 2P bf16 gradients (both gathered whole inside the
    step, temporaries) + 12P/N."""
    sizes = dict(step.mesh.shape)
    n = sizes.get("data", 1) * sizes.get("context", 1)  # ZeRO's ranks (jphantom.step.zero)
    per_rank = sum(math.prod(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(params))
    sharded = step.zero == 3 or getattr(step, "master_weights", "") == "sharded"  # stored shards
    p = per_rank * (n if sharded else 1)  # the parameters a rank holds without ZeRO
    cheng = {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}
    ours = {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}
    if sharded and step.zero == 1:
        ours[1] = cheng[1]
    return {"model_state_formula_bytes": ours[step.zero],
            "cheng_formula_bytes": cheng[step.zero], "data_parallel": n,
            "params_per_model_rank": p}
