"""Will the step's state fit? :meth:`jphantom.TrainStep.init` asks before it allocates anything.

The state's bytes per device are exact and free to count: the abstract state
(:meth:`~jphantom.TrainStep.abstract_state`, ``jax.eval_shape`` of the optimizer's ``init``) gives
every leaf's shape, dtype and sharding, so a leaf's device shard is
``sharding.shard_shape(shape)``. What a device holds is :func:`jphantom.runtime.mesh.device_memory`
(``memory_stats()['bytes_limit']`` on a GPU, the host's memory shared by the mesh's devices on
CPU). Gradients and activations come later and are not counted here: the run's fuller estimate is
:mod:`jphantom.analysis.memory`.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jphantom.errors import ConfigError
from jphantom.runtime.mesh import device_memory

GIB = 2**30


def device_bytes(abstract) -> int:
    """Bytes of one device's shards of every leaf of ``abstract`` (``ShapeDtypeStruct``s or
    arrays; a leaf without a sharding counts whole)."""
    total = 0
    for leaf in jax.tree.leaves(abstract):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def check_state_fits(state, mesh) -> None:
    """Raise :class:`ConfigError` when the parameters and optimizer state of ``state`` (an
    abstract :class:`~jphantom.step.layout.TrainState`) exceed what one device of ``mesh`` holds."""
    limit, source = device_memory(mesh)
    params, opt = device_bytes(state.params), device_bytes(state.opt_state)
    if limit is None or params + opt <= limit:
        return
    fix = ("shard the weights over more devices (a larger model axis, zero=3 over data) or use "
           "a smaller model" if params > limit or params >= opt else
           "shard the optimizer state (zero=1 over data) or use an optimizer with less state "
           "(optax.sgd)")
    raise ConfigError(
        f"step.init: the parameters ({params / GIB:.3g} GiB) and optimizer state "
        f"({opt / GIB:.3g} GiB) need {(params + opt) / GIB:.3g} GiB per device, before gradients "
        f"and activations, more than the {limit / GIB:.3g} GiB one device holds ({source}): "
        f"{fix}")
