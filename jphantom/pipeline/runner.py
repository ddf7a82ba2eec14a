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

The step walks the schedule's table (:func:`jphantom.pipeline.table.schedule_table`) with
``lax.scan`` over ticks; every device reads its own row (``comm.axis_index("stage")``) and, in
each slot of the tick, dispatches its task to the handler of its kind under ``lax.switch``:

    F    x = first(rest, inputs[m]) on chunk 0, else the activation received for (c, m);
         out, pullback = jax.vjp(body, chunk_params, x); stash the pullback's residuals;
         then, on the last chunk: loss, d_out = value_and_grad(last)(out), d_out into the inbox
    BW   d_chunk, dx = pullback(d_out) from the stash; grads += d_chunk (a running sum);
         then, on chunk 0: the embedding's vjp of dx
    B    dx and the gradient leaves that need no weight-only residual; W's linear function
    W    the weight gradients from it (:mod:`jphantom.pipeline.split`)

and then the slot's exchange: ``out`` (F) or ``dx`` (B, BW) to the device of the next or previous
model chunk, one ``[b, ...]`` collective-permute per direction that some device sends
(:mod:`jphantom.pipeline.table`). GPipe, 1F1B and interleaved 1F1B tick as an F slot and a BW
slot (one activation and one cotangent permute a tick); ZB-H1 and ZB-V as one slot of F, B or W.

With V more than twice the slots of a tick, a chunk's parameters are read from two copies per
slot, one array per layer and leaf (a GEMM reads them in place; XLA copies a slice of the
stack first), filled ahead of their runs of tasks in ticks the host gathers so that every device
fills at once (:func:`jphantom.pipeline.copies.chunk_copies`); the slot's switch then holds one
branch per task kind and copy, named with how many ticks each runs
(:func:`jphantom.pipeline.copies.branch_ticks`).

The residuals of ``jax.vjp`` (its ``Partial``'s leaves, less the chunk's own parameters, which are
not copied) live in buffers with one slot per micro-batch in flight; received messages wait in
slots too (:mod:`jphantom.pipeline.buffers`). Idle slots send ``bubble_fill`` (tests send NaN:
bubbles must never reach the loss or gradients) and write it everywhere a task writes.

The gradient sums are float32 (Megatron's ``main_grad``); a task's gradients leave its slot in
the compute precision and are widened as they are added, in place (``accumulate_grads_in=
"compute"``: summed in the dtype they are computed in, NeMo's bf16 gradient buffer). The head
(after an F slot, on the last chunk) and the embedding's backward (after a B or BW slot, on
chunk 0) run outside the slot's switch, in loops of zero or one trips (:func:`at_most_once`) that
add the loss, write the seed and add the rest's gradient (at the leaves the head or the embedding
reads: :func:`used_leaves`) in place, in the ticks that have them only. Those loops and the
entry's cond are named with how many of their segment's ticks take them (:meth:`_Step.taken`),
which the predictor reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jphantom.runtime import comm
from jphantom.pipeline.buffers import (cast_like, fill_like, put_live_slot, put_slot, rebuilder,
                                       slot_buffers, split_microbatches, take_index,
                                       varying_over, vjp_residuals, zeros_of)
from jphantom.pipeline.config import STAGE_AXIS, PipelineConfig, Stages, pipeline_for
from jphantom.pipeline.copies import COPY_FIELDS, branch_ticks, with_copies, with_copy
from jphantom.pipeline.schedule import model_chunk
from jphantom.pipeline.split import (Split, backward_input, backward_weight, pick,
                                     weight_only_residuals)
from jphantom.pipeline.table import FIELDS, KINDS, ScheduleTable, schedule_table, unit_order

__all__ = ["STAGE_AXIS", "PipelineConfig", "ScheduleTable", "Stages", "pipeline_for", "run",
           "schedule_table", "unit_order"]

_F = {name: i for i, name in enumerate(FIELDS + COPY_FIELDS)}  # the table's and the copies'

F_, B_, W_, BW_ = (KINDS.index(k) for k in ("F", "B", "W", "BW"))


def run(stages: Stages, config: PipelineConfig, table_: ScheduleTable, stacked, rest, inputs,
        targets, *, train: bool = True):
    """One step of the pipeline on this rank. ``stacked``: this device's units [V Lc, ...];
    ``rest``: the replicated parameters (varying over ``stage``); ``inputs``, ``targets``: the data
    rank's batch (arrays or tuples of them). Returns (loss share, d_stacked, d_rest), or the loss
    share alone when not ``train``. The loss is non-zero on the last stage only."""
    step = _Step(stages, config, table_, stacked, rest, inputs, targets, train)
    carry = step.buffers()
    for start, stop, phases in table_.segments:
        carry, _ = lax.scan(step.segment(phases, start, stop), carry, step.table[start:stop])
    if not train:
        return carry["loss"]
    d_stacked = jax.tree.map(lambda d: d.reshape(d.shape[0] * d.shape[1], *d.shape[2:]),
                             carry["d_chunks"])
    return carry["loss"], d_stacked, carry["d_rest"]


def field(row, name):
    """``row[name]``: one field (``FIELDS``) of a device's row of the table."""
    return row[_F[name]]


class _Step:
    """The interpreter of one step's table while it is traced: the step's constants (this
    rank's chunks, micro-batches and what flows, probed once), one handler per task kind
    (:data:`KINDS`: ``idle``, ``forward``, ``backward_whole``, ``backward_b``, ``backward_w``), and
    the slot that dispatches a row to its handler, writes back what it produced and exchanges
    its message."""

    def __init__(self, stages: Stages, config: PipelineConfig, table_: ScheduleTable, stacked,
                 rest, inputs, targets, train: bool):
        self.stages, self.schedule, self.rest, self.train = stages, table_, rest, train
        self.M, self.V, P_ = config.microbatches, config.local_chunks, table_.table.shape[1]
        V = self.V
        self.stage = comm.axis_index(STAGE_AXIS)
        self.chunks = jax.tree.map(lambda a: a.reshape(V, a.shape[0] // V, *a.shape[1:]), stacked)
        self.inputs, self.targets = jax.tree.map(lambda a: split_microbatches(a, self.M),
                                                 (inputs, targets))
        self.fill, self.accumulate_in = config.bubble_fill, config.accumulate_grads_in
        self.to_next = [(s, (s + 1) % P_) for s in range(P_) if table_.ring or s + 1 < P_]
        self.to_prev = [(d, s) for s, d in self.to_next]
        rows = table_.table.reshape(-1, table_.phases, *table_.table.shape[1:])
        # A chunk's layers read from two copies per slot (fill_copies) where those hold fewer
        # than the stage's own V chunks; otherwise each task slices its chunk out of the stack
        self.copies = bool(stages.layers) and V > 2 * table_.phases
        self.rows = with_copies(rows) if self.copies else rows
        self.table = jnp.asarray(self.rows)
        self.chunk_index = jnp.asarray(np.array(
            [[model_chunk(config.schedule, P_, s, v) for v in range(V)] for s in range(P_)],
            np.int32))
        self.handlers = {0: self.idle, F_: self.forward, B_: self.backward_b,
                         W_: self.backward_w, BW_: self.backward_whole}

    # ---- what flows, probed once (abstract values: nothing emitted) ----

    def buffers(self):
        """The loop's carry: the inbox and the loss, and (training) the stashes and the gradient
        sums. Probes the body's output, its pullback's residuals (and, split, how they split and
        B's linear function's residuals) and the loss."""
        stages, rest = self.stages, self.rest
        x0 = stages.first(rest, take_index(self.inputs, 0))
        x0 = jax.tree.map(lambda a: a + comm.pcast(jnp.zeros((), a.dtype), STAGE_AXIS,
                                                   to="varying"), x0)
        self.prepare = stages.prepare or (lambda chunk: chunk)
        self.local = [jax.tree.map(lambda a, v=v: a[v], self.chunks)
                      for v in range(self.V)]  # static slices
        chunk0 = self.layered(self.prepare(self.local[0]))  # compute precision (Stages.prepare)
        out0, stash0 = jax.eval_shape(self._probe_forward, chunk0, x0, self.global_chunk(0))
        # Probe again on an input typed as what flows between stages (the body's output: an MoE
        # carry's statistics start invariant and leave varying over the batch axes). The
        # pullbacks are rebuilt from this probe's structure, and a pullback traced for an
        # invariant input holds the transpose of its implicit cast, an all-reduce over those
        # axes, that a stage whose input arrives varying must not apply to the cotangent it
        # sends back.
        x0 = cast_like(x0, out0)
        out0, stash0 = jax.eval_shape(self._probe_forward, chunk0, x0, self.global_chunk(0))
        self.out0 = jax.tree.map(zeros_of, out0)
        self.zero = zeros_of(jax.eval_shape(
            lambda r, o: stages.last(r, o, take_index(self.targets, 0), self.M), rest, self.out0))
        # The stash lives in slots written at a stage-dependent index, so its buffers vary over
        # ``stage`` even where a residual does not (a rotary table computed from constants).
        self.stash0 = [varying_over(zeros_of(a), STAGE_AXIS) for a in stash0]
        self.rebuild = rebuilder(self.treedef, self.is_param)
        carry = {"inbox": slot_buffers(self.out0, self.schedule.inbox_slots), "loss": self.zero}
        if self.copies:  # two copies of a chunk per slot (fill_copies)
            params = jax.tree.map(zeros_of, jax.eval_shape(lambda c: c, chunk0))
            carry["copies"] = [[params, params] for _ in range(self.schedule.phases)]
        # A task's gradient leaves, as its backward computes them (in the compute precision);
        # they are widened only as they are added into the accumulators (``add_to_chunk``)
        self.zero_leaves = jax.tree.leaves(jax.tree.map(zeros_of, chunk0))
        if self.train:
            carry.update(self._training_buffers(chunk0))
            # the leaves of ``rest`` the head and the embedding read: the only ones F's and B's
            # gradients of ``rest`` can touch (the vocabulary-wide others stay out of the slots)
            self.rest_used = {F_: used_leaves(lambda r: stages.last(
                r, self.out0, take_index(self.targets, 0), self.M), rest)}
            self.rest_used[B_] = self.rest_used[BW_] = used_leaves(
                lambda r: self.entry(r, take_index(self.inputs, 0)), rest)
        return carry

    def _probe_forward(self, chunk, x, c):
        out, pullback = jax.vjp(lambda ch, x: self.stages.body(ch, x, c), chunk, x)
        self.treedef, stash, self.is_param = vjp_residuals(pullback, jax.tree.leaves(chunk))
        return out, stash

    def _training_buffers(self, chunk0):
        """The stashes (F to B or BW, F to W, B to W) and the gradient sums; how the residuals
        and the gradient leaves split between B and W (all B's without a split)."""
        table_, stash0 = self.schedule, self.stash0
        self.split = (weight_only_residuals(self.rebuild(chunk0), stash0, chunk0, self.out0)
                      if table_.splits else
                      Split((False,) * len(stash0), (False,) * len(self.zero_leaves)))
        self.known0 = pick(stash0, self.split.weight_only, False)
        self.weight0 = pick(stash0, self.split.weight_only, True)
        self.b_mask = [not w for w in self.split.weight_leaves]  # BW: every leaf
        self.b_zeros = pick(self.zero_leaves, self.b_mask, True)
        self.w_zeros = pick(self.zero_leaves, self.b_mask, False)
        carry = dict(stash_b=slot_buffers(self.known0, table_.stash_b_slots, garbage=False),
                     stash_w=slot_buffers(self.weight0, table_.stash_w_slots, garbage=False),
                     **self._gradient_sums(chunk0))
        if table_.splits:
            wstash0 = jax.eval_shape(self._probe_backward, chunk0, self.known0, self.out0)
            self.wstash0 = [varying_over(zeros_of(a), STAGE_AXIS) for a in wstash0]
            self.wstash_shapes = [(a.shape, a.dtype) for a in self.wstash0]
            carry["wstash"] = slot_buffers(self.wstash0, table_.wstash_slots, garbage=False)
        return carry

    def _gradient_sums(self, chunk0):
        """The step's gradient sums, zero: float32 (Megatron's ``main_grad``), or with
        ``accumulate_grads_in="compute"`` in the dtype each is computed in (a chunk's in its
        compute precision, ``chunk0``'s; the rest's in its own)."""
        if self.accumulate_in == "float32":
            return {"d_chunks": jax.tree.map(wide_zeros, self.chunks),
                    "d_rest": jax.tree.map(wide_zeros, self.rest)}
        typed = chunk0[0] if self.stages.layers else chunk0  # a layer's, or the stack's, dtypes
        return {"d_chunks": jax.tree.map(lambda a, c: jnp.zeros_like(a, dtype=c.dtype),
                                         self.chunks, typed),
                "d_rest": jax.tree.map(jnp.zeros_like, self.rest)}

    def _probe_backward(self, chunk, known, d_out):
        dx, b_leaves, linear = backward_input(self.rebuild(chunk), self.split, known, d_out,
                                              self.weight0)
        self.linear_treedef, wres, self.linear_is_param = vjp_residuals(
            linear, jax.tree.leaves(chunk))
        return wres

    # ---- the pieces the handlers share ----

    def global_chunk(self, v):
        return self.chunk_index[self.stage, v]

    def entry(self, rest, inputs_mb):
        """The part before the blocks, typed as what flows between stages (a carry's statistics
        start as plain zeros and flow varying over the batch axes)."""
        return cast_like(self.stages.first(rest, inputs_mb), self.out0)

    def head(self, out, m):
        """Loss share of micro-batch m and (training) d loss / d out, d loss / d rest."""
        last = lambda r, o: self.stages.last(r, o, take_index(self.targets, m), self.M)  # noqa: E731
        if not self.train:
            return last(self.rest, out), None, None
        loss, (d_rest, d_out) = jax.value_and_grad(  # ints: float0
            last, (0, 1), allow_int=True)(self.rest, out)
        return loss, d_out, d_rest

    def embedding_grad(self, dx, m):
        """On chunk 0: d loss / d rest through the part before the blocks."""
        _, embed_vjp = jax.vjp(lambda r: self.entry(r, take_index(self.inputs, m)), self.rest)
        return embed_vjp(cast_like(dx, self.out0))[0]

    def head_on_last(self, carry, row, out):
        """After an F slot, where its task was on the last chunk: the head on its output
        ``out``, its loss share added and (training) its seed for the backward written to the
        inbox slot the table names, and its gradient of ``rest`` added to the sums, in place
        (:func:`at_most_once`)."""
        m, keys = field(row, "mb"), ("loss", "inbox", "d_rest") if self.train else ("loss",)

        def head(part):
            loss, d_out, d_rest = self.head(out, m)
            part = dict(part, loss=part["loss"] + loss)
            if self.train:
                part["inbox"] = put_slot(part["inbox"], field(row, "seed"),
                                         cast_like(d_out, self.out0))
                part["d_rest"] = self.add_rest(part["d_rest"], d_rest, F_)
            return part
        return self.run_where(_on_head, row, head, carry, keys)

    def embedding_on_first(self, carry, row, dx):
        """After a B or BW slot, where its task was on chunk 0: the embedding's gradient of
        ``rest`` through the input's gradient ``dx``, added to the sums in place."""
        def embedding(part):
            d_rest = self.embedding_grad(dx, field(row, "mb"))
            return {"d_rest": self.add_rest(part["d_rest"], d_rest, B_)}
        return self.run_where(_on_embedding, row, embedding, carry, ("d_rest",))

    def run_where(self, when, row, fn, carry, keys):
        """``carry`` with its entries ``keys`` replaced by ``fn`` of them where this device's
        ``row`` satisfies ``when`` (:func:`at_most_once`, named :meth:`taken`)."""
        taken = when(field(row, "kind"), field(row, "first") > 0, field(row, "last") > 0)
        with self.taken(when):
            part = at_most_once(taken, fn, {k: carry[k] for k in keys})
        return {**carry, **part}

    def add_rest(self, sums, d_rest, kind):
        """``sums`` + the gradient ``d_rest`` of ``rest`` at the leaves task ``kind``'s part
        of the model reads (the head's for F, the embedding's for B and BW)."""
        grads = jax.tree.leaves(d_rest)
        used = self.rest_used[kind]
        return add_at(sums, used, [grads[i] for i in used])

    def chunk_of(self, v, row, buffers):
        """The local chunk's parameters in the compute precision (cast in the task, outside
        its ``jax.vjp``): static with one chunk per device; with more, the slot's copy of it
        the branch reads (:meth:`fill_copies`), or a dynamic slice of the stack."""
        if v is not None:
            return self.layered(self.prepare(self.local[v])), self.global_chunk(v)
        v = field(row, "chunk")
        if "chunk" in buffers:
            return buffers["chunk"], self.global_chunk(v)
        return self.fetched(v), self.global_chunk(v)

    def fetched(self, v):
        """Local chunk ``v``'s parameters as its tasks take them (:meth:`layered`), sliced out
        of the stage's stack: a copy, since XLA copies a slice before a GEMM reads it."""
        return self.layered(self.prepare(take_index(self.chunks, v)))

    def fill_copies(self, carry, row, p, rows):
        """The carry with slot ``p``'s copy ``fill`` of the row made local chunk
        ``fill_chunk``'s parameters, where the row names one
        (:func:`jphantom.pipeline.copies.chunk_copies`), in place: a loop of zero or one trips
        per copy (:func:`at_most_once`), named with the ticks of ``rows`` in which some device
        fills it (:func:`taken_scope`). Copying a chunk out of the stage's stack each
        task was 0.7 s of NeMo's 70B step; its devices fill a copy together, once in P ticks."""
        held = list(carry["copies"][p])
        for c in (0, 1):
            def fill(params):
                return cast_like(self.fetched(field(row, "fill_chunk")), params)
            taken = int((np.asarray(rows)[..., _F["fill"]] == c).any(axis=1).sum())
            with taken_scope(f"fill_copy_{c}", taken, len(rows)):
                held[c] = at_most_once(field(row, "fill") == c, fill, held[c])
        copies = list(carry["copies"])
        copies[p] = held
        return {**carry, "copies": copies}

    def layered(self, chunk):
        """A chunk's parameters as the body takes them: stacked [Lc, ...], or with
        ``Stages.layers`` one list per layer (static slices), so that the residuals the forward
        stashes and the gradients its backward gives are per layer, never stacked (a scan's,
        even unrolled, concatenates both)."""
        if not self.stages.layers:
            return chunk
        return [jax.tree.map(lambda a, l=l: a[l], chunk) for l in range(self.stages.layers)]

    # ---- one handler per task kind: (kinds of the slot, static chunk, row, buffers) ----

    def idle(self, kinds, v=None, row=None, buffers=None):
        """What a slot's branches return, as an idle slot fills it: the message; where F runs,
        its residuals; where B or BW runs, their gradient leaves (and B's, W's residuals); where
        W runs, W's. Each branch writes only what its slot's tasks can produce."""
        fill = self.fill
        result = {"msg": fill_like(self.out0, fill)}
        if not self.train:
            return result
        if F_ in kinds:
            result.update(stash_b=[jnp.full_like(a, fill) for a in self.known0],
                          stash_w=[jnp.full_like(a, fill) for a in self.weight0])
        if B_ in kinds:
            result["wstash"] = [jnp.full_like(a, fill) for a in self.wstash0]
        if B_ in kinds or BW_ in kinds:
            result["b_grads"] = self.b_zeros
        if W_ in kinds:
            result["w_grads"] = self.w_zeros
        return result

    def forward(self, kinds, v, row, buffers):
        """F: the body's forward on the micro-batch's input (the embedding's on chunk 0);
        training, its pullback's residuals stashed. On the last chunk the slot then runs the
        head on its output (:meth:`head_on_last`)."""
        message = take_index(buffers["inbox"], field(row, "inbox"))
        m = field(row, "mb")
        chunk, c = self.chunk_of(v, row, buffers)
        result = self.idle(kinds)
        with self.taken(_on_entry):
            x = lax.cond(field(row, "first") > 0,
                         lambda: self.entry(self.rest, take_index(self.inputs, m)),
                         lambda: message)
        body = lambda ch, x: self.stages.body(ch, x, c)  # noqa: E731
        if not self.train:
            result["msg"] = cast_like(body(chunk, x), self.out0)
            return result
        out, pullback = jax.vjp(body, chunk, x)
        _, stash, params = vjp_residuals(pullback, jax.tree.leaves(chunk))
        if params != self.is_param or _shapes(stash) != _shapes(self.stash0):
            raise RuntimeError("the stage body's vjp residuals changed between traces")
        stash = cast_like(stash, self.stash0)
        weight_only = self.split.weight_only
        result.update(msg=cast_like(out, self.out0), stash_b=pick(stash, weight_only, False),
                      stash_w=pick(stash, weight_only, True))
        return result

    def backward_whole(self, kinds, v, row, buffers):
        """BW: the whole backward from the stashed residuals: the input's gradient (sent on;
        on chunk 0 the slot then takes the embedding's: :meth:`embedding_on_first`) and every
        gradient leaf of the chunk."""
        d_out = take_index(buffers["inbox"], field(row, "inbox"))
        residuals = take_index(buffers["stash_b"], field(row, "stash_b"))
        d_chunk, dx = self.rebuild(self.chunk_of(v, row, buffers)[0])(residuals)(d_out)
        result = self.idle(kinds)
        result.update(msg=cast_like(dx, self.out0),
                      b_grads=cast_like(jax.tree.leaves(d_chunk), self.b_zeros))
        return result

    def backward_b(self, kinds, v, row, buffers):
        """B: the input's gradient and B's gradient leaves; W's linear function's residuals
        stashed for W."""
        d_out = take_index(buffers["inbox"], field(row, "inbox"))
        known = take_index(buffers["stash_b"], field(row, "stash_b"))
        chunk = self.chunk_of(v, row, buffers)[0]
        dx, b_leaves, linear = backward_input(self.rebuild(chunk), self.split, known, d_out,
                                              self.weight0)
        td, wres, params = vjp_residuals(linear, jax.tree.leaves(chunk))
        if params != self.linear_is_param or _shapes(wres) != self.wstash_shapes:
            raise RuntimeError("the stage body's input-gradient residuals changed between traces")
        self.linear_treedef = td
        result = self.idle(kinds)
        result.update(msg=cast_like(dx, self.out0), wstash=cast_like(wres, self.wstash0),
                      b_grads=cast_like(b_leaves, self.b_zeros))
        return result

    def backward_w(self, kinds, v, row, buffers):
        """W: the weights' gradient leaves, B's linear function applied to the weight-only
        residuals."""
        chunk = self.chunk_of(v, row, buffers)[0]
        linear = rebuilder(self.linear_treedef, self.linear_is_param)(chunk)(
            take_index(buffers["wstash"], field(row, "wstash")))
        result = self.idle(kinds)
        weight_only = take_index(buffers["stash_w"], field(row, "stash_w"))
        result["w_grads"] = cast_like(backward_weight(linear, weight_only), self.w_zeros)
        return result

    # ---- the interpreter: a tick's slots, each a dispatch, a write-back and an exchange ----

    def segment(self, phases, start, stop):
        """The scanned body of the ticks ``start:stop`` of a segment: its slots in turn, each on
        this device's row."""
        rows = self.rows[start:stop]  # [ticks, phases, P, fields]
        slots = [self.slot(*phase, rows[:, p], p) for p, phase in enumerate(phases)]

        def tick(carry, rows_now):
            for run_slot, rows_p in zip(slots, rows_now):
                if run_slot is not None:
                    carry = run_slot(carry, rows_p[self.stage])
            return carry, None
        return tick

    def slot(self, tasks, send_next, send_prev, rows, p):
        """One slot (phase ``p``) of a segment's ticks, whose devices run the kinds ``tasks``:
        one branch per kind (with one chunk per device its parameters static; with more, one
        per kind and copy of the chunk the task reads: :meth:`fill_copies`), and the idle one;
        then the slot's exchange. ``None`` where no device runs anything. ``rows``: the slot's
        rows of the segment's ticks, [ticks, P, fields] (:meth:`taken`)."""
        if not tasks:
            return None
        kinds = sorted(set(tasks) | {0})
        static = 0 if self.V == 1 else None
        copies = (0, 1) if self.copies else (None,)
        branches = [(0, None)] + [(k, c) for k in kinds if k for c in copies]
        index_of = np.zeros((len(KINDS), 2), np.int32)  # (kind, copy) -> branch
        for i, (k, c) in enumerate(branches):
            index_of[k, [0, 1] if c is None else c] = i  # a kind without copies: both

        def run_slot(carry, row):
            self.tracing = rows  # the rows :meth:`taken` counts while this slot is traced
            # The buffers a task of this slot reads, whole: the taken branch slices its slots
            # (operands only; every write is outside the switch).
            buffers = {"inbox": carry["inbox"]}
            if self.train and {B_, BW_} & set(kinds):
                buffers["stash_b"] = carry["stash_b"]
            if self.train and W_ in kinds:
                buffers.update(stash_w=carry["stash_w"], wstash=carry["wstash"])
            if self.copies:
                carry = self.fill_copies(carry, row, p, rows)
                buffers["copies"] = carry["copies"][p]
            calls = [lambda r, b, k=k, c=c: self.handlers[k](kinds, static, r, with_copy(b, c))
                     for k, c in branches]
            index = (jnp.asarray(index_of)[field(row, "kind"), jnp.maximum(field(row, "copy"), 0)]
                     if self.copies else jnp.asarray(index_of[:, 0])[field(row, "kind")])
            with jax.named_scope(branch_ticks(index_of, rows)):
                result = lax.switch(index, calls, row, buffers)
            carry = self.write_back(carry, row, result)
            if F_ in kinds:
                carry = self.head_on_last(carry, row, result["msg"])
            if self.train and {B_, BW_} & set(kinds):
                carry = self.embedding_on_first(carry, row, result["msg"])
            return self.exchange(carry, row, result["msg"], send_next, send_prev)
        return run_slot

    def write_back(self, carry, row, result):
        """The carry with a task's ``result`` in it: the gradient sums added, the stashes
        written to their slots."""
        carry = dict(carry)
        v = field(row, "chunk")
        for key, slots in (("stash_b", self.schedule.stash_b_slots),
                           ("stash_w", self.schedule.stash_w_slots),
                           ("wstash", self.schedule.wstash_slots)):
            if key in result:  # no garbage slot: an idle device rewrites a slot as it is
                carry[key] = put_live_slot(carry[key], field(row, key), result[key], slots)
        if "b_grads" in result:
            carry["d_chunks"] = add_to_chunk(carry["d_chunks"], v, result["b_grads"], self.b_mask,
                                             self.stages.layers)
        if "w_grads" in result:
            carry["d_chunks"] = add_to_chunk(carry["d_chunks"], v, result["w_grads"],
                                             self.split.weight_leaves, self.stages.layers)
        return carry

    def taken(self, when):
        """A name scope for a ``lax.cond`` of the slot being traced whose true branch runs in
        the ticks where some device's row satisfies ``when(kind, first, last)``:
        ``<when>_taken_in_<n>_of_<ticks>_ticks`` (:func:`ticks_taken`). The predictor prices
        the cond's branches by that share of its loop's trips, not every trip at the slower
        branch (:mod:`jphantom.predict.timeline`): the head runs in M ticks of a schedule of
        about V M, the embedding's backward likewise."""
        return taken_scope(when.__name__.lstrip("_"), *ticks_taken(self.tracing, when))

    def exchange(self, carry, row, msg, send_next, send_prev):
        """The slot's message kept (zb-v's turn) or sent to the next and the previous device,
        into the inbox slots the table names."""
        if self.schedule.keeps:  # zb-v's turn: the message stays on its device
            carry["inbox"] = put_slot(carry["inbox"], field(row, "keep"), msg)
        if send_next:  # one collective-permute of [b, ...] to the next device
            carry["inbox"] = put_slot(carry["inbox"], field(row, "from_prev"),
                                      comm.ppermute(msg, STAGE_AXIS, self.to_next))
        if send_prev:  # and one to the previous
            carry["inbox"] = put_slot(carry["inbox"], field(row, "from_next"),
                                      comm.ppermute(msg, STAGE_AXIS, self.to_prev))
        return carry


def _on_entry(kind, first, last):
    """F on the first chunk: the part before the blocks (the embedding)."""
    return (kind == F_) & first


def _on_head(kind, first, last):
    """F on the last chunk: the head, its loss and its gradient (:meth:`_Step.taken`)."""
    return (kind == F_) & last


def _on_embedding(kind, first, last):
    """B or BW on the first chunk: the embedding's gradient (:meth:`_Step.taken`)."""
    return ((kind == B_) | (kind == BW_)) & first


def taken_scope(name: str, taken: int, ticks: int):
    """The name scope ``<name>_taken_in_<taken>_of_<ticks>_ticks`` of a cond or a loop of at
    most one trip that runs in ``taken`` of its loop's ``ticks`` trips, which the HLO accounting
    and the predictor read (:func:`jphantom.analysis.hlo.callgraph.taken_share`)."""
    return jax.named_scope(f"{name}_taken_in_{taken}_of_{ticks}_ticks")


def ticks_taken(rows, when) -> tuple[int, int]:
    """Of the ticks of ``rows`` (a segment's table, [ticks, ..., fields]), how many have a row
    (of any device, any slot) where ``when(kind, first, last)`` holds, and how many there are."""
    rows = np.asarray(rows)
    hits = when(rows[..., _F["kind"]], rows[..., _F["first"]] > 0, rows[..., _F["last"]] > 0)
    return int(np.any(hits.reshape(len(rows), -1), axis=1).sum()), len(rows)


def used_leaves(fn, tree) -> tuple[int, ...]:
    """The indices of ``tree``'s leaves that ``fn(tree)`` reads (from its jaxpr: a leaf no
    equation and no output takes is not read)."""
    leaves, treedef = jax.tree.flatten(tree)
    jaxpr = jax.make_jaxpr(lambda *xs: fn(jax.tree.unflatten(treedef, xs)))(*leaves).jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return tuple(i for i, v in enumerate(jaxpr.invars) if id(v) in read)


def at_most_once(taken, fn, carry):
    """``fn(carry)`` where ``taken`` (a traced boolean) holds, else ``carry`` as it is: a
    ``lax.while_loop`` of zero or one trips. XLA updates a loop's carry in place, so the head's
    and embedding's gradients are added to their sums only in the ticks that have them; a
    ``lax.cond`` whose other branch passed the sums through made XLA copy them in every tick,
    and one returning zeros to add wrote and added the zeros in every tick. The predictor
    prices the body at its share of the ticks (:meth:`_Step.taken`)."""
    def body(state):
        _, inner = state
        return jnp.ones((), jnp.int32), fn(inner)
    stop = taken.astype(jnp.int32)
    return lax.while_loop(lambda state: state[0] < stop, body, (jnp.zeros((), jnp.int32), carry))[1]


def add_at(tree, index, grads):
    """``tree`` with ``grads`` added to its leaves ``index`` (the others as they are)."""
    leaves = jax.tree.leaves(tree)
    for i, g in zip(index, grads):
        leaves[i] = leaves[i] + g.astype(leaves[i].dtype)
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


def _shapes(arrays):
    return [(a.shape, a.dtype) for a in arrays]


def wide_zeros(a):
    """Zeros like ``a`` in at least float32 (a gradient accumulator)."""
    return jnp.zeros_like(a, dtype=jnp.promote_types(a.dtype, jnp.float32))


def add_to_chunk(d_chunks, v, leaves, mask, layers=0):
    """``d_chunks[v] +=`` the gradient ``leaves`` at the leaves where ``mask`` holds
    (``d_chunks``: [V, Lc, ...] per leaf; one chunk: a static index; ``layers``: the leaves and
    ``mask`` run layer by layer, Lc lists of the chunk's leaves, each added at its layer's row).
    A one-row scatter-add, in place, as the gradient sinks' (:mod:`jphantom.nn.sink`): written
    as a slice, an add and an update, XLA's GPU fusion copied the row out first and its
    rematerialisation cloned the copies."""
    out = jax.tree.leaves(d_chunks)
    new = iter(leaves)
    for i, on in enumerate(mask):
        if not on:
            continue
        j, g = i % len(out), next(new)
        row = (v,) if not layers else (v, i // len(out))
        if out[j].shape[0] == 1 and not layers:
            out[j] = out[j] + g[None].astype(out[j].dtype)
        else:
            out[j] = out[j].at[row].add(g.astype(out[j].dtype), unique_indices=True)
    return jax.tree.unflatten(jax.tree.structure(d_chunks), out)
