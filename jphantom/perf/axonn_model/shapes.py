"""The GPT the planner prices, by its sizes alone (:class:`GPTShape`: GPT-2 or Llama blocks,
Singh's thesis Table 5.1's GPT-20B and GPT-40B), its parameter and FLOP counts (Narayanan et
al.'s), and its fully connected layers under Algorithm 3 (Singh's thesis §1.4: QKV normal,
attention output transposed, MLP up normal, MLP down transposed)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jphantom.errors import ConfigError
from jphantom.perf.axonn_model.equations import LayerShape
from jphantom.perf.axonn_model.units import check_count


@dataclasses.dataclass(frozen=True)
class BlockKind:
    """A decoder block's design as the planner counts it (:attr:`GPTShape.kind`, named by the
    shape's ``family`` in :data:`BLOCKS`): what differs between GPT-2's and Llama's blocks, read as
    attributes rather than by name.

    ``sized``: the MLP width ``intermediate`` and the key/value heads ``kv_heads`` are the shape's
    own (grouped-query attention; defaults jphantom's 8h/3 rounded up to 32, and ``heads``), else
    the MLP is 4h wide, every head has its own key/value and neither may be given; ``gates``: the
    MLP's input matrices (GELU's one, SwiGLU's gate and up); ``small``: one block's biases and norm
    weights, in h; ``final_norm``: the final norm's weights, in h; ``positions``: a learned position
    table (S h parameters); ``tied``: a tied head by default; ``phantom``: the planner prices Seal
    et al.'s phantom layouts for it (GPT-2 blocks only); ``split_biases``: the biases tensor
    parallelism splits, in h (GPT-2's QKV 3h and MLP-in 4h; Llama's blocks have none)."""

    name: str
    sized: bool
    gates: int
    small: int
    final_norm: int
    positions: bool
    tied: bool
    phantom: bool
    split_biases: int = 0

    def intermediate(self, hidden: int) -> int:
        """The MLP width of ``hidden`` features: GPT-2's 4 h, a sized block's default 8h/3
        rounded up to 32."""
        return -(-8 * hidden // 3 // 32) * 32 if self.sized else 4 * hidden


GPT2_BLOCKS = BlockKind("gpt2", sized=False, gates=1, small=13, final_norm=2, positions=True,
                        tied=True, phantom=True, split_biases=7)
"""GPT-2's block (:mod:`jphantom.models.gpt2`): fused QKV h -> 3h, MLP h -> 4h -> h with GELU,
biases and LayerNorms (13 h per block, 2 h final), learned positions, tied embedding and head."""
LLAMA_BLOCKS = BlockKind("llama", sized=True, gates=2, small=2, final_norm=1, positions=False,
                         tied=False, phantom=False)
"""Llama's block (:mod:`jphantom.models.llama`): grouped-query attention, SwiGLU, no biases,
RMSNorms (2 h per block, h final), rotary positions (no table), an untied head."""
BLOCKS = {kind.name: kind for kind in (GPT2_BLOCKS, LLAMA_BLOCKS)}
"""The block kinds the planner prices, by :attr:`GPTShape.family`."""
FAMILIES = tuple(BLOCKS)
"""The names :attr:`GPTShape.family` takes."""


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """A decoder-only transformer's sizes for the planner (no arrays): ``layers`` L, ``hidden`` h,
    ``heads`` a, ``seq_len`` S, ``vocab_size`` V, and its ``family``, which names the
    :class:`BlockKind` of its blocks (:attr:`kind`, :data:`BLOCKS`):

    - ``gpt2`` (default): GPT-2 blocks (:mod:`jphantom.models.gpt2`): fused QKV h -> 3h,
      attention output h -> h, MLP h -> 4h -> h with GELU, biases and LayerNorms (13 h small
      parameters per block), learned positions (S h), tied embedding and head;
    - ``llama`` (:mod:`jphantom.models.llama`): grouped-query attention with ``kv_heads`` key/value
      heads (QKV h -> h + 2 h kv_heads / a), SwiGLU MLP of width ``intermediate`` I (gate and up
      h -> 2I, down I -> h), no biases, RMSNorms (2 h per block), rotary positions (no table), an
      untied head. ``intermediate`` defaults to jphantom's 8h/3 rounded up to 32, ``kv_heads`` to
      ``heads``.

    Defaults: S = 2048 and V = 51,200 (GPT-2's 50,257 BPE tokens padded to a multiple of 2048 so it
    divides every power-of-two split); Singh's Table 5.1 gives neither, so both are assumed.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int = 2048
    vocab_size: int = 51200
    family: str = "gpt2"
    intermediate: int | None = None
    kv_heads: int | None = None
    tied: bool | None = None  # a tied head (default: GPT-2's tied, Llama's untied)
    model: str | None = None  # the zoo family of these sizes (default: family)

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "seq_len", "vocab_size"):
            check_count(field, getattr(self, field), 1)
        if self.family not in BLOCKS:
            raise ConfigError(f"family={self.family!r}: the planner prices {FAMILIES}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}: each "
                              f"head has hidden/heads features; pick heads dividing {self.hidden}")
        if self.tied is None:
            object.__setattr__(self, "tied", self.kind.tied)
        if self.model is None:
            object.__setattr__(self, "model", self.family)
        if not self.kind.sized:
            for field in ("intermediate", "kv_heads"):
                if getattr(self, field) is not None:
                    raise ConfigError(f"{field} applies to family='llama' (GPT-2's MLP is 4h "
                                      "wide and its attention has one key/value per head)")
            return
        if self.intermediate is None:
            object.__setattr__(self, "intermediate", self.kind.intermediate(self.hidden))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        check_count("intermediate", self.intermediate, 1)
        check_count("kv_heads", self.kv_heads, 1)
        if self.heads % self.kv_heads:
            raise ConfigError(f"heads={self.heads} is not divisible by kv_heads={self.kv_heads}: "
                              "each key/value head serves heads/kv_heads query heads")

    @property
    def kind(self) -> BlockKind:
        """The design of its blocks (:data:`BLOCKS` by ``family``)."""
        return BLOCKS[self.family]

    @property
    def key_value_heads(self) -> int:
        """Its key/value heads (GPT-2: one per head)."""
        return self.kv_heads if self.kind.sized else self.heads

    @classmethod
    def of(cls, model: Any, seq_len: int | None = None) -> GPTShape:
        """A GPTShape from itself, a :class:`jphantom.models.gpt2.TransformerConfig` or a
        :class:`jphantom.models.llama.LlamaConfig` (``seq_len`` overrides the model's)."""
        if isinstance(model, GPTShape):
            shape = model
        elif getattr(model, "model_name", None) in ("transformer", "llama"):
            if getattr(model, "moe_every", 0) or getattr(model, "experts", 0):
                raise ConfigError("the planner prices dense blocks; MoE blocks are not modelled: "
                                  "use a dense model")
            if model.model_name == "transformer":
                shape = cls(model.layers, model.hidden, model.heads, model.seq_len,
                            model.vocab_size)
            else:
                shape = cls(model.layers, model.hidden, model.heads,
                            seq_len or model.max_positions, model.vocab_size, "llama",
                            model.intermediate, model.kv_heads)
        else:
            raise ConfigError(f"model={model!r} must be a GPTShape, a TransformerConfig or a "
                              "LlamaConfig (the planner prices dense decoder-only transformers)")
        return shape if seq_len is None else dataclasses.replace(shape, seq_len=seq_len)

    def linears(self) -> tuple[tuple[str, int, int, bool], ...]:
        """One block's fully connected layers as (name, k, n, transposed): k inputs, n outputs,
        ``transposed`` for the second of each pair (Singh's thesis Alg. 3's layout)."""
        h, width = self.hidden, self.mlp_width
        kv = 2 * h * self.key_value_heads // self.heads
        return (("qkv", h, h + kv, False), ("attn_out", h, h, True),
                ("mlp_up", h, self.kind.gates * width, False), ("mlp_down", width, h, True))

    @property
    def mlp_width(self) -> int:
        return self.intermediate if self.kind.sized else self.kind.intermediate(self.hidden)

    @property
    def block_matmul_params(self) -> int:
        """Σ k n over one block's linears (GPT-2: 12 h^2)."""
        return sum(k * n for _, k, n, _ in self.linears())

    @property
    def block_small_params(self) -> int:
        """One block's biases and norm weights: GPT-2 13 h (4 biases over 9 h, 2 LayerNorms
        4 h), Llama 2 h (2 RMSNorms)."""
        return self.kind.small * self.hidden

    @property
    def block_params(self) -> int:
        return self.block_matmul_params + self.block_small_params

    @property
    def tied_head(self) -> bool:
        return self.tied

    def param_count(self) -> int:
        """Weights and biases: the embedding (and an untied head), a learned position table, L
        blocks and the final norm: GPT-2 (tied head, :meth:`TransformerConfig.param_count`)
        V h + S h + L (12 h^2 + 13 h) + 2 h; Llama (untied head) 2 V h + L (Σ k n + 2 h) + h.
        Only a sized block's untied head is counted (GPT-2's count is the tied model's)."""
        h, kind = self.hidden, self.kind
        head = kind.sized and not self.tied
        return ((1 + head) * self.vocab_size * h + kind.positions * self.seq_len * h
                + self.layers * self.block_params + kind.final_norm * h)

    def flops_per_step(self, batch: int, *, recompute: bool = True) -> int:
        """FLOPs of one step over ``batch`` sequences: Narayanan et al.'s count (Singh's thesis §4.3,
        [EXT]) F = 96 B S L h^2 (1 + S/(6h) + V/(16 L h)) = B S (r L (24 h^2 + 4 S h) + 6 h V)
        with r = 4 passes of each block under activation recompute (forward, recompute, 2 x
        backward), r = 3 without; 24 h^2 is 2 Σ k n of GPT-2's block (Llama: its own Σ k n).
        The attention term counts the full S x S square."""
        h, L, S, V = self.hidden, self.layers, self.seq_len, self.vocab_size
        r = 4 if recompute else 3
        return batch * S * (r * L * (2 * self.block_matmul_params + 4 * S * h) + 6 * h * V)



GPT_20B = GPTShape(layers=32, hidden=7168, heads=56)
"""Singh's thesis Table 5.1's GPT-20B (S = 2048 and V = 51,200 assumed)."""
GPT_40B = GPTShape(layers=38, hidden=9216, heads=72)
"""Singh's thesis Table 5.1's GPT-40B (S = 2048 and V = 51,200 assumed)."""


def gpt_layers(shape: GPTShape, tokens: int, *, lm_head: bool = False) -> tuple[LayerShape, ...]:
    """The fully connected layers of a GPT under Alg. 3 (Singh's thesis §1.4), m = ``tokens`` of one
    data group (batch x S / G_data): per block QKV (k = h, n = 3h, normal: heads over X), attention
    output (h, h, transposed), MLP up (h, 4h, normal), MLP down (4h, h, transposed); L blocks
    (:meth:`GPTShape.linears`: a Llama's GQA and SwiGLU widths).
    ``lm_head``: also the (tied) LM head h -> V as one normal layer (vocabulary over X)."""
    shape = GPTShape.of(shape)
    check_count("tokens", tokens, 1)
    h = shape.hidden
    block = tuple(LayerShape(tokens, k, n, transposed, name)
                  for name, k, n, transposed in shape.linears())
    head = (LayerShape(tokens, h, shape.vocab_size, False, "lm_head"),) if lm_head else ()
    return block * shape.layers + head
