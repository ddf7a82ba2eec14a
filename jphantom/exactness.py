"""Exactness as a user command: one step of a layout against the one-device model it is.

Every strategy in jphantom is tested against the single-device model; this module lets a user
do the same for their own model, plan and mesh before a long run (torchtitan's users ask for it:
pytorch/torchtitan#1750, #3029):

    report = jphantom.verify(model, mesh, plan, loss_fn, tokens, targets)
    print(report)              # the loss's and every gradient's largest relative difference
    assert report.ok           # all within ``tolerance`` (default 1e-5)

It parallelises a copy of ``model`` with ``plan`` (the model given is left as it was), builds the
training step on ``mesh`` (any step option: ``zero``, ``accumulate``, ``precision``, ``pipeline``,
...), and computes the step's loss and gradients with every collective and reduction of the real
step. The reference is the same parameters through the plain model the parallel layers are
(:func:`jphantom.plans.dense_equivalent`) on one device, differentiated by autodiff: in float64
when jax's 64-bit mode is on (``jax.config.update("jax_enable_x64", True)`` before anything
else: the tests' oracle), else in the parameters' dtype. A gradient's difference is
max |g - g_ref| / max |g_ref| over the parameter (a parameter whose reference gradient is zero up
to rounding, below 1e-6 of the largest, is measured against the largest instead). ``jphantom
verify`` runs it for the command line's models and layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jphantom import token_mean

TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class Report:
    """The loss and every gradient of a layout's step against the one-device model's."""

    loss: float
    reference_loss: float
    loss_error: float  # |loss - reference| / |reference|
    errors: Mapping[str, float]  # parameter path -> largest relative difference of its gradient
    tolerance: float = TOLERANCE
    reference_dtype: str = "float32"

    @property
    def worst(self) -> tuple[str, float]:
        """The parameter whose gradient differs most, and by how much."""
        return max(self.errors.items(), key=lambda item: item[1])

    @property
    def ok(self) -> bool:
        return self.loss_error <= self.tolerance and self.worst[1] <= self.tolerance

    def __str__(self) -> str:
        path, error = self.worst
        verdict = "exact" if self.ok else "DIFFERS"
        lines = [f"{verdict} within {self.tolerance:g} (reference on one device in "
                 f"{self.reference_dtype}): loss {self.loss:.8g} against {self.reference_loss:.8g}"
                 f" (relative {self.loss_error:.2e}); gradients of {len(self.errors)} parameters,"
                 f" largest relative difference {error:.2e} at {path}"]
        for name, value in sorted(self.errors.items(), key=lambda item: -item[1])[:5]:
            lines.append(f"  {value:.2e}  {name}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "tolerance": self.tolerance, "loss": self.loss,
                "reference_loss": self.reference_loss, "loss_error": self.loss_error,
                "worst": {"parameter": self.worst[0], "error": self.worst[1]},
                "errors": dict(self.errors), "reference_dtype": self.reference_dtype}


def relative_errors(actual, expected) -> dict[str, float]:
    """Per leaf of two pytrees of arrays: max |a - e| / max |e| (the tree's largest |e| where a
    leaf's is below 1e-6 of it: a gradient that is zero up to rounding)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(expected)[0]]
    a_leaves = [np.asarray(a, np.float64) for a in jax.tree.leaves(actual)]
    e_leaves = [np.asarray(e, np.float64) for e in jax.tree.leaves(expected)]
    largest = max((float(np.max(np.abs(e))) for e in e_leaves if e.size), default=1.0)
    out = {}
    for path, a, e in zip(paths, a_leaves, e_leaves):
        scale = float(np.max(np.abs(e))) if e.size else 1.0
        scale = scale if scale > 1e-6 * largest else max(largest, 1e-30)
        out[_dotted(path)] = float(np.max(np.abs(a - e))) / scale if e.size else 0.0
    return out


def _dotted(keystr: str) -> str:
    """``"['layers']['block']['q_proj']['kernel']"`` -> ``"layers.block.q_proj.kernel"``."""
    return ".".join(part.strip("'\"") for part in keystr.strip("[]").split("]["))


def verify_step(step, params, *batch, tolerance: float = TOLERANCE) -> Report:
    """The :class:`Report` of a built training step (:func:`jphantom.make_train_step`) at
    ``params`` (a ``TrainState.params`` dict, in the step's storage order, as ``step.init``
    gives it) on ``batch`` (natural order; the step reorders it for a context layout)."""
    from jphantom.plans import dense_equivalent

    loss, grads = jax.jit(step.value_and_grad())(params, *step.context_order(batch))
    # interleaved and zb-v pipelines store their layers in device order: the model's for both
    params, grads = step.to_model_order(params), step.to_model_order(grads)
    wide = jnp.float64 if jax.config.jax_enable_x64 else None
    layout, loss_fn = step.layout, step.loss_fn

    def reference(params, *batch):
        model = dense_equivalent(layout.model_of(jax.tree.leaves(params)))
        if wide is not None:  # compute in the parameters' float64
            for _, module in nnx.iter_modules(model):
                if getattr(module, "dtype", None) is not None:
                    module.dtype = None
        return token_mean.value(loss_fn(model, *batch))

    device = step.mesh.devices.flat[0]
    cast = (lambda a: jnp.asarray(a, wide) if wide is not None and jnp.issubdtype(
        jnp.asarray(a).dtype, jnp.floating) else jnp.asarray(a))
    one_params, one_batch = jax.device_put(jax.tree.map(cast, (jax.device_get(params), batch)),
                                           device)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(one_params, *one_batch)
    loss, ref_loss = float(loss), float(ref_loss)
    return Report(loss, ref_loss, abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
                  relative_errors(jax.device_get(grads), jax.device_get(ref_grads)),
                  tolerance, "float64" if wide is not None else "the parameters' dtype")


def verify(model: nnx.Module, mesh, plan: Mapping | None, loss_fn: Callable, *batch,
           tolerance: float = TOLERANCE, **step_options) -> Report:
    """One step of ``model`` parallelised with ``plan`` (``None``: as it is) on ``mesh`` against
    the one-device model (module docstring). ``model`` is left as it was."""
    import optax

    from jphantom import plans
    from jphantom.train_step import make_train_step

    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    if plan is not None:
        copy = plans.parallelize(copy, mesh, plan)
    step = make_train_step(copy, mesh, optax.sgd(0.0), loss_fn, donate=False, **step_options)
    return verify_step(step, step.init().params, *batch, tolerance=tolerance)


__all__ = ["Report", "TOLERANCE", "relative_errors", "verify", "verify_step"]
