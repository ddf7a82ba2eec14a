"""The whole batch's load-balancing fractions: the hook between a step that splits the batch into
micro-batches and a mixture-of-experts model.

The Switch Transformer's load-balancing loss (Fedus et al. 2021, eq. 4), ``E sum_e f_e P_e``, is
not a mean over tokens: ``f_e``, the fraction of the batch's tokens whose first choice is expert
e, is a statistic of the whole batch. A step that accumulates micro-batches, or pipelines them,
would otherwise give each micro-batch its own ``f`` and train another loss. The hook has two
sides, both explicit:

- **the model** takes part by defining ``balance_statistics(*batch)`` -> ``[L_moe, 2E]`` (per MoE
  layer: how many tokens chose each expert first, then each expert's summed probability; ``None``
  without MoE layers) and by reading :func:`current` of itself where its MoE layers build their
  loss (``None``: the micro-batch's own fractions). :class:`jphantom.models.gpt2.GPT2` does both;
- **the step** (:class:`jphantom.TrainStep`) asks :func:`takes_part` of the model, sums the
  statistics over every micro-batch in a forward pass without gradient, turns them into
  fractions (:func:`fractions`) and gives them (:func:`give`) to the model it merges for each
  micro-batch before it runs ``loss_fn`` on it.

``loss_fn`` needs no parameter for it: the fractions are a value of the model's own state, a
:class:`Fraction` variable on the model the step merged (step data, not a parameter: no
gradient, no optimizer state, never checkpointed), as the dropout keys are
(:mod:`jphantom.nn.dropout`). ``f`` counts arg-max choices and carries no gradient, so the
accumulated loss and gradient equal the step's without micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

ATTRIBUTE = "balance_fraction"  # where the step puts the fractions on the model


class Fraction(nnx.Variable):
    """The whole batch's routing fractions [L_moe, E] the step gives a micro-batch's model."""


def takes_part(model) -> bool:
    """Whether ``model`` declares the hook (defines ``balance_statistics``)."""
    return callable(getattr(model, "balance_statistics", None))


def fractions(statistics: jax.Array) -> jax.Array:
    """The routing fractions ``f`` [L_moe, E] of summed statistics [L_moe, 2E] (their first E
    columns, the first-choice counts, normalised per layer; no gradient)."""
    counts = lax.stop_gradient(statistics[:, :statistics.shape[-1] // 2])
    return counts / jnp.sum(counts, axis=-1, keepdims=True)


def give(model: nnx.Module, fraction) -> None:
    """``model`` (one the step merged for a micro-batch) holds the whole batch's ``fraction``
    [L_moe, E] as a :class:`Fraction` (``None``: nothing given, each micro-batch its own)."""
    if fraction is not None:
        setattr(model, ATTRIBUTE, nnx.data(Fraction(fraction)))


def current(model: nnx.Module):
    """The whole batch's fractions the step gave ``model`` (:func:`give`), or ``None``."""
    given = getattr(model, ATTRIBUTE, None)
    return None if given is None else given.get_value()
