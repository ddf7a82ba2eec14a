"""Activation checkpointing per layer, with named ``jax.checkpoint`` policies.

Every stack of blocks (:class:`jphantom.nn.Stacked`) applies each block through
:func:`checkpointed` with its ``remat`` attribute, which the training step sets
(``make_train_step(..., remat=...)``, :func:`jphantom.nn.set_remat`). Models stay free of the
choice: the step says how, the layers say what (they name their collectives' outputs,
:func:`name_collective`).

Policies (their names :data:`NAMES`, which a run's configuration validates against without jax;
the ``jax.checkpoint`` policies ``POLICIES``, imported with jax on first use):

``none``
    keep every residual autodiff wants (no recompute).
``nothing_saveable``
    keep only each layer's input; the backward recomputes the layer's forward (Chen et al.'s
    sqrt-memory scheme per layer; the recompute repeats the layer's collectives).
``dots_saveable``
    keep the matmul outputs (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``),
    recompute the element-wise work.
``collectives_saveable``
    keep the outputs of the layer's collectives -- every tensor-parallel all-gather / all-reduce
    output is named ``"collective"`` (:func:`name_collective`) -- so a recompute never repeats a
    collective; everything else is recomputed.
``dots_collectives_saveable``
    both: the matmul outputs and the collectives' outputs (a row-parallel layer's all-reduced
    output too, which ``dots_saveable`` recomputes, repeating its all-reduce): what a layer
    scan on a CPU or GPU runs fastest with when memory allows (it stores far fewer bytes than
    ``none``, whose scan stacks every intermediate: ``benchmarks/peer_maxtext.py``).
``dots_attention_saveable``
    the matmul outputs and the attention core's output (named ``"attention"``,
    :func:`name_attention`): MaxText's ``minimal_flash`` (``dots_with_no_batch_dims`` and the
    name ``"context"``). The attention core's own batched matmuls (Q K^T, P V) have batch
    dimensions and are not kept: on XLA's path the backward recomputes the S x S scores from the
    kept q, k, v; a fused kernel's output, which ``dots_saveable`` recomputes by running the
    kernel again, is kept.
``qkv_saveable``
    only the attention core's inputs q, k and v (named ``"query"``, ``"key"``, ``"value"``,
    :func:`name_qkv`, after the projections and the rotary embedding): MaxText's
    ``save_qkv_proj`` (``save_only_these_names("query_proj", "value_proj", "key_proj",
    "qkv_proj")``); everything else, the MLP included, is recomputed.
``dots_but_mlp_in_saveable``
    every matmul of a block but the MLP's input projections: q, k and v (as ``qkv_saveable``),
    the attention's output projection (named ``"out_proj"``, :func:`name_out_proj`) and the
    MLP's output projection (named ``"mlpwo"``, :func:`name_mlp_out`). MaxText's
    ``save_dot_except_mlpwi`` (``save_only_these_names("query_proj", "value_proj", "key_proj",
    "qkv_proj", "out_proj", "mlpwo")``). The MLP's gate and up projections (MaxText's ``wi``),
    the attention core and the element-wise work are recomputed. A mixture of experts' layer
    names none of its GEMMs, so its experts are recomputed too.
``all_but_attention_core_saveable``
    Megatron-LM's selective recompute (Korthikanti et al. 2022, ``--recompute-granularity
    selective``): every residual of the layer is kept (as ``none``) but the attention core's,
    softmax(Q K^T) V, which the backward recomputes from its inputs q, k and v. A ``jax.checkpoint``
    policy cannot see inside ``jax.nn.dot_product_attention``, so this one is structural: the
    layer is not checkpointed, and each attention core (:class:`jphantom.nn.CausalAttention`,
    ``GatheredAttention``) runs its core under ``jax.checkpoint`` with nothing saved
    (:func:`recomputed`; :func:`jphantom.nn.set_remat` sets the cores' ``recompute``) where the
    core keeps an S x S array for its backward (XLA's path). A fused kernel (cuDNN's or Pallas'
    flash attention) and ring attention keep O(S) residuals already and run as under ``none``.
    Under ZeRO-3's per-layer fetch, where ``none`` keeps the matmul outputs and a fused attention
    kernel's (:func:`fetched_none`, :func:`checkpointed`), so does this policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from jphantom.errors import ConfigError

COLLECTIVE = "collective"
QKV = ("query", "key", "value")
ATTENTION = "attention"
OUT_PROJ, MLP_OUT = "out_proj", "mlpwo"  # MaxText's names for the two output projections
SELECTIVE = "all_but_attention_core_saveable"
BUT_MLP_IN = "dots_but_mlp_in_saveable"

NAMES = ("none", "nothing_saveable", "dots_saveable", "collectives_saveable",
         "dots_collectives_saveable", "dots_attention_saveable", "qkv_saveable", BUT_MLP_IN,
         SELECTIVE)
"""The policies by name (module docstring)."""

PEERS = {"dots_attention_saveable": "MaxText's minimal_flash",
         "qkv_saveable": "MaxText's save_qkv_proj",
         BUT_MLP_IN: "MaxText's save_dot_except_mlpwi",
         SELECTIVE: "Megatron-LM's selective recompute"}
"""The peers' name of each policy that equals one of theirs."""


@functools.cache
def policies() -> dict[str, Callable | None]:
    """The ``jax.checkpoint`` policy of each name of :data:`NAMES` (``None`` for ``none``), the
    same objects on every call (``POLICIES``)."""
    import jax

    saveable = jax.checkpoint_policies
    return {
        "none": None,
        "nothing_saveable": saveable.nothing_saveable,
        "dots_saveable": saveable.dots_with_no_batch_dims_saveable,
        "collectives_saveable": saveable.save_only_these_names(COLLECTIVE),
        "dots_collectives_saveable": saveable.save_from_both_policies(
            saveable.dots_with_no_batch_dims_saveable,
            saveable.save_only_these_names(COLLECTIVE)),
        "dots_attention_saveable": saveable.save_from_both_policies(
            saveable.dots_with_no_batch_dims_saveable,
            saveable.save_only_these_names(ATTENTION)),
        "qkv_saveable": saveable.save_only_these_names(*QKV),
        BUT_MLP_IN: saveable.save_only_these_names(*QKV, OUT_PROJ, MLP_OUT),
        SELECTIVE: None,  # the layer keeps everything; its attention cores recompute themselves
    }


def __getattr__(name):
    """``POLICIES`` (:func:`policies`) loads with jax on first use: importing the module, and
    checking a name, import none."""
    if name == "POLICIES":
        return policies()
    raise AttributeError(f"module 'jphantom.step.remat' has no attribute {name!r}")


def check(name: str) -> str:
    if name not in NAMES:
        raise ConfigError(f"remat={name!r}: use one of {', '.join(NAMES)}")
    return name


def with_cac(name: str | None, cac: bool) -> str:
    """The policy of ``--remat name --cac``: Singh's communication-aware checkpointing is
    checkpointing every layer while keeping the collectives' outputs, ``collectives_saveable``.
    ``name`` None: not given (``none`` without ``cac``); any other policy given with ``cac``,
    ``none`` too, contradicts it."""
    if name is None:
        return "collectives_saveable" if cac else "none"
    check(name)
    if not cac:
        return name
    if name != "collectives_saveable":
        raise ConfigError(f"cac keeps collective outputs (remat='collectives_saveable'); it "
                          f"contradicts remat={name!r}: give one of them")
    return "collectives_saveable"


FUSED_ATTENTION_FORWARD = "dot_product_attention_fwd"
"""The name of the primitive ``jax.nn.dot_product_attention(implementation="cudnn")``'s forward
binds (its FP8 and wrapper variants' names start with it): its outputs, the core's output and
the softmax statistics, are what its backward kernel reads."""


@functools.cache
def fetched_none() -> Callable:
    """The ``jax.checkpoint`` policy of ``none`` for a layer whose parameters ZeRO-3 gathered
    (:func:`checkpointed`): keep the matmul outputs (``dots_with_no_batch_dims_saveable``) and
    a fused attention kernel's outputs (:data:`FUSED_ATTENTION_FORWARD`), recompute the
    element-wise work and what derives from the parameters (a transposed weight, its FP8 copy).
    Under ``dots_saveable`` alone the backward ran cuDNN's forward kernel again for its softmax
    statistics: 0.46 s of Megatron-Bridge's 11.6 s FP8 step on 8 H100s (docs/predict.md). On
    XLA's attention (CPU) it is ``dots_saveable``."""
    import jax

    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def policy(prim, *args, **params):
        return prim.name.startswith(FUSED_ATTENTION_FORWARD) or dots(prim, *args, **params)
    return policy


def regathering(axis: str) -> Callable:
    """The ``jax.checkpoint`` policy of ``none`` for a layer under sequence parallelism over
    ``axis``: keep every residual but the sequence all-gathers' outputs, [B, S, h] whole on every
    rank, which the backward gathers again from the kept [B, S/p, h] (Korthikanti et al. 2022,
    Sec. 4.2.2: Megatron's column layers keep their sequence-parallel input and all-gather it
    again in the backward, under the input gradient's GEMM)."""
    def policy(prim, *_, **params):
        if prim.name == "all_gather":
            names = params["axis_name"]
            return axis not in (names if isinstance(names, tuple) else (names,))
        return not (prim.name == "name" and params.get("name") == COLLECTIVE)
    return policy


def checkpointed(fn: Callable, name: str, *, fetched: bool = False,
                 regather: str | None = None) -> Callable:
    """``fn`` (one layer) under ``jax.checkpoint`` with policy ``name``; ``fetched``: the layer's
    parameters are ZeRO-3's gathered ones (:meth:`jphantom.step.zero.LayerFetch.around`
    keeps every residual but them), so under ``none`` it keeps its matmul outputs and a fused
    attention kernel's (:func:`fetched_none`): keeping everything would keep values derived from
    the parameters, such as a transposed weight, whole. ``regather``: the layer all-gathers its sequence over this
    mesh axis (sequence parallelism), so under ``none`` it keeps the gathers' inputs, not their
    outputs (:func:`regathering`)."""
    import jax

    check(name)
    if fetched and name in ("none", SELECTIVE):
        return jax.checkpoint(fn, policy=fetched_none())
    if regather is not None and name in ("none", SELECTIVE):
        return jax.checkpoint(fn, policy=regathering(regather))
    return fn if policies()[name] is None else jax.checkpoint(fn, policy=policies()[name])


def recomputes_attention_core(name: str) -> bool:
    """Whether policy ``name`` has the attention cores recompute themselves in the backward
    (``all_but_attention_core_saveable``): what :func:`jphantom.nn.set_remat` sets on them."""
    return check(name) == SELECTIVE


def recomputed(core: Callable) -> Callable:
    """``core`` (an attention core's function of arrays, keyword arrays too) keeping nothing but
    its inputs: the backward runs its forward again (Megatron's selective recompute). A
    :func:`inputs_kept` ``custom_vjp``, not a nested ``jax.checkpoint``, whose policy the layer's
    own checkpoint (:func:`regathering` under sequence parallelism) would override, keeping the
    S x S probabilities after all."""

    def call(*args, **named):
        keys = tuple(named)
        positional = lambda *a: core(*a[:len(args)], **dict(zip(keys, a[len(args):])))
        return inputs_kept(positional)(*args, *named.values())

    return call


def inputs_kept(fn: Callable) -> Callable:
    """``fn`` (a function of arrays) whose backward keeps only its inputs and runs its forward
    again (a ``jax.custom_vjp``: unlike a nested ``jax.checkpoint``, an enclosing layer's
    checkpoint policy cannot make it keep its intermediates). For cheap element-wise work whose
    intermediates are wider or more numerous than its inputs: a norm's float32 arithmetic on a
    16-bit input, SwiGLU's silu."""
    import jax

    kept = jax.custom_vjp(fn)
    kept.defvjp(lambda *args: (fn(*args), args),
                lambda args, cotangent: jax.vjp(fn, *args)[1](cotangent))
    return kept


def _named(x, name: str):
    """``x`` marked ``name`` for the name-based policies (``jax.ad_checkpoint.checkpoint_name``,
    imported with jax on first use)."""
    from jax.ad_checkpoint import checkpoint_name

    return checkpoint_name(x, name)


def name_collective(x):
    """Mark a collective's output, so that ``collectives_saveable`` keeps it."""
    return _named(x, COLLECTIVE)


def name_qkv(q, k, v):
    """Mark the attention core's inputs, so that ``qkv_saveable`` keeps them."""
    return tuple(_named(a, n) for a, n in zip((q, k, v), QKV))


def name_out_proj(out):
    """Mark the attention's output projection, so that ``dots_but_mlp_in_saveable`` keeps it."""
    return _named(out, OUT_PROJ)


def name_mlp_out(out):
    """Mark the MLP's output projection, so that ``dots_but_mlp_in_saveable`` keeps it."""
    return _named(out, MLP_OUT)


def name_attention(out):
    """Mark the attention core's output, so that ``dots_attention_saveable`` keeps it."""
    return _named(out, ATTENTION)


def residuals(fn: Callable, params, x, policy: str) -> list:
    """What autodiff keeps between the forward and the backward of one call ``fn(params, x)``
    under ``policy``, as ``jax.ShapeDtypeStruct`` s: the leaves of ``jax.vjp``'s residuals other
    than the parameters and the input themselves (which live anyway). Abstract: nothing is
    computed. Inside a ``shard_map`` (collectives) call it per rank. Under
    ``all_but_attention_core_saveable`` the attention cores of ``fn`` recompute themselves only
    when their ``recompute`` is set (:func:`jphantom.nn.set_remat`)."""
    import jax

    check(policy)
    wrapped = fn if policies()[policy] is None else jax.checkpoint(fn, policy=policies()[policy])

    def probe(p, x):
        _, vjp_fn = jax.vjp(wrapped, p, x)
        inputs = jax.tree.leaves((p, x))
        return [leaf for leaf in jax.tree.leaves(vjp_fn) if not any(leaf is q for q in inputs)]

    return jax.eval_shape(probe, params, x)


def residual_bytes(fn: Callable, params, x, policy: str) -> int:
    """Bytes of :func:`residuals`: the prediction of what a policy saves per layer."""
    return sum(a.size * a.dtype.itemsize for a in residuals(fn, params, x, policy))
