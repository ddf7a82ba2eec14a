"""The step's per-rank loss and gradient, before any reduction: each rank's share of the global
loss, the weighted (global token mean) loss, accumulation over micro-batches and the MoE
whole-batch balance.

- **The loss share.** ``loss_fn(model, *batch)`` returns the mean loss of the rank's batch; the
  step differentiates the rank's share of the global mean (the mean over the batch axes it varies
  over, divided by their size), so that one ``psum`` of the gradients after the backward is the
  global gradient.
- **The weighted loss** (:mod:`jphantom.step.token_mean`): a ``loss_fn`` returning ``(total, weight[,
  mean])`` trains on ``sum(total) / sum(weight)`` over every rank and micro-batch; the global
  weight is found first (one scalar all-reduce inside the forward), each share is then its part
  of the whole loss.
- **Accumulation**: ``accumulate = n`` micro-batches summed by one loop before the one reduction
  per step (micro-batch i draws its dropout masks from key i), a loop XLA keeps as a loop
  (:func:`accumulate`); the stacked blocks' gradients are added into float32 sinks inside
  each micro-batch's backward (:meth:`LocalGradients.into_sinks`, :mod:`jphantom.nn.sink`).
- **MoE balance** (:mod:`jphantom.nn.balance`): the whole batch's routing fractions, found by a
  forward pass over the micro-batches without gradient and given to each micro-batch's loss.

:class:`LocalGradients` is the step's gradient provider without a pipeline (the functions before it
price the loss for every provider); the reductions after the backward are
:mod:`jphantom.step.reduce`'s, the pipelined provider :mod:`jphantom.step.pipeline`'s, GSPMD's
:mod:`jphantom.step.gspmd`'s.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom.runtime import comm
from jphantom.step import token_mean
from jphantom.step import zero as zero_module
from jphantom.errors import ConfigError
from jphantom.nn import balance as balance_module
from jphantom.nn import dropout as dropout_module
from jphantom.nn import metadata
from jphantom.nn import sink as sink_module
from jphantom.nn import stack as stack_module
from jphantom.pipeline.buffers import split_microbatches, zeros_of
from jphantom.step.rank_params import RankParameters
from jphantom.step.layout import module_at
from jphantom.step.setup import StepSetup


class Gradients(NamedTuple):
    """What every gradient provider returns: ``share``, this rank's share of the global loss
    (GSPMD's provider: the global loss itself); ``grads``, its gradients before the reductions
    (GSPMD: the global gradients); ``weight``, a weighted ``loss_fn``'s global weight
    (:mod:`jphantom.step.token_mean`; ``None`` for a scalar ``loss_fn``), which the step checks
    before it applies the update (:func:`jphantom.step.token_mean.guard`)."""

    share: Any
    grads: Any
    weight: Any = None


def accumulate(fn, micro, *, mean: bool, indexed: bool = False, carried=None):
    """``fn(micro_batch[, i])`` summed over the micro-batches ``micro`` (each array [n, ...]) by one
    loop, one micro-batch at a time (``indexed``: each call also gets its index i); ``mean``:
    divided by n (a scalar ``loss_fn``'s mean; a weighted one's shares already sum to the whole
    loss). ``carried``: a tree each call also takes, last, and returns updated beside its
    summand, ``fn(micro_batch, i, carried) -> (summand, carried)`` (the gradient sinks of
    :mod:`jphantom.nn.sink`, which accumulate themselves); then ``(sum, carried)``, both divided
    by n under ``mean``.

    The loop's bound passes through an ``optimization_barrier``, so XLA does not know its trip
    count: with a known one, XLA's GPU pipeline treats the micro-batch loop as the step's
    outermost loop and rewrites it, the collective pipeliner peeling micro-batches to move micro-
    batch i+1's first collective into micro-batch i, the loop double-buffering unrolling the rest,
    until the optimised program held every micro-batch's forward and backward side by side (4
    micro-batches: 17 loops for 3, 3.7x the temporaries of one). With the bound hidden the loop
    survives as one loop over one micro-batch's program. The analysis reads the bound back
    (:func:`jphantom.analysis.hlo.callgraph.trip_count`)."""
    n = micro[0].shape[0]
    threaded = carried is not None

    def step(mb, i, c):  # -> (summand, carried)
        given = (mb, i) if indexed else (mb,)
        return fn(*given, c) if threaded else (fn(*given), c)

    first = jax.eval_shape(lambda mb: step(mb, 0, carried)[0], [m[0] for m in micro])

    def one(i, state):
        total, c = state
        part, c = step([lax.dynamic_index_in_dim(m, i, keepdims=False) for m in micro], i, c)
        return jax.tree.map(jnp.add, total, part), c

    out = lax.fori_loop(0, lax.optimization_barrier(jnp.int32(n)), one,
                        (jax.tree.map(zeros_of, first), carried))
    out = jax.tree.map(lambda a: a / n, out) if mean else out
    return out if threaded else out[0]


def loss_of(setup: StepSetup, model, batch, balance=None, key=None):
    """``loss_fn(model, *batch)`` in the compute precision, ``model`` (one merged for this
    micro-batch) first given the micro-batch's step data as values of its own state:
    ``balance``, the whole batch's routing fractions (:func:`balance_fraction`,
    :func:`jphantom.nn.balance.give`), and ``key``, its dropout key
    (:func:`jphantom.nn.dropout.give_keys`; none: dropout layers pass their input through)."""
    balance_module.give(model, balance)
    if key is not None:
        dropout_module.give_keys(model, key)
    return setup.loss_fn(model, *setup.precision.cast(batch))


def takes_balance(setup: StepSetup) -> bool:
    """Whether micro-batches get the whole batch's routing fractions: the model declares
    :mod:`jphantom.nn.balance`'s hook (GPT-2's MoE blocks)."""
    return balance_module.takes_part(setup.model_template)


def balance_fraction(setup: StepSetup, model, micro):
    """The whole batch's routing fractions [L_moe, E] from its micro-batches ``micro`` (each array
    [n, b, ...]): a forward pass over each (no gradient) summing every MoE layer's router
    statistics. ``None`` when the model has no MoE layers or does not take part
    (:func:`takes_balance`). With them a micro-batch's load-balancing loss uses the whole batch's
    fractions, so the accumulated loss and gradient equal the unaccumulated step's (the
    fractions count arg-max choices: they carry no gradient)."""
    if not takes_balance(setup):
        return None
    statistics = lambda mb: model.balance_statistics(*setup.precision.cast(mb))
    shape = jax.eval_shape(statistics, [m[0] for m in micro])
    if shape is None:
        return None
    return balance_module.fractions(accumulate(statistics, micro, mean=False))


def loss_share(setup: StepSetup, model, batch, balance=None, weight=None, micro=1, key=None):
    """``(share, weight)``: this rank's share of the global loss, of the global mean of a scalar
    ``loss_fn`` (``weight`` None), or of the global token mean of a weighted one
    (:mod:`jphantom.step.token_mean`) with its global weight (given: the global weight when
    micro-batches share it, ``micro`` of them); ``key``: the micro-batch's dropout key."""
    out = loss_of(setup, model, batch, balance, key)
    weighted = token_mean.terms(out, setup.loss_fn)
    if weighted is not None:
        if weight is None:  # one all-reduce of a scalar, inside the forward
            weight = token_mean.global_weight(weighted.weight,
                                              metadata.varying_axes(weighted.total))
        return token_mean.shares(weighted, weight, micro=micro), weight
    loss = jnp.asarray(out)
    if loss.shape != ():
        raise ConfigError(f"loss_fn returned shape {loss.shape}; it must return the "
                          "scalar mean loss, or (total, weight) for a global token mean")
    loss = loss.astype(jnp.promote_types(loss.dtype, jnp.float32))
    return setup.mean_share(loss)[0], None  # this rank's share of the global mean


def micro_weight(setup: StepSetup, model, micro, balance=None, *, exclude=()):
    """The global weight of a weighted ``loss_fn`` over the micro-batches ``micro`` (each array
    [n, b, ...]): ``loss_fn`` mapped over them keeping only the weight, which XLA reduces to the
    weight's own arithmetic (:mod:`jphantom.step.token_mean`); ``None`` for a scalar ``loss_fn``.
    ``model`` is given ``balance`` here, where it was merged: a module takes no new value from
    inside the map's trace."""
    balance_module.give(model, balance)
    struct = jax.eval_shape(lambda *mb: loss_of(setup, model, mb), *(m[0] for m in micro))
    if not isinstance(struct, tuple):
        return None
    weights = lax.map(lambda mb: token_mean.terms(loss_of(setup, model, mb),
                                                  setup.loss_fn).weight, micro)
    return token_mean.global_weight(jnp.sum(weights, axis=0),
                                    metadata.varying_axes(struct[0]), exclude)


def micro_key(key, index):
    """Micro-batch ``index``'s dropout key of the step's ``key`` (``None``: none)."""
    return None if key is None else jax.random.fold_in(key, index)


def _wide_zeros(x):
    """Zeros of ``x``'s shape in float32 (or wider), varying over the mesh axes ``x`` does."""
    axes = tuple(sorted(metadata.varying_axes(x)))
    zeros = jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32))
    return comm.pcast(zeros, axes, to="varying") if axes else zeros


class _Shards:
    """Per leaf of ``base`` (the parameters a micro-batch differentiates), where its gradient
    accumulates (:meth:`LocalGradients.into_sinks`): ``dims[i] >= 0`` in the rank's shard along
    that dimension over ``axes[i]`` (ZeRO-2, :func:`jphantom.step.zero.reduce_scatter`), else
    whole."""

    def __init__(self, base, dims, axes, mesh_shape):
        self.base, self.dims, self.axes, self.mesh_shape = base, dims, axes, mesh_shape

    def reduce(self, i, row: bool = False):
        """Leaf ``i``'s reduction of its gradient (``row``: of one layer's row of a stacked
        leaf); ``None`` when it accumulates whole."""
        dim, axes = self.dims[i], self.axes[i]
        return None if dim < 0 else zero_module.GradientScatter(dim - 1 if row else dim, axes)

    def apply(self, i, g):
        """Leaf ``i``'s gradient ``g`` as it accumulates (before it is widened)."""
        reduce = self.reduce(i)
        return g if reduce is None else reduce(reduce.prepare(g))

    def zeros(self, i):
        """Leaf ``i``'s float32 accumulator, zero: of the leaf's shape, or of its shard's varying
        over the axes it is scattered over."""
        x, dim = self.base[i], self.dims[i]
        if dim < 0:
            return _wide_zeros(x)
        shape = list(x.shape)
        shape[dim] //= math.prod(self.mesh_shape.get(a, 1) for a in self.axes[i])
        axes = tuple(sorted(set(metadata.varying_axes(x)) | set(self.axes[i])))
        zeros = jnp.zeros(shape, jnp.promote_types(x.dtype, jnp.float32))
        return comm.pcast(zeros, axes, to="varying")


def unscaled(loss, grads, like, scale):
    """The loss and gradients divided by the loss ``scale``, in float32 (or wider) before the
    master weights' dtype (``like``)."""
    return loss / scale, [(g.astype(jnp.promote_types(g.dtype, jnp.float32)) / scale
                           ).astype(x.dtype) for g, x in zip(grads, like)]


class LocalGradients:
    """The gradient provider of a step without a pipeline: ``share, grads, weight =
    provider(leaves, *batch)`` (a :class:`Gradients`), this rank's loss share and gradients
    before the reductions and the global weight (module docstring)."""

    def __init__(self, setup: StepSetup, params: RankParameters):
        self.setup, self.params = setup, params

    def __call__(self, leaves, *batch, scale=None, key=None):
        """``scale``: the loss scale (a traced scalar under dynamic loss scaling; default the
        precision's); ``key``: the step's dropout key data (none: dropout layers pass their input
        through)."""
        setup, params = self.setup, self.params
        leaves = list(leaves)
        key = None if key is None else jax.random.wrap_key_data(key)
        scale = setup.precision.loss_scale if scale is None else scale

        def one(leaves, *batch, balance=None, weight=None, micro=1, index=0):
            varied = params.vary_params(leaves)
            (loss, found), grads = jax.value_and_grad(scaled, has_aux=True)(
                varied, *batch, balance=balance, weight=weight, micro=micro,
                key=micro_key(key, index))
            return unscaled(loss, grads, leaves, scale), found

        def scaled(p, *b, **options):
            share, found = loss_share(setup, params.model(p, train=True), b, **options)
            return share * scale, found

        if setup.accumulate == 1:
            (loss, grads), found = one(leaves, *batch)
            return Gradients(loss, grads, found)
        n = setup.accumulate
        micro = [split_microbatches(b, n) for b in batch]
        if self.sunk or setup.master_weights == "sharded":
            return self.into_sinks(leaves, micro, scale, key)
        balance = balance_fraction(setup, params.model(leaves, train=True), micro)
        # a weighted loss_fn: the global weight of all micro-batches first, each micro-batch's
        # share is then its part of the whole loss (summed, not averaged)
        weight = micro_weight(setup, params.model(leaves, train=False), micro, balance)
        options = dict(balance=balance, weight=weight, micro=n)
        # micro-batch i draws its dropout masks from key i
        loss, grads = accumulate(lambda mb, i: one(leaves, *mb, **options, index=i)[0], micro,
                                 mean=weight is None, indexed=True)
        return Gradients(loss, grads, weight)

    @functools.cached_property
    def sunk(self) -> tuple:
        """The model's stacks (``(path, leaf indices)``, :attr:`ParamLayout.stacks`) whose
        gradients accumulate into float32 sinks (:mod:`jphantom.nn.sink`): all of them when the
        step accumulates micro-batches, none when a block gathers its whole stack itself
        (pmm3d's ``gather_stacked``: its gradient is the whole stack's transpose)."""
        setup = self.setup
        if setup.accumulate == 1:
            return ()
        stacks = setup.layout.stacks
        model = setup.model_template
        if any(stack_module.gathers_stacked(*nnx.split(module_at(model, path).block))
               for path, _ in stacks):
            return ()
        return stacks

    @property
    def scattered(self) -> bool:
        """Whether the gradients come out already reduce-scattered over ``data`` (ZeRO-2 with
        accumulation, :meth:`into_sinks`): the reducer then only sums over the other axes.
        Every gradient provider says so (:class:`jphantom.step.pipeline.PipelineGradients`'
        and GSPMD's: never)."""
        setup = self.setup
        return setup.zero == 2 and setup.accumulate > 1 and bool(
            self.sunk or setup.master_weights == "sharded")

    def into_sinks(self, leaves, micro, scale, key) -> Gradients:
        """Accumulation with the stacked blocks' gradients added into float32 sinks inside the
        backward (:mod:`jphantom.nn.sink`, Megatron-LM's gradient accumulation fusion): each
        micro-batch's loss is differentiated with respect to the other leaves and the sinks,
        never to the stacked leaves, so no micro-batch's [L, ...] gradient stack exists; the
        other leaves' gradients are summed in float32. Under a sharded master (Megatron's
        distributed optimizer with gradient accumulation) the bf16 parameters are gathered over
        ``data`` once before the micro-batch loop, the sinks and sums are the gathered
        parameters', and the sum is reduce-scattered (the gather's transpose, in bf16) once after
        the loop, not once per micro-batch; with no sinks (:attr:`sunk` empty) that is all.
        ZeRO-2 (:attr:`scattered`; Rajbhandari et al.'s gradient partitioning, DeepSpeed's
        under accumulation) instead reduce-scatters each layer's gradient inside each
        micro-batch's backward, and each other leaf's once per micro-batch, in the gradient's
        dtype (bf16 under a sharded master, as its gather's transpose), into float32 sinks and
        sums that are the rank's shards: 1/D of the whole, for k times the reduce-scatters
        of k micro-batches."""
        setup, params = self.setup, self.params
        varied = params.vary_params(leaves)
        scatter = None
        if setup.master_weights == "sharded":
            if self.scattered:
                base = params.gather(varied, train=True)
            else:
                base, scatter = jax.vjp(lambda xs: params.gather(xs, train=True), varied)
            build = lambda p: params.built(p, train=True)  # noqa: E731
            weighing = build(base)
        else:
            base = varied
            build = lambda p: params.model(p, train=True)  # noqa: E731
            weighing = params.model(leaves, train=False)
        balance = balance_fraction(setup, build(base), micro)
        weight = micro_weight(setup, weighing, micro, balance)
        options = dict(balance=balance, weight=weight, micro=len(micro[0]))
        stacked = {i for _, indices in self.sunk for i in indices}
        free = [i for i in range(len(base)) if i not in stacked]
        shards = self._shards(base)

        def share(mb, i, own, sinks):  # the micro-batch's scaled loss share
            p = list(base)
            for j, x in zip(free, own):
                p[j] = x
            model = build(p)
            for (path, indices), accs in zip(self.sunk, sinks):
                module_at(model, path).sink = sink_module.Sink(
                    accs, [shards.reduce(j, row=True) for j in indices])
            return loss_share(setup, model, mb, **options, key=micro_key(key, i))[0] * scale

        loss, own, sinks = self._micro_batches(share, micro, [base[j] for j in free], free,
                                               shards, mean=weight is None)
        grads = [None] * len(base)
        for j, g in zip(free, own):
            grads[j] = g
        for (_, indices), accs in zip(self.sunk, sinks):
            for j, g in zip(indices, accs):
                grads[j] = g
        if scatter is not None:
            (grads,) = scatter([g.astype(x.dtype) for g, x in zip(grads, base)])
        return Gradients(*unscaled(loss, grads, leaves, scale), weight)

    def _micro_batches(self, share, micro, own, free, shards, *, mean: bool):
        """:meth:`into_sinks`' loop: each micro-batch's ``share`` differentiated with respect to
        the free leaves ``own`` and the sinks; ``(loss, the free leaves' gradients, sinks)``
        summed (``mean``: averaged), the free leaves' gradients reduced per micro-batch under
        ZeRO-2 (:attr:`scattered`). (Handing them to the next micro-batch, so that their
        reduce-scatter runs under its forward, hides 0.1 s more of NeMo's Llama3.1-8B step but
        makes XLA rematerialise under the run's memory budget, costing 0.7 s.)"""
        widen = lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32))  # noqa: E731

        def one(mb, i, sinks):
            loss, (grads, sinks) = jax.value_and_grad(share, argnums=(2, 3))(mb, i, own, sinks)
            return (loss, [widen(shards.apply(j, g)) for j, g in zip(free, grads)]), sinks

        sinks0 = [[shards.zeros(i) for i in indices] for _, indices in self.sunk]
        (loss, summed), sinks = accumulate(one, micro, mean=mean, indexed=True, carried=sinks0)
        return loss, summed, sinks

    def _shards(self, base) -> "_Shards":
        """What :meth:`into_sinks` accumulates per leaf of ``base``: the whole gradient, or
        under ZeRO-2 (:attr:`scattered`) the rank's shard of it."""
        layout = self.setup.layout
        dims = layout.zero_dims if self.scattered else (-1,) * len(base)
        return _Shards(base, dims, layout.zero_axes, dict(self.setup.mesh.shape))

    def evaluate(self, fn):
        """``fn(model, *batch)`` per rank -> a scalar mean or a dict of them as global means
        (forward only; run inside the step's ``shard_map``)."""
        setup = self.setup

        def per_rank(leaves, *batch):
            model = self.params.model(leaves, train=False)
            out = fn(model, *setup.precision.cast(batch))
            weighted = token_mean.terms(out, fn)
            if weighted is not None:  # a global token mean
                weight = token_mean.global_weight(weighted.weight,
                                                  metadata.varying_axes(weighted.total))
                return setup.global_value(token_mean.shares(weighted, weight))

            def total(value):
                value = jnp.asarray(value)
                value = value.astype(jnp.promote_types(value.dtype, jnp.float32))
                return setup.global_value(setup.mean_share(value)[0])

            return jax.tree.map(total, out)

        return per_rank
