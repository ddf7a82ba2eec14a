"""SAMO: sparsity-aware memory optimization for pruned models (Singh's thesis ch. 4, Singh & Bhatele,
IPDPS'23), an experimental step on the ``data`` axis built from :class:`jphantom.TrainStep`'s
parts (its per-rank value and gradient, the axes each gradient is summed over, its shard_map)::

    step = make_samo_step(model, mesh, optax.adam(1e-3), loss_fn, SamoConfig(sparsity=0.9),
                          precision="bf16")
    state = step.init()                  # magnitude-pruned; theta16 dense, the rest compressed
    state, loss = step(state, x, t)

For a model whose weights are pruned to a fraction f = 1 - s of nonzeros, SAMO keeps:

- the compute weights theta16 **dense** (explicit zeros; dense GEMMs are faster than sparse ones
  at these sparsities): 2 phi bytes in bf16 (the step's ``precision`` is theta16's dtype);
- the float32 master weights, the optimizer's state (Adam's two moments) and the gradients
  **compressed**: only the f phi nonzeros, as flat vectors sharing one int32 index vector per
  tensor (``index = flatnonzero(mask)``).

One step (:meth:`SamoStep.build`), inside one ``jax.jit``::

    def per_rank(theta16, index, *batch):                # inside one jax.shard_map over data
        loss, g16 = value_and_grad(loss_fn)(theta16, *batch)   # dense, compute dtype
        g = g16.ravel()[index]                           # compress (f phi values per rank)
        g = psum(g, "data")                              # all-reduce: (1 - s) of the dense one
        return psum(loss share), g
    master, opt_state = optimizer.update(g.astype(float32), ...)   # optax on the global compressed
    theta16 = zeros(size).at[index].set(master.astype(compute)).reshape(shape)   # expand

The optimizer runs after the ``shard_map`` on the global compressed vectors (a dict like the
parameters, one flat vector of nonzeros per tensor): element-wise updates and global norms
(``optax.clip_by_global_norm``) equal the masked dense model's; transformations that read a
tensor's shape (Adafactor's factored moments, Muon) see flat vectors instead.

Model-state bytes (Eqs. 4.1-4.5, phi = parameters before pruning): theta16 2 phi; master, m, v and
the float32 gradient 4 f phi each; the compressed 16-bit gradient 2 f phi; the index 4 f phi; the
16-bit compressed copy made while expanding 2 f phi: M = 24 (1 - s) phi + 2 phi, against 20 phi
for dense mixed-precision Adam (break-even at s = 0.25). Here the master, moments, index and
theta16 live between steps (:func:`state_bytes` measures them from the arrays); the gradients
and the copy exist inside the step. The gradient is compressed once the whole backward is done
(XLA frees the dense one right after), not per layer as the paper does.

Pure data parallelism: every mesh axis other than ``data`` has size 1, no ZeRO (SAMO's state is
replicated over ``data``), no pipeline, ``spmd="shard_map"``; accumulation, remat and precision
compose. The pruning mask is unstructured magnitude pruning of every weight with ``ndim >= 2``
(:func:`magnitude_masks`); biases and norms stay dense (their index covers them whole).
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

from jphantom.runtime import comm
from jphantom.errors import ConfigError
from jphantom.step.layout import TrainState, group_by
from jphantom.step.train_step import TrainStep

DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class SamoConfig:
    """``sparsity`` (s): the fraction of each weight (``ndim >= 2``) pruned by magnitude."""

    sparsity: float = 0.9

    def __post_init__(self):
        if isinstance(self.sparsity, bool) or not isinstance(self.sparsity, (int, float)) \
                or not 0.0 <= self.sparsity < 1.0:
            raise ConfigError(f"sparsity={self.sparsity!r} must be in [0, 1), e.g. 0.9")


@dataclasses.dataclass
class SamoState:
    """What SAMO keeps between steps besides theta16 (``TrainState.params``), in
    ``TrainState.opt_state``; each a dict like the parameters: ``index`` the int32 flat indices of
    a tensor's nonzeros, ``master`` their values (the parameters' dtype, float32),
    ``opt_state`` the optax state of ``master``."""

    index: Any
    master: Any
    opt_state: Any


jax.tree_util.register_dataclass(SamoState, data_fields=["index", "master", "opt_state"],
                                 meta_fields=[])


def magnitude_masks(params, sparsity: float):
    """Host-side boolean masks: for each weight (``ndim >= 2``) its largest-magnitude
    (1 - sparsity) entries (ties to the first in row-major order); other tensors dense."""
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


def check(config, mesh, *, zero: int, pipeline, spmd: str) -> SamoConfig:
    """``config`` if SAMO composes with the step's other options, else a ``ConfigError`` naming
    the fix."""
    if not isinstance(config, SamoConfig):
        raise ConfigError(f"SAMO takes a jphantom.experimental.samo.SamoConfig, not "
                          f"{type(config).__name__}")
    if pipeline is not None or "stage" in mesh.axis_names:
        raise ConfigError("SAMO does not run under a pipeline: drop pipeline= and the 'stage' "
                          "axis")
    extra = {a: s for a, s in dict(mesh.shape).items() if a != DATA_AXIS and s > 1}
    if extra:
        raise ConfigError(f"SAMO runs on pure data parallelism: the mesh {dict(mesh.shape)} "
                          f"splits {sorted(extra)} too; use a mesh 'data=D' (other axes of "
                          "size 1)")
    if zero:
        raise ConfigError(f"SAMO keeps its compressed master weights and moments replicated over "
                          f"'data'; zero={zero} (ZeRO) would shard them: use zero=0 for SAMO")
    if spmd != "shard_map":
        raise ConfigError(f"SAMO compresses the gradient inside the shard_map, before the data "
                          f"all-reduce; spmd={spmd!r} has none: use spmd='shard_map' for SAMO")
    return config


def init(step, params, masks=None) -> tuple[Any, SamoState]:
    """``(theta16, SamoState)`` for ``step``'s dense ``params`` (a dict like
    ``TrainState.params``) pruned by ``masks`` (default :func:`magnitude_masks` at the config's
    sparsity), everything replicated over ``data``: theta16 ``where(mask, params, 0)`` in the
    compute dtype, ``master`` the nonzeros in the parameters' dtype, the optimizer's state of
    ``master``. The step wraps them in a ``TrainState``."""
    host = jax.tree.map(np.asarray, jax.device_get(params))
    if masks is None:
        masks = magnitude_masks(host, step.samo.sparsity)
    dtype = jnp.dtype(step.precision.compute)
    index = jax.tree.map(lambda m: np.flatnonzero(np.asarray(m)).astype(np.int32), masks)
    master = jax.tree.map(lambda a, i: a.ravel()[i], host, index)
    theta = jax.tree.map(lambda a, m: np.where(m, a, 0).astype(dtype), host, masks)
    replicated = NamedSharding(step.mesh, P())
    theta = jax.device_put(theta, step.param_shardings())
    index, master = jax.device_put((index, master), replicated)
    opt_state = jax.jit(step.optimizer.init, out_shardings=replicated)(master)
    return theta, SamoState(index, master, opt_state)


def expand(master, index, shape, dtype):
    """theta16 of one tensor: the compressed 16-bit copy scattered into zeros."""
    size = int(np.prod(shape))
    return jnp.zeros((size,), dtype).at[index].set(
        master.astype(dtype), indices_are_sorted=True, unique_indices=True).reshape(shape)


class SamoStep(TrainStep):
    """``state, loss = step(state, *batch)`` of a magnitude-pruned model with compressed master
    weights, optimizer state and gradient all-reduce (module docstring); built by
    :func:`make_samo_step`."""

    def __init__(self, model, mesh, optimizer, loss_fn, samo: SamoConfig, **options):
        self.samo = check(samo, mesh, zero=options.get("zero", 0),
                          pipeline=options.get("pipeline"), spmd=options.get("spmd", "shard_map"))
        super().__init__(model, mesh, optimizer, loss_fn, **options)
        if self.setup.dropout:
            self.setup.refuse_dropout("SAMO")

    def init_state(self, params) -> TrainState:
        """theta16 dense, the master weights and optimizer state compressed (:func:`init`)."""
        return TrainState(*init(self, params))

    def build(self):
        """``step(state, *batch) -> (state, loss)`` for SAMO: one ``jax.jit`` of one
        ``jax.shard_map`` over ``data`` and the update after it (module docstring). The backward
        is the module step's own (precision, accumulation, remat, the loss averaged over the
        ranks it varies over)."""
        vary = self.reducer.vary  # per leaf: the axes its gradient is summed over (data)

        def per_rank(theta, index, *batch):
            loss, grads, _ = self.gradients(theta, *batch)  # dense, compute dtype
            compressed = [g.ravel().at[i].get(indices_are_sorted=True, unique_indices=True)
                          for g, i in zip(grads, index)]  # [f phi] per tensor
            # all-reduce of (1 - s) of the dense gradient
            compressed = group_by(compressed, vary, lambda xs, axes: comm.psum(xs, axes))
            return self.setup.global_value(loss), compressed

        param_sh = self.param_shardings()

        def samo_step(state, *batch):
            theta, samo = state.params, state.opt_state
            fn = self.over_mesh(per_rank, len(batch), before=(P(),), out_specs=(P(), P()))
            loss, grads = fn(tuple(jax.tree.leaves(theta)), tuple(jax.tree.leaves(samo.index)),
                             *batch)
            grads = jax.tree.unflatten(jax.tree.structure(samo.master),
                                       [g.astype(m.dtype) for g, m in
                                        zip(grads, jax.tree.leaves(samo.master))])
            updates, opt_state = self.optimizer.update(grads, samo.opt_state, samo.master)
            master = optax.apply_updates(samo.master, updates)
            theta = jax.tree.map(lambda m, i, t: expand(m, i, t.shape, t.dtype), master,
                                 samo.index, theta)
            theta = lax.with_sharding_constraint(theta, param_sh)
            samo = SamoState(samo.index, master, opt_state)
            return state._replace(params=theta, opt_state=samo), loss

        return jax.jit(samo_step, donate_argnums=(0,) if self.donate else ())


def make_samo_step(model, mesh, optimizer, loss_fn, samo: SamoConfig, **options) -> SamoStep:
    """SAMO's step of ``model`` on ``mesh`` (a ``data`` axis; the others of size 1): the options
    of :func:`jphantom.make_train_step` less ZeRO, pipelines and GSPMD."""
    return SamoStep(model, mesh, optimizer, loss_fn, samo, **options)


def state_bytes(state) -> dict[str, int]:
    """Per-device bytes of what lives between steps (a SAMO step's ``TrainState``), measured from
    the arrays: theta16, the index, the master weights, Adam's moments (0 for another optimizer),
    the whole optimizer state and the total."""
    def size(tree):
        return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(tree))
    samo = state.opt_state
    adam = [s for s in jax.tree.leaves(samo.opt_state,
                                       is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    return {"theta": size(state.params), "index": size(samo.index), "master": size(samo.master),
            "moments": size([(s.mu, s.nu) for s in adam]), "optimizer": size(samo.opt_state),
            "total": size(state)}


def formula_bytes(phi: int, nonzeros: int) -> dict[str, float]:
    """Singh's thesis Eqs. 4.1-4.5 with f phi = ``nonzeros``: at rest (theta16 2 phi, master + m + v
    12 f phi, index 4 f phi) and in all (+ float32 and 16-bit gradients 6 f phi, the 16-bit copy
    2 f phi) = 24 f phi + 2 phi; dense mixed-precision Adam 20 phi."""
    f_phi = nonzeros
    return {"at_rest": 2 * phi + 16 * f_phi, "total": 2 * phi + 24 * f_phi, "dense": 20 * phi}
