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
wrong shard) differs by order 1. Under fp8 the reference also makes the step's scaling choices
(:func:`scale_groups`): each data rank (``data``, ``z``) and each micro-batch (``accumulate``, a
pipeline's) quantises with its own tensors' scales, as :mod:`jphantom.step.fp8` documents, so the
reference runs the one-device FP8 model on each of those groups of rows and combines their losses
as the step does (the global token mean); comparing with one whole-batch FP8 step would measure
the recipe's per-rank scaling, not the layout.

**The verdict says which.** ``exact`` is printed only against a float32/float64 reference at the
default 1e-5; under a mixed precision a passing layout is "within the documented bound" (the
bound and its derivation printed beside it), with ``--tolerance`` "within the given tolerance".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jphantom.step import token_mean

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

    @property
    def verdict(self) -> str:
        """``exact`` (float32 against float64, at 1e-5), ``within the documented bound`` (a
        mixed precision's derived bound), ``within the given tolerance``, or ``DIFFERS``."""
        if not self.ok:
            return "DIFFERS"
        if self.derived == "as given":
            return "within the given tolerance"
        return "exact" if self.derived == "float32" else "within the documented bound"

    def __str__(self) -> str:
        path, error = self.worst
        verdict = self.verdict if self.ok else "DIFFERS from the reference beyond"
        verdict = verdict if verdict != "exact" else "exact within"
        lines = [f"{verdict} {self.tolerance:.3g} ({self.derived}; reference: "
                 f"{self.reference}): loss {self.loss:.8g} against {self.reference_loss:.8g}"
                 f" (relative {self.loss_error:.2e}); gradients of {len(self.errors)} parameters,"
                 f" largest relative difference {error:.2e} at {path}"]
        for name, value in sorted(self.errors.items(), key=lambda item: -item[1])[:5]:
            lines.append(f"  {value:.2e}  {name}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"ok": self.ok, "verdict": self.verdict, "tolerance": self.tolerance,
                "loss": self.loss,
                "reference_loss": self.reference_loss, "loss_error": self.loss_error,
                "worst": {"parameter": self.worst[0], "error": self.worst[1]},
                "errors": dict(self.errors), "reference": self.reference,
                "tolerance_derived": self.derived}


UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "e5m2": 2.0 ** -3}
GROWTH = 32  # unit roundoffs a mixed-precision layout may differ by (module docstring)


def tolerance_of(precision) -> tuple[float, str]:
    """The tolerance :func:`verify_step` uses for a step at ``precision`` (a
    :class:`jphantom.step.precision.Precision`), and how it is derived (module docstring): float32
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
    groups = scale_groups(step, batch) if precision.fp8 else None
    share, weight_of = _reference(step.layout, step.loss_fn, precision, wide)
    device = step.mesh.devices.flat[0]
    one_params, one_batch = on_one_device((params, batch), device, wide)
    ref_loss, ref_grads = _reference_gradients(share, weight_of, one_params, one_batch, groups)
    ref_loss = float(ref_loss) / precision.loss_scale
    if precision.loss_scale != 1:
        ref_grads = jax.tree.map(lambda g: g / precision.loss_scale, ref_grads)
    loss = float(loss)
    tolerance, derived = (tolerance_of(precision) if tolerance is None
                          else (tolerance, "as given"))
    where = (f"the one-device step in {precision.name}"
             + (f", scaled per data rank and micro-batch as the step ({len(groups)} groups of "
                "rows)" if groups is not None and len(groups) > 1 else "") if mixed else
             f"one device in {'float64' if wide is not None else 'the parameters dtype'}")
    return Report(loss, ref_loss, abs(loss - ref_loss) / max(abs(ref_loss), 1e-30),
                  relative_errors(jax.device_get(grads), jax.device_get(ref_grads)),
                  tolerance, where, derived)


def on_one_device(tree, device, wide=None):
    """``tree``'s arrays copied to ``device``, floating ones widened to ``wide`` (``None``: as
    they are) on the host on the way: no program is compiled per leaf, as converting each array
    with ``jnp.asarray`` outside a trace would."""
    def cast(a):
        a = np.asarray(a)
        return a.astype(wide) if wide is not None and jnp.issubdtype(a.dtype, jnp.floating) else a

    return jax.device_put(jax.tree.map(cast, jax.device_get(tree)), device)


def scale_groups(step, batch) -> list[np.ndarray] | None:
    """The rows of ``batch`` (natural order) that quantise together in ``step`` under fp8: one
    group per data rank (coordinates on ``data`` and ``z``; ranks of ``expert`` share their
    scales, :data:`jphantom.step.fp8.NO_SCALE_AXES`) and micro-batch (``accumulate``, a pipeline's
    micro-batches: consecutive rows of a rank's, :func:`jphantom.pipeline.buffers.
    split_microbatches`), each an array of row indices. A GSPMD step scales the whole global
    micro-batch. ``None`` (one whole-batch reference) where the batch is not split on its rows
    alone by the default specs."""
    from jphantom.step.fp8 import NO_SCALE_AXES
    from jphantom.step.layout import batch_axes_of

    setup = getattr(step, "setup", None)
    if setup is not None and getattr(setup, "batch_specs", None) is not None:
        return None  # custom batch specs: the rows' ranks are not known here
    rows = int(np.shape(batch[0])[0]) if batch else 0
    if rows == 0 or any(np.ndim(b) == 0 or np.shape(b)[0] != rows for b in batch):
        return None
    micro = step.pipeline.microbatches if step.pipeline is not None else step.accumulate
    sizes = dict(step.mesh.shape)
    axes = batch_axes_of(step.mesh) if step.spmd != "gspmd" else ()
    ranks = math.prod(sizes[a] for a in axes)
    if rows % (ranks * micro):
        return None
    per_rank, per_micro = rows // ranks, rows // (ranks * micro)
    groups: dict[tuple, list[int]] = {}
    for row in range(rows):
        rank, within = divmod(row, per_rank)
        coords = np.unravel_index(rank, [sizes[a] for a in axes]) if axes else ()
        key = (tuple(int(c) for a, c in zip(axes, coords) if a in NO_SCALE_AXES),
               within // per_micro)
        groups.setdefault(key, []).append(row)
    return [np.asarray(v) for _, v in sorted(groups.items())]


def _reference(layout, loss_fn, precision, wide):
    """The one-device loss of the parameters (a dict in the step's model order) as
    ``(share, weight_of)``: ``share(params, *batch, weight, count)`` runs the plain model they are
    (:func:`jphantom.plans.dense_equivalent`), in float64 (``wide``), or, for a mixed precision,
    through the policy the step applies on each rank (the parameters and the floating inputs cast
    to the compute dtype, FP8 GEMMs in the blocks, the loss scaled), and returns ``batch``'s
    share of the loss: ``total / weight + mean / count`` for a weighted ``loss_fn`` (``weight``:
    every group's together, the global token mean), the scalar mean / ``count`` otherwise;
    ``weight_of(params, *batch)`` is the weight of ``batch`` (``None`` for a scalar ``loss_fn``)."""
    from jphantom.nn.stack import set_fp8
    from jphantom.plans import dense_equivalent

    def loss_out(params, batch):
        leaves = precision.cast(jax.tree.leaves(params))
        model = dense_equivalent(layout.model_of(leaves))
        if wide is not None:  # compute in the parameters' float64
            for _, module in nnx.iter_modules(model):
                if getattr(module, "dtype", None) is not None:
                    module.dtype = None
        model = precision.retype(model)
        if precision.fp8:
            set_fp8(model)
        return loss_fn(model, *precision.cast(batch))

    def share(params, *batch, weight=None, count=1):
        parts = token_mean.terms(loss_out(params, batch), loss_fn)
        if parts is None:
            value = jnp.asarray(loss_out(params, batch)) / count
        else:
            weight = parts.weight if weight is None else weight
            value = parts.total / lax.stop_gradient(weight) + jnp.asarray(parts.mean) / count
        return value.astype(jnp.promote_types(value.dtype, jnp.float32)) * precision.loss_scale

    def weight_of(params, *batch):
        parts = token_mean.terms(loss_out(params, batch), loss_fn)
        return None if parts is None else parts.weight

    return share, weight_of


def _reference_gradients(share, weight_of, params, batch, groups):
    """The reference loss and gradient: of the whole batch at once, or, with ``groups`` (the rows
    a step's data ranks and micro-batches quantise by themselves, :func:`scale_groups`), each
    group's share of the loss differentiated by itself and the shares' gradients summed in float32
    (at least), as the step's ranks reduce theirs."""
    if groups is None or len(groups) == 1:
        return jax.jit(jax.value_and_grad(share))(params, *batch)
    parts = [[b[rows] for b in batch] for rows in groups]
    weights = [jax.jit(weight_of)(params, *part) for part in parts]
    weight = None if weights[0] is None else sum(weights)
    one = jax.jit(jax.value_and_grad(partial(share, count=len(groups))))
    wide = lambda a: a.astype(jnp.promote_types(a.dtype, jnp.float32))
    loss, grads = 0.0, None
    for part in parts:
        value, grad = one(params, *part, weight=weight)
        loss = loss + wide(value)
        grads = (jax.tree.map(wide, grad) if grads is None
                 else jax.tree.map(lambda a, g: a + wide(g), grads, grad))
    return loss, grads


def verify(model: nnx.Module, mesh, plan: Mapping | None, loss_fn: Callable, *batch,
           tolerance: float | None = None, **step_options) -> Report:
    """One step of ``model`` parallelised with ``plan`` (``None``: as it is) on ``mesh`` against
    the one-device model (module docstring); ``tolerance``: default :func:`tolerance_of` the
    step's precision. ``model`` is left as it was."""
    import optax

    from jphantom import plans
    from jphantom.step.train_step import make_train_step

    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    if plan is not None:
        copy = plans.parallelize(copy, mesh, plan)
    step = make_train_step(copy, mesh, optax.sgd(0.0), loss_fn, donate=False, **step_options)
    return verify_step(step, step.init().params, *batch, tolerance=tolerance)


__all__ = ["Report", "TOLERANCE", "on_one_device", "relative_errors", "scale_groups",
           "tolerance_of", "verify", "verify_step"]
