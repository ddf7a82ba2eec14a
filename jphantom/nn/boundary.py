"""A named point between layers where a plan may change how an activation is split.

On one device a :class:`Boundary` is the identity. A model puts one where a strategy may need to
re-lay its activation out between the layers it has and the layout its inputs or outputs come in:
Seal et al.'s FFN takes and returns activations whose features are split over ``model`` (phantom's
layout), and Megatron's column/row pairs run on replicated activations in between, so the FFN
has an ``entry`` and an ``exit`` boundary. A plan swaps them for the layers that move the data
(``gather`` and ``scatter`` styles: :class:`~jphantom.nn.tensor.GatherFeatures`,
:class:`~jphantom.nn.tensor.ScatterFeatures`); every other strategy leaves them alone. Holds no
parameter and no collective.
"""

from __future__ import annotations

import jax
from flax import nnx


class Boundary(nnx.Module):
    """``x -> x``: where a plan may gather or scatter the features (module docstring)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


__all__ = ["Boundary"]
