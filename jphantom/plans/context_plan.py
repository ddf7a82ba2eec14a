"""The ready-made plan of context parallelism (:mod:`jphantom.nn.attention`): every attention
core and positions module over the ``context`` axis, ring or all-gather attention:
:func:`context`."""

from __future__ import annotations

from flax import nnx

from jphantom.errors import ConfigError
from jphantom.nn import attention
from jphantom.plans.paths import modules_by_path
from jphantom.plans.styles import Style


def context(model: nnx.Module, *, algorithm: str = "ring", balanced: bool = True
            ) -> dict[str, Style]:
    """Context parallelism (:mod:`jphantom.nn.attention`): every attention core
    (:class:`~jphantom.nn.attention.CausalAttention`) and positions module
    (:class:`~jphantom.nn.attention.Positions`) of ``model`` over the ``context`` axis, with
    ``algorithm`` ``ring`` or ``all-gather`` and the ``balanced`` causal layout. Merge it with
    another plan (``{**plans.megatron(model), **plans.context(model)}``) or apply it alone."""
    attention.check_algorithm(algorithm)
    plan = {}
    for path, (_, module) in modules_by_path(model).items():
        if isinstance(module, attention.CausalAttention):
            plan[path] = Style("context", algorithm=algorithm, balanced=balanced)
        elif isinstance(module, attention.Positions):
            plan[path] = Style("context", balanced=balanced)
    if not any(isinstance(m, attention.CausalAttention) for _, m in nnx.iter_modules(model)):
        raise ConfigError(f"{type(model).__name__} has no jphantom.nn.CausalAttention core: "
                          "context parallelism swaps it for ring attention; build the model's "
                          "attention with one (q, k, v -> output) and its positions with "
                          "jphantom.nn.Positions")
    return plan
