"""Causal attention cores and context parallelism: the sequence of every activation split over a
``context`` mesh axis.

A model computes q, k and v with its own projections and hands them to an *attention core*, a
parameterless NNX module; it asks a *positions* module for the global positions of the tokens it
holds (rotary phases, a position table). On one device, and under every strategy that keeps the
sequence whole, those are :class:`CausalAttention` and :class:`Positions`. Context parallelism
swaps them (plan style ``context``, :func:`jphantom.plans.context`) for

=========================  =====================================================================
:class:`RingAttention`     K/V chunks passed around the ring of ``context`` ranks with
                           ``lax.ppermute``, online-softmax (log-sum-exp) accumulation, fully
                           masked chunks skipped; the backward (``jax.custom_vjp``) passes K/V
                           around the ring again and carries dK/dV accumulators home, storing no
                           K/V of the forward's steps. The default.
:class:`GatheredAttention` K and V all-gathered over ``context`` (MaxText's default): simple, the
                           whole sequence's K/V and a [S/C, S] score block per rank; backward a
                           reduce-scatter of dK/dV (the gather's transpose).
:class:`ContextPositions`  the global positions of this rank's tokens.
=========================  =====================================================================

Everything else of the model (embeddings, norms, MLP, head, loss) runs on the rank's chunk as it
is: the loss is this rank's mean, which the training step averages over ``context`` as it does
over ``data``, and every parameter's gradient is summed over ``context``.

**Layouts.** S tokens on C ranks. *Contiguous*: rank r holds tokens [rS/C, (r+1)S/C); under a
causal mask rank C-1 does C times rank 0's attention work. *Balanced* (the default; Megatron-LM's
and MaxText's load-balanced causal layout): the sequence is cut into 2C chunks of c = S/(2C) and
rank r holds chunks r and 2C-1-r, so that every rank does the same work.
:func:`to_context_order` puts a batch in that order (the training step does it before placing
the batch; :func:`from_context_order` undoes it).

**Ring attention** (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers";
flash attention's online softmax, Dao et al. 2022; causal balancing as in Megatron-LM's context
parallelism). Step 0 attends the rank's own chunk under the causal mask; step s = 1..C-1 receives
the K/V chunk of rank j = r - s (mod C) from its left neighbour and merges

    lse = logaddexp(lse, lse_s),   o = o exp(lse_old - lse) + o_s exp(lse_s - lse)

Contiguous layout: j < r attends the whole chunk, j > r is fully masked and skipped. Balanced:
j < r attends both of r's chunks against j's first chunk (j's second chunk is later than both of
r's); j > r attends r's second chunk against both of j's (r's first chunk precedes them): 2c^2
query-key pairs either way, c^2 fewer than the diagonal step's 4c^2 less its masked half.
:func:`schedule` is the table of what each rank does at each step; :func:`attention_work` counts
its query-key pairs.

Bytes per layer and rank (B sequences, Hk key/value heads of dimension d, e bytes per element;
q has Hq = G Hk heads):

===============  ==============================================  ================================
algorithm        forward                                         backward
===============  ==============================================  ================================
ring             (C-1) K/V chunks: (C-1) 2 B (S/C) Hk d e        (C-1) K/V chunks again and
                 (collective-permutes)                           (C-1) dK/dV chunks (float32)
all-gather       all-gather of K and V: (C-1)/C 2 B S Hk d e      reduce-scatter of dK and dV,
                 received                                        the same bytes
===============  ==============================================  ================================

Memory: the ring holds one [B, Hq, S/C, S/C] score block at a time (1/C^2 of the unsplit
attention's), the all-gather one [B, Hq, S/C, S] block (1/C) and the whole sequence's K and V.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jphantom import comm
from jphantom.errors import ConfigError

ALGORITHMS = ("ring", "all-gather")
AXIS = "context"


# -- the unsplit core: which kernel runs it ---------------------------------------------------

IMPLEMENTATIONS = ("auto", "xla", "cudnn")
FUSED_DTYPES = ("bfloat16", "float16")


def platform_of(device) -> str:
    """``nvidia``, ``rocm``, ``cpu`` or ``tpu``: the platform of ``device`` (a device of the
    step's mesh: also the target devices of an ahead-of-time compile, which the process's default
    backend is not)."""
    platform = str(getattr(device, "platform", "cpu")).lower()
    kind = str(getattr(device, "device_kind", "")).lower()
    if platform in ("gpu", "cuda", "rocm"):
        if platform == "rocm" or "amd" in kind or "instinct" in kind:
            return "rocm"
        return "nvidia"
    return platform


# XLA flags under which XLA's cuDNN flash attention fails at run time: on an H200 with jax 0.11.2
# the step's first call raises ``IndexError: absl::container_internal::raw_hash_map<>::at``
# (benchmarks/results/gpu_resilience/deterministic_ops.json); XLA's attention path trains.
DETERMINISTIC_FLAGS = ("--xla_gpu_deterministic_ops=true", "--xla_gpu_deterministic_ops",
                       "--xla_gpu_exclude_nondeterministic_ops=true")


def fused_problem(platform: str, dtype, head_dim: int) -> str | None:
    """Why cuDNN's flash attention (``jax.nn.dot_product_attention(implementation="cudnn")``)
    cannot run these inputs, or ``None``: it runs on NVIDIA GPUs, in bfloat16 or float16, with a
    head dimension that is a multiple of 8 and at most 128, and not under XLA's deterministic-ops
    flags (:data:`DETERMINISTIC_FLAGS`: XLA's cuDNN attention fails at run time under them)."""
    if platform != "nvidia":
        return f"the {platform} platform has no cuDNN (it is NVIDIA's)"
    asked = set(os.environ.get("XLA_FLAGS", "").split()) & set(DETERMINISTIC_FLAGS)
    if asked:
        return (f"XLA_FLAGS has {sorted(asked)[0]}, under which XLA's cuDNN flash attention "
                "fails at run time (jax 0.11.2 on an H200)")
    name = jnp.dtype(dtype).name
    if name not in FUSED_DTYPES:
        return (f"{name} compute: cuDNN's flash attention takes bfloat16 or float16 "
                "(--precision bf16)")
    if head_dim % 8 or head_dim > 128:
        return (f"head dimension {head_dim}: cuDNN's flash attention needs a multiple of 8, "
                "at most 128")
    return None


def choose(implementation: str, platform: str, dtype, head_dim: int) -> tuple[str, str]:
    """The kernel (``xla`` or ``cudnn``) that runs attention for ``implementation`` (``auto``,
    ``xla``, ``cudnn``) and why. ``auto`` takes cuDNN wherever :func:`fused_problem` finds none,
    else XLA's path, and says why; ``cudnn`` where cuDNN cannot run is a :class:`ConfigError`."""
    check_implementation(implementation)
    if implementation == "xla":
        return "xla", "asked for (--attention xla)"
    problem = fused_problem(platform, dtype, head_dim)
    if implementation == "cudnn":
        if problem:
            raise ConfigError(f"attention='cudnn' cannot run here: {problem}; use --attention "
                              "auto (XLA's path where cuDNN cannot run) or xla")
        return "cudnn", "asked for (--attention cudnn)"
    if problem:
        return "xla", f"auto: {problem}"
    return "cudnn", f"auto: {jnp.dtype(dtype).name} on an NVIDIA GPU"


def check_implementation(name: str) -> str:
    if name not in IMPLEMENTATIONS:
        raise ConfigError(f"attention={name!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    return name


def _window_size(window: int | None):
    """``jax.nn.dot_product_attention``'s ``local_window_size`` of a causal sliding window of
    ``window`` tokens (a query attends itself and the window-1 before it)."""
    return None if window is None else (window - 1, 0)


def causal_attention(q, k, v, mask=None, *, window: int | None = None,
                     implementation: str = "xla") -> jax.Array:
    """Causal softmax attention, q [B, S, Hq, d], k and v [B, Sk, Hk, d] (Hq a multiple of Hk:
    each key/value head serves Hq/Hk query heads, never repeated) -> [B, S, Hq, d], through
    ``jax.nn.dot_product_attention``: ``implementation`` ``xla`` (XLA's path: scores
    [B, Hq, S, Sk] in float32, softmax in float32; exact, every platform) or ``cudnn`` (cuDNN's
    flash attention: memory linear in S). ``window``: a causal sliding window of that many tokens
    (Mistral's, Gemma's local layers). ``mask`` [S, Sk] (True: attend; XLA's path) replaces the
    causal mask of S = Sk positions 0..S-1."""
    local = _window_size(window)
    if implementation == "xla" and jnp.dtype(q.dtype) == jnp.float16:
        return _float16_attention(q, k, v, mask, window)
    if mask is not None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None],
                                            local_window_size=local, implementation="xla")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                        implementation=implementation)


def _float16_attention(q, k, v, mask, window):
    """XLA's path for float16 inputs, written out: ``jax.nn.dot_product_attention`` pins the
    F16_F16_F32 dot algorithm there, which XLA:CPU refuses at compile time. The same arithmetic:
    scores in float32, softmax in float32, GQA by grouping the query heads."""
    b, s, hq, d = q.shape
    hk = k.shape[2]
    grouped = q.reshape(b, s, hk, hq // hk, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, k,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    if mask is None:
        pos = jnp.arange(s)
        mask = pos[:, None] >= jnp.arange(k.shape[1])[None, :]
        if window is not None:
            mask &= pos[:, None] - jnp.arange(k.shape[1])[None, :] < window
    weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(v.dtype), v)
    return out.reshape(b, s, hq, d)


class Positions(nnx.Module):
    """The positions 0..S-1 of a whole sequence of S tokens (``length(S)``: S)."""

    def __call__(self, seq: int) -> jax.Array:
        return jnp.arange(seq)

    def length(self, seq: int) -> int:
        return seq


class CausalAttention(nnx.Module):
    """The attention core of a whole sequence: :func:`causal_attention` with the kernel
    :func:`choose` picks for ``implementation`` (``auto``: cuDNN's flash attention on NVIDIA GPUs
    in bf16/fp16, XLA's path elsewhere) on ``platform`` (set by the training step from its mesh's
    devices, :func:`configure`; ``None``: the process's default backend). ``window``: a causal
    sliding window of that many tokens."""

    def __init__(self, *, window: int | None = None, implementation: str = "auto"):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ConfigError(f"window={window!r} must be a whole number of tokens >= 1")
        self.window, self.implementation = window, check_implementation(implementation)
        self.platform = None

    def kernel(self, dtype, head_dim: int) -> tuple[str, str]:
        """The kernel this core runs for ``dtype`` inputs of ``head_dim`` and why
        (:func:`choose`)."""
        platform = self.platform or platform_of(jax.devices()[0])
        return choose(self.implementation, platform, dtype, head_dim)

    def __call__(self, q, k, v) -> jax.Array:
        kernel, _ = self.kernel(q.dtype, q.shape[-1])
        return causal_attention(q, k, v, window=self.window, implementation=kernel)


def configure(model: nnx.Module, implementation: str | None, platform: str) -> nnx.Module:
    """``model`` with every attention core's ``implementation`` (unless ``None``: as built) and
    ``platform`` set: the training step calls it on each rank's model as it traces the step, so
    the kernel is chosen for the devices the step is compiled for."""
    if implementation is not None:
        check_implementation(implementation)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (CausalAttention, RingAttention)):
            if implementation is not None:
                module.implementation = implementation
            module.platform = platform
    return model


# -- layouts -----------------------------------------------------------------------------------


def _order(size: int, balanced: bool) -> list[int]:
    """The 2C (balanced) or C chunks of the natural sequence in the order the ranks hold them."""
    if not balanced:
        return list(range(size))
    return [i for r in range(size) for i in (r, 2 * size - 1 - r)]


def _index(length: int, size: int, balanced: bool) -> np.ndarray:
    parts = len(_order(size, balanced))
    if length % parts:
        raise ConfigError(f"a sequence of {length} tokens does not split into {parts} equal "
                          f"chunks for context={size}" + (" (load-balanced: 2 per rank)"
                                                          if balanced else ""))
    c = length // parts
    return np.concatenate([np.arange(i * c, (i + 1) * c) for i in _order(size, balanced)])


def to_context_order(x, size: int, *, axis: int = 1, balanced: bool = True):
    """``x`` (numpy or jax) with its sequence dimension ``axis`` in the balanced layout's order
    (rank r's chunks r and 2C-1-r contiguous, rank by rank); the identity when not ``balanced``
    or ``size`` is 1."""
    if size == 1 or not balanced:
        return x
    index = _index(x.shape[axis], size, balanced)
    return np.take(x, index, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, index, axis)


def from_context_order(x, size: int, *, axis: int = 1, balanced: bool = True):
    """The inverse of :func:`to_context_order`."""
    if size == 1 or not balanced:
        return x
    index = np.argsort(_index(x.shape[axis], size, balanced))
    return np.take(x, index, axis=axis) if isinstance(x, np.ndarray) else jnp.take(x, index, axis)


def layout_positions(rank, size: int, local: int, balanced: bool) -> jax.Array:
    """The global positions [local] of the tokens rank ``rank`` (traced or not) holds."""
    if size == 1:
        return jnp.arange(local)
    if balanced:
        c = local // 2
        return jnp.concatenate([rank * c + jnp.arange(c),
                                (2 * size - 1 - rank) * c + jnp.arange(c)])
    return rank * local + jnp.arange(local)


# -- the schedule ------------------------------------------------------------------------------

# what a rank does with the K/V chunk of rank j at a ring step (s >= 1)
FULL, SKIP = 0, 1  # contiguous layout: j < r attends the whole chunk, j > r nothing
EARLY, LATE = 0, 1  # balanced: j < r both q chunks x j's first chunk; j > r r's second x both


def schedule(size: int) -> np.ndarray:
    """[C, C]: at ring step s (row; row 0 is the diagonal step) rank r (column) attends the K/V
    of rank (r - s) mod C as kind 0 (``FULL`` / ``EARLY``: j < r) or 1 (``SKIP`` / ``LATE``:
    j > r); the same table serves both layouts, whose branches differ."""
    table = np.zeros((size, size), np.int32)
    for s in range(1, size):
        for r in range(size):
            table[s, r] = 0 if (r - s) % size < r else 1
    return table


def attention_work(size: int, balanced: bool, local: int) -> list[int]:
    """Query-key pairs each rank scores over the ring (the diagonal step's whole block included),
    for ``local`` tokens per rank: what :class:`RingAttention` computes, from :func:`schedule`."""
    table = schedule(size)
    c = local // 2
    work = []
    for r in range(size):
        pairs = local * local  # step 0: the own chunk(s), one block
        for s in range(1, size):
            kind = table[s, r]
            if balanced:
                pairs += 2 * c * c  # EARLY: 2c x c; LATE: c x 2c
            elif kind == FULL:
                pairs += local * local
        work.append(pairs)
    return work


# -- blocks ------------------------------------------------------------------------------------


def _vary_like(x, like):
    """``x`` varying over the mesh axes ``like`` varies over (a branch's constant output)."""
    axes = tuple(sorted(comm.varying_axes(like)))
    return comm.pcast(x, axes, to="varying") if axes else x


def _block(q, k, v, mask, scale):
    """Attention of q [B, Sq, Hk, G, d] over k, v [B, Sk, Hk, d] under ``mask`` [Sq, Sk] (None:
    all): the normalised output [B, Sq, Hk, G, d] and log-sum-exp [B, Sq, Hk, G], float32. Rows
    with every key masked give output 0 and log-sum-exp -inf."""
    s = jnp.einsum("bqhgd,bkhd->bqhgk", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        s = jnp.where(mask[None, :, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m[..., None])
    total = jnp.sum(p, axis=-1)
    lse = m + jnp.log(total)
    p = p / jnp.where(total > 0, total, 1.0)[..., None]
    o = jnp.einsum("bqhgk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, lse


def _block_grads(q, k, v, do, lse, delta, mask, scale):
    """dq, dk, dv of one block given the final log-sum-exp ``lse`` and ``delta`` = sum(do o)
    [B, Sq, Hk, G] (flash attention's backward), float32."""
    f32 = jnp.float32
    s = jnp.einsum("bqhgd,bkhd->bqhgk", q, k, preferred_element_type=f32) * scale
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask[None, :, None, None, :], p, 0.0)
    dv = jnp.einsum("bqhgk,bqhgd->bkhd", p, do, preferred_element_type=f32)
    dp = jnp.einsum("bqhgd,bkhd->bqhgk", do, v.astype(f32), preferred_element_type=f32)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bqhgk,bkhd->bqhgd", ds, k.astype(f32), preferred_element_type=f32) * scale
    dk = jnp.einsum("bqhgk,bqhgd->bkhd", ds, q.astype(f32), preferred_element_type=f32) * scale
    return dq, dk, dv


def _merge(o, lse, o_s, lse_s):
    new = jnp.logaddexp(lse, lse_s)  # lse is finite: every query attends itself at step 0
    return o * jnp.exp(lse - new)[..., None] + o_s * jnp.exp(lse_s - new)[..., None], new


def _ring_perm(size: int):
    return [(i, (i + 1) % size) for i in range(size)]


def _kernels(kernel: str, scale: float):
    """``(forward, backward)`` of one block for ``kernel`` (``xla``: the einsum blocks above;
    ``pallas`` / ``pallas-interpret``: :mod:`jphantom.nn.flash`'s Triton kernels, the latter
    through Pallas' interpreter on any platform, for tests): ``forward(q, k, v, causal) ->
    (o, lse)`` and ``backward(q, k, v, o, lse, delta, do, causal) -> (dq, dk, dv)`` given the
    final ``o``, ``lse`` and ``delta`` = sum(do o), float32. ``causal``: query i of the block
    attends keys 0..i (the diagonal step's mask in both layouts)."""
    if kernel == "xla":
        mask = lambda q, causal: (jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool)) if causal
                                  else None)
        return (lambda q, k, v, causal: _block(q, k, v, mask(q, causal), scale),
                lambda q, k, v, o, lse, delta, do, causal: _block_grads(
                    q, k, v, do, lse, delta, mask(q, causal), scale))
    from jphantom.nn import flash

    interpret = kernel == "pallas-interpret"
    return (lambda q, k, v, causal: flash.block(q, k, v, causal=causal, scale=scale,
                                                interpret=interpret),
            lambda q, k, v, o, lse, delta, do, causal: flash.block_grads(
                q, k, v, o, lse, do, causal=causal, scale=scale, interpret=interpret))


def _forward_branches(balanced, forward):
    if not balanced:
        def full(q, k, v):
            return forward(q, k, v, False)

        def skip(q, k, v):
            o = jnp.zeros(q.shape, jnp.float32)
            return _vary_like(o, q), _vary_like(jnp.full(q.shape[:-1], -jnp.inf, jnp.float32), q)
        return [full, skip]

    def early(q, k, v):
        c = k.shape[1] // 2
        return forward(q, k[:, :c], v[:, :c], False)

    def late(q, k, v):
        c = q.shape[1] // 2
        o, lse = forward(q[:, c:], k, v, False)
        zeros = _vary_like(jnp.zeros(o.shape, jnp.float32), o)
        none = _vary_like(jnp.full(lse.shape, -jnp.inf, lse.dtype), lse)
        return jnp.concatenate([zeros, o], 1), jnp.concatenate([none, lse], 1)
    return [early, late]


def _backward_branches(balanced, backward):
    if not balanced:
        def full(q, k, v, o, do, lse, delta):
            return backward(q, k, v, o, lse, delta, do, False)

        def skip(q, k, v, o, do, lse, delta):
            zq = _vary_like(jnp.zeros(q.shape, jnp.float32), q)
            zk = _vary_like(jnp.zeros(k.shape, jnp.float32), k)
            return zq, zk, _vary_like(jnp.zeros(v.shape, jnp.float32), v)
        return [full, skip]

    def early(q, k, v, o, do, lse, delta):
        c = k.shape[1] // 2
        dq, dk, dv = backward(q, k[:, :c], v[:, :c], o, lse, delta, do, False)
        pad = lambda g: jnp.concatenate([g, _vary_like(jnp.zeros(g.shape, g.dtype), g)], 1)
        return dq, pad(dk), pad(dv)

    def late(q, k, v, o, do, lse, delta):
        c = q.shape[1] // 2
        dq, dk, dv = backward(q[:, c:], k, v, o[:, c:], lse[:, c:], delta[:, c:], do[:, c:],
                              False)
        dq = jnp.concatenate([_vary_like(jnp.zeros(dq.shape, dq.dtype), dq), dq], 1)
        return dq, dk, dv
    return [early, late]


# -- ring attention ----------------------------------------------------------------------------


def _ring_forward(q, k, v, size, balanced, kernel):
    """q [B, S/C, Hk, G, d], k and v [B, S/C, Hk, d] -> output and log-sum-exp (float32)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    rank = comm.axis_index(AXIS)
    forward, _ = _kernels(kernel, scale)
    o, lse = forward(q, k, v, True)  # the diagonal step: the layout's causal mask
    table = jnp.asarray(schedule(size))
    branches = _forward_branches(balanced, forward)
    kv = (k, v)
    for s in range(1, size):
        kv = lax.ppermute(kv, AXIS, _ring_perm(size))
        o_s, lse_s = lax.switch(table[s, rank], branches, q, *kv)
        o, lse = _merge(o, lse, o_s, lse_s)
    return o, lse


def _ring(q, k, v, size, balanced, kernel):
    o, _ = _ring_forward(q, k, v, size, balanced, kernel)
    return o.astype(q.dtype)


def _ring_fwd(q, k, v, size, balanced, kernel):
    o, lse = _ring_forward(q, k, v, size, balanced, kernel)
    out = o.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _ring_bwd(size, balanced, kernel, residuals, do):
    q, k, v, o, lse = residuals
    scale = 1.0 / math.sqrt(q.shape[-1])
    rank = comm.axis_index(AXIS)
    _, backward = _kernels(kernel, scale)
    do32, o32 = do.astype(jnp.float32), o.astype(jnp.float32)
    delta = jnp.sum(do32 * o32, axis=-1)
    dq, dk, dv = backward(q, k, v, o32, lse, delta, do32, True)
    table = jnp.asarray(schedule(size))
    branches = _backward_branches(balanced, backward)
    perm = _ring_perm(size)
    kv, carried = (k, v), None
    for s in range(1, size):
        kv = lax.ppermute(kv, AXIS, perm)
        dq_s, dk_s, dv_s = lax.switch(table[s, rank], branches, q, *kv, o32, do32, lse, delta)
        dq = dq + dq_s
        if carried is None:  # the accumulator of rank r-1's chunk starts here
            carried = (dk_s, dv_s)
        else:  # rank r-1 carried it one step: add this rank's part
            carried = lax.ppermute(carried, AXIS, perm)
            carried = (carried[0] + dk_s, carried[1] + dv_s)
    if carried is not None:  # after step C-1 it holds rank r+1's chunk: one step home
        carried = lax.ppermute(carried, AXIS, perm)
        dk, dv = dk + carried[0], dv + carried[1]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring_attention = jax.custom_vjp(_ring, nondiff_argnums=(3, 4, 5))
_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def _grouped(q, k):
    b, s, hq, d = q.shape
    hk = k.shape[2]
    if hq % hk:
        raise ConfigError(f"{hq} query heads do not share {hk} key/value heads evenly")
    return q.reshape(b, s, hk, hq // hk, d)


def ring_attention(q, k, v, *, size: int, balanced: bool = True,
                   kernel: str = "xla") -> jax.Array:
    """Causal attention of this rank's chunk of a sequence split over ``context`` (``size``
    ranks), q [B, S/C, Hq, d], k and v [B, S/C, Hk, d] -> [B, S/C, Hq, d]; inside ``shard_map``.
    ``kernel``: the blocks' (``xla``, ``pallas``; :func:`_kernels`)."""
    out = _ring_attention(_grouped(q, k), k, v, size, balanced, kernel)
    return out.reshape(q.shape)


def gathered_attention(q, k, v, *, size: int, balanced: bool = True,
                       window: int | None = None) -> jax.Array:
    """Causal attention of this rank's chunk with K and V all-gathered over ``context`` (XLA's
    path: the mask of the layout's positions is not one cuDNN takes)."""
    local = q.shape[1]
    k_all = comm.all_gather(k, AXIS, axis=1, tiled=True)
    v_all = comm.all_gather(v, AXIS, axis=1, tiled=True)
    q_pos = layout_positions(comm.axis_index(AXIS), size, local, balanced)
    k_pos = jnp.concatenate([layout_positions(r, size, local, balanced) for r in range(size)])
    mask = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        mask &= q_pos[:, None] - k_pos[None, :] < window
    return causal_attention(q, k_all, v_all, mask)


# -- the context layers ------------------------------------------------------------------------


class ContextPositions(nnx.Module):
    """The global positions of the S/C tokens this rank holds on the ``context`` axis
    (``length``: the whole sequence's S)."""

    def __init__(self, *, size: int, balanced: bool = True):
        self.size, self.balanced = size, balanced

    def __call__(self, seq: int) -> jax.Array:
        return layout_positions(comm.axis_index(AXIS), self.size, seq, self.balanced)

    def length(self, seq: int) -> int:
        return seq * self.size

    def dense_equivalent(self) -> Positions:
        return Positions()


class RingAttention(nnx.Module):
    """Ring attention over ``context`` (module docstring): :func:`ring_attention`, its blocks on
    the kernel :meth:`kernel` picks; ``window`` (a sliding window) is refused by name: use
    :class:`GatheredAttention`."""

    algorithm = "ring"

    def __init__(self, *, size: int, balanced: bool = True, window: int | None = None,
                 implementation: str = "auto"):
        self.size, self.balanced = size, balanced
        self.window, self.implementation = window, check_implementation(implementation)
        self.platform = None
        if window is not None and self.algorithm == "ring":
            raise ConfigError(f"a sliding window ({window} tokens) with ring attention: its "
                              "blocks skip by whole chunks, not windows; use "
                              "--context-attention all-gather")

    def kernel(self, dtype, head_dim: int) -> tuple[str, str]:
        """The kernel of the blocks and why (:func:`context_kernel`)."""
        platform = self.platform or platform_of(jax.devices()[0])
        return context_kernel(self.algorithm, self.implementation, platform, dtype, head_dim)

    def __call__(self, q, k, v) -> jax.Array:
        kernel, _ = self.kernel(q.dtype, q.shape[-1])
        return ring_attention(q, k, v, size=self.size, balanced=self.balanced, kernel=kernel)

    def dense_equivalent(self) -> CausalAttention:
        return CausalAttention(window=self.window, implementation=self.implementation)


class GatheredAttention(RingAttention):
    """Attention over ``context`` with K/V all-gathered: :func:`gathered_attention`."""

    algorithm = "all-gather"

    def __call__(self, q, k, v) -> jax.Array:
        self.kernel(q.dtype, q.shape[-1])
        return gathered_attention(q, k, v, size=self.size, balanced=self.balanced,
                                  window=self.window)


def context_kernel(algorithm: str, implementation: str, platform: str, dtype,
                   head_dim: int) -> tuple[str, str]:
    """The kernel of context attention's blocks and why: where :func:`choose` picks cuDNN for
    the unsplit core, the ring's blocks run jax's Pallas Triton flash kernels
    (:mod:`jphantom.nn.flash`: cuDNN's statistics come back only in the compute dtype), else
    XLA's einsum blocks; the all-gather variant attends under its layout's position mask, on
    XLA's path."""
    kernel, why = choose(implementation, platform, dtype, head_dim)
    if kernel == "xla":
        return "xla", why
    if algorithm != "ring":
        return "xla", (f"{algorithm} context attention: the layout's position mask is not one "
                       "cuDNN takes")
    return "pallas", (f"{why}; ring blocks: jax's Pallas Triton flash attention (float32 "
                      "log-sum-exp to merge them)")


def kernels_of(model: nnx.Module, implementation: str | None, platform: str, dtype,
               head_dim: int) -> dict[str, str]:
    """``{attention core class: "kernel (why)"}`` of ``model``'s cores on ``platform`` in
    ``dtype`` (``implementation``: the step's choice, ``None``: each core's own): what ``train``
    prints and records, so that no fallback is silent."""
    out = {}
    for _, module in nnx.iter_modules(model):
        name = type(module).__name__
        if name in out or not isinstance(module, (CausalAttention, RingAttention)):
            continue
        chosen = implementation or module.implementation
        if isinstance(module, RingAttention):
            kernel, why = context_kernel(module.algorithm, chosen, platform, dtype, head_dim)
        else:
            kernel, why = choose(chosen, platform, dtype, head_dim)
        out[name] = f"{kernel} ({why})"
    return out


def context_of(model: nnx.Module) -> tuple[int, bool] | None:
    """``(C, balanced)`` of a model whose attention runs over ``context``, else ``None``."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, (RingAttention, ContextPositions)):
            return module.size, module.balanced
    return None


def check_algorithm(name: str) -> str:
    if name not in ALGORITHMS:
        raise ConfigError(f"context attention {name!r}: use one of {', '.join(ALGORITHMS)}")
    return name


__all__ = ["causal_attention", "Positions", "CausalAttention", "ContextPositions", "choose",
           "configure", "platform_of", "fused_problem", "IMPLEMENTATIONS", "context_kernel",
           "kernels_of",
           "RingAttention", "GatheredAttention", "ring_attention", "gathered_attention",
           "to_context_order", "from_context_order", "layout_positions", "schedule",
           "attention_work", "context_of", "ALGORITHMS"]
