"""SAMO: sparsity-aware memory optimization for pruned models (seed 004 ch. 4, Singh & Bhatele,
IPDPS'23), on the ``data`` axis of the one-shard_map step.

For a model whose weights are pruned to a fraction f = 1 - s of nonzeros, SAMO keeps:

- the compute weights theta16 **dense** (explicit zeros; dense GEMMs are faster than sparse ones
  at these sparsities): 2 phi bytes in bf16;
- the float32 master weights, Adam's two moments and the gradients **compressed**: only the f phi
  nonzeros, as flat vectors sharing one int32 index vector per tensor (``index = flatnonzero``).

One step (:func:`make_step`), per data rank::

    g16 = grad(loss)(theta16)                        # dense, compute dtype
    g = g16.ravel()[index]                           # compress (f phi values)
    g = psum(g, "data")                              # the all-reduce moves (1 - s) of the dense one
    master, m, v = adam(g.astype(float32), ...)      # optax on the compressed vectors
    theta16 = zeros(size).at[index].set(master.astype(compute)).reshape(shape)   # expand

Model-state bytes (Eqs. 4.1-4.5, phi = parameters before pruning): theta16 2 phi; master, m, v and
the float32 gradient 4 f phi each; the compressed 16-bit gradient 2 f phi; the index 4 f phi; the
16-bit compressed copy made while expanding 2 f phi: M = 24 (1 - s) phi + 2 phi, against 20 phi
for dense mixed-precision Adam (break-even at s = 0.25). Here the master, moments, index and
theta16 live between steps (:func:`state_bytes` measures them from the arrays); the gradients
and the copy exist inside the step. The gradient is compressed once the whole backward is done
(XLA frees the dense one right after), not per layer as the paper does.

Pure data parallelism (a mesh ``data=D``, ``model=1``) of any per-rank strategy's loss; the
pruning mask is unstructured magnitude pruning of every weight matrix (``ndim >= 2``), biases and
norms stay dense (their index covers them whole).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.errors import ConfigError
from jphantom.precision import Precision

DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class SamoConfig:
    """``sparsity``: fraction of each weight matrix pruned; ``compute``: theta16's dtype."""

    sparsity: float = 0.9
    compute: str = "bfloat16"
    learning_rate: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        if not 0.0 <= self.sparsity < 1.0:
            raise ConfigError(f"sparsity={self.sparsity!r} must be in [0, 1), e.g. 0.9")
        if self.compute not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"compute={self.compute!r}: use bfloat16, float16 or float32")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate={self.learning_rate!r} must be positive")

    def optimizer(self) -> optax.GradientTransformation:
        return optax.adam(self.learning_rate, b1=self.b1, b2=self.b2, eps=self.eps)


@dataclasses.dataclass
class SamoState:
    """``theta``: dense compute weights; ``index``: per tensor the int32 flat indices of its
    nonzeros; ``master``: float32 nonzeros; ``opt_state``: optax Adam state on ``master``."""

    theta: Any
    index: Any
    master: Any
    opt_state: Any


jax.tree_util.register_dataclass(SamoState, data_fields=["theta", "index", "master", "opt_state"],
                                 meta_fields=[])


def magnitude_masks(params, sparsity: float):
    """Host-side boolean masks: for each weight matrix (``ndim >= 2``) the largest-magnitude
    (1 - sparsity) of its entries; other tensors dense."""
    def mask(a):
        a = np.asarray(a)
        if a.ndim < 2 or sparsity == 0:
            return np.ones(a.shape, bool)
        keep = max(1, int(round(a.size * (1 - sparsity))))
        order = np.argsort(-np.abs(a).ravel(), kind="stable")[:keep]
        out = np.zeros(a.size, bool)
        out[order] = True
        return out.reshape(a.shape)
    return jax.tree.map(mask, params)


def _check_mesh(program) -> None:
    extra = [n for n, s in program.mesh.axes if n != DATA_AXIS and s > 1]
    if extra or not program.manual or DATA_AXIS not in program.mesh.shape:
        raise ConfigError(f"SAMO runs on pure data parallelism of a per-rank strategy (mesh "
                          f"'data=D' or 'data=D,model=1', strategy tensor or phantom); got "
                          f"{program.strategy!r} on {program.mesh}")


def init(program, mesh, params, masks, config: SamoConfig) -> SamoState:
    """SAMO's state for dense ``params`` (host or device) pruned by ``masks``, replicated over
    ``data``."""
    _check_mesh(program)
    dtype = jnp.dtype(config.compute)
    index = jax.tree.map(lambda m: np.flatnonzero(np.asarray(m).ravel()).astype(np.int32), masks)
    master = jax.tree.map(lambda a, i: np.asarray(a, np.float32).ravel()[i], params, index)
    theta = jax.tree.map(lambda a, m: np.where(m, np.asarray(a, np.float32), 0).astype(dtype),
                         params, masks)
    opt_state = config.optimizer().init(jax.tree.map(jnp.asarray, master))
    replicated = NamedSharding(mesh, P())
    return jax.device_put(SamoState(theta, index, master, opt_state), replicated)


def expand(master, index, shape, dtype):
    """theta16 of one tensor: the compressed 16-bit copy scattered into zeros."""
    size = int(np.prod(shape))
    return jnp.zeros((size,), dtype).at[index].set(master.astype(dtype)).reshape(shape)


def make_step(program, mesh, config: SamoConfig):
    """``step(state, *batch) -> (state, loss)``: one ``jax.jit`` of one ``jax.shard_map`` over the
    data axis (module docstring), opened by :func:`jphantom.step.sharded`."""
    _check_mesh(program)
    from jphantom.step import loss_axes, sharded

    optimizer = config.optimizer()
    summed = loss_axes(program)

    def per_rank(state: SamoState, *batch):
        theta = lax.pcast(state.theta, DATA_AXIS, to="varying")
        batch = Precision(config.compute).cast(batch)  # activations in theta16's dtype too
        loss, grads = jax.value_and_grad(program.loss)(theta, *batch)
        compressed = jax.tree.map(lambda g, i: g.ravel()[i], grads, state.index)
        compressed = lax.psum(compressed, DATA_AXIS)  # (1 - s) of the dense all-reduce
        grads32 = jax.tree.map(lambda g: g.astype(jnp.float32), compressed)
        updates, opt_state = optimizer.update(grads32, state.opt_state, state.master)
        master = optax.apply_updates(state.master, updates)
        theta = jax.tree.map(lambda m, i, t: expand(m, i, t.shape, t.dtype), master, state.index,
                             state.theta)
        return SamoState(theta, state.index, master, opt_state), lax.psum(loss, summed)

    state_specs = P()  # everything replicated over data (a prefix spec for the whole state)
    return sharded(per_rank, mesh, (state_specs, *program.batch_specs), (state_specs, P()))


def state_bytes(state: SamoState) -> dict[str, int]:
    """Per-device bytes of what lives between steps, measured from the arrays."""
    def size(tree):
        return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))
    moments = [s for s in state.opt_state if isinstance(s, optax.ScaleByAdamState)][0]
    return {"theta": size(state.theta), "index": size(state.index), "master": size(state.master),
            "moments": size((moments.mu, moments.nu)), "total": size(state)}


def formula_bytes(phi: int, nonzeros: int) -> dict[str, float]:
    """Seed 004 Eqs. 4.1-4.5 with f phi = ``nonzeros``: at rest (theta16 2 phi, master + m + v
    12 f phi, index 4 f phi) and in all (+ float32 and 16-bit gradients 6 f phi, the 16-bit copy
    2 f phi) = 24 f phi + 2 phi; dense mixed-precision Adam 20 phi."""
    f_phi = nonzeros
    return {"at_rest": 2 * phi + 16 * f_phi, "total": 2 * phi + 24 * f_phi, "dense": 20 * phi}
