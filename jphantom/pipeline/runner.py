"""Pipeline parallelism executed inside the one SPMD training step: one executor for every
schedule (GPipe, 1F1B and interleaved 1F1B: Narayanan et al. 2021, Sec. 2.2, Singh's thesis ch. 3;
ZB-H1 and ZB-V: Qi et al., "Zero Bubble Pipeline Parallelism", Sec. 2).

The training step (:class:`jphantom.TrainStep`) cuts a model at its one
:class:`jphantom.nn.Stacked` and gives this executor its :class:`Stages`: the stacked blocks'
parameters ``[U, ...]`` (U = the blocks; the FFN's layers or Megatron pairs), the rest (embeddings,
final norm, head), and three per-rank functions holding the inner strategy's collectives (tensor
or phantom parallelism over ``model``):

    first(rest, inputs_mb)        -> x     the part of the loss before the blocks, on chunk 0
    body(chunk, x, c)             -> x     U / (P V) blocks of model chunk c
    last(rest, x, targets_mb, M)  -> loss  the part after them (head + loss) on the last chunk:
                                           this rank's share of the global mean loss (M: micro-
                                           batches per step)

The stacked parameters are split over the ``stage`` mesh axis, ``U / P`` contiguous units per
device, stored in the order (:func:`unit_order`) that gives device ``s`` its model chunks: ``v P +
s`` with V virtual stages (Megatron's round-robin), ``s`` and ``2P - 1 - s`` with ``zb-v``. The
rest is replicated over ``stage``; its gradient (non-zero on the first and last stage only) is
all-reduced over ``stage`` once per step, like Megatron's embedding-group all-reduce.

The step walks the schedule's table (:func:`jphantom.pipeline.table.plan`) with ``lax.scan``
over ticks; every device reads its own row (``comm.axis_index("stage")``) and, in each slot of
the tick, runs one task under ``lax.switch``:

    F    x = first(rest, inputs[m]) on chunk 0, else the activation received for (c, m);
         out, pullback = jax.vjp(body, chunk_params, x); stash the pullback's residuals;
         on the last chunk: loss, d_out = value_and_grad(last)(out), d_out into the inbox
    BW   d_chunk, dx = pullback(d_out) from the stash; grads += d_chunk (a running sum);
         on chunk 0: the embedding's vjp of dx
    B    dx and the gradient leaves that need no weight-only residual; W's linear function
    W    the weight gradients from it (:mod:`jphantom.pipeline.split`)

and then the slot's exchange: ``out`` (F) or ``dx`` (B, BW) to the device of the next or previous
model chunk, one ``[b, ...]`` collective-permute per direction that some device sends
(:mod:`jphantom.pipeline.table`). GPipe, 1F1B and interleaved 1F1B tick as an F slot and a BW
slot (one activation and one cotangent permute a tick); ZB-H1 and ZB-V as one slot of F, B or W.

The residuals of ``jax.vjp`` (its ``Partial``'s leaves, less the chunk's own parameters, which are
not copied) live in buffers with one slot per micro-batch in flight; received messages wait in
slots too (:mod:`jphantom.pipeline.buffers`). Idle slots send ``bubble_fill`` (tests send NaN:
bubbles must never reach the loss or gradients) and write it everywhere a task writes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jphantom import comm
from jphantom.pipeline.buffers import (cast_like, fill_like, put_slot, rebuilder, slot_buffers,
                                       split_microbatches, take_index, varying_over,
                                       vjp_residuals, zeros_of)
from jphantom.pipeline.config import STAGE_AXIS, PipelineConfig, Stages, pipeline_for
from jphantom.pipeline.schedule import model_chunk
from jphantom.pipeline.split import (Split, backward_input, backward_weight, pick,
                                     weight_only_residuals)
from jphantom.pipeline.table import FIELDS, KINDS, Plan, plan, unit_order

__all__ = ["STAGE_AXIS", "PipelineConfig", "Plan", "Stages", "pipeline_for", "plan", "run",
           "unit_order"]

_F = {name: i for i, name in enumerate(FIELDS)}
F_, B_, W_, BW_ = (KINDS.index(k) for k in ("F", "B", "W", "BW"))


def run(stages: Stages, config: PipelineConfig, plan_: Plan, stacked, rest, inputs, targets, *,
        train: bool = True):
    """One step of the pipeline on this rank. ``stacked``: this device's units [V Lc, ...];
    ``rest``: the replicated parameters (varying over ``stage``); ``inputs``, ``targets``: the data
    rank's batch (arrays or tuples of them). Returns (loss share, d_stacked, d_rest), or the loss
    share alone when not ``train``. The loss is non-zero on the last stage only."""
    schedule, M = config.schedule, config.microbatches
    P_ = plan_.table.shape[1]
    V = config.local_chunks
    stage = comm.axis_index(STAGE_AXIS)
    chunks = jax.tree.map(lambda a: a.reshape(V, a.shape[0] // V, *a.shape[1:]), stacked)
    inputs, targets = jax.tree.map(lambda a: split_microbatches(a, M), (inputs, targets))
    fill = config.bubble_fill
    to_next = [(s, (s + 1) % P_) for s in range(P_) if plan_.ring or s + 1 < P_]
    to_prev = [(d, s) for s, d in to_next]
    table = jnp.asarray(plan_.table.reshape(-1, plan_.phases, *plan_.table.shape[1:]))
    chunk_index = jnp.asarray(np.array([[model_chunk(schedule, P_, s, v) for v in range(V)]
                                        for s in range(P_)], np.int32))

    def field(row, name):
        return row[_F[name]]

    def global_chunk(v):
        return chunk_index[stage, v]

    def entry(rest, inputs_mb):
        """The part before the blocks, typed as what flows between stages (a carry's statistics
        start as plain zeros and flow varying over the batch axes)."""
        return cast_like(stages.first(rest, inputs_mb), out0)

    # Abstract values of what flows (nothing emitted): the body's output, its pullback's
    # residuals (and, split, how they split and B's linear function's residuals), the loss.
    x0 = stages.first(rest, take_index(inputs, 0))
    x0 = jax.tree.map(lambda a: a + comm.pcast(jnp.zeros((), a.dtype), STAGE_AXIS, to="varying"),
                      x0)
    prepare = stages.prepare or (lambda chunk: chunk)
    local = [jax.tree.map(lambda a, v=v: a[v], chunks) for v in range(V)]  # static slices
    chunk0 = prepare(local[0])  # in the compute precision (Stages.prepare)
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
    # The stash lives in slots written at a stage-dependent index, so its buffers vary over
    # ``stage`` even where a residual does not (a rotary table computed from constants).
    stash0 = [varying_over(zeros_of(a), STAGE_AXIS) for a in stash0]

    rebuild = rebuilder(treedef, is_param)
    carry = {"inbox": slot_buffers(out0, plan_.inbox_slots), "loss": zero}
    # the gradient accumulators: as stored, at least float32 (bf16 parameters, a sharded
    # master, sum their micro-batches' gradients in float32, as Megatron's main_grad)
    zero_leaves = jax.tree.leaves(jax.tree.map(wide_zeros, local[0]))
    if train:
        split = (weight_only_residuals(rebuild(chunk0), stash0, chunk0, out0) if plan_.splits
                 else Split((False,) * len(stash0), (False,) * len(zero_leaves)))
        known0, weight0 = pick(stash0, split.weight_only, False), pick(stash0, split.weight_only,
                                                                      True)
        b_mask = [not w for w in split.weight_leaves]  # BW: every leaf
        b_zeros, w_zeros = pick(zero_leaves, b_mask, True), pick(zero_leaves, b_mask, False)
        carry.update(stash_b=slot_buffers(known0, plan_.stash_b_slots),
                     stash_w=slot_buffers(weight0, plan_.stash_w_slots),
                     d_chunks=jax.tree.map(wide_zeros, chunks),
                     d_rest=jax.tree.map(wide_zeros, rest))
        traced = {}
        if plan_.splits:
            def probe_backward(chunk, known, d_out):
                dx, b_leaves, linear = backward_input(rebuild(chunk), split, known, d_out, weight0)
                probed["linear_treedef"], wres, probed["linear_is_param"] = vjp_residuals(
                    linear, jax.tree.leaves(chunk))
                return wres

            wstash0 = jax.eval_shape(probe_backward, chunk0, known0, out0)
            wstash0 = [varying_over(zeros_of(a), STAGE_AXIS) for a in wstash0]
            wstash_shapes = [(a.shape, a.dtype) for a in wstash0]
            carry["wstash"] = slot_buffers(wstash0, plan_.wstash_slots)

    def head(out, m):
        """Loss share of micro-batch m and (training) d loss / d out, d loss / d rest."""
        if not train:
            return stages.last(rest, out, take_index(targets, m), M), None, None
        loss, (d_rest, d_out) = jax.value_and_grad(lambda r, o: stages.last(  # ints: float0
            r, o, take_index(targets, m), M), (0, 1), allow_int=True)(rest, out)
        return loss, d_out, d_rest

    def embedding_grad(dx, m):
        """On chunk 0: d loss / d rest through the part before the blocks."""
        _, embed_vjp = jax.vjp(lambda r: entry(r, take_index(inputs, m)), rest)
        return embed_vjp(cast_like(dx, out0))[0]

    def idle_result(kinds):
        """What a slot's branches return, as an idle slot fills it: the message and the loss;
        where F runs, its residuals and the loss's seed; where B or BW runs, their gradient
        leaves (and B's, W's residuals); where W runs, W's; where F, B or BW runs, the head's or
        embedding's gradient (``rest``). Each branch writes only what its slot's tasks can
        produce."""
        result = {"msg": fill_like(out0, fill), "loss": jnp.zeros_like(zero)}
        if not train:
            return result
        if F_ in kinds:
            result.update(stash_b=[jnp.full_like(a, fill) for a in known0],
                          stash_w=[jnp.full_like(a, fill) for a in weight0],
                          seed=fill_like(out0, fill))
        if B_ in kinds:
            result["wstash"] = [jnp.full_like(a, fill) for a in wstash0]
        if B_ in kinds or BW_ in kinds:
            result["b_grads"] = b_zeros
        if W_ in kinds:
            result["w_grads"] = w_zeros
        if {F_, B_, BW_} & set(kinds):
            result["d_rest"] = jax.tree.map(jnp.zeros_like, rest)
        return result

    def chunk_of(v, row):
        """The local chunk's parameters in the compute precision (cast in the task, outside
        its ``jax.vjp``): static with one chunk per device; with more a dynamic slice (a branch
        per chunk would multiply every branch's buffers)."""
        if v is not None:
            return prepare(local[v]), global_chunk(v)
        v = field(row, "chunk")
        return prepare(take_index(chunks, v)), global_chunk(v)

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
                      stash_b=pick(stash, split.weight_only, False),
                      stash_w=pick(stash, split.weight_only, True))
        return result

    def backward_whole(kinds, v, row, buffers):
        d_out = take_index(buffers["inbox"], field(row, "inbox"))
        residuals = take_index(buffers["stash_b"], field(row, "stash_b"))
        m, (chunk, _) = field(row, "mb"), chunk_of(v, row)
        d_chunk, dx = rebuild(chunk)(residuals)(d_out)
        d_rest = lax.cond(field(row, "first") > 0, lambda: embedding_grad(dx, m),
                          lambda: jax.tree.map(jnp.zeros_like, rest))
        result = idle_result(kinds)
        result.update(msg=cast_like(dx, out0), d_rest=d_rest,
                      b_grads=cast_like(jax.tree.leaves(d_chunk), b_zeros))
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
        d_rest = lax.cond(field(row, "first") > 0, lambda: embedding_grad(dx, m),
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

    branch_of_kind = {0: idle, F_: forward, B_: backward_b, W_: backward_w, BW_: backward_whole}

    def slot(tasks, send_next, send_prev):
        """One slot of a segment's ticks, whose devices run the kinds ``tasks``: one branch per
        kind (with one chunk per device its parameters static), and the idle one; then the
        slot's exchange. ``None`` where no device runs anything."""
        if not tasks:
            return None
        kinds = sorted(set(tasks) | {0})
        index_of = np.zeros(len(KINDS), np.int32)
        index_of[kinds] = np.arange(len(kinds))
        static = 0 if V == 1 else None

        def run_slot(carry, row):
            # The buffers a task of this slot reads, whole: the taken branch slices its slots
            # (operands only; every write is outside the switch).
            buffers = {"inbox": carry["inbox"]}
            if train and {B_, BW_} & set(kinds):
                buffers["stash_b"] = carry["stash_b"]
            if train and W_ in kinds:
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
            if plan_.keeps:  # zb-v's turn: the message stays on its device
                carry["inbox"] = put_slot(carry["inbox"], field(row, "keep"), msg)
            if send_next:  # one collective-permute of [b, ...] to the next device
                carry["inbox"] = put_slot(carry["inbox"], field(row, "from_prev"),
                                          comm.ppermute(msg, STAGE_AXIS, to_next))
            if send_prev:  # and one to the previous
                carry["inbox"] = put_slot(carry["inbox"], field(row, "from_next"),
                                          comm.ppermute(msg, STAGE_AXIS, to_prev))
            return carry
        return run_slot

    def segment(phases):
        slots = [slot(*phase) for phase in phases]

        def tick(carry, rows):
            for run_slot, rows_p in zip(slots, rows):
                if run_slot is not None:
                    carry = run_slot(carry, rows_p[stage])
            return carry, None
        return tick

    for start, stop, phases in plan_.segments:
        carry, _ = lax.scan(segment(phases), carry, table[start:stop])
    if not train:
        return carry["loss"]
    d_stacked = jax.tree.map(lambda d: d.reshape(d.shape[0] * d.shape[1], *d.shape[2:]),
                             carry["d_chunks"])
    return carry["loss"], d_stacked, carry["d_rest"]


def wide_zeros(a):
    """Zeros like ``a`` in at least float32 (a gradient accumulator)."""
    return jnp.zeros_like(a, dtype=jnp.promote_types(a.dtype, jnp.float32))


def add_to_chunk(d_chunks, v, leaves, mask):
    """``d_chunks[v] +=`` the gradient ``leaves`` at the leaves where ``mask`` holds
    (``d_chunks``: [V, ...] per leaf; one chunk: a static index)."""
    new, out = iter(leaves), []
    for acc, on in zip(jax.tree.leaves(d_chunks), mask):
        if not on:
            out.append(acc)
        elif acc.shape[0] == 1:
            out.append(acc + next(new)[None])
        else:
            out.append(lax.dynamic_update_index_in_dim(
                acc, lax.dynamic_index_in_dim(acc, v, 0, keepdims=False) + next(new), v, 0))
    return jax.tree.unflatten(jax.tree.structure(d_chunks), out)
