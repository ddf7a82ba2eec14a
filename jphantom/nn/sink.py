"""Gradient accumulation into a carried float32 sink: a layer scan whose backward adds each
layer's weight gradient into its slice of an accumulator, in place, as Megatron-LM's weight-
gradient GEMM accumulates into ``main_grad`` (its ``--gradient-accumulation-fusion`` option, a
fused CUDA kernel of Megatron-LM's code rather than an equation of the seeds' papers; here for the
seeds' Megatron layouts with ``--accumulate``).

    carry = scan_into(layer, state, sink, carry, xs, args)
    # forward: carry = layer(state[l], carry, xs[l], args) for l = 0 .. L-1
    # d/d sink: sink + d/d state (float32); d/d state: zero

Without it a step that accumulates k micro-batches differentiates each micro-batch's loss with
respect to the stacked parameters: the backward's ``lax.scan`` writes every layer's gradient
into an [L, ...] stack in the compute dtype, which is then added to the float32 accumulator, so
XLA holds the stack beside the accumulator (15 GiB at Llama3.1-8B's width in bf16, on top of the
accumulator's 30 GiB; ``benchmarks/gradient_sink.py`` measures it on a toy). With it the step
differentiates with respect to the accumulator instead, whose gradient is the accumulator plus
the micro-batch's gradient, and the stack never exists.

The forward runs each layer under ``jax.vjp`` and keeps its pullback's residuals as the scan's
outputs (what a checkpoint policy saves, so :mod:`jphantom.step.remat`'s policies apply as
without the sink); a residual that is the layer's own slice of ``state`` or ``xs`` (a weight a
GEMM's input gradient needs, a dropout key) is not stacked again but sliced again in the
backward. The backward is its own reverse scan carrying the carry's cotangent, the ``args``'
cotangents and the sink. Holds no collective itself: the layers' pullbacks run theirs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.pipeline.buffers import zeros_of
from jphantom.runtime import comm


class Sink:
    """The accumulators a training step gives a :class:`jphantom.nn.Stacked` (its ``sink``): one
    float32 array per leaf of its blocks' parameters (``jax.tree.leaves`` order), each of that
    leaf's shape, or of ``reduce``'s output for one layer's gradient stacked [L, ...].
    ``reduce``: per leaf, ``None`` or a function applied to each layer's gradient before it is
    added (ZeRO-2's reduce-scatter over ``data``, :mod:`jphantom.step.grads`: the accumulator
    is then the leaf's shard). A holder, not a pytree: set on a model built for one
    micro-batch, never split."""

    def __init__(self, leaves, reduce=None):
        self.leaves = list(leaves)
        self.reduce = tuple(reduce) if reduce is not None else (None,) * len(self.leaves)
        if len(self.reduce) != len(self.leaves):
            raise ValueError(f"Sink of {len(self.leaves)} accumulators given "
                             f"{len(self.reduce)} reductions")


def scan_into(layer: Callable, state, sink, carry, xs, args=(), *, peel_first: bool = False,
              reduce=None):
    """``carry`` through ``layer(layer_state, carry, layer_xs, args)`` for each layer of
    ``state`` and ``xs`` (pytrees stacked [L, ...]), whose gradient with respect to ``sink`` (a
    list of float arrays, one per leaf of ``state``, each of its shape) is ``sink`` plus the
    gradient with respect to ``state``, and with respect to ``state`` zero (module docstring).
    The leaves of the carry and of ``args`` that are not floats (a packed batch's segment ids)
    get no gradient. ``peel_first``: layer 0 runs outside the scans, forward and backward, so
    that the compiler drops what only its input gradient needs when nothing uses it
    (:class:`jphantom.nn.stack.Stacked`'s ``peel_first``). ``reduce``: per leaf of ``sink``,
    ``None`` or a function of one layer's gradient whose output is added instead (the
    accumulator then of its shape, stacked: :class:`Sink`'s)."""
    reduce = tuple(reduce) if reduce is not None else (None,) * len(sink)
    return _scan_into(layer, bool(peel_first), reduce)(state, list(sink), carry, xs, args)


def _scan_into(layer, peel_first, reduce):
    """The custom VJP for one call (what its forward learns of the residuals is its own)."""
    static = {}

    def forward(state, carry, xs, args):
        """The carry after every layer, and the residuals of layer 0 (peeled) and the rest."""
        arg_floats, arg_rebuild = _split_floats(args)
        first = []
        if peel_first:
            layer_state, layer_xs = _row((state, xs), 0)
            carry, first = _layer_vjp(layer, static, "first", layer_state, carry, layer_xs,
                                      arg_floats, arg_rebuild)
            state, xs = jax.tree.map(lambda a: a[1:], (state, xs))
        kept = []
        if jax.tree.leaves(state)[0].shape[0]:
            carry, kept = lax.scan(
                lambda c, item: _layer_vjp(layer, static, "scan", item[0], c, item[1],
                                           arg_floats, arg_rebuild),
                carry, (state, xs))
        return carry, (first, kept)

    @jax.custom_vjp
    def call(state, sink, carry, xs, args):
        return lax.scan(lambda c, item: (layer(item[0], c, item[1], args), None), carry,
                        (state, xs))[0]

    def fwd(state, sink, carry, xs, args):
        out, (first, kept) = forward(state, carry, xs, args)
        return out, (state, sink, xs, args, first, kept)

    def bwd(saved, ct):
        state, sink, xs, args, first, kept = saved
        ct_floats, ct_rebuild = _split_floats(ct)
        arg_floats, arg_rebuild = _split_floats(args)
        ct_args = [jnp.zeros_like(a) for a in arg_floats]
        backward = _delayed if any(r is not None for r in reduce) else _direct
        ct_floats, ct_args, sink = backward(static, reduce, peel_first, state, xs, first, kept,
                                            (ct_floats, ct_args, sink))
        return (None, sink, _nones(ct_rebuild(ct_floats)), None, _nones(arg_rebuild(ct_args)))

    call.defvjp(fwd, bwd)
    return call


def _direct(static, reduce, peel_first, state, xs, first, kept, carry):
    """The reverse scan over the layers, each layer's gradient added into the sink as its
    backward ends (``reduce`` all ``None``): ``(carry's cotangent, args' cotangents, sink)``."""
    start = 1 if peel_first else 0

    def one(carry, item):
        ct_floats, ct_args, sink = carry
        index, layer_kept, layer_state, layer_xs = item
        d_state, d_floats, d_args = _pullback(static, "scan", layer_kept, layer_state,
                                              layer_xs)(ct_floats)
        sink = _add_rows(sink, index, jax.tree.leaves(d_state), reduce)
        return (d_floats, [a + d for a, d in zip(ct_args, d_args)], sink), None

    layers = jax.tree.leaves(state)[0].shape[0]
    if layers > start:
        rest = jax.tree.map(lambda a: a[start:], (state, xs)) if start else (state, xs)
        carry, _ = lax.scan(one, carry, (jnp.arange(start, layers), kept, *rest), reverse=True)
    ct_floats, ct_args, sink = carry
    if peel_first:
        d_state, ct_floats, d_args = _pullback(static, "first", first,
                                               *_row((state, xs), 0))(ct_floats)
        sink = _add_rows(sink, 0, jax.tree.leaves(d_state), reduce)
        ct_args = [a + d for a, d in zip(ct_args, d_args)]
    return ct_floats, ct_args, sink


def _delayed(static, reduce, peel_first, state, xs, first, kept, carry):
    """:func:`_direct` with each layer's gradient reduced (ZeRO-2's reduce-scatter, ``reduce``'s
    entries with a ``prepare`` half: :class:`jphantom.step.zero.GradientScatter`) and added one
    layer later, in the backward of the layer below: the collective's input is the scan's
    carry, prepared as the layer's backward ends, ready as the next iteration starts, so XLA
    runs it under that layer's GEMMs instead of waiting on it at the iteration's end. The
    scan's first iteration reduces zeros (one extra collective per call: slicing the stacked
    residuals to peel the last layer instead would copy them); the first layer's reduction
    runs after the scan."""
    ct_floats, ct_args, sink = carry
    start = 1 if peel_first else 0
    layers = jax.tree.leaves(state)[0].shape[0]
    pending = None  # (layer index, its gradient) not yet added

    def handed(grads):  # a layer's gradient as the layer below takes it
        return [g if r is None else r.prepare(g) for g, r in zip(grads, reduce)]

    def one(carry, item):
        ct_floats, ct_args, sink, (above, grads) = carry
        index, layer_kept, layer_state, layer_xs = item
        sink = _add_rows(sink, above, grads, reduce)
        d_state, d_floats, d_args = _pullback(static, "scan", layer_kept, layer_state,
                                              layer_xs)(ct_floats)
        return (d_floats, [a + d for a, d in zip(ct_args, d_args)], sink,
                (index, handed(jax.tree.leaves(d_state)))), None

    if layers > start:
        indices = jnp.arange(start, layers)
        zeros = handed([zeros_of(a) for a in jax.tree.leaves(_row(state, layers - 1))])
        rest = jax.tree.map(lambda a: a[start:], (state, xs)) if start else (state, xs)
        (ct_floats, ct_args, sink, pending), _ = lax.scan(
            one, (ct_floats, ct_args, sink, (indices[-1], zeros)), (indices, kept, *rest),
            reverse=True)
    if peel_first:
        d_state, ct_floats, d_args = _pullback(static, "first", first,
                                               *_row((state, xs), 0))(ct_floats)
        ct_args = [a + d for a, d in zip(ct_args, d_args)]
        if pending is not None:
            sink = _add_rows(sink, *pending, reduce)
        pending = (0, handed(jax.tree.leaves(d_state)))
    if pending is not None:
        sink = _add_rows(sink, *pending, reduce)
    return ct_floats, ct_args, sink


def _layer_vjp(layer, static, name, layer_state, carry, layer_xs, arg_floats, arg_rebuild):
    """One layer's output and the residuals of its pullback that are not its own slices of the
    stacks; ``static[name]`` learns the pullback's structure and where its own slices go."""
    floats, rebuild = _split_floats(carry)

    def run(layer_state, floats, arg_floats):
        out = layer(layer_state, rebuild(floats), layer_xs, arg_rebuild(arg_floats))
        leaves, treedef = jax.tree.flatten(out)
        static["out"] = treedef, [_is_float(x) for x in leaves]
        return [x for x in leaves if _is_float(x)], [x for x in leaves if not _is_float(x)]

    out_floats, pullback, others = jax.vjp(run, layer_state, floats, arg_floats, has_aux=True)
    residuals, tree = jax.tree.flatten(pullback)
    own = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves((layer_state, layer_xs)))}
    static[name] = tree, [own.get(id(r), -1) for r in residuals]
    out = _merge_floats(*static["out"], out_floats, others)
    return out, [r for r in residuals if id(r) not in own]


def _pullback(static, name, kept, layer_state, layer_xs):
    """A layer's pullback rebuilt from its ``kept`` residuals and its own slices."""
    tree, where = static[name]
    own, kept = jax.tree.leaves((layer_state, layer_xs)), iter(kept)
    return jax.tree.unflatten(tree, [next(kept) if w < 0 else own[w] for w in where])


def _row(tree, index):
    """Layer ``index``'s slice of every stacked leaf of ``tree``."""
    return jax.tree.map(lambda a: a[index], tree)


def _split_floats(tree):
    """The float leaves of ``tree`` and a function rebuilding ``tree`` from new ones (the other
    leaves as they were)."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = [_is_float(x) for x in leaves]

    def rebuild(floats):
        floats = iter(floats)
        return jax.tree.unflatten(treedef, [next(floats) if m else x
                                            for x, m in zip(leaves, mask)])

    return [x for x, m in zip(leaves, mask) if m], rebuild


def _merge_floats(treedef, mask, floats, others):
    """The tree ``treedef`` of the leaves ``floats`` where ``mask`` and ``others`` elsewhere."""
    floats, others = iter(floats), iter(others)
    return jax.tree.unflatten(treedef, [next(floats) if m else next(others) for m in mask])


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _add_rows(sink, index, grads, reduce):
    """``sink`` with one layer's ``grads`` (its leaves') added into row ``index``."""
    return [_add_row(acc, index, g, r) for acc, g, r in zip(sink, grads, reduce)]


def _add_row(acc, index, g, reduce=None):
    """``acc`` with ``g`` (one layer's gradient, through ``reduce`` in its own dtype when given)
    added into its row ``index``, in ``acc``'s dtype and type (a gradient varying over fewer
    axes than its accumulator is marked so)."""
    g = (g if reduce is None else reduce(g)).astype(acc.dtype)
    extra = tuple(sorted(comm.varying_axes(acc) - comm.varying_axes(g)))
    g = comm.pcast(g, extra, to="varying") if extra else g
    return acc.at[index].add(g, indices_are_sorted=True, unique_indices=True)


def _nones(tree):
    """``tree`` as a custom VJP's cotangent: ``None`` (zero) for its leaves that are not floats
    (a float0 cotangent of an integer input, or the input itself)."""
    return jax.tree.map(lambda x: x if _is_float(x) else None, tree)
