"""GPT-2's shape: :class:`TransformerConfig`, one validated dataclass of the dense model and
its optional mixture-of-experts blocks, with its parameter and FLOP counts.

Architecture (Radford et al. 2019, as Hugging Face's ``GPT2LMHeadModel``): token and learned
position embeddings; ``layers`` pre-LayerNorm blocks of causal multi-head attention and a GELU-tanh
MLP of width 4h, each with a residual connection; a final LayerNorm; an LM head tied to the token
embedding (``tied_head=False``: an untied ``head``, as the phantom-parallel GPT-2 has). No dropout.

Mixture of experts (``moe_every=n``): every n-th block (blocks n-1, 2n-1, ...) replaces its MLP by
a top-k MoE of ``experts`` GELU FFNs of width 4h (:class:`jphantom.nn.moe.SwitchMoE`). The
loss adds ``balance_weight`` x the load-balancing loss and ``z_weight`` x the router z-loss of
every MoE block (Switch Transformer's 0.01, ST-MoE's 0.001).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from jphantom.errors import ConfigError, check_int
from jphantom.registry.dtypes import DTYPES, check_dtype, check_float64  # noqa: F401

if TYPE_CHECKING:
    from jphantom.nn.routing import MoEConfig

LAYER_NORM_EPS = 1e-5


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A GPT-2 shape. ``seq_len`` is the number of positions (``n_positions``). ``ghost_width`` is
    k of every phantom projection (phantom strategies only)."""

    vocab_size: int = 256
    seq_len: int = 128
    hidden: int = 256
    heads: int = 4
    layers: int = 4
    ghost_width: int | None = None
    dtype: str = "float32"
    layer_norm_eps: float = LAYER_NORM_EPS
    tied_head: bool = True
    moe_every: int = 0  # 0: no mixture of experts; n: every n-th block is an MoE block
    experts: int = 8
    top_k: int = 2
    capacity_factor: float | None = 1.25  # None: dropless
    balance_weight: float = 0.01
    z_weight: float = 0.001
    model_name = "transformer"

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "hidden", "heads", "layers"):
            check_int(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ConfigError(f"hidden={self.hidden} is not divisible by heads={self.heads}: each "
                              f"head has hidden/heads features; pick heads dividing {self.hidden}")
        k = self.ghost_width
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"ghost_width={k!r} must be an integer >= 1, e.g. 8")
        check_dtype(self.dtype)
        check_float64(self.dtype)
        if not (self.layer_norm_eps > 0 and math.isfinite(self.layer_norm_eps)):
            raise ConfigError(f"layer_norm_eps={self.layer_norm_eps} must be a positive number")
        every = self.moe_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(f"moe_every={every!r} must be an integer >= 0 (0: no MoE blocks; "
                              "n: every n-th block is one)")
        if every:
            if self.layers % every:
                raise ConfigError(f"layers={self.layers} is not divisible by moe_every={every}: "
                                  "every n-th block is an MoE block, so L must be a multiple of n")
            for name in ("balance_weight", "z_weight"):
                value = getattr(self, name)
                if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                    raise ConfigError(f"{name}={value!r} must be a number >= 0")
            self.moe  # validates experts, top_k and capacity_factor

    @property
    def moe(self) -> MoEConfig | None:
        """The MoE layer of the MoE blocks (None without them; :mod:`jphantom.nn.routing`, which
        imports jax, only for them)."""
        if not self.moe_every:
            return None
        from jphantom.nn.routing import MoEConfig

        return MoEConfig(self.hidden, self.experts, self.top_k, self.capacity_factor)

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every if self.moe_every else 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def param_count(self, active: bool = False) -> int:
        """Weights and biases of the dense-layout model (tied head counted once); ``active``:
        those one token uses (k of the E experts of an MoE block)."""
        h, v, s, L, Lm = self.hidden, self.vocab_size, self.seq_len, self.layers, self.moe_layers
        attention = 4 * h + (3 * h * h + 3 * h) + (h * h + h)
        mlp = (4 * h * h + 4 * h) + (4 * h * h + h)
        experts = self.top_k if active else self.experts
        blocks = L * attention + (L - Lm) * mlp + Lm * (h * self.experts + experts * mlp)
        return v * h + s * h + blocks + 2 * h + (0 if self.tied_head else h * v + v)

    def flops_per_token(self) -> int:
        """Forward + backward matmul FLOPs per token (6 x weights in matmuls + attention); an MoE
        block counts its router and the k experts a token visits (active parameters)."""
        h, L, s, v, Lm = self.hidden, self.layers, self.seq_len, self.vocab_size, self.moe_layers
        matmul_weights = L * 4 * h * h + (L - Lm) * 8 * h * h + Lm * (
            h * self.experts + self.top_k * 8 * h * h) + v * h
        return 6 * matmul_weights + 6 * L * s * h  # causal attention: QK^T and AV, half the square


def moe_fields(moe_every: int = 0, experts: int = 8, top_k: int = 2,
               capacity_factor: float = 1.25, dropless: bool = False) -> dict:
    """The :class:`TransformerConfig` MoE fields of the CLI's flags (``--dropless``: no capacity)."""
    return {"moe_every": moe_every, "experts": experts, "top_k": top_k,
            "capacity_factor": None if dropless else capacity_factor}
