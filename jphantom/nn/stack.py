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
        return apply_blocks(graphdef, state, h, *args, remat=self.remat)


def apply_blocks(graphdef, state, h: jax.Array, *args, remat: str = "none") -> jax.Array:
    """The blocks of a split :class:`Stacked` (``state`` stacked [L', ...]) applied in order under
    ``lax.scan``, each checkpointed with ``remat``: a pipeline stage's body runs its L' blocks so."""

    def one(layer_state, h):
        return nnx.merge(graphdef, layer_state)(h, *args)

    if remat != "none":
        one = jax.checkpoint(one, policy=remat_module.POLICIES[remat])
    h, _ = lax.scan(lambda h, layer_state: (one(layer_state, h), None), h, state)
    return h


class StackInput(Exception):
    """Raised by :class:`Capture` to hand a pipeline the activation entering the blocks."""

    def __init__(self, h):
        super().__init__("the activation entering the stacked blocks")
        self.h = h


class Capture(Stacked):
    """Stands in for a :class:`Stacked` while a pipeline runs the model's part before the blocks
    (its first stage's embedding): raises :class:`StackInput` with the blocks' input."""

    def __init__(self):  # holds no blocks
        self.remat = "none"

    def __call__(self, h, *args):
        raise StackInput(h)


class Feed(Stacked):
    """Stands in for a :class:`Stacked` while a pipeline runs the model's part after the blocks
    (its last stage's head and loss): returns the pipeline's output instead of its input."""

    def __init__(self, output_fn):  # holds no blocks
        self.output_fn, self.remat = output_fn, "none"

    def __call__(self, h, *args):
        return self.output_fn()


def set_remat(model: nnx.Module, policy: str) -> None:
    """Checkpoint every :class:`Stacked` block of ``model`` with ``policy`` (``none``,
    ``nothing_saveable``, ``dots_saveable``, ``collectives_saveable``)."""
    remat_module.check(policy)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Stacked):
            module.remat = policy
