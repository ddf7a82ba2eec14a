"""The key/value cache of generation: a model's attention cores, positions and stacked blocks
swapped for ones that write and read a preallocated cache, in two phases.

*Prefill* runs right-padded prompts [B, S] (each row's tokens at positions 0..len-1, pads
after them) through the model as training does: the same attention core, so the same fused
kernel where the training path picks one (``jax.nn.dot_product_attention``, cuDNN on NVIDIA GPUs
in 16-bit), causal, so a real token never sees the pads after it. Each core's keys and values
[B, S, Hk, d] are written into a cache of T = S + max_new_tokens slots.

*Decode* runs one token per row [B, 1] at each row's own position ``pos`` [B] (its prompt
length, then one more each step): RoPE's phases or the position table at ``pos``, the new key
and value written into slot ``pos`` of its row, and the query attending slots ``j <= pos``
(and ``pos - j < window`` on sliding-window layers; Gemma 3's local and global layers pick
theirs by layer index) through ``jax.nn.dot_product_attention`` with that mask. Slots past
``pos`` (a shorter prompt's pads, not yet written steps) are never attended.

The swap (:func:`with_cache`) works on a copy of any NNX model built from jphantom's
:class:`~jphantom.nn.attention.CausalAttention`, :class:`~jphantom.nn.attention.Positions` and
:class:`~jphantom.nn.Stacked` (the zoo, and a user's model built from them): the cores find the
cache of the layer being run in a trace-time :class:`Decoding` context, and a
:class:`CachedStack` scans the stacked cache [L, ...] beside the stacked parameters, so the
cache is a plain pytree that the decode loop carries. GQA caches the Hk key/value heads only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jphantom.errors import ConfigError
from jphantom.nn.attention import CausalAttention, Positions
from jphantom.nn.attention.core import causal_attention
from jphantom.nn.stack import Stacked, gather_stacked

_LOCAL = threading.local()


class Slot:
    """One level of the cache being consumed and produced in call order: the top level (each
    core or stack the model calls), or one layer of a :class:`CachedStack`'s scan."""

    def __init__(self, entries=None):
        self.entries, self.taken, self.out = entries, 0, []

    def next_in(self):
        if self.entries is None:
            return None
        entry = self.entries[self.taken]
        self.taken += 1
        return entry


@dataclasses.dataclass
class Decoding:
    """The trace-time state of one model call under :func:`decoding`: ``mode`` (``prefill`` or
    ``decode``), ``length`` T (cache slots), ``positions`` [B] (decode: each row's position)."""
    mode: str
    length: int
    positions: jax.Array | None
    slots: list

    @property
    def slot(self) -> Slot:
        return self.slots[-1]


def current() -> Decoding:
    state = getattr(_LOCAL, "state", None)
    if state is None:
        raise ConfigError("a cached attention core ran outside jphantom.generate: call the "
                          "original model (jphantom.generation.with_cache works on a copy)")
    return state


@contextlib.contextmanager
def decoding(mode: str, length: int, positions=None, cache=None):
    """Run a model swapped by :func:`with_cache` in ``mode`` with the cache ``cache`` (a tuple
    from the previous call, ``None`` in prefill); yields the :class:`Decoding` whose
    :func:`result` after the call is the new cache."""
    state = Decoding(mode, length, positions, [Slot(cache)])
    previous, _LOCAL.state = getattr(_LOCAL, "state", None), state
    try:
        yield state
    finally:
        _LOCAL.state = previous


def result(state: Decoding) -> tuple:
    """The cache written by the call under ``state``."""
    return tuple(state.slots[0].out)


def _write(cache, new, positions):
    """``new`` [B, 1, Hk, d] written into slot ``positions[b]`` of each row of ``cache``."""
    return jax.vmap(lambda c, x, p: lax.dynamic_update_slice_in_dim(c, x, p, axis=0))(
        cache, new.astype(cache.dtype), positions)


def decode_mask(positions, length: int, window):
    """[B, 1, 1, T]: slot j attended by the query at ``positions[b]``: j <= pos and, with a
    ``window`` (a traced or static count, ``None``: none), pos - j < window."""
    slots = jnp.arange(length)[None, :]
    pos = positions[:, None]
    mask = slots <= pos
    if window is not None:
        mask &= pos - slots < window
    return mask[:, None, None, :]


def decode_attention(q, k, v, mask):
    """One query per row, q [B, 1, Hq, d], over the cache k, v [B, T, Hk, d] under ``mask``:
    ``jax.nn.dot_product_attention`` (XLA's path; GQA without repeating heads), float16 written
    out with float32 scores (XLA:CPU refuses its pinned F16 algorithm, as in training)."""
    if jnp.dtype(q.dtype) != jnp.float16:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    b, _, hq, d = q.shape
    hk = k.shape[2]
    grouped = q.reshape(b, 1, hk, hq // hk, d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", grouped, k,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    weights = jax.nn.softmax(jnp.where(mask[:, :, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights.astype(v.dtype), v)
    return out.reshape(b, 1, hq, d)


class CachedAttention(nnx.Module):
    """A :class:`~jphantom.nn.attention.CausalAttention` that writes its keys and values into
    the cache in prefill and attends the cache in decode (the module docstring). ``full`` and
    ``local_window``: Gemma 3's traced per-layer choice (:func:`jphantom.nn.attention.packing.
    attend` hands them over instead of its ``lax.cond`` of two cores)."""

    selects_window = True
    takes_segments = False

    def __init__(self, core: CausalAttention):
        self.core = core
        self.window = core.window

    def __call__(self, q, k, v, *, full=None, local_window=None):
        state = current()
        if state.mode == "prefill":
            out = self._prefill(q, k, v, full, local_window)
            pad = ((0, 0), (0, state.length - k.shape[1]), (0, 0), (0, 0))
            state.slot.out.append((jnp.pad(k, pad), jnp.pad(v, pad)))
            return out
        cache_k, cache_v = state.slot.next_in()
        cache_k = _write(cache_k, k, state.positions)
        cache_v = _write(cache_v, v, state.positions)
        state.slot.out.append((cache_k, cache_v))
        window = self.window
        if full is not None:
            window = jnp.where(full, state.length + 1, local_window)
        mask = decode_mask(state.positions, state.length, window)
        return decode_attention(q, cache_k, cache_v, mask).astype(q.dtype)

    def _prefill(self, q, k, v, full, local_window):
        if full is None:
            return self.core(q, k, v)
        kernel, _ = self.core.kernel(q.dtype, q.shape[-1])
        return lax.cond(full, lambda *a: causal_attention(*a, implementation=kernel),
                        lambda *a: causal_attention(*a, window=local_window,
                                                    implementation=kernel), q, k, v)


class DecodePositions(nnx.Module):
    """The positions of the tokens a cached model runs: 0..S-1 in prefill (right padding), each
    row's ``pos + 0..S-1`` [B, S] in decode; ``length``: the cache's T (RoPE's table)."""

    def __call__(self, seq: int) -> jax.Array:
        state = current()
        if state.mode == "prefill":
            return jnp.arange(seq)
        return state.positions[:, None] + jnp.arange(seq)[None, :]

    def length(self, seq: int) -> int:
        return max(current().length, seq)


class CachedStack(Stacked):
    """A :class:`~jphantom.nn.Stacked` whose ``lax.scan`` also scans each layer's cache (stacked
    [L, ...]) in and out beside its parameters."""

    def __init__(self, stacked: Stacked):  # the blocks of ``stacked``, its options
        self.block, self.layers = stacked.block, stacked.layers
        self.with_index, self.peel_first = stacked.with_index, stacked.peel_first
        self.remat, self.fetch = "none", None

    def __call__(self, carry, *args):
        state = current()
        graphdef, params = gather_stacked(*nnx.split(self.block))
        entries = state.slot.next_in()
        indices = jnp.arange(jax.tree.leaves(params)[0].shape[0])

        def one(carry, xs):
            layer_params, layer_cache, index = xs
            block = nnx.merge(graphdef, layer_params)
            state.slots.append(Slot(layer_cache))
            try:
                carry = block(carry, index, *args) if self.with_index else block(carry, *args)
            finally:
                layer = state.slots.pop()
            return carry, tuple(layer.out)

        carry, caches = lax.scan(one, carry, (params, entries, indices))
        state.slot.out.append(caches)
        return carry


def _swapped(module):
    if type(module) is CausalAttention:
        return CachedAttention(module)
    if type(module) is Positions:
        return DecodePositions()
    if type(module) is Stacked:
        return CachedStack(module)
    return None


def cores_of(model: nnx.Module) -> list:
    """The attention cores of ``model``: jphantom's causal ones and any other attention core (a
    ring, a user's), the latter refused by :func:`with_cache`."""
    from jphantom.nn.attention import GatheredAttention, RingAttention
    return [m for _, m in nnx.iter_modules(model)
            if isinstance(m, (CausalAttention, RingAttention, GatheredAttention))]


def with_cache(model: nnx.Module) -> nnx.Module:
    """A copy of ``model`` (sharing its arrays) whose causal attention cores, positions and
    stacked blocks use the cache (module docstring); ``model`` itself is unchanged. A core other
    than :class:`~jphantom.nn.attention.CausalAttention` (context parallelism's) is refused."""
    for core in cores_of(model):
        if type(core) is not CausalAttention:
            raise ConfigError(f"generation with a {type(core).__name__} core (context "
                              "parallelism) is not implemented: decode one token at a time "
                              "needs no context axis; load the model without --mesh context=")
    copy = nnx.merge(*nnx.split(model))
    found = [(path, m) for path, m in nnx.iter_modules(copy) if _swapped(m) is not None]
    for path, module in sorted(found, key=lambda item: -len(item[0])):
        parent = copy
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        new = _swapped(module)
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, path[-1], new)
    return copy


def decode_bytes(model: nnx.Module, batch: int, length: int) -> dict:
    """The bytes one decode step reads at least, the HBM roofline's numerator: every parameter
    (``weights_bytes``) and the whole key/value cache of ``batch`` rows of ``length`` slots
    (``cache_bytes``, from the cache's shapes: nothing is run or allocated)."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    weights = sum(a.size * a.dtype.itemsize for a in params)
    cached = with_cache(model)
    graphdef, state = nnx.split(cached)

    def prefill(state):
        with decoding("prefill", length) as current_state:
            nnx.merge(graphdef, state)(jnp.zeros((batch, 1), jnp.int32))
        return result(current_state)

    shapes = jax.tree.leaves(jax.eval_shape(prefill, state))
    return {"weights_bytes": int(weights),
            "cache_bytes": int(sum(s.size * jnp.dtype(s.dtype).itemsize for s in shapes))}
