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

**Mixed precision.** A step at ``precision`` bf16, float16 or fp8 cannot match float64: it is
compared with the one-device step at the same precision (the parameters and floating inputs cast
to the compute dtype, the blocks' GEMMs in FP8 under fp8, the loss scaled under float16, exactly
as each rank's step does; on one device the two are bit for bit the same). A layout still rounds
its sums differently (bf16 partial sums before an all-reduce), so the tolerance comes from the
precision (:func:`tolerance_of`, stated in the report): bf16 and float16 allow
:data:`GROWTH` = 32 unit roundoffs u of the compute dtype (2^-3 for bf16, 2^-6 for float16):
one rounding differs by u, and the differences grow through the layers forward and backward and
through sums that cancel; 2-layer GPT-2 and Llama layouts (tensor, sequence, data, expert,
context, pmm3d, pipeline) measured at most 11 u. fp8 allows one E5M2 rounding step (2 u, u =
2^-3: 0.25): an element near a rounding boundary of an output gradient's E5M2 lands one step
away under another layout (measured at most 0.147). A broken layout (a missing reduction, a
wrong shard) differs by order 1.
"""

from __future__ import annotations

import dataclasses
import math
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
    reference: str = "one device in float64"  # what the step was compared with
    derived: str = "float32"  # where the tolerance comes from (tolerance_of)

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
        lines = [f"{verdict} within {self.tolerance:.3g} ({self.derived}; reference: "
                 f"{self.reference}): loss {self.loss:.8g} against {self.reference_loss:.8g}"
                 f" (relative {self.loss_error:.2e}); gradients of {len(self.errors)} parameters,"
                 f" largest relative difference {error:.2e} at {path}"]
        for name, value in sorted(self.errors.items(), key=lambda item: -item[1])[:5]:
            lines.append(f"  {value:.2e}  {name}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "tolerance": self.tolerance, "loss": self.loss,
                "reference_loss": self.reference_loss, "loss_error": self.loss_error,
                "worst": {"parameter": self.worst[0], "error": self.worst[1]},
                "errors": dict(self.errors), "reference": self.reference,
                "tolerance_derived": self.derived}


UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "e5m2": 2.0 ** -3}
GROWTH = 32  # unit roundoffs a mixed-precision layout may differ by (module docstring)


def tolerance_of(precision) -> tuple[float, str]:
    """The tolerance :func:`verify_step` uses for a step at ``precision`` (a
    :class:`jphantom.precision.Precision`), and how it is derived (module docstring): float32
    1e-5 (against float64); bf16 and float16 :data:`GROWTH` unit roundoffs of the compute dtype;
    fp8 one E5M2 rounding step (2 u)."""
    if precision.fp8:
        return 2 * UNIT_ROUNDOFF["e5m2"], "one E5M2 rounding step, 2 u = 2^-2"
    if precision.compute in UNIT_ROUNDOFF:
        u = UNIT_ROUNDOFF[precision.compute]
        return GROWTH * u, f"{GROWTH} u of {precision.compute}, u = 2^{round(math.log2(u))}"
    return TOLERANCE, "float32"


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


def verify_step(step, params, *batch, tolerance: float | None = None) -> Report:
    """The :class:`Report` of a built training step (:func:`jphantom.make_train_step`) at
    ``params`` (a ``TrainState.params`` dict, in the step's storage order, as ``step.init``
    gives it) on ``batch`` (natural order; the step reorders it for a context layout).
    ``tolerance``: default :func:`tolerance_of` the step's precision."""
    loss, grads = jax.jit(step.value_and_grad())(params, *step.context_order(batch))
    # interleaved and zb-v pipelines store their layers in device order: the model's for both
    params, grads = step.to_model_order(params), step.to_model_order(grads)
    precision = step.precision
    mixed = not precision.is_default
    wide = jnp.float64 if jax.config.jax_enable_x64 and not mixed else None
    reference = _reference(step.layout, step.loss_fn, precision, wide)
    device = step.mesh.devices.flat[0]
    cast = (lambda a: jnp.asarray(a, wide) if wide is not None and jnp.issubdtype(
        jnp.asarray(a).dtype, jnp.floating) else jnp.asarray(a))
    one_params, one_batch = jax.device_put(jax.tree.map(cast, (jax.device_get(params), batch)),
                                           device)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(reference))(one_params, *one_batch)
    ref_loss = float(ref_loss) / precision.loss_scale
    ref_grads = jax.tree.map(lambda g: g / precision.loss_scale, ref_grads)
    loss = float(loss)
    tolerance, derived = (tolerance_of(precision) if tolerance is None
                          else (tolerance, "as given"))
    where = (f"the one-device step in {precision.name}" if mixed else
             f"one device in {'float64' if wide is not None else 'the parameters dtype'}")
    return Report(loss, ref_loss, abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
                  relative_errors(jax.device_get(grads), jax.device_get(ref_grads)),
                  tolerance, where, derived)


def _reference(layout, loss_fn, precision, wide):
    """The one-device loss of the parameters (a dict in the step's model order): the plain model
    they are (:func:`jphantom.plans.dense_equivalent`), in float64 (``wide``), or, for a mixed
    precision, through the policy the step applies on each rank (the parameters and the floating
    inputs cast to the compute dtype, FP8 GEMMs in the blocks, the loss scaled)."""
    from jphantom.nn.stack import set_fp8
    from jphantom.plans import dense_equivalent

    def reference(params, *batch):
        leaves = precision.cast(jax.tree.leaves(params))
        model = dense_equivalent(layout.model_of(leaves))
        if wide is not None:  # compute in the parameters' float64
            for _, module in nnx.iter_modules(model):
                if getattr(module, "dtype", None) is not None:
                    module.dtype = None
        model = precision.retype(model)
        if precision.fp8:
            set_fp8(model)
        value = token_mean.value(loss_fn(model, *precision.cast(batch)))
        return value.astype(jnp.promote_types(value.dtype, jnp.float32)) * precision.loss_scale

    return reference


def verify(model: nnx.Module, mesh, plan: Mapping | None, loss_fn: Callable, *batch,
           tolerance: float | None = None, **step_options) -> Report:
    """One step of ``model`` parallelised with ``plan`` (``None``: as it is) on ``mesh`` against
    the one-device model (module docstring); ``tolerance``: default :func:`tolerance_of` the
    step's precision. ``model`` is left as it was."""
    import optax

    from jphantom import plans
    from jphantom.train_step import make_train_step

    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    if plan is not None:
        copy = plans.parallelize(copy, mesh, plan)
    step = make_train_step(copy, mesh, optax.sgd(0.0), loss_fn, donate=False, **step_options)
    return verify_step(step, step.init().params, *batch, tolerance=tolerance)


__all__ = ["Report", "TOLERANCE", "relative_errors", "tolerance_of", "verify", "verify_step"]
