"""Repeated blocks with their parameters stacked over depth, run under ``lax.scan``.

    self.blocks = jphantom.nn.Stacked(lambda rngs: Block(config, rngs=rngs), layers, rngs=rngs)
    h = self.blocks(h)                          # h = block_{L-1}(... block_0(h))

:class:`Stacked` creates L blocks under ``nnx.vmap`` (every parameter gets a leading [L] axis) and
applies them with ``lax.scan`` over the split state, so a model's compile time is flat in its
depth, a plan that names ``blocks.*.attn.q`` swaps the layer of every block at once, and a
pipeline can cut the L axis over ``stage``. ``remat`` is the block's activation-checkpointing
policy (:mod:`jphantom.remat`), an explicit attribute: :func:`set_remat` sets it, the step's
``remat=`` option calls it. Holds no collective.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax import lax

from jphantom import remat as remat_module
from jphantom.errors import check_int


class Stacked(nnx.Module):
    """``layers`` copies of one block, parameters stacked [L, ...], applied in order."""

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], layers: int, *,
                 rngs: nnx.Rngs):
        self.layers = check_int("layers", layers)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=layers)
        def create(rngs):
            return make_block(rngs)

        self.block = create(rngs)
        self.remat = "none"

    def __call__(self, h: jax.Array, *args) -> jax.Array:
        """``h`` through every block; ``args`` are passed to each block unchanged."""
        graphdef, state = nnx.split(self.block)

        def one(layer_state, h):
            return nnx.merge(graphdef, layer_state)(h, *args)

        if self.remat != "none":
            one = jax.checkpoint(one, policy=remat_module.POLICIES[self.remat])
        h, _ = lax.scan(lambda h, layer_state: (one(layer_state, h), None), h, state)
        return h


def set_remat(model: nnx.Module, policy: str) -> None:
    """Checkpoint every :class:`Stacked` block of ``model`` with ``policy`` (``none``,
    ``nothing_saveable``, ``dots_saveable``, ``collectives_saveable``)."""
    remat_module.check(policy)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Stacked):
            module.remat = policy
