"""The whole batch's load-balancing fractions: the hook between a step that splits the batch into
micro-batches and a mixture-of-experts model.

The Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4), ``E sum_e f_e P_e``, is
not a mean over tokens: ``f_e``, the fraction of the batch's tokens whose first choice is expert
e, is a statistic of the whole batch. A step that accumulates micro-batches, or pipelines them,
would otherwise give each micro-batch its own ``f`` and train another loss. The hook has two
sides, both explicit:

- **the model** takes part by defining ``balance_statistics(*batch)`` -> ``[L_moe, 2E]`` (per MoE
  layer: how many tokens chose each expert first, then each expert's summed probability; ``None``
  without MoE layers) and by reading :func:`current` where its MoE layers build their loss
  (``None``: the micro-batch's own fractions). :class:`jphantom.models.gpt2.GPT2` does both;
- **the step** (:class:`jphantom.TrainStep`) asks :func:`takes_part` of the model, sums the
  statistics over every micro-batch in a forward pass without gradient, turns them into
  fractions (:func:`fractions`) and runs each micro-batch's ``loss_fn`` inside :func:`given`.

``loss_fn`` needs no parameter for it: the fractions reach the model through this context, as the
dropout keys do (:mod:`jphantom.nn.dropout`). ``f`` counts arg-max choices and carries no
gradient, so the accumulated loss and gradient equal the step's without micro-batches.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax

_FRACTION: contextvars.ContextVar = contextvars.ContextVar("jphantom_balance_fraction",
                                                          default=None)


def takes_part(model) -> bool:
    """Whether ``model`` declares the hook (defines ``balance_statistics``)."""
    return callable(getattr(model, "balance_statistics", None))


def fractions(statistics: jax.Array) -> jax.Array:
    """The routing fractions ``f`` [L_moe, E] of summed statistics [L_moe, 2E] (their first E
    columns, the first-choice counts, normalised per layer; no gradient)."""
    counts = lax.stop_gradient(statistics[:, :statistics.shape[-1] // 2])
    return counts / jnp.sum(counts, axis=-1, keepdims=True)


@contextlib.contextmanager
def given(fraction):
    """Inside: the MoE model's losses use the whole batch's ``fraction`` [L_moe, E] (``None``:
    each micro-batch its own)."""
    token = _FRACTION.set(fraction)
    try:
        yield
    finally:
        _FRACTION.reset(token)


def current():
    """The whole batch's fractions the step gave (:func:`given`), or ``None``."""
    return _FRACTION.get()
