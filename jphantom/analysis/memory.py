"""Will a training step fit? A simple per-device estimate, checked before anything is allocated.

Training at a size that cannot fit (width 2**20 is 8 TiB of dense weights) should fail at once with
the numbers, not after minutes of swapping or with an allocator crash. :func:`estimate_training_memory`
adds up, per device:

===================  ========  ===================================================================
entry                how       what
===================  ========  ===================================================================
``parameters``       exact     the device's shards of every parameter (the step's abstract state:
                               shapes and shardings only, nothing allocated)
``gradients``        exact     = parameters (jax materialises every gradient before the update)
``optimizer_state``  exact     the optimizer state's shards (0 for SGD, two moments for Adam)
``batch``            exact     the device's shards of the inputs and targets
``activations``      rough     :func:`activation_bytes`: the FFN's ``depth x local batch x width``
                               elements, a language model's four hidden-wide vectors per block
                               and token plus its logits. Compiler temporaries are not counted,
                               so this is a lower bound of the real peak.
===================  ========  ===================================================================

:func:`available_memory` is what a device can hold: ``jax.devices()[0].memory_stats()["bytes_limit"]``
where the backend reports it (GPUs), else the host's physical memory (``os.sysconf``) shared by the
devices of the mesh (simulated CPU devices all live in the host's memory).
:func:`check_fits` raises :class:`ConfigError` with the estimate when the total exceeds it.
"""

from __future__ import annotations

import math

import numpy as np

from jphantom.errors import ConfigError
from jphantom.runtime.mesh import device_memory
from jphantom.step.memory import device_bytes

GIB = 2**30


def estimate_training_memory(step, batch, *, activations: int) -> dict[str, int]:
    """Bytes per device of one training step (module docstring): ``step`` a
    :class:`jphantom.TrainStep` (its abstract state's shards: nothing allocated), ``batch`` the
    batch's ``ShapeDtypeStruct``s with their shardings, ``activations`` the rough activation
    bytes per device (:func:`activation_bytes`)."""
    state = step.abstract_state()
    params = device_bytes(state.params)
    estimate = {
        "parameters": params,
        "gradients": params,
        "optimizer_state": device_bytes(state.opt_state),
        "batch": device_bytes(batch),
        "activations": activations,
    }
    estimate["total"] = sum(estimate.values())
    return estimate


def activation_bytes(config, program) -> int:
    """A rough lower bound of the activations one device keeps for the backward: the FFN one
    width-wide row per layer and sample of the data rank's batch (what tensor-t1 saves); a
    language model four hidden-wide vectors per block and token (the block's input, its norms'
    outputs, the attention's output) plus the logits of the rank's tokens."""
    mesh = program.mesh
    rows = config.train.batch // max(1, math.prod(mesh.size(a) for a in ("data", "expert", "z")))
    itemsize = np.dtype(config.model.dtype).itemsize
    if not config.model.family.is_language_model:
        return config.model.depth * rows * config.model.width * itemsize
    family = program.config
    hidden = getattr(family, "hidden", config.model.hidden)
    layers = getattr(family, "layers", config.model.layers)
    vocab = getattr(family, "vocab_size", config.model.vocab)
    tokens = rows * config.model.seq_len
    return (4 * layers * tokens * hidden + tokens * vocab // max(1, mesh.size("model"))) * itemsize


def available_memory(mesh) -> tuple[int | None, str]:
    """(bytes one device of ``mesh`` can hold, where the number comes from); None if unknown
    (:func:`jphantom.runtime.mesh.device_memory`, which the step's own check before ``init`` reads too)."""
    return device_memory(mesh)


def check_fits(estimate: dict[str, int], mesh, what: str = "this training step") -> None:
    """Raise :class:`ConfigError` with the estimate if it exceeds :func:`available_memory`."""
    limit, source = available_memory(mesh)
    if limit is None or estimate["total"] <= limit:
        return
    terms = {name: value for name, value in estimate.items() if name != "total"}
    parts = ", ".join(f"{name} {value / GIB:.3g}" for name, value in terms.items())
    largest = max(terms, key=terms.get)
    fix = {"parameters": "more shards (a larger model axis), ZeRO-3 over data, or a smaller "
                         "model",
           "gradients": "ZeRO-2/3 over data, more shards, or a smaller model",
           "optimizer_state": "ZeRO-1 or more over data, or SGD",
           "batch": "a smaller batch or more data ranks",
           "activations": "a smaller batch, more data ranks, --remat nothing_saveable or "
                          "--accumulate N"}[largest]
    raise ConfigError(
        f"{what} needs about {estimate['total'] / GIB:.3g} GiB per device ({parts} GiB), more than "
        f"the {limit / GIB:.3g} GiB available ({source}); the largest term is {largest}: use "
        f"{fix}.")


def check_run(config, program, step) -> dict[str, int]:
    """The per-device memory estimate of ``config``'s run (its ``program`` and ``step``, nothing
    allocated); raises :class:`ConfigError` naming the largest term when it cannot fit."""
    from jphantom.analysis.compiled import abstract_batch

    estimate = estimate_training_memory(step, abstract_batch(config, program, step),
                                        activations=activation_bytes(config, program))
    check_fits(estimate, step.mesh, f"training {config.model.name} under "
                                    f"{config.parallel.strategy} on mesh {program.mesh}")
    return estimate


def check_compiled(config, program, step) -> dict[str, int]:
    """The compiled step's own memory (XLA's ``memory_analysis()``: arguments + outputs -
    aliased + temporaries per device, attention scores and every other buffer included) against
    what a device holds (:func:`available_memory`), before anything is allocated: a ConfigError
    with the figures and the flags that reduce them. The compilation is the run's own (jax
    caches it: the first step does not compile again). Returns the figures."""
    from jphantom.analysis.compiled import abstract_batch, compiled_memory

    compiled = step.lower(step.abstract_state(), *abstract_batch(config, program, step)).compile()
    memory = compiled_memory(compiled)
    if not memory:
        return memory
    peak = (memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
            + memory["temp_bytes"])
    memory["peak_bytes"] = peak
    limit, source = available_memory(step.mesh)
    if limit is not None and peak > limit:
        raise ConfigError(
            f"the compiled step of {config.model.name} under {config.parallel.strategy} on mesh "
            f"{program.mesh} needs {peak / GIB:.3g} GiB per device (XLA's memory analysis: "
            f"arguments {memory['argument_bytes'] / GIB:.3g}, outputs "
            f"{memory['output_bytes'] / GIB:.3g}, temporaries {memory['temp_bytes'] / GIB:.3g} "
            f"GiB), more than the {limit / GIB:.3g} GiB available ({source}): reduce it with a "
            "smaller --batch or --seq-len, --accumulate N, --remat nothing_saveable, --zero 3, "
            "more model or context ranks")
    return memory
