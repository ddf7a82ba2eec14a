"""Zero-bubble pipelines executed: each backward split into B and W inside the one SPMD step.

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
   their dots: B costs the chain, not the whole backward (``tests/test_zero_bubble_run.py``
   checks B + W = the backward's FLOPs from the compiled HLO).
4. **W** applies that linear function to the stashed ``R_W``: ``dW = x^T dy``, exactly the
   pullback's weight gradient (W's leaves are linear and homogeneous in ``R_W``: a parameter
   used in a matmul and *also*, within the same chunk, in an op whose gradient needs none of
   ``R_W`` would break that; no layer of jphantom or flax.nnx does).

With remat policies that recompute a block in its backward, the recomputed matmul inputs are
not residuals: their weight gradients stay in B (correct; less to defer).

The lock-step table (:func:`jphantom.pipeline.schedule.lockstep_split`): in each slot every
device runs one task, F, B or W (``lax.switch`` on its row), then what it produced moves:
activations to the next model chunk's device, input gradients to the previous one's. With the
V placement (``zb-v``: device s holds chunks s and 2P - 1 - s) both directions occur in one slot,
so each slot holds up to two collective-permutes, ``s -> s + 1`` and ``s -> s - 1``, each one
``[b, ...]`` message; at the turn (chunk P - 1 to P, both on device P - 1) the message stays on
the device. Slots whose tasks send nothing one way skip that permute (segments of slots with the
same kinds and sends, as in :mod:`.runner`), so the compiled step holds exactly
``SplitPlan.permutes`` collective-permutes. Buffers (all slots assigned on the host):

    inbox    messages received or kept: a forward's input, a backward's cotangent (F or B to B)
    stash_b  the pullback's residuals B needs (F to B)
    stash_w  the weight-only residuals R_W (F to W)
    wstash   B's linear function's residuals, the dy's (B to W)

Idle slots send ``bubble_fill`` (tests: NaN) and the idle branch writes it everywhere it writes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax import lax

from jphantom import comm
from jphantom.pipeline.runner import (STAGE_AXIS, PipelineConfig, Stages, allocate_slots,
                                      cast_like, fill_like, put_slot, slot_buffers,
                                      split_microbatches, take_index, varying_over,
                                      vjp_residuals, zeros_of)
from jphantom.pipeline.schedule import SplitLockstep, chunks_of, lockstep_split, model_chunk

KINDS = ("idle", "F", "B", "W")
MAX_SEGMENTS = 12  # more loops than this and short runs join their neighbour (``plan``)
MIN_RUN = 3  # slots: the runs that then join
FIELDS = ("kind", "chunk", "mb", "first", "last", "inbox", "stash_b", "stash_w", "wstash", "seed",
          "keep", "from_prev", "from_next")
_F = {name: i for i, name in enumerate(FIELDS)}


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


def rebuilder(treedef, is_param):
    """``rebuild(chunk)(residuals)``: a stashed ``jax.vjp`` pullback (or ``jax.linearize``
    function) from its stashed leaves and the chunk's own parameters at the positions
    ``is_param`` names (:func:`jphantom.pipeline.runner.vjp_residuals`)."""
    def rebuild(chunk):
        chunk_leaves = jax.tree.leaves(chunk)

        def with_residuals(residuals):
            stored = iter(residuals)
            return jax.tree.unflatten(treedef, [chunk_leaves[j] if j >= 0 else next(stored)
                                                for j in is_param])
        return with_residuals
    return rebuild


def _pick(values, mask, keep: bool):
    return [v for v, m in zip(values, mask) if m == keep]


def _merge(mask, kept, dropped):
    kept, dropped = iter(kept), iter(dropped)
    return [next(kept) if m else next(dropped) for m in mask]


def backward_input(rebuild, split: Split, known, d_out, weight_like):
    """B (module docstring, step 3): ``(dx, B's gradient leaves, W's linear function)`` from the
    residuals B needs (``known``) and the output's cotangent ``d_out``; ``weight_like``: the
    weight-only residuals' types (the linearisation point is their zeros)."""
    def pullback(weight_only):
        d_chunk, dx = rebuild(_merge(split.weight_only, weight_only, known))(d_out)
        leaves = jax.tree.leaves(d_chunk)
        return (dx, _pick(leaves, split.weight_leaves, False),
                _pick(leaves, split.weight_leaves, True))

    (dx, b_leaves, _), linear = jax.linearize(pullback, [jnp.zeros_like(a) for a in weight_like])
    return dx, b_leaves, linear


def backward_weight(linear, weight_only):
    """W (module docstring, step 4): W's gradient leaves, ``x^T dy`` from B's linear function."""
    return linear(list(weight_only))[2]


# --------------------------------------------------------------------------------------------------
# The table (host side)
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """The lock-step slots as ``table[t, s, field]`` (``FIELDS``), the buffers' slot counts and
    the scan segments ``(start, stop, kinds, send_next, send_prev)``, ``kinds`` the task kinds
    its slots run (indices into ``KINDS``)."""

    lockstep: SplitLockstep
    table: np.ndarray
    inbox_slots: int
    stash_b_slots: int
    stash_w_slots: int
    wstash_slots: int
    segments: tuple[tuple[int, int, tuple[int, ...], bool, bool], ...]

    @property
    def permutes(self) -> int:
        """Collective-permutes the compiled step holds: one per slot and direction that sends."""
        return sum((stop - start) * (int(nxt) + int(prv))
                   for start, stop, _, nxt, prv in self.segments)


def plan(config: PipelineConfig, stages: int, *, train: bool = True) -> SplitPlan:
    """Compile ``config``'s split schedule to the executor's table (``train=False``: its
    forward tasks only, for evaluation)."""
    P, schedule = stages, config.schedule
    steps = lockstep_split(schedule, P, config.microbatches, forward_only=not train)
    V = chunks_of(schedule, P)
    last = V * P - 1
    device = {model_chunk(schedule, P, s, v): s for s in range(P) for v in range(V)}
    when: dict[tuple[str, int, int], int] = {}
    for t, slot in enumerate(steps.slots):
        for s, op in enumerate(slot):
            if op is not None:
                kind, m, v = op
                when[(kind, model_chunk(schedule, P, s, v), m)] = t
    inbox, stash_b, stash_w, wstash = ([[] for _ in range(P)] for _ in range(4))
    # Phases: 2t = slot t's task, 2t + 1 = its exchange (what arrives is stored then).
    for (kind, c, m), t in when.items():
        if kind != "F":
            continue
        s = device[c]
        if c > 0:
            inbox[s].append((2 * when[("F", c - 1, m)] + 1, 2 * t, ("x", c, m)))
        if train:
            tb, tw = when[("B", c, m)], when[("W", c, m)]
            written = 2 * t if c == last else 2 * when[("B", c + 1, m)] + 1
            inbox[s].append((written, 2 * tb, ("g", c, m)))
            stash_b[s].append((2 * t, 2 * tb, (c, m)))
            stash_w[s].append((2 * t, 2 * tw, (c, m)))
            wstash[s].append((2 * tb, 2 * tw, (c, m)))
    slot_of, counts = [{}, {}, {}, {}], [0, 0, 0, 0]
    for s in range(P):
        for i, intervals in enumerate((inbox[s], stash_b[s], stash_w[s], wstash[s])):
            slots, n = allocate_slots(intervals)
            slot_of[i].update({(s, key): slot for key, slot in slots.items()})
            counts[i] = max(counts[i], n)
    I, SB, SW, WS = (max(1, n) for n in counts)  # index n of each buffer: the garbage slot
    table = np.zeros((len(steps.slots), P, len(FIELDS)), np.int32)
    for name, garbage in (("inbox", I), ("seed", I), ("keep", I), ("from_prev", I),
                          ("from_next", I), ("stash_b", SB), ("stash_w", SW), ("wstash", WS)):
        table[:, :, _F[name]] = garbage
    sends = np.zeros((len(steps.slots), 2), bool)  # (to s + 1, to s - 1)
    kinds = [set() for _ in steps.slots]

    def deliver(t, s, key, to):
        """The message of device s in slot t goes to device ``to``, into its inbox slot of key."""
        at = slot_of[0][(to, key)]
        if to == s:
            table[t, s, _F["keep"]] = at
        elif to == s + 1:
            table[t, to, _F["from_prev"]] = at
            sends[t, 0] = True
        else:
            assert to == s - 1, (s, to)
            table[t, to, _F["from_next"]] = at
            sends[t, 1] = True

    for t, slot in enumerate(steps.slots):
        for s, op in enumerate(slot):
            if op is None:
                continue
            kind, m, v = op
            c = model_chunk(schedule, P, s, v)
            row = table[t, s]
            kinds[t].add(KINDS.index(kind))
            row[[_F["kind"], _F["chunk"], _F["mb"], _F["first"], _F["last"]]] = (
                KINDS.index(kind), v, m, c == 0, c == last)
            if kind == "F":
                if c > 0:
                    row[_F["inbox"]] = slot_of[0][(s, ("x", c, m))]
                if train:
                    row[_F["stash_b"]] = slot_of[1][(s, (c, m))]
                    row[_F["stash_w"]] = slot_of[2][(s, (c, m))]
                    if c == last:
                        row[_F["seed"]] = slot_of[0][(s, ("g", c, m))]
                if c < last:
                    deliver(t, s, ("x", c + 1, m), device[c + 1])
            elif kind == "B":  # reads the cotangent and B's residuals, writes W's
                row[_F["inbox"]] = slot_of[0][(s, ("g", c, m))]
                row[_F["stash_b"]] = slot_of[1][(s, (c, m))]
                row[_F["wstash"]] = slot_of[3][(s, (c, m))]
                if c > 0:
                    deliver(t, s, ("g", c - 1, m), device[c - 1])
            else:  # W reads the weight-only residuals and B's
                row[_F["stash_w"]] = slot_of[2][(s, (c, m))]
                row[_F["wstash"]] = slot_of[3][(s, (c, m))]

    def signature(t):
        return tuple(sorted(kinds[t])), bool(sends[t, 0]), bool(sends[t, 1])

    segments, start = [], 0
    for t in range(1, len(steps.slots) + 1):
        if t == len(steps.slots) or signature(t) != signature(start):
            segments.append((start, t, *signature(start)))
            start = t
    # Every segment is a loop with its own buffers: where sends alternate slot by slot (zb-v,
    # two stages) one loop per slot costs memory and compile time. Past MAX_SEGMENTS, runs
    # shorter than MIN_RUN slots join the segment before them (the union of their kinds and
    # exchanges); a joined slot with nothing to send one way still permutes (its idle fill),
    # counted in ``permutes``.
    joined = []
    for seg in segments:
        if len(segments) > MAX_SEGMENTS and joined and seg[1] - seg[0] < MIN_RUN:
            prev = joined.pop()
            seg = (prev[0], seg[1], tuple(sorted(set(prev[2]) | set(seg[2]))),
                   prev[3] or seg[3], prev[4] or seg[4])
        joined.append(seg)
    segments = joined
    return SplitPlan(steps, table, I, SB, SW, WS, tuple(segments))


def unit_order(units: int, stages: int, schedule: str) -> np.ndarray:
    """``order[g]``: the model unit stored at position g of the stacked axis, so that a
    contiguous split over ``stages`` gives device s its chunks in local order (``zb-v``: chunk s,
    then chunk 2P - 1 - s)."""
    P, V = stages, chunks_of(schedule, stages)
    per_chunk = units // (P * V)
    g = np.arange(units)
    s, within = divmod(g, V * per_chunk)
    v, j = divmod(within, per_chunk)
    c = np.array([model_chunk(schedule, P, int(a), int(b)) for a, b in zip(s, v)])
    return c * per_chunk + j


# --------------------------------------------------------------------------------------------------
# The executor (per rank, inside the step's shard_map)
# --------------------------------------------------------------------------------------------------


def run(stages: Stages, config: PipelineConfig, plan_: SplitPlan, stacked, rest, inputs, targets,
        *, train: bool = True):
    """One step of a split-backward pipeline on this rank (as :func:`jphantom.pipeline.runner.run`):
    (loss share, d_stacked, d_rest), or the loss share alone when not ``train``."""
    schedule, M = config.schedule, config.microbatches
    P_ = plan_.table.shape[1]
    V = chunks_of(schedule, P_)
    stage = comm.axis_index(STAGE_AXIS)
    chunks = jax.tree.map(lambda a: a.reshape(V, a.shape[0] // V, *a.shape[1:]), stacked)
    inputs, targets = split_microbatches(inputs, M), split_microbatches(targets, M)
    fill = config.bubble_fill
    to_next = [(s, s + 1) for s in range(P_ - 1)]
    to_prev = [(s + 1, s) for s in range(P_ - 1)]
    table = jnp.asarray(plan_.table)
    chunk_index = jnp.asarray(np.array([[model_chunk(schedule, P_, s, v) for v in range(V)]
                                        for s in range(P_)], np.int32))

    def field(row, name):
        return row[_F[name]]

    def global_chunk(v):
        return chunk_index[stage, v]

    def entry(rest, inputs_mb):
        return cast_like(stages.first(rest, inputs_mb), out0)

    # Abstract values of what flows (nothing emitted): the body's output, its pullback's
    # residuals and their split, B's linear function's residuals, the head's loss.
    x0 = stages.first(rest, take_index(inputs, 0))
    x0 = jax.tree.map(lambda a: a + comm.pcast(jnp.zeros((), a.dtype), STAGE_AXIS, to="varying"),
                      x0)
    local = [jax.tree.map(lambda a, v=v: a[v], chunks) for v in range(V)]  # static slices
    chunk0 = local[0]
    probed = {}

    def probe_forward(chunk, x, c):
        out, pullback = jax.vjp(lambda ch, x: stages.body(ch, x, c), chunk, x)
        probed["treedef"], stash, probed["is_param"] = vjp_residuals(pullback, jax.tree.leaves(chunk))
        return out, stash

    out0, stash0 = jax.eval_shape(probe_forward, chunk0, x0, global_chunk(0))
    # Probe again on an input typed as what flows between stages (the body's output: an MoE
    # carry's statistics start invariant and leave varying over the batch axes). The pullbacks
    # are rebuilt from this probe's structure, and a pullback traced for an invariant input holds
    # the transpose of its implicit cast, an all-reduce over those axes, that a stage whose input
    # arrives varying must not apply to the cotangent it sends back.
    x0 = cast_like(x0, out0)
    out0, stash0 = jax.eval_shape(probe_forward, chunk0, x0, global_chunk(0))
    treedef, is_param = probed["treedef"], probed["is_param"]
    out0 = jax.tree.map(zeros_of, out0)
    zero = zeros_of(jax.eval_shape(lambda r, o: stages.last(r, o, take_index(targets, 0), M), rest,
                                 out0))
    stash0 = [varying_over(zeros_of(a), STAGE_AXIS) for a in stash0]

    rebuild = rebuilder(treedef, is_param)
    carry = {"inbox": slot_buffers(out0, plan_.inbox_slots), "loss": zero}
    if train:
        split = weight_only_residuals(rebuild(chunk0), stash0, chunk0, out0)
        known0, weight0 = _pick(stash0, split.weight_only, False), _pick(stash0, split.weight_only,
                                                                        True)

        def probe_backward(chunk, known, d_out):
            dx, b_leaves, linear = backward_input(rebuild(chunk), split, known, d_out, weight0)
            probed["linear_treedef"], wres, probed["linear_is_param"] = vjp_residuals(
                linear, jax.tree.leaves(chunk))
            return wres

        wstash0 = jax.eval_shape(probe_backward, chunk0, known0, out0)
        wstash0 = [varying_over(zeros_of(a), STAGE_AXIS) for a in wstash0]
        wstash_shapes = [(a.shape, a.dtype) for a in wstash0]
        carry.update(stash_b=slot_buffers(known0, plan_.stash_b_slots),
                     stash_w=slot_buffers(weight0, plan_.stash_w_slots),
                     wstash=slot_buffers(wstash0, plan_.wstash_slots),
                     d_chunks=jax.tree.map(jnp.zeros_like, chunks),
                     d_rest=jax.tree.map(jnp.zeros_like, rest))
        traced = {}

    def head(out, m):
        if not train:
            return stages.last(rest, out, take_index(targets, m), M), None, None
        loss, (d_rest, d_out) = jax.value_and_grad(
            lambda r, o: stages.last(r, o, take_index(targets, m), M), argnums=(0, 1))(rest, out)
        return loss, d_out, d_rest

    if train:
        b_mask = [not w for w in split.weight_leaves]
        zero_leaves = jax.tree.leaves(jax.tree.map(jnp.zeros_like, chunk0))
        b_zeros, w_zeros = _pick(zero_leaves, b_mask, True), _pick(zero_leaves, b_mask, False)

    def idle_result(kinds):
        """What a segment's branches return, as an idle slot fills it: the message and the loss;
        where F runs, its residuals and the loss's seed; where B runs, W's residuals and B's
        gradient leaves; where W runs, W's; where F or B runs, the head's or embedding's
        gradient (``rest``). Each branch writes only what its segment's slots can produce."""
        result = {"msg": fill_like(out0, fill), "loss": jnp.zeros_like(zero)}
        if not train:
            return result
        if 1 in kinds:
            result.update(stash_b=[jnp.full_like(a, fill) for a in known0],
                          stash_w=[jnp.full_like(a, fill) for a in weight0],
                          seed=fill_like(out0, fill))
        if 2 in kinds:
            result.update(wstash=[jnp.full_like(a, fill) for a in wstash0], b_grads=b_zeros)
        if 3 in kinds:
            result["w_grads"] = w_zeros
        if 1 in kinds or 2 in kinds:
            result["d_rest"] = jax.tree.map(jnp.zeros_like, rest)
        return result

    def chunk_of(v, row):
        """The local chunk's parameters: static with one chunk per device; with two (zb-v) a
        dynamic slice (a branch per chunk would double every branch's buffers)."""
        if v is not None:
            return local[v], global_chunk(v)
        v = field(row, "chunk")
        return take_index(chunks, v), global_chunk(v)

    def forward(kinds, v, row, buffers):
        message = take_index(buffers["inbox"], field(row, "inbox"))
        m = field(row, "mb")
        chunk, c = chunk_of(v, row)
        result = idle_result(kinds)
        x = lax.cond(field(row, "first") > 0, lambda: entry(rest, take_index(inputs, m)),
                     lambda: message)
        body = lambda ch, x: stages.body(ch, x, c)  # noqa: E731
        if not train:
            out = body(chunk, x)
            result["msg"] = cast_like(out, out0)
            result["loss"] = lax.cond(field(row, "last") > 0, lambda: head(out, m)[0],
                                      lambda: jnp.zeros_like(zero))
            return result
        out, pullback = jax.vjp(body, chunk, x)
        _, stash, params = vjp_residuals(pullback, jax.tree.leaves(chunk))
        if params != is_param or [(a.shape, a.dtype) for a in stash] != \
                [(a.shape, a.dtype) for a in stash0]:
            raise RuntimeError("the stage body's vjp residuals changed between traces")
        stash = cast_like(stash, stash0)

        def with_head():
            loss, d_out, d_rest = head(out, m)
            return loss, cast_like(d_out, out0), d_rest

        def without_head():
            return (jnp.zeros_like(zero), fill_like(out0, fill),
                    jax.tree.map(jnp.zeros_like, rest))

        loss, d_out, d_rest = lax.cond(field(row, "last") > 0, with_head, without_head)
        result.update(msg=cast_like(out, out0), loss=loss, seed=d_out, d_rest=d_rest,
                      stash_b=_pick(stash, split.weight_only, False),
                      stash_w=_pick(stash, split.weight_only, True))
        return result

    def backward_b(kinds, v, row, buffers):
        d_out = take_index(buffers["inbox"], field(row, "inbox"))
        known = take_index(buffers["stash_b"], field(row, "stash_b"))
        m, (chunk, _) = field(row, "mb"), chunk_of(v, row)
        dx, b_leaves, linear = backward_input(rebuild(chunk), split, known, d_out, weight0)
        td, wres, params = vjp_residuals(linear, jax.tree.leaves(chunk))
        if params != probed["linear_is_param"] or [(a.shape, a.dtype) for a in wres] \
                != wstash_shapes:
            raise RuntimeError("the stage body's input-gradient residuals changed between traces")
        traced["linear_treedef"] = td

        def embedding():
            _, embed_vjp = jax.vjp(lambda r: entry(r, take_index(inputs, m)), rest)
            return embed_vjp(cast_like(dx, out0))[0]

        d_rest = lax.cond(field(row, "first") > 0, embedding,
                          lambda: jax.tree.map(jnp.zeros_like, rest))
        result = idle_result(kinds)
        result.update(msg=cast_like(dx, out0), wstash=cast_like(wres, wstash0),
                      b_grads=cast_like(b_leaves, b_zeros), d_rest=d_rest)
        return result

    def backward_w(kinds, v, row, buffers):
        linear = rebuilder(traced.get("linear_treedef", probed["linear_treedef"]),
                           probed["linear_is_param"])(chunk_of(v, row)[0])(
            take_index(buffers["wstash"], field(row, "wstash")))
        result = idle_result(kinds)
        weight_only = take_index(buffers["stash_w"], field(row, "stash_w"))
        result["w_grads"] = cast_like(backward_weight(linear, weight_only), w_zeros)
        return result

    def idle(kinds, v, row, buffers):
        return idle_result(kinds)

    branch_of_kind = {0: idle, 1: forward, 2: backward_b, 3: backward_w}

    def add_to_chunk(d_chunks, v, leaves, mask):
        """``d_chunks[v] +=`` the gradient ``leaves`` at the leaves where ``mask`` holds."""
        new, out = iter(leaves), []
        for acc, on in zip(jax.tree.leaves(d_chunks), mask):
            if not on:
                out.append(acc)
            elif V == 1:
                out.append(acc + next(new)[None])
            else:
                out.append(lax.dynamic_update_index_in_dim(
                    acc, lax.dynamic_index_in_dim(acc, v, 0, keepdims=False) + next(new), v, 0))
        return jax.tree.unflatten(jax.tree.structure(d_chunks), out)

    def segment(tasks, send_next, send_prev):
        """The scan body of a segment whose slots run the kinds ``tasks``: one branch per kind
        (with one chunk per device its parameters static), and the idle one."""
        kinds = sorted(set(tasks) | {0})
        index_of = np.zeros(len(KINDS), np.int32)
        index_of[kinds] = np.arange(len(kinds))
        static = 0 if V == 1 else None

        def tick(carry, rows):
            row = rows[stage]
            # The buffers a task of this segment reads, whole: the taken branch slices its slots
            # (operands only; every write is outside the switch).
            buffers = {"inbox": carry["inbox"]}
            if train and 2 in kinds:
                buffers["stash_b"] = carry["stash_b"]
            if train and 3 in kinds:
                buffers.update(stash_w=carry["stash_w"], wstash=carry["wstash"])
            branches = [lambda r, b, k=k: branch_of_kind[k](kinds, static, r, b) for k in kinds]
            index = jnp.asarray(index_of)[field(row, "kind")]
            result = lax.switch(index, branches, row, buffers)
            carry = dict(carry)
            carry["loss"] = carry["loss"] + result["loss"]
            v = field(row, "chunk")
            for buffer, key in (("stash_b", "stash_b"), ("stash_w", "stash_w"),
                                ("wstash", "wstash"), ("inbox", "seed")):
                if key in result:
                    carry[buffer] = put_slot(carry[buffer], field(row, key), result[key])
            if "b_grads" in result:
                carry["d_chunks"] = add_to_chunk(carry["d_chunks"], v, result["b_grads"], b_mask)
            if "w_grads" in result:
                carry["d_chunks"] = add_to_chunk(carry["d_chunks"], v, result["w_grads"],
                                                 split.weight_leaves)
            if "d_rest" in result:
                carry["d_rest"] = jax.tree.map(jnp.add, carry["d_rest"], result["d_rest"])
            msg = result["msg"]
            carry["inbox"] = put_slot(carry["inbox"], field(row, "keep"), msg)
            if send_next:  # one collective-permute of [b, ...] down the devices
                carry["inbox"] = put_slot(carry["inbox"], field(row, "from_prev"),
                                      comm.ppermute(msg, STAGE_AXIS, to_next))
            if send_prev:  # and one up
                carry["inbox"] = put_slot(carry["inbox"], field(row, "from_next"),
                                      comm.ppermute(msg, STAGE_AXIS, to_prev))
            return carry, None
        return tick

    for start, stop, *flags in plan_.segments:
        carry, _ = lax.scan(segment(*flags), carry, table[start:stop])
    if not train:
        return carry["loss"]
    d_stacked = jax.tree.map(lambda d: d.reshape(d.shape[0] * d.shape[1], *d.shape[2:]),
                             carry["d_chunks"])
    return carry["loss"], d_stacked, carry["d_rest"]

