"""Mixed precision as a policy of the step, not casts scattered through models.

The parameters and the optimizer state stay in their stored dtype (float32: the master weights);
inside the step the policy casts the parameters and the floating inputs to the compute dtype
before the forward, so every matmul and activation runs in it, and autodiff casts the gradients
back to float32 before the reduction and the update (Micikevicius et al. 2018; seed 001 Sec. 1.2).
Losses reduce in at least float32 (the FFN's squared error and the transformer's cross-entropy
promote). ``float16`` scales the loss by a static factor before differentiating and unscales the
gradients after, so that small gradients do not flush to zero.

=========  ===============  ==========  ==============
name       compute          master      loss scale
=========  ===============  ==========  ==============
float32    float32          float32     1
bf16       bfloat16         float32     1
float16    float16          float32     2^12 (static)
=========  ===============  ==========  ==============
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jphantom.errors import ConfigError

NAMES = ("float32", "bf16", "float16")


@dataclasses.dataclass(frozen=True)
class Precision:
    """``compute``: the dtype of the forward and backward; ``loss_scale``: the static factor."""

    compute: str = "float32"
    loss_scale: float = 1.0

    def __post_init__(self):
        if self.compute not in ("float32", "bfloat16", "float16", "float64"):
            raise ConfigError(f"compute dtype {self.compute!r}: use float32, bfloat16 or float16")
        if not self.loss_scale > 0:
            raise ConfigError(f"loss_scale={self.loss_scale!r} must be positive, e.g. 4096")

    @classmethod
    def named(cls, name: str | Precision) -> Precision:
        if isinstance(name, Precision):
            return name
        if name == "float32":
            return cls()
        if name == "bf16":
            return cls("bfloat16")
        if name == "float16":
            return cls("float16", 2.0 ** 12)
        raise ConfigError(f"precision={name!r}: use one of {', '.join(NAMES)}")

    @property
    def is_default(self) -> bool:
        return self.compute == "float32" and self.loss_scale == 1.0

    def cast(self, tree):
        """Floating leaves to the compute dtype (integers, e.g. tokens, untouched)."""
        if self.is_default:
            return tree
        dtype = jnp.dtype(self.compute)
        return jax.tree.map(
            lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)
