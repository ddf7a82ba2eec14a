"""Seal et al.'s FFN: L layers of width n, ReLU between them, none after the last, trained on MSE.

    y = W_L relu(... relu(W_2 relu(W_1 x + b_1) + b_2) ...) + b_L        x, y [B, n]

:class:`FFN` is a Flax NNX module of plain ``nnx.Linear`` layers holding no collective; a
strategy is a plan applied to it (:func:`jphantom.registry.program.build`, through the family's
builder :func:`jphantom.models.ffn.program.build`, which also validates the configuration against
the mesh):

    program = jphantom.registry.program.build(FFNConfig(width=4096, depth=2, ghost_width=16), "phantom",
                                     "data=2,model=4")
    step = program.train_step(mesh, optax.sgd(0.1))
    state = program.init(step)               # parameters created in their shards
    state, loss = step(state, x, t)          # x, t [B, n]: rows over data, features over model

Structure (module paths a plan names). The layers are stacked with :class:`jphantom.nn.Stacked`
(parameters [U, ...], ``lax.scan``), so compile time is flat in depth, ZeRO-3 gathers one unit at
a time and a ``stage`` axis cuts the units into pipeline stages:

- ``pairs=False`` (phantom, T1, dense, GSPMD): ``layers.block.linear``, one unit per layer
  (U = L).
- ``pairs=True`` (Megatron's column/row pairs, pmm3d's normal/transposed layers: the strategies
  whose consecutive layers alternate): ``layers.block.first`` and ``layers.block.second``, one
  unit per pair of layers (U = floor(L/2)), and ``last``, a lone last layer when L is odd (outside
  the stack: on a pipeline's last stage). ``FFN(config, pairs=True)`` is the same model as
  ``pairs=False``, its parameters grouped differently.
- ``entry`` and ``exit``: :class:`jphantom.nn.boundary.Boundary` (the identity), where Megatron's
  plan gathers the feature-split input and scatters the replicated output back.

Every unit gets its global index (``with_index``) and applies the ReLU before it when the index
is not 0; the first unit runs outside the scan (``peel_first``), so that autodiff drops its input
gradient (nobody needs dL/dx) and with it the collective it would cost.

One idea a module:

- :mod:`~jphantom.models.ffn.config`: the shape, :class:`FFNConfig` (no jax: a run's
  configuration builds it as it validates);
- :mod:`~jphantom.models.ffn.model`: the NNX module, :class:`FFN`, and its loss;
- :mod:`~jphantom.models.ffn.family`: its registration (``ffn``, :mod:`jphantom.registry.families`);
- :mod:`~jphantom.models.ffn.program`: its builder, the model under a strategy on a mesh
  (:class:`jphantom.registry.program.Program`; in the program layer, imported when a model is
  built).

Importing the package registers the family and imports no jax; the module's names load on first
use.
"""

from jphantom.models.ffn.config import DTYPES, FFNConfig
from jphantom.models.ffn.family import FAMILY

_LAZY = {"mse": "model", "Layer": "model", "Pair": "model", "FFN": "model", "ffn_loss": "model"}
__all__ = ["DTYPES", "FAMILY", "FFNConfig", *_LAZY]


def __getattr__(name):
    """The NNX module's names (jax) load on first use (module docstring)."""
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module 'jphantom.models.ffn' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jphantom.models.ffn.{_LAZY[name]}"), name)
