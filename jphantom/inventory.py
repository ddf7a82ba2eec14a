"""What each strategy's training step moves over ``model``: the collectives the designs' formulas
predict, per device, kind by kind. The HLO tests (``tests/models/test_transformer.py``) assert the
compiled step moves exactly these, the planner (:mod:`jphantom.planner`) and the analytic step model
(:mod:`jphantom.perf.step_model`) price them.

Formulas: Megatron tensor parallelism (Shoeybi et al.) and its sequence parallelism (Korthikanti
et al.) for the GPT-2 transformer and Llama; phantom parallelism for GPT-2 (Seal et al. Sec. 5);
the FFN under ``tensor``, ``tensor-t1`` and ``phantom`` (Seal et al. Table II).
"""

from __future__ import annotations

from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig
from jphantom.strategies import STRATEGIES, get


def collective_inventory(config, strategy: str, mesh, batch: int, *,
                         sequence_parallel: bool = False) -> dict[str, list[int]]:
    """Per-device result elements of each collective kind over ``model`` in one training step
    (``batch``: the per-data-rank batch; the data-parallel gradient reduction not included), from
    the designs' formulas: the GPT-2 transformer and Llama (``max_positions`` tokens per
    sequence) under ``tensor`` (Megatron, Shoeybi et al., Korthikanti et al.), GPT-2 under
    ``phantom`` (Seal et al. Sec. 5), the FFN under ``tensor``, ``tensor-t1`` and ``phantom``
    (Seal et al. Table II). Strategies whose collectives are left to ``jax.jit`` or are
    Eqs. 5.1-5.5 (:mod:`jphantom.perf.axonn_model`) have none to list."""
    from jphantom.models.ffn import FFNConfig
    from jphantom.models.llama import LlamaConfig
    from jphantom.models.gpt2 import TransformerConfig

    name = get(strategy).name
    mesh = MeshConfig.parse(mesh) if isinstance(mesh, str) else MeshConfig.of(mesh)
    p = mesh.size("model")
    if isinstance(config, FFNConfig):
        n, L, b = config.width, config.depth, batch
        if name == "tensor-t1":
            # T1: per layer an all-gather of B n forward and a reduce-scatter to B n/p backward;
            # the first layer's reduce-scatter would only give dL/dx of the data: removed
            return {"all-gather": [b * n] * L, "reduce-scatter": [b * n // p] * (L - 1)}
        if name == "tensor":
            # Megatron pairs with phantom's feature-split I/O: gather the input (and its
            # transpose, scatter's all-gather, when the depth is even); per pair g forward, and
            # f backward for every column layer but the first
            pairs, odd = divmod(L, 2)
            return {"all-gather": [b * n] * (1 + (0 if odd else 1)),
                    "all-reduce": [b * n] * (pairs + pairs + odd - 1)}
        if STRATEGIES[name].family == "phantom":
            # Seal et al. Table II per layer: forward one all-gather of k B from each of p ranks
            # (result p k B); backward one reduce-scatter to k B at every layer, the first
            # included (Gamma_1 feeds dL/dC_1, Eq. 20)
            k = config.ghost_width
            return {"all-gather": [p * k * b] * L, "reduce-scatter": [k * b] * L}
    elif isinstance(config, (TransformerConfig, LlamaConfig)):
        llama = isinstance(config, LlamaConfig)
        L, h = config.layers, config.hidden
        s = config.max_positions if llama else config.seq_len
        tokens = batch * s
        if name == "tensor" and not sequence_parallel:
            # embedding all-reduce (fwd); per block g, g (fwd) and f, f (bwd); head f (bwd);
            # cross-entropy: max, sum of exponentials, target logit
            return {"all-reduce": [tokens * h] * (4 * L + 2) + [tokens] * 3}
        if name == "tensor":
            # each all-reduce of B*S*h becomes a reduce-scatter to B*S*h/p and an all-gather
            # back; plus the gradients of the sequence-parallel parameters (LayerNorms, row
            # biases, wpe)
            # (Llama: the two RMSNorms of every block and the final one)
            sp_grads = [L * h] * 2 + [h] if llama else [L * h] * 6 + [h] * 2 + [s * h]
            return {"reduce-scatter": [tokens * h // p] * (4 * L + 2),
                    "all-gather": [tokens * h] * (4 * L + 2),
                    "all-reduce": [tokens] * 3 + sp_grads}
        if STRATEGIES[name].family == "phantom" and not llama:
            k = config.ghost_width
            projections = 4 * L + 1
            return {"all-gather": [tokens * p * k] * projections,
                    "reduce-scatter": [tokens * k] * projections,
                    "all-reduce": [tokens] * (8 * L + 4 + 3)}
    raise ConfigError(f"strategy {name!r} has no hand-written collectives to list for "
                      f"{type(config).__name__}: inspect its compiled step instead "
                      "(jphantom inspect)")
