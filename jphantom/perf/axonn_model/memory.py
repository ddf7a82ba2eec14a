"""The per-device memory model of the planner (modelled; Singh's thesis has none for Ch. 5):
bytes of state per parameter by :class:`PrecisionBytes`, checkpointed activations by Korthikanti et
al.'s per-layer count, the LM head's logits, and the 4D layout's total (:func:`pmm3d_memory`)."""

from __future__ import annotations

import dataclasses

from jphantom.errors import ConfigError
from jphantom.perf.axonn_model.equations import Grid
from jphantom.perf.axonn_model.shapes import GPTShape, gpt_layers


@dataclasses.dataclass(frozen=True)
class PrecisionBytes:
    """``element_bytes`` of messages and activations; ``state_bytes`` per parameter for
    parameters + gradients + Adam's two moments."""

    name: str
    element_bytes: int
    state_bytes: int
    source: str


PRECISIONS = {
    "bf16": PrecisionBytes("bf16", 2, 16, "bf16 weights and gradients + fp32 master weights and "
                           "Adam moments: 2 + 2 + 12 = 16 bytes per parameter (Cheng et al. §1.1; "
                           "jphantom's bf16 policy keeps fp32 weights and gradients: 4 + 4 + 8, "
                           "also 16)"),
    "float32": PrecisionBytes("float32", 4, 16,
                              "fp32 weights, gradients, Adam moments: 4 + 4 + 8"),
}


def precision_of(name: str | PrecisionBytes) -> PrecisionBytes:
    if isinstance(name, PrecisionBytes):
        return name
    try:
        return PRECISIONS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"precision={name!r}: use one of {list(PRECISIONS)}") from None


def checkpointed_activations(shape: GPTShape, tokens: float, *, stream_split: int,
                             inner_split: int, stored_layers: float, element_bytes: int,
                             flash_attention: bool = True) -> dict[str, float]:
    """Activation bytes per device under per-layer activation checkpointing (Singh's thesis §4.3: the
    Ch. 5 runs checkpoint activations), modelled with Korthikanti et al.'s per-layer count (seed
    003 digest: s b h (34 + 5 a s / h) bytes at 2-byte activations, of which 10 s b h are the
    LayerNorm/dropout/residual parts a tensor split replicates and 24 s b h + 5 a s^2 b the
    attention/MLP internals it splits):

    - ``checkpoints``: each of ``stored_layers`` layers keeps its input, ``tokens`` x h /
      ``stream_split`` elements (the residual stream as this layout shards it);
    - ``working``: one layer recomputed for its backward, tokens x h x (10 / stream_split + (24 +
      5 a S / h) / inner_split) x element_bytes / 2 bytes; ``flash_attention`` (default) drops the
      5 a S / h attention-score term (a fused attention kernel keeps no S x S scores).

    ``tokens``: the tokens this device holds in one forward (its data group's share of the
    micro-batch, divided by any token split)."""
    h = shape.hidden
    scores = 0.0 if flash_attention else 5 * shape.heads * shape.seq_len / h
    checkpoints = stored_layers * tokens * h / stream_split * element_bytes
    working = tokens * h * (10 / stream_split + (24 + scores) / inner_split) * element_bytes / 2
    return {"checkpoints": checkpoints, "working": working}


def llama_layer_activations(*, seq: int, batch: int, hidden: int, heads: int, kv_heads: int,
                            intermediate: int, head_dim: int | None = None, tensor: int = 1,
                            sequence_parallel: bool = False, context: int = 1,
                            element_bytes: int = 2, flash_attention: bool = True
                            ) -> dict[str, float]:
    """Activation bytes one Llama layer keeps for its backward, per device, counted the way
    Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models",
    Sec. 4.1 and Table 2) count s b h (34 + 5 a s / h) for GPT's layer: each tensor the backward
    reads, at ``element_bytes`` (16-bit activations), no recompute. Llama's layer (pre-RMSNorm,
    grouped-query attention with RoPE, SwiGLU, no dropout, no biases) with s = ``seq`` /
    ``context`` tokens of ``batch`` sequences on this rank, h hidden, a heads of d = ``head_dim``,
    K key/value heads, f = ``intermediate``, t = ``tensor`` ranks:

    - ``stream``: the two RMSNorms' inputs (the residual stream) and outputs (the q/k/v and the
      gate/up GEMMs' input), 4 x 2 s b h, / t under sequence parallelism (Megatron keeps the
      sequence-parallel GEMM input and all-gathers it again in the backward), else whole;
    - ``attention``: q (2 s b a d), k and v (2 x 2 s b K d; RoPE needs nothing, it is linear) and
      the core's output, also o_proj's input (2 s b a d), / t; a fused kernel's softmax
      statistics, float32 [b, a, s] (4 s b a / t); without one the probabilities, 2 a s^2 b / t
      (no dropout, so neither the mask nor the dropped copy: Korthikanti's 5 a s^2 b is 2 + 2 + 1);
    - ``mlp``: the gate's and up's outputs and down's input, 3 x 2 s b f / t (Megatron's fused
      SwiGLU keeps its input and recomputes silu; a fourth array, silu(gate), if kept);
    - ``norm_statistics``: the two norms' per-token 1 / rms, float32, 2 x 4 s b / t_sp.

    Llama-3-8B (h 4096, a 32, K 8, f 14336 = 3.5 h): 8 + 2 + 1 + 2 + 21 = 34 s b h / t under
    TP + SP, GPT's 34 to the byte (its 4 h GELU MLP and dropout cost what SwiGLU's 3.5 h does)."""
    d = head_dim or hidden // heads
    s, b, e = seq / context, batch, element_bytes
    split = tensor if sequence_parallel else 1
    terms = {
        "stream": 4 * e * s * b * hidden / split,
        "attention": e * s * b * (2 * heads * d + 2 * kv_heads * d) / tensor
        + (4 * s * b * heads if flash_attention else e * heads * s * seq * b) / tensor,
        "mlp": 3 * e * s * b * intermediate / tensor,
        "norm_statistics": 2 * 4 * s * b / split,
    }
    terms["total"] = sum(terms.values())
    return terms


def logits_bytes(tokens: float, vocab_split: int, shape: GPTShape) -> float:
    """The LM head's float32 logits of ``tokens`` tokens, vocabulary split ``vocab_split`` ways."""
    return tokens * shape.vocab_size / vocab_split * 4


def pmm3d_memory(grid: Grid, shape: GPTShape, batch: int, *,
                 precision: str | PrecisionBytes = "bf16", accumulate: int = 1,
                 flash_attention: bool = True, lm_head: bool = True) -> dict:
    """Bytes per device of the 4D layout (modelled; the paper has no memory model for Ch. 5):

    - ``state``: state_bytes (16 for bf16 + Adam) x (the matmul weights, Σ k n over the layers,
      with the tied embedding as the LM head, / (G_x G_y G_z): Ŵ is sharded over X, Y and Z and
      replicated over data) + state_bytes x the small parameters (biases, LayerNorms, positions:
      13 L h + 2 h + S h), counted replicated (an upper bound; < 2% of the state here);
    - ``checkpoints`` and ``working``: :func:`checkpointed_activations` with the residual stream
      [B S / (G_data G_z A), h / G_y] (§1.4) and the layer internals split over X;
    - ``transient``: one layer's gathered weight W (k n / (G_x G_y)) and its unreduced gradient, the
      largest layer's, at element_bytes;
    - ``logits``: float32 [B S / (G_data G_z A), V / G_x].
    """
    p = precision_of(precision)
    layers = gpt_layers(shape, 1, lm_head=lm_head)
    h, L, S = shape.hidden, shape.layers, shape.seq_len
    tables = shape.vocab_size * h * (1 if shape.tied_head else 2)  # embedding (+ untied head)
    matmul = L * shape.block_matmul_params + (tables if lm_head else 0)
    small = shape.param_count() - L * shape.block_matmul_params - tables
    tensor_group = grid.x * grid.y * grid.z
    tokens = batch * S / (grid.data * grid.z * accumulate)
    acts = checkpointed_activations(shape, tokens, stream_split=grid.y, inner_split=grid.x,
                                    stored_layers=L, element_bytes=p.element_bytes,
                                    flash_attention=flash_attention)
    biggest = max(layer.k * layer.n for layer in layers)
    memory = {
        "state": p.state_bytes * (matmul / tensor_group + small),
        **acts,
        "transient": 2 * biggest / (grid.x * grid.y) * p.element_bytes,
        "logits": logits_bytes(tokens, grid.x, shape) if lm_head else 0.0,
    }
    memory["total"] = sum(memory.values())
    return memory
