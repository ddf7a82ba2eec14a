"""Pipeline parallelism executed inside the one SPMD training step (the Day 66 notes Sec. 2.2, Singh's thesis ch. 3).

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
device; with ``V`` virtual stages, device ``s`` holds the model chunks ``v P + s`` (``v < V``),
Megatron's round-robin: the step stores the unit axis permuted (:func:`unit_order`) so that a
contiguous split gives each device its chunks. The rest is replicated over ``stage``; its gradient
(non-zero on the first and last stage only) is all-reduced over ``stage`` once per step, like
Megatron's embedding-group all-reduce.

The step walks the schedule's lock-step table (:func:`jphantom.pipeline.schedule.lockstep`) with
``lax.scan`` over ticks; every device reads its own row of the table (``comm.axis_index("stage")``)
and runs, under ``lax.cond``, at most::

    forward slot:   x = first(rest, inputs[m]) on chunk 0, else the activation received for (c, m)
                    out, vjp = jax.vjp(body, chunk_params[v], x); stash vjp's residuals
                    on the last chunk: loss, d_out = value_and_grad(last)(out), d_out into the inbox
    ppermute        out -> stage s + 1 (ring with V > 1): one [b, ...] activation per tick
    backward slot:  d_chunk, dx = vjp(d_out) from the stash; grads[v] += d_chunk (a running sum)
                    on chunk 0: the embedding's vjp of dx
    ppermute        dx -> stage s - 1: one [b, ...] cotangent per tick

The residuals of ``jax.vjp`` (its ``Partial``'s leaves, less the chunk's own parameters, which are
not copied) live in a buffer with one slot per micro-batch in flight; received activations and
cotangents wait in slot buffers too. All slots are assigned on the host from the table, so a
1F1B step holds at most ``min(M, 2 (P - s) - 1)`` residual sets whatever ``M`` is, GPipe ``M``.
Ticks with no forward (backward) anywhere skip that slot and its exchange: the scan is cut into
segments of ticks with the same slots, so the compiled step holds exactly one collective-permute
per tick that moves an activation and one per tick that moves a cotangent.

Idle slots send ``bubble_fill`` (tests send NaN: bubbles must never reach the loss or gradients).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jphantom import comm
from jphantom.errors import ConfigError, check_int
from jphantom.pipeline.schedule import ALL_SCHEDULES, SPLIT_SCHEDULES, Lockstep, chunks_of, lockstep

STAGE_AXIS = "stage"


def zeros_of(struct) -> jax.Array:
    """Zeros of an abstract value (``jax.eval_shape`` inside a shard_map) with its shape, dtype
    and varying mesh axes."""
    zeros = jnp.zeros(struct.shape, struct.dtype)
    varying = tuple(sorted(comm.varying_axes(struct)))  # none outside a shard_map
    return comm.pcast(zeros, varying, to="varying") if varying else zeros


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How a step is pipelined: the schedule, micro-batches per step (per data rank) and virtual
    stages per device (``interleaved-1f1b`` only). The split-backward schedules (``zb-h1``,
    ``zb-v``) run in :mod:`jphantom.pipeline.split`."""

    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    bubble_fill: float = 0.0  # what idle slots send; tests use NaN

    def __post_init__(self):
        if self.schedule not in ALL_SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; use one of "
                              f"{', '.join(ALL_SCHEDULES)}")
        check_int("microbatches", self.microbatches)
        check_int("virtual_stages", self.virtual_stages)
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise ConfigError(f"virtual_stages={self.virtual_stages} applies to 'interleaved-1f1b' "
                              f"only, not {self.schedule!r}: pass --schedule interleaved-1f1b or "
                              "--virtual-stages 1")

    @property
    def split(self) -> bool:
        """Whether the schedule splits each backward into B and W (zero-bubble)."""
        return self.schedule in SPLIT_SCHEDULES

    @property
    def local_chunks(self) -> int:
        """Model chunks per device: the virtual stages, or 2 for ``zb-v``'s V placement."""
        return self.virtual_stages * chunks_of(self.schedule, 1)

    def check(self, stages: int, units: int, unit_name: str = "layers") -> None:
        """Raise ConfigError where this pipeline cannot cut a model of ``units`` on ``stages``."""
        chunks = stages * self.local_chunks
        if units % chunks:
            per = (f"stages x virtual stages = {stages} x {self.virtual_stages}"
                   if self.schedule != "zb-v" else f"2 x stages = 2 x {stages} (zb-v's chunks)")
            raise ConfigError(f"{unit_name}={units} is not divisible by {per}: every model chunk "
                              f"needs the same number of {unit_name}; pick a multiple of {chunks}")
        if self.schedule == "interleaved-1f1b" and self.microbatches % stages:
            raise ConfigError(f"interleaved-1f1b needs microbatches divisible by the {stages} "
                              f"stages (as Megatron-LM does), got microbatches={self.microbatches}: "
                              f"use a multiple of {stages}")

    def check_batch(self, batch: int) -> None:
        if batch % self.microbatches:
            raise ConfigError(f"the per-data-rank batch {batch} is not divisible by "
                              f"microbatches={self.microbatches}: pick a batch that is a multiple of "
                              f"{self.microbatches}, or fewer micro-batches")


def pipeline_for(mesh, batch: int, *, schedule: str = "1f1b", microbatches: int | None = None,
                 virtual_stages: int = 1) -> PipelineConfig | None:
    """The pipeline a step on ``mesh`` (a MeshConfig) runs: ``None`` without a ``stage`` axis (then
    the settings must keep their defaults), else the validated :class:`PipelineConfig`
    (``microbatches`` defaults to the number of stages), the per-data-rank ``batch`` checked
    against the micro-batches -- before anything compiles."""
    if STAGE_AXIS not in mesh.shape:
        given = [f"--{flag} {value}" for flag, value, default in (
            ("schedule", schedule, "1f1b"), ("microbatches", microbatches, None),
            ("virtual-stages", virtual_stages, 1)) if value != default]
        if given:
            raise ConfigError(f"{' '.join(given)} only apply to a pipelined step, but mesh {mesh} "
                              f"has no stage axis: add stage=N to the mesh (e.g. --mesh "
                              f"stage=2,{mesh}) or leave the pipeline settings out")
        return None
    if microbatches is not None:
        check_int("microbatches", microbatches)
    config = PipelineConfig(schedule, microbatches or mesh.size(STAGE_AXIS), virtual_stages)
    data = mesh.size("data")
    try:
        config.check_batch(batch // data)
    except ConfigError as error:
        raise ConfigError(f"batch={batch} over data={data}: {error}") from None
    return config


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model cut for pipelining (module docstring): ``units`` stacked blocks, called
    ``unit_name`` in errors, and the three per-rank functions."""

    units: int
    unit_name: str
    first: Callable[[Any, jax.Array], jax.Array]
    body: Callable[[Any, jax.Array, jax.Array], jax.Array]
    last: Callable[[Any, jax.Array, jax.Array, int], jax.Array]


# --------------------------------------------------------------------------------------------------
# The table, compiled to per-tick, per-stage integers (host side)
# --------------------------------------------------------------------------------------------------

FIELDS = ("f_on", "f_chunk", "f_mb", "f_first", "f_last", "f_in", "f_stash", "f_seed", "f_recv",
          "b_on", "b_chunk", "b_mb", "b_first", "b_in", "b_stash", "b_recv")
_F = {name: i for i, name in enumerate(FIELDS)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The lock-step table as arrays: ``table[t, s, field]`` (``FIELDS``), slot counts, and the
    scan segments ``(start, stop, forward, send_forward, backward, send_backward)``."""

    lockstep: Lockstep
    table: np.ndarray
    activation_slots: int
    cotangent_slots: int
    stash_slots: int
    segments: tuple[tuple[int, int, bool, bool, bool, bool], ...]

    @property
    def forward_permutes(self) -> int:
        return sum(stop - start for start, stop, _, send, _, _ in self.segments if send)

    @property
    def backward_permutes(self) -> int:
        return sum(stop - start for start, stop, _, _, _, send in self.segments if send)


def allocate_slots(intervals: list[tuple[int, int, Any]]) -> tuple[dict[Any, int], int]:
    """Slots for (write time, read time, key) intervals: a slot is reused once read before the
    next write. Returns key -> slot and the number of slots."""
    slot_of, free_after = {}, []
    for write, read, key in sorted(intervals, key=lambda i: (i[0], i[1])):
        for slot, busy_until in enumerate(free_after):
            if busy_until < write:
                break
        else:
            slot = len(free_after)
            free_after.append(0)
        free_after[slot] = read
        slot_of[key] = slot
    return slot_of, len(free_after)


def plan(config: PipelineConfig, stages: int, *, train: bool = True) -> Plan:
    """Compile the schedule's lock-step table for the executor. ``train=False``: its forward
    slots only, for evaluation."""
    steps = lockstep(config.schedule, stages, config.microbatches, config.virtual_stages)
    P, V = stages, config.virtual_stages
    ticks = [(t.forward, t.backward) for t in steps.ticks]
    if not train:  # evaluation: the schedule's forward slots only
        ticks = [(fwd, (None,) * P) for fwd, _ in ticks if any(f is not None for f in fwd)]
    last = V * P - 1
    # When each (chunk, microbatch) runs its forward / backward.
    f_tick, b_tick = {}, {}
    for t, (fwd, bwd) in enumerate(ticks):
        for s in range(P):
            if fwd[s] is not None:
                m, v = fwd[s]
                f_tick[(v * P + s, m)] = t
            if bwd[s] is not None:
                m, v = bwd[s]
                b_tick[(v * P + s, m)] = t
    # Slot intervals per device, in phases: 4t forward slot, 4t+1 activation exchange,
    # 4t+2 backward slot, 4t+3 cotangent exchange.
    acts = [[] for _ in range(P)]
    cots = [[] for _ in range(P)]
    stash = [[] for _ in range(P)]
    for (c, m), t in f_tick.items():
        s = c % P
        if c > 0:
            acts[s].append((4 * f_tick[(c - 1, m)] + 1, 4 * t, (c, m)))
        if train:
            stash[s].append((4 * t, 4 * b_tick[(c, m)] + 2, (c, m)))
            written = 4 * t if c == last else 4 * b_tick[(c + 1, m)] + 3
            cots[s].append((written, 4 * b_tick[(c, m)] + 2, (c, m)))
    act_slot, cot_slot, stash_slot = {}, {}, {}
    counts = [0, 0, 0]
    for s in range(P):
        for i, (intervals, into) in enumerate(((acts[s], act_slot), (cots[s], cot_slot),
                                               (stash[s], stash_slot))):
            slots, n = allocate_slots(intervals)
            into.update(slots)
            counts[i] = max(counts[i], n)
    A, C, S = (max(1, n) for n in counts)  # slot index n (A, C, S) is the garbage slot
    table = np.zeros((len(ticks), P, len(FIELDS)), np.int32)
    table[:, :, _F["f_in"]] = A
    table[:, :, _F["f_recv"]] = A
    table[:, :, _F["f_stash"]] = S
    table[:, :, _F["b_stash"]] = S
    table[:, :, _F["f_seed"]] = C
    table[:, :, _F["b_in"]] = C
    table[:, :, _F["b_recv"]] = C
    for t, (fwd, bwd) in enumerate(ticks):
        for s in range(P):
            row = table[t, s]
            if fwd[s] is not None:
                m, v = fwd[s]
                c = v * P + s
                row[[_F["f_on"], _F["f_chunk"], _F["f_mb"]]] = (1, v, m)
                row[_F["f_first"]], row[_F["f_last"]] = c == 0, c == last
                if c > 0:
                    row[_F["f_in"]] = act_slot[(c, m)]
                if train:
                    row[_F["f_stash"]] = stash_slot[(c, m)]
                    if c == last:
                        row[_F["f_seed"]] = cot_slot[(c, m)]
                if c < last:  # the receiver stores it at the end of this tick
                    receiver = table[t, (s + 1) % P]
                    receiver[_F["f_recv"]] = act_slot[(c + 1, m)]
            if bwd[s] is not None:
                m, v = bwd[s]
                c = v * P + s
                row[[_F["b_on"], _F["b_chunk"], _F["b_mb"]]] = (1, v, m)
                row[_F["b_first"]] = c == 0
                row[_F["b_in"]] = cot_slot[(c, m)]
                row[_F["b_stash"]] = stash_slot[(c, m)]
                if c > 0:
                    table[t, (s - 1) % P][_F["b_recv"]] = cot_slot[(c - 1, m)]
    # Segments of consecutive ticks with the same slots and exchanges.
    def signature(t):
        fwd, bwd = ticks[t]
        sends_f = any(f is not None and f[1] * P + s < last for s, f in enumerate(fwd))
        sends_b = any(b is not None and b[1] * P + s > 0 for s, b in enumerate(bwd))
        return (any(f is not None for f in fwd), sends_f, any(b is not None for b in bwd), sends_b)

    segments, start = [], 0
    for t in range(1, len(ticks) + 1):
        if t == len(ticks) or signature(t) != signature(start):
            segments.append((start, t, *signature(start)))
            start = t
    return Plan(steps, table, A, C, S, tuple(segments))


# --------------------------------------------------------------------------------------------------
# The executor (per rank, inside the step's shard_map)
# --------------------------------------------------------------------------------------------------


def split_microbatches(x: jax.Array, m: int) -> jax.Array:
    return x.reshape(m, x.shape[0] // m, *x.shape[1:])


def _chunks(stacked, V: int):
    """Local stacked leaves [V * Lc, ...] -> [V, Lc, ...]."""
    return jax.tree.map(lambda a: a.reshape(V, a.shape[0] // V, *a.shape[1:]), stacked)


def take_index(tree, i):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def put_slot(buffers, i, values):
    """``buffers`` with slot ``i`` (dimension 0) of each leaf set to ``values`` (cast to it)."""
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), i, 0),
                        buffers, values)


def cast_like(tree, like):
    """``tree``'s leaves in ``like``'s dtypes and varying over (at least) its mesh axes
    (activations may be pytrees: an MoE block's ``(h, aux)``, whose statistics start as plain
    zeros; integer leaves' cotangents, float0, become zeros of the leaf's dtype)."""
    from jphantom.nn.metadata import varying_axes

    def one(a, b):
        a = jnp.zeros(b.shape, b.dtype) if a.dtype == jax.dtypes.float0 else a.astype(b.dtype)
        extra = tuple(sorted(varying_axes(b) - varying_axes(a)))
        return comm.pcast(a, extra, to="varying") if extra else a
    return jax.tree.map(one, tree, like)


def varying_over(x, axis):
    """``x`` also varying over ``axis``."""
    return x if axis in comm.varying_axes(x) else comm.pcast(x, axis, to="varying")


def fill_like(tree, fill):
    """A pytree like ``tree`` filled with ``fill`` (floating leaves; integer leaves with 0)."""
    return jax.tree.map(lambda a: jnp.full_like(a, fill) if jnp.issubdtype(a.dtype, jnp.floating)
                        else jnp.zeros_like(a), tree)


def slot_buffers(value, n):
    """A buffer of ``n + 1`` slots shaped like ``value`` (same varying axes), zero-filled."""
    return jax.tree.map(lambda a: jnp.broadcast_to(jnp.zeros_like(a)[None], (n + 1, *a.shape)),
                        value)


def vjp_residuals(vjp_fn, chunk_leaves):
    """``jax.vjp``'s Partial -> (treedef, leaves to stash, positions of leaves that are the chunk's
    own parameters: those are re-read at the backward instead of copied)."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    is_param = tuple(next((j for j, p in enumerate(chunk_leaves) if leaf is p), -1)
                     for leaf in leaves)
    return treedef, [leaf for leaf, j in zip(leaves, is_param) if j < 0], is_param


def run(stages: Stages, config: PipelineConfig, plan_: Plan, stacked, rest, inputs, targets, *,
        train: bool = True):
    """One step of the pipeline on this rank. ``stacked``: this device's units [V Lc, ...];
    ``rest``: the replicated parameters (varying over ``stage``); ``inputs``, ``targets``: the data
    rank's batch. Returns (loss share, d_stacked, d_rest) -- or the loss share alone when not
    ``train``. The loss is non-zero on the last stage only."""
    V, M = config.virtual_stages, config.microbatches
    P_ = plan_.table.shape[1]
    stage = comm.axis_index(STAGE_AXIS)
    chunks = _chunks(stacked, V)
    inputs, targets = split_microbatches(inputs, M), split_microbatches(targets, M)
    fill = config.bubble_fill
    perm_f = [(s, (s + 1) % P_) for s in range(P_) if V > 1 or s + 1 < P_]
    perm_b = [(d, s) for s, d in perm_f]
    table = jnp.asarray(plan_.table)

    def field(row, name):
        return row[_F[name]]

    def chunk_of(v):
        return take_index(chunks, v) if V > 1 else stacked

    def stage_input(row, received):
        m = field(row, "f_mb")
        return lax.cond(field(row, "f_first") > 0,
                        lambda: entry(rest, take_index(inputs, m)),
                        lambda: received)

    def head(out, m):
        """Loss share of micro-batch m and (training) d loss / d out, d loss / d rest."""
        if not train:
            return stages.last(rest, out, take_index(targets, m), M), None, None
        (loss, (d_rest, d_out)) = jax.value_and_grad(
            lambda r, o: stages.last(r, o, take_index(targets, m), M), argnums=(0, 1))(rest, out)
        return loss, d_out, d_rest

    # Shapes (and varying axes) of what flows, from an abstract trace of tick 0's slot (jax.eval_shape:
    # nothing of it is emitted): the body's output, its vjp residuals, the head's loss.
    row0 = take_index(table, 0)[stage]
    x0 = stages.first(rest, take_index(inputs, 0))
    x0 = jax.tree.map(lambda a: a + comm.pcast(jnp.zeros((), a.dtype), STAGE_AXIS, to="varying"),
                      x0)  # as in the ticks
    chunk0 = chunk_of(field(row0, "f_chunk"))
    probed = {}

    def probe(chunk, x, c):
        out, vjp_fn = jax.vjp(lambda ch, x: stages.body(ch, x, c), chunk, x)
        probed["treedef"], stash, probed["is_param"] = vjp_residuals(vjp_fn, jax.tree.leaves(chunk))
        return out, stash

    out0, stash0 = jax.eval_shape(probe, chunk0, x0, field(row0, "f_chunk") * P_ + stage)
    treedef, is_param = probed["treedef"], probed["is_param"]
    stash_shapes = [(a.shape, a.dtype) for a in stash0]
    traced = {"treedef": treedef}
    zero = zeros_of(jax.eval_shape(lambda r, o: stages.last(r, o, take_index(targets, 0), M), rest,
                                 jax.tree.map(zeros_of, out0)))
    out0 = jax.tree.map(zeros_of, out0)

    def entry(rest, inputs_mb):
        """The part before the blocks, typed as what flows between stages (a carry's statistics
        start as plain zeros and flow varying over the batch axes)."""
        return cast_like(stages.first(rest, inputs_mb), out0)
    # The stash lives in slots written at a stage-dependent index, so its buffers vary over
    # ``stage`` even where a residual does not (a rotary table computed from constants).
    stash0 = [varying_over(zeros_of(a), STAGE_AXIS) for a in stash0]
    carry = {"act": slot_buffers(out0, plan_.activation_slots), "loss": zero}
    if train:
        carry.update(cot=slot_buffers(out0, plan_.cotangent_slots),
                     stash=slot_buffers(stash0, plan_.stash_slots),
                     d_chunks=jax.tree.map(jnp.zeros_like, chunks if V > 1 else stacked),
                     d_rest=jax.tree.map(jnp.zeros_like, rest))

    def forward_slot(row, carry):
        m, v = field(row, "f_mb"), field(row, "f_chunk")
        c = v * P_ + stage

        received = take_index(carry["act"], field(row, "f_in"))  # one slot, read outside the cond

        def active():
            x = stage_input(row, received)
            chunk = chunk_of(v)
            body = lambda ch, x: stages.body(ch, x, c)
            if not train:
                out = body(chunk, x)
                loss = lax.cond(field(row, "f_last") > 0, lambda: head(out, m)[0],
                                lambda: jnp.zeros_like(zero))
                return out, loss
            out, vjp_fn = jax.vjp(body, chunk, x)
            td, stash, params = vjp_residuals(vjp_fn, jax.tree.leaves(chunk))
            if params != is_param or [(a.shape, a.dtype) for a in stash] != stash_shapes:
                raise RuntimeError("the stage body's vjp residuals changed between traces")
            traced["treedef"] = td  # the backward slots rebuild the pullback with it

            def with_head():
                loss, d_out, d_rest = head(out, m)
                return loss, cast_like(d_out, out), d_rest

            def without_head():
                return (jnp.zeros_like(zero), fill_like(out, fill),
                        jax.tree.map(jnp.zeros_like, rest))

            loss, d_out, d_rest = lax.cond(field(row, "f_last") > 0, with_head, without_head)
            return out, loss, cast_like(stash, stash0), d_out, d_rest

        def idle():
            out = fill_like(out0, fill)
            if not train:
                return out, jnp.zeros_like(zero)
            return (out, jnp.zeros_like(zero), jax.tree.map(lambda a: jnp.full_like(a, fill), stash0),
                    fill_like(out0, fill), jax.tree.map(jnp.zeros_like, rest))

        result = lax.cond(field(row, "f_on") > 0, active, idle)
        carry = dict(carry)
        carry["loss"] = carry["loss"] + result[1]
        if train:
            out, _, stash, d_out, d_rest = result
            carry["stash"] = put_slot(carry["stash"], field(row, "f_stash"), stash)
            carry["cot"] = put_slot(carry["cot"], field(row, "f_seed"), d_out)
            carry["d_rest"] = jax.tree.map(jnp.add, carry["d_rest"], d_rest)
        return result[0], carry

    def backward_slot(row, carry):
        m, v = field(row, "b_mb"), field(row, "b_chunk")

        # One slot of residuals and one cotangent, read outside the cond (the branches never
        # take the whole buffers).
        residuals = take_index(carry["stash"], field(row, "b_stash"))
        d_out = take_index(carry["cot"], field(row, "b_in"))

        def active():
            chunk = chunk_of(v)
            chunk_leaves = jax.tree.leaves(chunk)
            stored = iter(residuals)
            leaves = [chunk_leaves[j] if j >= 0 else next(stored) for j in is_param]
            vjp_fn = jax.tree.unflatten(traced["treedef"], leaves)
            d_chunk, dx = vjp_fn(d_out)

            def embedding():
                _, embed_vjp = jax.vjp(lambda r: entry(r, take_index(inputs, m)), rest)
                return embed_vjp(cast_like(dx, out0))[0]

            d_rest = lax.cond(field(row, "b_first") > 0, embedding,
                              lambda: jax.tree.map(jnp.zeros_like, rest))
            return d_chunk, dx, d_rest

        def idle():
            return (jax.tree.map(jnp.zeros_like, chunk0), fill_like(out0, fill),
                    jax.tree.map(jnp.zeros_like, rest))

        d_chunk, dx, d_rest = lax.cond(field(row, "b_on") > 0, active, idle)
        carry = dict(carry)
        if V > 1:
            carry["d_chunks"] = jax.tree.map(
                lambda acc, d: lax.dynamic_update_index_in_dim(
                    acc, lax.dynamic_index_in_dim(acc, v, 0, keepdims=False) + d, v, 0),
                carry["d_chunks"], d_chunk)
        else:
            carry["d_chunks"] = jax.tree.map(jnp.add, carry["d_chunks"], d_chunk)
        carry["d_rest"] = jax.tree.map(jnp.add, carry["d_rest"], d_rest)
        return dx, carry

    def segment(has_f, send_f, has_b, send_b):
        def tick(carry, rows):
            row = rows[stage]
            if has_f:
                out, carry = forward_slot(row, carry)
                if send_f:  # the activation exchange: one collective-permute of [b, ...]
                    received = comm.ppermute(out, STAGE_AXIS, perm_f)
                    carry["act"] = put_slot(carry["act"], field(row, "f_recv"), received)
            if has_b:
                dx, carry = backward_slot(row, carry)
                if send_b:  # the cotangent exchange: one collective-permute of [b, ...]
                    received = comm.ppermute(cast_like(dx, out0), STAGE_AXIS, perm_b)
                    carry["cot"] = put_slot(carry["cot"], field(row, "b_recv"), received)
            return carry, None
        return tick

    for start, stop, *flags in plan_.segments:
        carry, _ = lax.scan(segment(*flags), carry, table[start:stop])
    if not train:
        return carry["loss"]
    d_stacked = carry["d_chunks"] if V == 1 else jax.tree.map(
        lambda d: d.reshape(d.shape[0] * d.shape[1], *d.shape[2:]), carry["d_chunks"])
    return carry["loss"], d_stacked, carry["d_rest"]


# --------------------------------------------------------------------------------------------------
# Interleaved stages: the storage order of the stacked units
# --------------------------------------------------------------------------------------------------


def unit_order(units: int, stages: int, virtual_stages: int) -> np.ndarray:
    """``order[g]``: the model unit stored at global position ``g`` of the stacked axis, so that a
    contiguous split over ``stages`` gives device ``s`` the chunks ``v P + s``, ``v < V``."""
    P_, V = stages, virtual_stages
    per_chunk = units // (P_ * V)
    g = np.arange(units)
    s, within = divmod(g, V * per_chunk)
    v, j = divmod(within, per_chunk)
    return (v * P_ + s) * per_chunk + j
