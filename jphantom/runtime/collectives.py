"""PCCL's hierarchical all-gather and reduce-scatter over a (node, local) pair of mesh axes (Singh's thesis ch. 6).

Written per rank, for use inside the step's one ``jax.shard_map`` (like every layer in
:mod:`jphantom.nn`; nothing here opens a shard_map). The caller names two mesh axes: a
``node`` axis (outer, N ranks: the nodes) and a ``local`` axis (inner, M ranks: the GPUs of a node),
e.g. ``("data", "model")`` or ``("z", "x")``. Global rank r = node · M + local, the order of a flat
collective over ``(node_axis, local_axis)``.

- :func:`hierarchical_all_gather` equals ``lax.all_gather(x, (node, local), axis=axis, tiled=True)``:
  PCCL's Fig. 6.5 order, the inter-node phase first (**recursive doubling**, log2 N rounds of
  ``lax.ppermute`` with partner node XOR 2^s, the buffer doubling each round), then the intra-node
  all-gather (``lax.all_gather`` over ``local``: the vendor library's collective, RCCL's ring), then
  the local shuffle [local][node] -> [node][local]. Inter-node first is what makes each rank move only
  (N-1)/N · n/M bytes across nodes (digest 3.3).
- :func:`hierarchical_reduce_scatter` equals ``lax.psum_scatter(x, (node, local),
  scatter_dimension=axis, tiled=True)``: the reverse, the shuffle [node][local] -> [local][node]
  first, the intra-node reduce-scatter (``lax.psum_scatter`` over ``local``), then **recursive
  halving** across nodes (log2 N rounds, partner XOR 2^s, the buffer halving each round).
- :func:`choose` picks "flat" or "hierarchical" from an alpha-beta model (below); :func:`all_gather`
  and :func:`reduce_scatter` are the front-ends that use it (``method="auto"``).
- :func:`rounds` is the number of collective-permutes across nodes the hierarchical version issues.

Recursive doubling without selects. Slot j of the inter-node buffer holds node (me XOR j)'s block.
A round at distance h = 2^s appends the partner's h slots after this rank's h: the partner is
me XOR h and its slot j is node me XOR h XOR j = me XOR (h + j), exactly slot h + j here. After
log2 N rounds one gather with index me XOR j puts the blocks in node order. Recursive halving keeps
the node order instead: the buffer holds the 2h node blocks of an aligned window containing this
node; a round at distance h keeps the half holding this node (``dynamic_slice`` at bit s of the node
index), sends the other half to the partner, who holds the same window, and adds what it receives.
(The halving could run on XOR slots too, after one gather: on simulated CPU devices that was up to
1.7x slower at 4 MiB. For the doubling, ``dynamic_update_slice`` rounds into a node-ordered buffer
were not consistently faster than the concatenations and one gather: slower for N = 2, 4.)

Gradients. Both functions are linear and are left to JAX's autodiff, no ``custom_vjp``: the transpose
of a ``ppermute`` is the inverse ``ppermute``, of a concatenation the slices, of ``all_gather`` over
``local`` the ``psum_scatter``. So the backward of the hierarchical all-gather *is* a hierarchical
reduce-scatter (intra-node reduce-scatter, then log2 N halving rounds of the same sizes) and the
backward of the reduce-scatter is a hierarchical all-gather; no residuals are kept but the rank's
index. The reduce-scatter adds in another order than XLA's, so float results agree to rounding
(bitwise for exact sums). ``tests/strategies/test_hierarchical_collectives.py`` checks values and gradients
against the flat collectives and counts the permutes of forward + backward in HLO. Both work under
``check_vma=True`` (the outputs vary over both axes, as the flat collectives' do); the result is
named for communication-aware checkpointing (:func:`jphantom.step.remat.name_collective`).

Non-power-of-two node counts. Recursive doubling/halving needs N = 2^k (digest sec. 6 item 14: Bruck
or pairwise exchange would be needed otherwise, and PCCL describes neither). The explicit
``hierarchical_*`` functions raise :class:`~jphantom.errors.ConfigError` for such N; :func:`choose`
answers "flat" for them, so ``method="auto"`` falls back to the flat collective.

The model (Thakur-Gropp / Rabenseifner, digest 3.3; link sharing of Singh's thesis Eq. 5.7). n = bytes of
the full buffer per rank (the all-gather's output, the reduce-scatter's input; PCCL's convention),
p = N · M, alpha per message (μs), bandwidths in GB/s (1 GB/s moves 1000 bytes per μs):

    flat ring      T = (p-1) alpha + (p-1)/p · n / beta_ring
                   beta_ring = the ring's slowest link: min(beta_inter if N > 1, beta_intra if M > 1)
    hierarchical   T = (M-1) alpha + (M-1)/M · n / beta_intra                  intra-node ring
                     + log2(N) alpha + (N-1)/N · (n/M) / (beta_inter / M)      recursive doubling

beta_inter is the bandwidth between two nodes. The flat ring has one stream crossing each node
boundary and gets all of it; the hierarchical inter-node phase runs M exchanges at once (one per
local rank), which share it (Eq. 5.7: beta_inter / min(G_node, concurrent groups)), so its bandwidth
term is (N-1)/N · n / beta_inter. Reduce-scatter has the same terms; the reduction's gamma·(p-1)/p·n
is equal in both ((M-1)/M · n + (N-1)/N · n/M = (p-1)/p · n reduced), so it cancels from the choice.
Subtracting, for N, M > 1 and beta_intra <= beta_inter (so beta_ring = beta_intra):

    T_flat - T_hier = (M(N-1) - log2 N) alpha - (N-1)/N · n · (1/beta_inter - 1/(M beta_intra))

hierarchical saves latency, which grows with the nodes, and pays bandwidth when M beta_intra >
beta_inter: small messages over many nodes go hierarchical, large ones over few nodes go flat (the
crossover of PCCL's Figs. 6.6/6.9). Ties go to "flat" (the simpler program). The defaults
(:data:`ALPHA_US`, :data:`BETA_INTER`, :data:`BETA_INTRA`) are Frontier-like assumptions, not
measurements: 10 μs per message, a node's 4 NICs × 25 GB/s = 100 GB/s, one MI250X Infinity Fabric
link of 50 GB/s between GCDs. With them, 4 nodes of 8 GCDs go flat above ~39 MB (PCCL is 0.52x of
RCCL at 1 GB on 32 GCDs, digest 3.4) and 256 nodes of 8 go hierarchical below ~2.7 GB.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jphantom.step import remat
from jphantom.errors import ConfigError, check_int, check_real

KINDS = ("all-gather", "reduce-scatter")  # HLO names, as in jphantom.perf.comm_model
METHODS = ("auto", "flat", "hierarchical")

ALPHA_US = 10.0  # latency per message, μs (assumed, Frontier-like)
BETA_INTER = 100.0  # GB/s between two nodes: 4 NICs x 25 GB/s (digest sec. 6 item 7)
BETA_INTRA = 50.0  # GB/s between two GPUs of a node: one MI250X Infinity Fabric link

_BYTES_PER_US = 1e3  # 1 GB/s = 1e9 B/s = 1e3 B/μs


# --------------------------------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------------------------------


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check_kind(kind: Any) -> str:
    if kind not in KINDS:
        raise ConfigError(f"collective kind {kind!r} is not one of {KINDS}")
    return kind


def _check_power_of_two_nodes(nodes: int, node_axis: str = "node") -> None:
    if not _is_power_of_two(nodes):
        below = 1 << (nodes.bit_length() - 1)
        raise ConfigError(
            f"{node_axis}={nodes} ranks: recursive doubling/halving across nodes needs a power of "
            f"two (log2 rounds with partner rank XOR 2^s; Singh's thesis ch. 6). Use method='flat' or "
            f"method='auto' (which falls back to the flat collective), or {below} or {2 * below} nodes")


def _axis_sizes(node_axis: Any, local_axis: Any) -> tuple[int, int]:
    """(N, M): the sizes of the two named axes of the enclosing shard_map."""
    for name, value in (("node_axis", node_axis), ("local_axis", local_axis)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name}={value!r} must be a mesh axis name such as 'data' or 'model'")
    if node_axis == local_axis:
        raise ConfigError(f"node_axis and local_axis are both {node_axis!r}: name two different mesh "
                          "axes, the outer (nodes) and the inner (ranks of a node)")
    try:
        return int(lax.axis_size(node_axis)), int(lax.axis_size(local_axis))
    except NameError as error:
        raise ConfigError(
            f"mesh axes ({node_axis!r}, {local_axis!r}): {error}. Call this per rank inside a "
            "jax.shard_map over a mesh that has both axes") from None


def _check_axis(axis: Any, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ConfigError(f"axis={axis!r} is not an axis of a rank-{ndim} array: use 0..{ndim - 1}")
    return axis % ndim


# --------------------------------------------------------------------------------------------------
# The collectives, per rank.
# --------------------------------------------------------------------------------------------------


def _varying(x: jax.Array, axis_name: str) -> jax.Array:
    """x marked as varying over ``axis_name`` (``check_vma``), as a collective over it would leave it."""
    if axis_name in jax.typeof(x).manual_axis_type.varying:
        return x
    return lax.pcast(x, (axis_name,), to="varying")


def _xor_partners(nodes: int, distance: int) -> list[tuple[int, int]]:
    """ppermute pairs of one round: node i sends to node i XOR distance."""
    return [(i, i ^ distance) for i in range(nodes)]


def hierarchical_all_gather(x: jax.Array, node_axis: str, local_axis: str, *, axis: int = 0) -> jax.Array:
    """All-gather over (node_axis, local_axis), inter-node recursive doubling + intra-node gather.

    Per rank: x [..., a, ...] (a at ``axis``) -> [..., N·M·a, ...], rank (node, local)'s block at
    position node·M + local: equal to ``lax.all_gather(x, (node_axis, local_axis), axis=axis,
    tiled=True)``. Singh's thesis ch. 6, Fig. 6.5 (digest 3.2): log2 N ppermute rounds across nodes, then
    one all-gather inside the node, then the shuffle. N must be a power of two (ConfigError).
    """
    nodes, local = _axis_sizes(node_axis, local_axis)
    _check_power_of_two_nodes(nodes, node_axis)
    axis = _check_axis(axis, x.ndim)
    me = lax.axis_index(node_axis)

    buf = x[None]  # [1, *S]  slot j holds node (me XOR j)'s x
    distance = 1
    while distance < nodes:  # recursive doubling, round s at distance 2^s
        got = lax.ppermute(buf, node_axis, _xor_partners(nodes, distance))  # [2^s, *S] across nodes
        buf = jnp.concatenate([buf, got], axis=0)  # [2^(s+1), *S]
        distance *= 2
    if nodes > 1:  # slot order -> node order
        buf = jnp.take(buf, me ^ jnp.arange(nodes), axis=0, unique_indices=True, mode="clip")  # [N, *S]
    if local > 1:
        buf = lax.all_gather(buf, local_axis, axis=0)  # [M, N, *S]  in-node all-gather, (M-1)/M n in
    else:  # one rank per node: no in-node phase (XLA would keep a copy over singleton groups)
        buf = _varying(buf, local_axis)[None]  # [1, N, *S]
    buf = jnp.swapaxes(buf, 0, 1)  # [N, M, *S]  the shuffle: [local][node] -> [node][local]
    buf = jnp.moveaxis(buf, (0, 1), (axis, axis + 1))  # [*S[:axis], N, M, S[axis], ...]
    shape = (*x.shape[:axis], nodes * local * x.shape[axis], *x.shape[axis + 1:])
    return remat.name_collective(buf.reshape(shape))


def hierarchical_reduce_scatter(x: jax.Array, node_axis: str, local_axis: str, *,
                                axis: int = 0) -> jax.Array:
    """Reduce-scatter over (node_axis, local_axis), intra-node reduce-scatter + recursive halving.

    Per rank: x [..., N·M·c, ...] (at ``axis``) -> [..., c, ...], the sum over all ranks of block
    node·M + local: equal to ``lax.psum_scatter(x, (node_axis, local_axis), scatter_dimension=axis,
    tiled=True)``. Singh's thesis ch. 6 (digest 3.2: "the same in reverse order, intra-node first"): the
    input is shuffled to [local][node], reduce-scattered inside the node, then log2 N ppermute rounds
    of recursive halving across nodes. N must be a power of two and x.shape[axis] a multiple of
    N·M (ConfigError).
    """
    nodes, local = _axis_sizes(node_axis, local_axis)
    _check_power_of_two_nodes(nodes, node_axis)
    axis = _check_axis(axis, x.ndim)
    if x.shape[axis] % (nodes * local):
        raise ConfigError(
            f"reduce-scatter of shape {tuple(x.shape)} along axis {axis}: {x.shape[axis]} is not a "
            f"multiple of {node_axis} x {local_axis} = {nodes} x {local} = {nodes * local} ranks; pad "
            "it or pick another axis")
    me = lax.axis_index(node_axis)

    block = x.shape[axis] // (nodes * local)
    buf = x.reshape(*x.shape[:axis], nodes, local, block, *x.shape[axis + 1:])
    buf = jnp.moveaxis(buf, (axis + 1, axis), (0, 1))  # [M, N, *R]  the shuffle: [local][node]
    if local > 1:
        buf = lax.psum_scatter(buf, local_axis, scatter_dimension=0)  # [N, *R]  in-node reduce-scatter
    else:  # one rank per node: no in-node phase
        buf = _varying(buf[0], local_axis)  # [N, *R]
    half = nodes // 2
    while half >= 1:  # recursive halving, round s at distance 2^s = half, from the top bit down
        upper = (me // half) % 2  # buf holds 2·half node blocks; mine is in the upper half iff 1
        keep = lax.dynamic_slice_in_dim(buf, upper * half, half, axis=0)  # [half, *R]
        send = lax.dynamic_slice_in_dim(buf, (1 - upper) * half, half, axis=0)  # the partner's half
        buf = keep + lax.ppermute(send, node_axis, _xor_partners(nodes, half))  # [half, *R] across
        half //= 2
    return remat.name_collective(buf[0])  # [*S[:axis], c, *S[axis+1:]]


def flat_all_gather(x: jax.Array, node_axis: str, local_axis: str, *, axis: int = 0) -> jax.Array:
    """``lax.all_gather(x, (node_axis, local_axis), axis=axis, tiled=True)``, named for CAC."""
    _axis_sizes(node_axis, local_axis)
    axis = _check_axis(axis, x.ndim)
    return remat.name_collective(lax.all_gather(x, (node_axis, local_axis), axis=axis, tiled=True))


def flat_reduce_scatter(x: jax.Array, node_axis: str, local_axis: str, *, axis: int = 0) -> jax.Array:
    """``lax.psum_scatter(x, (node_axis, local_axis), scatter_dimension=axis, tiled=True)``."""
    nodes, local = _axis_sizes(node_axis, local_axis)
    axis = _check_axis(axis, x.ndim)
    if x.shape[axis] % (nodes * local):
        raise ConfigError(
            f"reduce-scatter of shape {tuple(x.shape)} along axis {axis}: {x.shape[axis]} is not a "
            f"multiple of {nodes * local} ranks ({node_axis} x {local_axis}); pad it or pick another axis")
    return remat.name_collective(
        lax.psum_scatter(x, (node_axis, local_axis), scatter_dimension=axis, tiled=True))


# --------------------------------------------------------------------------------------------------
# The alpha-beta model and the selector.
# --------------------------------------------------------------------------------------------------


def rounds(kind: str, nodes: int, local: int) -> int:
    """Collective-permute rounds across nodes that the hierarchical ``kind`` issues: log2(nodes)
    (recursive doubling for "all-gather", halving for "reduce-scatter"; ``local`` adds none, its
    phase is one all-gather / reduce-scatter). ConfigError unless nodes is a power of two."""
    _check_kind(kind)
    check_int("nodes", nodes, 1, "ranks on that level")
    check_int("local", local, 1, "ranks on that level")
    _check_power_of_two_nodes(nodes)
    return nodes.bit_length() - 1


def cost_us(kind: str, method: str, nbytes: float, nodes: int, local: int, *,
            alpha_us: float = ALPHA_US, beta_inter: float = BETA_INTER,
            beta_intra: float = BETA_INTRA) -> float:
    """The model's time in μs of ``kind`` by ``method`` ("flat" or "hierarchical") for a full
    buffer of ``nbytes`` per rank (all-gather output, reduce-scatter input) on nodes x local ranks;
    the formulas are in the module docstring. ConfigError for hierarchical on non-power-of-two
    nodes, where recursive doubling/halving is not defined."""
    _check_kind(kind)
    nodes, local = check_int("nodes", nodes, 1, "ranks on that level"), check_int("local", local, 1, "ranks on that level")
    n = check_real("nbytes", nbytes)
    alpha = check_real("alpha_us", alpha_us)
    inter = check_real("beta_inter", beta_inter, low_inclusive=False) * _BYTES_PER_US  # bytes per μs
    intra = check_real("beta_intra", beta_intra, low_inclusive=False) * _BYTES_PER_US
    p = nodes * local
    if method == "flat":
        links = [b for b, present in ((inter, nodes > 1), (intra, local > 1)) if present]
        ring = min(links) if links else inter  # the ring runs at its slowest link
        return (p - 1) * alpha + (p - 1) / p * n / ring
    if method == "hierarchical":
        _check_power_of_two_nodes(nodes)
        in_node = (local - 1) * alpha + (local - 1) / local * n / intra  # ring inside the node
        # Recursive doubling/halving on n/M, the M concurrent exchanges sharing beta_inter (Eq. 5.7).
        across = math.log2(nodes) * alpha + (nodes - 1) / nodes * (n / local) / (inter / local)
        return in_node + across
    raise ConfigError(f"method={method!r}: the model prices 'flat' or 'hierarchical'")


def choose(kind: str, nbytes: float, nodes: int, local: int, *, alpha_us: float = ALPHA_US,
           beta_inter: float = BETA_INTER, beta_intra: float = BETA_INTRA) -> str:
    """"flat" or "hierarchical": the cheaper by :func:`cost_us` (module docstring's formulas, ties
    to "flat"); "flat" whenever nodes is not a power of two (no recursive doubling there).

    ``nbytes`` is the full buffer per rank (all-gather output, reduce-scatter input), alpha_us the
    latency per message in μs, beta_inter / beta_intra bandwidths in GB/s between nodes / inside one.
    """
    model = dict(alpha_us=alpha_us, beta_inter=beta_inter, beta_intra=beta_intra)
    flat = cost_us(kind, "flat", nbytes, nodes, local, **model)  # validates every argument
    if not _is_power_of_two(nodes):
        return "flat"
    hierarchical = cost_us(kind, "hierarchical", nbytes, nodes, local, **model)
    return "hierarchical" if hierarchical < flat else "flat"


# --------------------------------------------------------------------------------------------------
# Front-ends.
# --------------------------------------------------------------------------------------------------


def _resolve(method: Any, kind: str, nbytes: int, nodes: int, local: int, model: dict) -> str:
    if method not in METHODS:
        raise ConfigError(f"method={method!r}: use one of {METHODS}")
    return choose(kind, nbytes, nodes, local, **model) if method == "auto" else method


def all_gather(x: jax.Array, node_axis: str, local_axis: str, axis: int = 0, method: str = "auto", *,
               alpha_us: float = ALPHA_US, beta_inter: float = BETA_INTER,
               beta_intra: float = BETA_INTRA) -> jax.Array:
    """Tiled all-gather over (node_axis, local_axis) along ``axis``, x [.., a, ..] -> [.., N·M·a, ..]:
    ``method="flat"`` (one ``lax.all_gather``), ``"hierarchical"`` (:func:`hierarchical_all_gather`)
    or ``"auto"``: :func:`choose` on the output's bytes per rank (decided at trace time)."""
    nodes, local = _axis_sizes(node_axis, local_axis)
    model = dict(alpha_us=alpha_us, beta_inter=beta_inter, beta_intra=beta_intra)
    nbytes = x.size * x.dtype.itemsize * nodes * local  # the gathered buffer, per rank
    if _resolve(method, "all-gather", nbytes, nodes, local, model) == "hierarchical":
        return hierarchical_all_gather(x, node_axis, local_axis, axis=axis)
    return flat_all_gather(x, node_axis, local_axis, axis=axis)


def reduce_scatter(x: jax.Array, node_axis: str, local_axis: str, axis: int = 0, method: str = "auto",
                   *, alpha_us: float = ALPHA_US, beta_inter: float = BETA_INTER,
                   beta_intra: float = BETA_INTRA) -> jax.Array:
    """Tiled reduce-scatter (sum) over (node_axis, local_axis) along ``axis``, x [.., N·M·c, ..] ->
    [.., c, ..]: ``method="flat"`` (one ``lax.psum_scatter``), ``"hierarchical"``
    (:func:`hierarchical_reduce_scatter`) or ``"auto"``: :func:`choose` on the input's bytes per rank."""
    nodes, local = _axis_sizes(node_axis, local_axis)
    model = dict(alpha_us=alpha_us, beta_inter=beta_inter, beta_intra=beta_intra)
    nbytes = x.size * x.dtype.itemsize  # the buffer to reduce, per rank
    if _resolve(method, "reduce-scatter", nbytes, nodes, local, model) == "hierarchical":
        return hierarchical_reduce_scatter(x, node_axis, local_axis, axis=axis)
    return flat_reduce_scatter(x, node_axis, local_axis, axis=axis)
