"""What each strategy's training step moves over ``model``: the collectives the designs' formulas
predict, per device, kind by kind. The HLO tests (``tests/models/test_transformer.py``) assert the
compiled step moves exactly these, the planner (:mod:`jphantom.planner`) and the analytic step model
(:mod:`jphantom.perf.step_model`) price them.

A strategy names its formulas in its registry row (:attr:`jphantom.registry.strategies.Strategy.collectives`,
one :class:`Collectives` object of this module): Megatron tensor parallelism (Shoeybi et al.) and
its sequence parallelism (Korthikanti et al.) for the GPT-2 transformer and Llama; phantom
parallelism for GPT-2 (Seal et al. Sec. 5); the FFN under ``tensor``, ``tensor-t1`` and
``phantom`` (Seal et al. Table II).
"""

from __future__ import annotations

from jphantom.errors import ConfigError
from jphantom.runtime.mesh import MeshConfig
from jphantom.registry.strategies import get


def collective_inventory(config, strategy: str, mesh, batch: int, *,
                         sequence_parallel: bool = False) -> dict[str, list[int]]:
    """Per-device result elements of each collective kind over ``model`` in one training step
    (``batch``: the per-data-rank batch; the data-parallel gradient reduction not included), from
    the formulas the strategy declares (:attr:`jphantom.registry.strategies.Strategy.collectives`): the
    GPT-2 transformer and Llama (``max_positions`` tokens per sequence) under ``tensor``
    (:data:`MEGATRON`), GPT-2 under ``phantom`` (:data:`PHANTOM`), the FFN under ``tensor``,
    ``tensor-t1`` (:data:`T1`) and ``phantom``. Strategies whose collectives are left to
    ``jax.jit`` or are Eqs. 5.1-5.5 (:mod:`jphantom.perf.axonn_model`) have none to list."""
    from jphantom.models.ffn import FFNConfig
    from jphantom.models.llama import LlamaConfig
    from jphantom.models.gpt2 import TransformerConfig

    row = get(strategy)
    mesh = MeshConfig.parse(mesh) if isinstance(mesh, str) else MeshConfig.of(mesh)
    p = mesh.size("model")
    formulas, counts = row.collectives, None
    if formulas is not None and isinstance(config, FFNConfig):
        counts = formulas.ffn(config, p, batch)
    elif formulas is not None and isinstance(config, (TransformerConfig, LlamaConfig)):
        counts = formulas.transformer(config, p, batch, sequence_parallel,
                                      llama=isinstance(config, LlamaConfig))
    if counts is None:
        raise ConfigError(f"strategy {row.name!r} has no hand-written collectives to list for "
                          f"{type(config).__name__}: inspect its compiled step instead "
                          "(jphantom inspect)")
    return counts


class Collectives:
    """One design's collectives over ``model`` per device and step, ``{kind: [elements of each
    execution]}``, for the FFN (``ffn``: width n, depth L, batch B) and the transformers
    (``transformer``: GPT-2, or Llama with ``llama``); ``None`` where the design has no formula
    for the model."""

    def ffn(self, config, p: int, b: int) -> dict[str, list[int]] | None:
        return None

    def transformer(self, config, p: int, batch: int, sequence_parallel: bool, *,
                    llama: bool) -> dict[str, list[int]] | None:
        return None


class MegatronCollectives(Collectives):
    """Megatron tensor parallelism (Shoeybi et al.) and its sequence parallelism (Korthikanti
    et al.); the FFN's column/row pairs with phantom's feature-split I/O."""

    def ffn(self, config, p, b):
        # gather the input (and its transpose, scatter's all-gather, when the depth is even);
        # per pair g forward, and f backward for every column layer but the first
        n, L = config.width, config.depth
        pairs, odd = divmod(L, 2)
        return {"all-gather": [b * n] * (1 + (0 if odd else 1)),
                "all-reduce": [b * n] * (pairs + pairs + odd - 1)}

    def transformer(self, config, p, batch, sequence_parallel, *, llama):
        L, h = config.layers, config.hidden
        s = config.max_positions if llama else config.seq_len
        tokens = batch * s
        if not sequence_parallel:
            # embedding all-reduce (fwd); per block g, g (fwd) and f, f (bwd); head f (bwd);
            # cross-entropy: max, sum of exponentials, target logit
            return {"all-reduce": [tokens * h] * (4 * L + 2) + [tokens] * 3}
        # each all-reduce of B*S*h becomes a reduce-scatter to B*S*h/p and an all-gather back;
        # the backward gathers each block's two column-layer inputs again from their kept
        # [B, S/p, h] shards (Korthikanti et al. Sec. 4.2.2, as Megatron does: remat.regathering;
        # JAX emits them at every L, but with L = 1 XLA:CPU inlines the one-trip layer loops and
        # drops the checkpoint's optimization barrier before its CSE, merging them into the
        # forward's gathers: 4L+2 compiled there, so the HLO tests use L >= 2);
        # plus the gradients of the sequence-parallel parameters (LayerNorms, row biases, wpe)
        # (Llama: the two RMSNorms of every block and the final one)
        sp_grads = [L * h] * 2 + [h] if llama else [L * h] * 6 + [h] * 2 + [s * h]
        return {"reduce-scatter": [tokens * h // p] * (4 * L + 2),
                "all-gather": [tokens * h] * (6 * L + 2),
                "all-reduce": [tokens] * 3 + sp_grads}


class T1Collectives(Collectives):
    """Seal et al.'s TP: row-sharded weights, all-gather forward, reduce-scatter backward."""

    def ffn(self, config, p, b):
        # per layer an all-gather of B n forward and a reduce-scatter to B n/p backward; the
        # first layer's reduce-scatter would only give dL/dx of the data: removed
        n, L = config.width, config.depth
        return {"all-gather": [b * n] * L, "reduce-scatter": [b * n // p] * (L - 1)}


class PhantomCollectives(Collectives):
    """Phantom parallelism (Seal et al. Table II; GPT-2: Sec. 5), fused or not: the same
    messages."""

    def ffn(self, config, p, b):
        # per layer: forward one all-gather of k B from each of p ranks (result p k B);
        # backward one reduce-scatter to k B at every layer, the first included (Gamma_1 feeds
        # dL/dC_1, Eq. 20)
        k, L = config.ghost_width, config.depth
        return {"all-gather": [p * k * b] * L, "reduce-scatter": [k * b] * L}

    def transformer(self, config, p, batch, sequence_parallel, *, llama):
        if llama:
            return None
        k, L, tokens = config.ghost_width, config.layers, batch * config.seq_len
        projections = 4 * L + 1
        return {"all-gather": [tokens * p * k] * projections,
                "reduce-scatter": [tokens * k] * projections,
                "all-reduce": [tokens] * (8 * L + 4 + 3)}


MEGATRON = MegatronCollectives()
"""``tensor``'s collectives (its registry row's
:attr:`~jphantom.registry.strategies.Strategy.collectives`)."""
T1 = T1Collectives()
"""``tensor-t1``'s collectives."""
PHANTOM = PhantomCollectives()
"""``phantom``'s and ``phantom-unfused``'s collectives."""
