"""Mixed precision as a policy of the step, not casts scattered through models.

The parameters and the optimizer state stay in their stored dtype (float32: the master weights);
inside the step the policy casts the parameters and the floating inputs to the compute dtype
before the forward, so every matmul and activation runs in it, and autodiff casts the gradients
back to float32 before the reduction and the update (Micikevicius et al. 2018; Cheng et al. Sec. 1.2).
Losses reduce in at least float32 (the FFN's squared error and the transformer's cross-entropy
promote). ``float16`` scales the loss before differentiating and unscales the gradients after, so
that small gradients do not flush to zero, with *dynamic* loss scaling (Micikevicius et al. 2018;
Megatron-LM's and ``jmp``'s): the scale starts at 2^15, a step whose gradients are not all finite
is skipped (parameters and optimizer state unchanged) and halves the scale (never below 1), and
every ``period`` finite steps in a row double it. The scale lives in the optimizer state
(:class:`LossScaleState`, :func:`dynamic_loss_scale` wraps the optimizer), so checkpoints keep
it.

=========  ===============  ==========  ======================
name       compute          master      loss scale
=========  ===============  ==========  ======================
float32    float32          float32     1
bf16       bfloat16         float32     1
float16    float16          float32     dynamic, from 2^15
fp8        bfloat16; the    float32     1
           blocks' GEMMs
           in FP8
=========  ===============  ==========  ======================

``fp8`` (:mod:`jphantom.step.fp8`: E4M3 forward operands, E5M2 output gradients, per-tensor current
scaling) is bf16 with the GEMMs of the linear layers inside the model's
:class:`~jphantom.nn.stack.Stacked` blocks (every linear layer of a model without them) on FP8
operands (:func:`jphantom.nn.stack.set_fp8`, which the training step applies to each rank's
model): ``nnx.Linear`` gets :func:`jphantom.step.fp8.dot_general` as its ``dot_general``, and
jphantom's parallel layers (column, row, T1, phantom, experts, pmm3d) their ``fp8`` flag.
Embeddings, norms, attention and the LM head stay bf16. No loss scale: E5M2's range covers the
gradients.

The names (:data:`NAMES`) and :class:`Precision` import no jax (a run's configuration validates
against them); casting and loss scaling import jax and optax when they run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

from jphantom.errors import ConfigError

if TYPE_CHECKING:
    import jax
    import optax

NAMES = ("float32", "bf16", "float16", "fp8")


@dataclasses.dataclass(frozen=True)
class Precision:
    """``compute``: the dtype of the forward and backward; ``loss_scale``: the static factor."""

    compute: str = "float32"
    loss_scale: float = 1.0  # the static scale, or the dynamic scale's start
    dynamic: bool = False
    period: int = 2000  # finite steps in a row before the dynamic scale doubles
    fp8: bool = False  # the blocks' GEMMs on FP8 operands (jphantom.step.fp8)

    def __post_init__(self):
        if self.compute not in ("float32", "bfloat16", "float16", "float64"):
            raise ConfigError(f"compute dtype {self.compute!r}: use float32, bfloat16 or float16")
        if not self.loss_scale > 0:
            raise ConfigError(f"loss_scale={self.loss_scale!r} must be positive, e.g. 4096")
        if self.fp8 and self.compute not in ("bfloat16", "float32"):
            raise ConfigError(f"fp8 GEMMs with {self.compute} compute: use bfloat16 "
                              "(precision='fp8')")

    @classmethod
    def named(cls, name: str | Precision) -> Precision:
        if isinstance(name, Precision):
            return name
        if name == "float32":
            return cls()
        if name == "bf16":
            return cls("bfloat16")
        if name == "float16":
            return cls("float16", 2.0 ** 15, dynamic=True)
        if name == "fp8":
            return cls("bfloat16", fp8=True)
        raise ConfigError(f"precision={name!r}: use one of {', '.join(NAMES)}")

    @property
    def is_default(self) -> bool:
        return self.compute == "float32" and self.loss_scale == 1.0 and not self.fp8

    @property
    def name(self) -> str:
        """The name :meth:`named` takes for this policy (``custom`` for other combinations)."""
        for name in NAMES:
            if Precision.named(name) == self:
                return name
        return "custom"

    def check_master(self, dtypes) -> None:
        """Every policy but float32 updates float32 master weights (the table above): the
        floating parameters' dtypes (``dtypes``, names) must all be float32, else a ConfigError
        naming them. Stated once; the run's configuration and the training step both check it."""
        if self.is_default:
            return
        other = sorted({str(d) for d in dtypes} - {"float32"})
        if other:
            raise ConfigError(f"precision={self.name!r} computes in {self.compute} and updates "
                              f"float32 master weights, but the model's parameters are "
                              f"{', '.join(other)}: build the model in float32 (--dtype float32; "
                              "the policy casts it for the forward), or train in its dtype with "
                              "precision='float32'")

    def retype(self, model):
        """``model`` (merged from :meth:`cast` leaves) computing in the compute dtype: modules that
        name a floating ``dtype`` get the compute dtype. Flax's ``nnx.Embed`` sets its ``dtype`` to
        its ``param_dtype`` when none is given and casts its table back to it, so without this
        a float32 model's embedding, and the residual stream after it, stay float32 and every
        matmul promotes to float32 (measured on an H100 compile: all of Megatron's all-reduces
        in float32 under ``bf16``)."""
        if self.is_default:
            return model
        import jax.numpy as jnp
        from flax import nnx

        dtype = jnp.dtype(self.compute)
        for _, module in nnx.iter_modules(model):
            current = getattr(module, "dtype", None)
            if current is not None and jnp.issubdtype(current, jnp.floating) and current != dtype:
                module.dtype = dtype
        return model

    def cast(self, tree):
        """Floating leaves to the compute dtype (integers, e.g. tokens, untouched)."""
        if self.is_default:
            return tree
        import jax
        import jax.numpy as jnp

        dtype = jnp.dtype(self.compute)
        return jax.tree.map(
            lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


class LossScaleState(NamedTuple):
    """The dynamic loss scale and the wrapped optimizer's state."""

    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: finite steps since the scale last changed
    inner: Any


def dynamic_loss_scale(inner: optax.GradientTransformation, *, initial: float = 2.0 ** 15,
                       period: int = 2000, factor: float = 2.0,
                       minimum: float = 1.0) -> optax.GradientTransformation:
    """``inner`` with dynamic loss scaling (module docstring): the update of gradients that are
    not all finite is zero and leaves ``inner``'s state as it was; the scale halves then, and
    doubles after ``period`` finite steps in a row. The step scales the loss by
    ``state.scale`` and hands the update unscaled gradients."""
    import jax
    import jax.numpy as jnp
    import optax

    def init(params):
        return LossScaleState(jnp.asarray(initial, jnp.float32), jnp.zeros((), jnp.int32),
                              inner.init(params))

    def update(grads, state, params=None):
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        updates, inner_state = inner.update(safe, state.inner, params)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = good >= period
        scale = jnp.where(finite, jnp.where(grow, state.scale * factor, state.scale),
                          jnp.maximum(state.scale / factor, minimum))
        return updates, LossScaleState(scale.astype(jnp.float32),
                                       jnp.where(grow, 0, good).astype(jnp.int32),
                                       keep(inner_state, state.inner))

    return optax.GradientTransformation(init, update)
