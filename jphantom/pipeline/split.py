"""A stage's backward split into B and W, for the zero-bubble pipelines.

Qi, Wan, Huang & Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024), Sec. 2: a stage's backward
is two computations, **B**, the gradient of the stage's input (``dx = J_x^T g``; the next stage
up waits for it) and **W**, the gradient of its weights (``dW = J_W^T g``; nothing waits for it
until the optimizer), so W can be deferred into what would be bubbles. For a linear layer
``y = x W``, ``B: dx = dy W^T`` and ``W: dW = x^T dy``: both need ``dy``, the cotangent of the
layer's output, which B computes on its way down the chain.

How one ``jax.vjp`` is split, with nothing recomputed (:func:`weight_only_residuals`,
:func:`backward_input`, :func:`backward_weight`):

1. The forward slot runs ``out, pullback = jax.vjp(body, chunk, x)`` and stashes the pullback's
   residuals (its leaves, less the chunk's own parameters), as 1F1B does.
2. Once per trace, the pullback's jaxpr is walked backwards from ``dx`` (into scans, jits and
   checkpoints; a fixpoint over a scan's carry): residuals that ``dx`` does not need -- the
   matmuls' inputs ``x``, whose only use is ``x^T dy`` -- are *weight-only* (``R_W``); the
   chunk's gradient leaves that depend on them are W's, the others (a bias: ``sum dy``) B's.
3. **B** runs the pullback under ``jax.linearize`` in ``R_W`` at ``R_W = 0``: the chain
   (every ``dy``, ``dx``, B's leaves) does not depend on ``R_W`` and is evaluated; W's leaves are
   linear in ``R_W`` (``x^T dy``), so they are left as a linear function whose residuals are the
   ``dy``'s -- the B-to-W stash. The zero-point values of W's leaves are never used, so XLA drops
   their dots: B costs the chain, not the whole backward (``tests/pipeline/test_zero_bubble_run.py``
   checks B + W = the backward's FLOPs from the compiled HLO).
4. **W** applies that linear function to the stashed ``R_W``: ``dW = x^T dy``, exactly the
   pullback's weight gradient (W's leaves are linear and homogeneous in ``R_W``: a parameter
   used in a matmul and *also*, within the same chunk, in an op whose gradient needs none of
   ``R_W`` would break that; no layer of jphantom or flax.nnx does).

With remat policies that recompute a block in its backward, the recomputed matmul inputs are
not residuals: their weight gradients stay in B (correct; less to defer).

The executor (:mod:`jphantom.pipeline.runner`) runs F, B and W as tasks of their own slots, in
the schedule's order (:mod:`jphantom.pipeline.table`); its buffers carry the residuals from F to
B (``stash_b``), the weight-only ones from F to W (``stash_w``) and B's linear function's
residuals, the ``dy``'s, from B to W (``wstash``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jcore
import jax.numpy as jnp


# --------------------------------------------------------------------------------------------------
# Which residuals only the weight gradient needs (a dependency walk over the pullback's jaxpr)
# --------------------------------------------------------------------------------------------------


def needed_inputs(jaxpr, needed_outputs: list[bool]) -> list[bool]:
    """Which of ``jaxpr``'s inputs the outputs marked in ``needed_outputs`` depend on. Walks into
    scans (a fixpoint over the carry), conditionals and any equation holding one sub-jaxpr with
    its own inputs and outputs (jit, checkpoint, custom derivatives); anything else is taken to
    need all its inputs (never wrong: a residual wrongly kept in B only defers less)."""
    live = {v for v, n in zip(jaxpr.outvars, needed_outputs) if n and isinstance(v, jcore.Var)}
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not any(outs) and not eqn.effects:
            continue
        ins = _equation_inputs(eqn, outs)
        live.update(v for v, n in zip(eqn.invars, ins) if n and isinstance(v, jcore.Var))
    return [v in live for v in jaxpr.invars]


def _scan_counts(params) -> tuple[int, int]:
    """A scan equation's (constants, carries) among its inputs: ``num_consts`` / ``num_carry``
    (jax 0.10), or the sizes of the first two groups of ``ft_in`` (jax 0.12)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].tree.children()
    return consts.num_leaves, carry.num_leaves


def _open(j):
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _equation_inputs(eqn, outs: list[bool]) -> list[bool]:
    everything = [True] * len(eqn.invars)
    if eqn.primitive.name == "scan":
        body = _open(eqn.params["jaxpr"])
        consts, carries = _scan_counts(eqn.params)
        carry = outs[:carries]
        while True:
            ins = needed_inputs(body, carry + outs[carries:])
            grown = [a or b for a, b in zip(carry, ins[consts:consts + carries])]
            if grown == carry:
                return ins
            carry = grown
    if eqn.primitive.name == "cond":
        needed = [False] * (len(eqn.invars) - 1)
        for branch in eqn.params["branches"]:
            needed = [a or b for a, b in zip(needed, needed_inputs(_open(branch), outs))]
        return [True] + needed
    subs = [_open(j) for j in jcore.jaxprs_in_params(eqn.params)]
    if len(subs) == 1 and len(subs[0].invars) == len(eqn.invars) \
            and len(subs[0].outvars) == len(eqn.outvars):
        return needed_inputs(subs[0], outs)
    return everything


@dataclasses.dataclass(frozen=True)
class Split:
    """How a chunk's pullback splits: ``weight_only[i]`` for each stashed residual (R_W),
    ``weight_leaves[j]`` for each leaf of the chunk's gradient (W's; the others are B's)."""

    weight_only: tuple[bool, ...]
    weight_leaves: tuple[bool, ...]


def weight_only_residuals(rebuild, residuals, chunk, d_out) -> Split:
    """The split of the pullback ``rebuild(residuals)`` (module docstring, step 2)."""
    def pullback(res, g):
        d_chunk, dx = rebuild(res)(g)
        return jax.tree.leaves(d_chunk) + jax.tree.leaves(dx)

    closed = jax.make_jaxpr(pullback)(residuals, d_out)
    n_res = len(jax.tree.leaves(residuals))
    n_chunk = len(jax.tree.leaves(chunk))
    n_out = len(closed.jaxpr.outvars)
    by_dx = needed_inputs(closed.jaxpr, [i >= n_chunk for i in range(n_out)])[:n_res]
    weight_only = tuple(not used and jnp.issubdtype(r.dtype, jnp.floating)
                        for used, r in zip(by_dx, jax.tree.leaves(residuals)))
    leaves = []
    for j in range(n_chunk):
        uses = needed_inputs(closed.jaxpr, [i == j for i in range(n_out)])[:n_res]
        leaves.append(any(u and w for u, w in zip(uses, weight_only)))
    return Split(weight_only, tuple(leaves))


def pick(values, mask, keep: bool):
    """The ``values`` whose ``mask`` entry is ``keep``."""
    return [v for v, m in zip(values, mask) if m == keep]


def merge(mask, kept, dropped):
    """The inverse of :func:`pick`: ``kept`` where ``mask`` holds, ``dropped`` elsewhere."""
    kept, dropped = iter(kept), iter(dropped)
    return [next(kept) if m else next(dropped) for m in mask]


def backward_input(rebuild, split: Split, known, d_out, weight_like):
    """B (module docstring, step 3): ``(dx, B's gradient leaves, W's linear function)`` from the
    residuals B needs (``known``) and the output's cotangent ``d_out``; ``weight_like``: the
    weight-only residuals' types (the linearisation point is their zeros)."""
    def pullback(weight_only):
        d_chunk, dx = rebuild(merge(split.weight_only, weight_only, known))(d_out)
        leaves = jax.tree.leaves(d_chunk)
        return (dx, pick(leaves, split.weight_leaves, False),
                pick(leaves, split.weight_leaves, True))

    (dx, b_leaves, _), linear = jax.linearize(pullback, [jnp.zeros_like(a) for a in weight_like])
    return dx, b_leaves, linear


def backward_weight(linear, weight_only):
    """W (module docstring, step 4): W's gradient leaves, ``x^T dy`` from B's linear function."""
    return linear(list(weight_only))[2]
