"""Repeated blocks with their parameters stacked over depth, run under ``lax.scan``.

    self.blocks = jphantom.nn.Stacked(lambda rngs: Block(config, rngs=rngs), layers, rngs=rngs)
    h = self.blocks(h)                          # h = block_{L-1}(... block_0(h))

:class:`Stacked` creates L blocks under ``nnx.vmap`` (every parameter gets a leading [L] axis) and
applies them with ``lax.scan`` over the split state, so a model's compile time is flat in its
depth, a plan that names ``blocks.*.attn.q`` swaps the layer of every block at once, and a
pipeline can cut the L axis over ``stage``.

What flows from block to block (the *carry*) is whatever the model passes: an array, or a pytree
such as ``(h, aux)`` where a block adds its auxiliary losses to ``aux`` (the MoE blocks). With
``with_index=True`` each block is called ``block(carry, index, *args)``, ``index`` the layer's
global position (Seal et al.'s FFN applies its ReLU before every layer but the first).
``peel_first=True`` runs layer 0 outside the scan, so that autodiff can drop what only its input
gradient needs (the FFN's data need none; inside the scan the first layer's backward collective
would be the body's and stay; a stack of one layer then has no scan at all), and so that the carry
entering the scan has the types the blocks give it (the MoE blocks' ``aux`` starts as plain zeros
and leaves the first block varying over the batch axes, as ``check_vma`` records).

A module of the block may define ``gather_stacked()``: it runs once on the module holding all L
layers' parameters, before the scan (:func:`gather_stacked`; pmm3d's deferred weights gather the
whole stack in one collective).

Three explicit attributes, set by the training step and never by a context: ``remat``, the
blocks' activation-checkpointing policy (:mod:`jphantom.step.remat`; :func:`set_remat`);
``fetch``, ZeRO-3's per-layer all-gather over ``data`` (:class:`jphantom.step.zero.LayerFetch`),
whose ``around(layer)`` runs each layer on its gathered parameters and gathers them again
for the backward; and ``sink``, the float32 accumulators a step accumulating micro-batches
has the blocks' backward add their gradients into (:class:`jphantom.nn.sink.Sink`). The
block's state that is not parameters, the values the step puts on the model it merges for a
micro-batch (each dropout layer's keys, one per layer: :class:`jphantom.nn.dropout.StepKey`), is
stacked [L] as the parameters are and sliced with them by the scan, never fetched. Holds no
collective itself.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom.nn import sink as sink_module
from jphantom.runtime import comm
from jphantom.step import remat as remat_module
from jphantom.errors import check_int


class Stacked(nnx.Module):
    """``layers`` copies of one block, parameters stacked [L, ...], applied in order."""

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], layers: int, *,
                 rngs: nnx.Rngs, with_index: bool = False, peel_first: bool = False):
        self.layers = check_int("layers", layers)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=layers)
        def create(rngs):
            return make_block(rngs)

        self.block = create(rngs)
        self.with_index, self.peel_first = bool(with_index), bool(peel_first)
        self.remat = "none"
        self.fetch = None
        self.sink = None

    def __call__(self, carry, *args):
        """``carry`` through every block; ``args`` are passed to each block unchanged."""
        graphdef, state, data = nnx.split(self.block, nnx.Param, ...)
        return apply_blocks(graphdef, state, carry, *args, data=data, remat=self.remat,
                            fetch=self.fetch, with_index=self.with_index,
                            peel_first=self.peel_first,
                            sink=None if self.sink is None else self.sink.leaves,
                            sink_reduce=None if self.sink is None else self.sink.reduce)


def apply_blocks(graphdef, state, carry, *args, data=None, remat: str = "none", fetch=None,
                 with_index: bool = False, peel_first: bool = False, offset=0, sink=None,
                 sink_reduce=None, unroll: bool = False):
    """The blocks of a split :class:`Stacked` (``state`` its parameters, stacked [L', ...])
    applied in order under ``lax.scan``, each checkpointed with ``remat`` and its parameters
    passed through ``fetch``: a pipeline stage's body runs its L' blocks so (``offset``: the
    global index of its first). ``data``: the rest of the block's state, stacked as its
    parameters and sliced with them but never fetched: the step's values for one micro-batch
    (each dropout layer's keys, :class:`jphantom.nn.dropout.StepKey`). ``sink``: float32
    accumulators, one per leaf of ``state`` (in ``jax.tree.leaves`` order), that the blocks'
    parameter gradients are added into instead (:mod:`jphantom.nn.sink`; not with
    ``gather_stacked`` hooks, whose gradient is the whole stack's); ``sink_reduce``: per
    accumulator, ``None`` or what each layer's gradient passes through first
    (:class:`jphantom.nn.sink.Sink`'s ``reduce``). ``unroll``: the scan unrolled (a pipeline's
    model chunk of few layers, :attr:`jphantom.pipeline.config.PipelineConfig.unroll_layers`): each
    layer reads its weights where they lie instead of from a copy of its chunk."""

    data = nnx.State({}) if data is None else data
    if sink is not None and gathers_stacked(graphdef, state, data):
        raise ValueError("a gradient sink under gather_stacked: the step accumulates such "
                         "blocks' gradients itself")
    graphdef, state = gather_stacked(graphdef, state, data)
    one = remat_module.checkpointed(_one_block(graphdef, with_index), remat,
                                    fetched=fetch is not None,
                                    regather=_sequence_axis(graphdef, state, data))
    if fetch is not None:
        one = fetch.around(one)
    layers = jax.tree.leaves(state)[0].shape[0]
    xs = (offset + jnp.arange(layers), data)  # per layer: its index and its step data
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    # the carry's type as the blocks leave it
    typed = lambda st, c, x: _varying_like(c, jax.eval_shape(  # noqa: E731
        lambda st, c, x: one(first(st), c, first(x), args), st, c, x))
    if sink is not None and layers:
        return sink_module.scan_into(one, state, sink, typed(state, carry, xs), xs, args,
                                     peel_first=peel_first, reduce=sink_reduce)
    if peel_first:
        carry = one(first(state), carry, first(xs), args)
        if layers == 1:
            return carry
        state, xs = jax.tree.map(lambda a: a[1:], (state, xs))
    if not jax.tree.leaves(state) or jax.tree.leaves(state)[0].shape[0] == 0:
        return carry
    carry, _ = lax.scan(lambda c, x: (one(x[0], c, x[1], args), None), typed(state, carry, xs),
                        (state, xs), unroll=bool(unroll))
    return carry


def apply_layers(graphdef, states, carry, *, remat: str = "none", with_index: bool = False,
                 offset=0):
    """The blocks applied in order, each with its own parameters ``states[l]`` (not a stack):
    a pipeline's model chunk of few layers as Megatron-LM's Python loop over them runs it, each
    checkpointed with ``remat`` (:func:`apply_blocks`' ``one``; ``offset``: the global index of
    the first). Unlike a scan, even unrolled, nothing is stacked: the residuals a ``jax.vjp`` of
    it keeps and the gradients its pullback gives are per layer, with no concatenation of
    either (:class:`jphantom.pipeline.config.Stages`' ``layers``)."""
    data = nnx.State({})
    one = remat_module.checkpointed(_one_block(graphdef, with_index), remat, fetched=False,
                                    regather=_sequence_axis(graphdef, states[0], data))
    for layer, state in enumerate(states):
        carry = one(state, carry, (offset + layer, data), ())
    return carry


def _one_block(graphdef, with_index: bool):
    """One block's call on its parameters ``layer_state``: ``(index, layer_data)`` its global
    index and its step data, ``args`` the blocks' other inputs (:func:`apply_blocks`,
    :func:`apply_layers`)."""
    def one(layer_state, carry, index_data, args):
        index, layer_data = index_data
        block = nnx.merge(graphdef, layer_state, layer_data)
        return block(carry, index, *args) if with_index else block(carry, *args)
    return one


def _sequence_axis(graphdef, state, data) -> str | None:
    """The mesh axis a block's sequence-parallel modules all-gather the sequence over (their
    ``gathers_sequence``), or None. None too for a block on FP8 GEMMs (:func:`set_fp8`): an FP8
    GEMM keeps its own residuals, its quantised operands, which no checkpoint policy reaches, and
    regathering under it gave NaN gradients (an open defect: the bf16 steps regather)."""
    block = nnx.merge(graphdef, state, data)
    modules = [m for _, m in nnx.iter_modules(block)]
    if any(getattr(m, "fp8", False) is True for m in modules):
        return None
    axes = {getattr(m, "gathers_sequence", None) for m in modules} - {None}
    return next(iter(axes)) if len(axes) == 1 else None


def _varying_like(carry, out):
    """``carry`` marked varying over every mesh axis its block output varies over (inside a
    shard_map, ``check_vma``): an MoE block's statistics enter as plain zeros and leave varying
    over the batch axes, and a scan's carry must keep its type."""
    from jphantom.nn.metadata import varying_axes

    def one(c, o):
        extra = tuple(sorted(varying_axes(o) - varying_axes(c)))
        return comm.pcast(c, extra, to="varying") if extra else c

    return jax.tree.map(one, carry, out)


def gather_stacked(graphdef, state, data=None):
    """The block's graph and state after every module of it that defines ``gather_stacked()``
    (pmm3d's deferred linears) has run it on the whole stack of its parameters [L, ...], before
    the layers: one collective per stack instead of one per layer (its transpose, after the
    backward, also one). Unchanged when no module defines it. ``data``: the block's state that
    is not parameters, split off (:func:`apply_blocks`): then only the parameters come back."""
    extra = () if data is None else (data,)
    block = nnx.merge(graphdef, state, *extra)  # fresh variables: the caller's never changed
    hooks = [m.gather_stacked for _, m in nnx.iter_modules(block)
             if callable(getattr(m, "gather_stacked", None))]
    if not hooks:
        return graphdef, state
    for hook in hooks:
        hook()
    return nnx.split(block, nnx.Param, ...)[:2] if extra else nnx.split(block)


def gathers_stacked(graphdef, state, data=None) -> bool:
    """Whether a module of the block gathers its whole stack in ``gather_stacked()``
    (:func:`gather_stacked`; a module that defines it says with ``stack_gathered``)."""
    extra = () if data is None else (data,)
    block = nnx.merge(graphdef, state, *extra)
    return any(callable(getattr(m, "gather_stacked", None)) and getattr(m, "stack_gathered", True)
               for _, m in nnx.iter_modules(block))


class StackInput(Exception):
    """Raised by :class:`Capture` to hand a pipeline the activation entering the blocks."""

    def __init__(self, h):
        super().__init__("the activation entering the stacked blocks")
        self.h = h


class Capture(Stacked):
    """Stands in for a :class:`Stacked` while a pipeline runs the model's part before the blocks
    (its first stage's embedding): raises :class:`StackInput` with the blocks' input."""

    def __init__(self):  # holds no blocks
        self.remat, self.fetch, self.sink = "none", None, None

    def __call__(self, h, *args):
        raise StackInput(h)


class Feed(Stacked):
    """Stands in for a :class:`Stacked` while a pipeline runs the model's part after the blocks
    (its last stage's head and loss): returns the pipeline's output instead of its input."""

    def __init__(self, output_fn):  # holds no blocks
        self.output_fn, self.remat, self.fetch, self.sink = output_fn, "none", None, None

    def __call__(self, h, *args):
        return self.output_fn()


def set_fp8(model: nnx.Module) -> nnx.Module:
    """The linear layers of ``model``'s :class:`Stacked` blocks (every linear layer of a model
    without them) on FP8 operands (:mod:`jphantom.step.fp8`): ``nnx.Linear``'s ``dot_general`` becomes
    :func:`jphantom.step.fp8.dot_general`, and the layers with an ``fp8`` flag (jphantom's column, row,
    T1, phantom, experts and pmm3d layers) get it set. The step calls it on each rank's model
    under ``precision='fp8'``. A mixture of experts' router stays in the compute dtype (its
    top-k choice is sensitive to rounding; TransformerEngine and torchao leave it too)."""
    from jphantom.step import fp8

    stacks = [m for _, m in nnx.iter_modules(model) if isinstance(m, Stacked)]
    for root in [s.block for s in stacks] or [model]:
        for path, module in nnx.iter_modules(root):
            if path and path[-1] == "router":
                continue
            if isinstance(module, nnx.Linear):
                module.dot_general = fp8.dot_general
            elif hasattr(module, "fp8"):
                module.fp8 = True
    return model


def set_remat(model: nnx.Module, policy: str) -> None:
    """Checkpoint every :class:`Stacked` block of ``model`` with ``policy``
    (:data:`jphantom.step.remat.NAMES`), and set every attention core's ``recompute``: whether it
    recomputes itself in the backward (``all_but_attention_core_saveable``, Megatron's selective
    recompute, :func:`jphantom.step.remat.recomputes_attention_core`)."""
    from jphantom.nn.attention import CausalAttention, RingAttention

    recompute = remat_module.recomputes_attention_core(policy)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Stacked):
            module.remat = policy
        elif isinstance(module, (CausalAttention, RingAttention)):
            module.recompute = recompute
