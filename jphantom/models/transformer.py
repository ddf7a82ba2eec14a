"""The GPT-2 transformer, written against a strategy's layers: it holds no collective.

Architecture (Radford et al. 2019, as Hugging Face's ``GPT2LMHeadModel``): token and learned
position embeddings; ``layers`` pre-LayerNorm blocks of causal multi-head attention and a GELU-tanh
MLP of width 4h, each with a residual connection; a final LayerNorm; an LM head tied to the token
embedding (an untied ``head`` is allowed: the phantom transformer has one). No dropout.

Dense parameter layout (``y = x W + b``, Hugging Face's Conv1D convention), blocks stacked over L:

    wte [V, h]   wpe [S_max, h]   ln_f {scale, bias} [h]   (head {weight [h, V], bias [V]})
    blocks: ln1, ln2 {scale, bias} [L, h]
            qkv      {weight [L, h, 3, h], bias [L, 3, h]}    (q | k | v, heads contiguous in h)
            attn_out {weight [L, h, h],    bias [L, h]}
            mlp_up   {weight [L, h, 4h],   bias [L, 4h]}
            mlp_down {weight [L, 4h, h],   bias [L, h]}

Mixture of experts (``moe_every=n``, issue 10): every n-th block (blocks n-1, 2n-1, ...) replaces
its MLP by a top-k MoE of ``experts`` GELU FFNs of width 4h (:mod:`jphantom.sharding.expert`).
Those blocks are stacked apart, ``moe_blocks`` [L/n, ...] with ``moe`` {router [h, E], w_in
[E, h, 4h], b_in [E, 4h], w_out [E, 4h, h], b_out [E, h]}; ``blocks`` holds the L - L/n others.
The loss adds ``balance_weight`` x the load-balancing loss and ``z_weight`` x the router z-loss of
every MoE block (Switch Transformer's 0.01, ST-MoE's 0.001).

A strategy supplies a :class:`Layers` object whose methods run on one rank (inside the step's
``shard_map``) and own every collective: ``embed``, ``norm``, ``column`` (a linear map whose output
features may be split: the QKV and MLP-up projections), ``row`` (its partner that returns to the
residual layout: attention output, MLP down), ``moe`` (the MoE MLP) and the head's
``loss``/``logits``. The model below is the same for every strategy; attention runs on whatever
heads the rank holds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp
from jax import lax

from jphantom import remat
from jphantom.errors import ConfigError, check_int
from jphantom.sharding.expert import MoEConfig

DTYPES = ("float32", "bfloat16", "float16", "float64")
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
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {DTYPES}")
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ConfigError("dtype='float64' needs 64-bit mode: call "
                              "jax.config.update('jax_enable_x64', True) first, or use float32")
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
        """The MoE layer of the MoE blocks (None without them)."""
        if not self.moe_every:
            return None
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


def init_dense(key: jax.Array, config: TransformerConfig) -> dict:
    """GPT-2 initialisation: N(0, 0.02) weights, N(0, 0.02/sqrt(2L)) residual projections, zero
    biases, unit LayerNorm scales (an MoE block's experts as its MLP, the router N(0, 0.02))."""
    h, L, v, s = config.hidden, config.layers, config.vocab_size, config.seq_len
    dtype = jnp.dtype(config.dtype)
    # the first 8 keys as before MoE existed, the MoE blocks' after them
    keys = iter([*jax.random.split(key, 8), *jax.random.split(jax.random.fold_in(key, 1), 8)])
    normal = lambda shape, std: (jax.random.normal(next(keys), (math.prod(shape),), dtype)
                                 * std).reshape(shape)  # flat draw: fast with sharded outputs
    residual = 0.02 / math.sqrt(2 * L)
    norm = lambda *lead: {"scale": jnp.ones((*lead, h), dtype), "bias": jnp.zeros((*lead, h), dtype)}

    def attention_part(n):
        return {"ln1": norm(n),
                "qkv": {"weight": normal((n, h, 3, h), 0.02), "bias": jnp.zeros((n, 3, h), dtype)},
                "attn_out": {"weight": normal((n, h, h), residual),
                             "bias": jnp.zeros((n, h), dtype)},
                "ln2": norm(n)}

    params = {"wte": normal((v, h), 0.02), "wpe": normal((s, h), 0.01), "ln_f": norm()}
    moe, n_moe = config.moe, config.moe_layers
    if L - n_moe:
        n = L - n_moe
        params["blocks"] = {
            **attention_part(n),
            "mlp_up": {"weight": normal((n, h, 4 * h), 0.02), "bias": jnp.zeros((n, 4 * h), dtype)},
            "mlp_down": {"weight": normal((n, 4 * h, h), residual),
                         "bias": jnp.zeros((n, h), dtype)},
        }
    if moe is not None:
        e, f = moe.experts, moe.width
        params["moe_blocks"] = {**attention_part(n_moe), "moe": {
            "router": normal((n_moe, h, e), 0.02),
            "w_in": normal((n_moe, e, h, f), 0.02), "b_in": jnp.zeros((n_moe, e, f), dtype),
            "w_out": normal((n_moe, e, f, h), residual), "b_out": jnp.zeros((n_moe, e, h), dtype)}}
    if not config.tied_head:
        params["head"] = {"weight": normal((h, v), 0.02), "bias": jnp.zeros((v,), dtype)}
    return params


class Layers(Protocol):
    """One rank's layers, given by a strategy. ``h`` is the residual stream in the strategy's layout
    (replicated [B, S, h], sequence-sharded [B, S/p, h] or feature-sharded [B, S, h/p])."""

    def embed(self, params: dict, tokens: jax.Array) -> jax.Array: ...

    def prepare(self, params: dict) -> dict:
        """Mark parameters whose gradients the strategy reduces once per step (Megatron-SP)."""

    def norm(self, params: dict, h: jax.Array) -> jax.Array: ...

    def column(self, params: dict, x: jax.Array) -> jax.Array:
        """[..., features in] -> [B, S, this rank's output features] (full sequence)."""

    def row(self, params: dict, x: jax.Array) -> jax.Array:
        """[B, S, this rank's input features] -> residual layout."""

    def loss(self, params: dict, h: jax.Array, targets: jax.Array) -> jax.Array:
        """Sum of token cross-entropies of the rank's tokens (final norm applied by the model)."""

    def logits(self, params: dict, h: jax.Array) -> jax.Array: ...

    def moe(self, params: dict, x: jax.Array, config: MoEConfig) -> tuple[jax.Array, dict]:
        """The MoE MLP of an MoE block on the normed stream: (output in the residual layout,
        {"load_balance", "z_loss", "dropped"}) (:func:`jphantom.sharding.expert.moe_per_rank`)."""


def attention(qkv: jax.Array, head_dim: int) -> jax.Array:
    """Causal multi-head self-attention on the rank's heads: qkv [B, S, 3 * a * d] -> [B, S, a * d].

    The t tokens are t column vectors; every projection around this acts on each token alike."""
    batch, seq, _ = qkv.shape
    q, k, v = jnp.moveaxis(qkv.reshape(batch, seq, 3, -1, head_dim), 2, 0)  # [B, S, a, d] each
    scores = jnp.einsum("bqad,bkad->baqk", q, k) / jnp.sqrt(jnp.asarray(head_dim, qkv.dtype))
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    wide = jnp.promote_types(scores.dtype, jnp.float32)  # softmax in at least float32
    weights = jax.nn.softmax(scores.astype(wide), axis=-1).astype(qkv.dtype)
    out = jnp.einsum("baqk,bkad->bqad", weights, v)
    return out.reshape(batch, seq, -1)


def _attend(layers: Layers, config: TransformerConfig, p: dict, h: jax.Array) -> jax.Array:
    qkv = layers.column(p["qkv"], layers.norm(p["ln1"], h))
    return h + layers.row(p["attn_out"], attention(qkv, config.head_dim))


def block(layers: Layers, config: TransformerConfig, p: dict, h: jax.Array) -> jax.Array:
    """One pre-LayerNorm GPT-2 block on the residual stream ``h``."""
    h = _attend(layers, config, p, h)
    up = jax.nn.gelu(layers.column(p["mlp_up"], layers.norm(p["ln2"], h)), approximate=True)
    return h + layers.row(p["mlp_down"], up)


def moe_block(layers: Layers, config: TransformerConfig, p: dict, h: jax.Array):
    """A block whose MLP is the mixture of experts: (h, aux of the MoE layer)."""
    h = _attend(layers, config, p, h)
    out, aux = layers.moe(p["moe"], layers.norm(p["ln2"], h), config.moe)
    return h + out, aux


def trunk(layers: Layers, config: TransformerConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """Embeddings, the blocks under ``lax.scan`` over the stacked layer axis, the final norm."""
    return trunk_and_aux(layers, config, params, tokens)[0]


def trunk_and_aux(layers: Layers, config: TransformerConfig, params: dict, tokens):
    """The final-normed stream and the MoE blocks' aux summed over them (None without MoE)."""
    h = layers.embed(params, tokens)
    if config.moe is None:
        return layers.norm(params["ln_f"], blocks(layers, config, params["blocks"], h)), None
    every, groups = config.moe_every, config.moe_layers
    dense_blocks = None if every == 1 else jax.tree.map(
        lambda a: a.reshape(groups, every - 1, *a.shape[1:]), params["blocks"])
    expert_block = remat.layer(lambda p, h: moe_block(layers, config, p, h))

    def group(h, xs):  # n - 1 dense blocks, then the MoE block
        dense_p, moe_p = xs
        if dense_p is not None:
            h = blocks(layers, config, dense_p, h)
        return expert_block(moe_p, h)

    h, aux = lax.scan(group, h, (dense_blocks, params["moe_blocks"]))
    return layers.norm(params["ln_f"], h), jax.tree.map(lambda a: a.sum(axis=0), aux)


def blocks(layers: Layers, config: TransformerConfig, stacked: dict, h: jax.Array) -> jax.Array:
    """The blocks stacked [L', ...] in ``stacked``, under ``lax.scan`` (a pipeline stage's body)."""
    one = remat.layer(lambda p, h: block(layers, config, p, h))  # the step's checkpoint policy
    h, _ = lax.scan(lambda h, p: (one(p, h), None), h, stacked)
    return h


def loss_and_metrics(layers: Layers, config: TransformerConfig, params: dict, tokens, targets):
    """(loss sum, metrics) of the rank's tokens. The loss sum is the next-token cross-entropies
    (nats) plus, with MoE blocks, ``tokens x (balance_weight x load balance + z_weight x z-loss)``
    summed over the MoE blocks (so that the mean over the batch adds them once). Metrics: sums of
    ``cross_entropy``, and with MoE ``dropped`` assignments of ``assignments`` (T k per MoE block)."""
    params = layers.prepare(params)
    h, aux = trunk_and_aux(layers, config, params, tokens)
    cross_entropy = layers.loss(params, h, targets)
    metrics = {"cross_entropy": cross_entropy}
    if aux is None:
        return cross_entropy, metrics
    count = targets.size
    extra = config.balance_weight * aux["load_balance"] + config.z_weight * aux["z_loss"]
    metrics.update(dropped=aux["dropped"],
                   assignments=jnp.asarray(count * config.top_k * config.moe_layers, jnp.int32))
    return cross_entropy + count * extra.astype(cross_entropy.dtype), metrics


def loss_sum(layers: Layers, config: TransformerConfig, params: dict, tokens, targets):
    """The training objective summed over the rank's tokens: next-token cross-entropies (nats),
    plus the MoE auxiliary losses (:func:`loss_and_metrics`)."""
    return loss_and_metrics(layers, config, params, tokens, targets)[0]


def logits_of(layers: Layers, config: TransformerConfig, params: dict, tokens) -> jax.Array:
    params = layers.prepare(params)
    return layers.logits(params, trunk(layers, config, params, tokens))


def logits(config: TransformerConfig, params: dict, tokens, *, strategy: str = "dense", mesh=None,
           sequence_parallel: bool = False) -> jax.Array:
    """float32 logits [batch, seq, vocab] of the dense parameter layout (what
    :func:`jphantom.models.gpt2.load` returns) under a dense-family strategy.

    ``params`` are sharded as the strategy needs (``mesh``: a jax Mesh; default all devices on one
    ``model`` axis, or one device for ``dense``). A vocabulary not divisible by the model axis
    (GPT-2's 50257) is padded with zero rows for the run and the padding is cut from the result.
    Phantom models have their own parameters (p is part of the model): use their program's forward.
    """
    from jphantom import strategies
    from jphantom.mesh import first_devices, make_mesh, mesh_config_of
    from jphantom.step import make_forward_fn

    chosen = strategies.get(strategy)
    if chosen.family != "dense":
        raise ConfigError(f"logits() takes dense parameters; strategy {strategy!r} has its own "
                          "(p is part of a phantom model): use its Program's forward instead")
    if mesh is None:
        mesh = (make_mesh({"model": 1}, first_devices(1)) if strategy == "dense"
                else make_mesh({"model": jax.device_count()}))
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] > config.seq_len:
        raise ConfigError(f"tokens have shape {tuple(tokens.shape)}; expected [batch, seq] with "
                          f"seq <= seq_len={config.seq_len}")
    p = int(mesh.shape.get("model", 1))
    vocab = config.vocab_size
    padded = -(-vocab // p) * p
    run_config = dataclasses.replace(config, vocab_size=padded, seq_len=tokens.shape[1])
    params = {**params, "wte": jnp.pad(params["wte"], ((0, padded - vocab), (0, 0))),
              "wpe": params["wpe"][: tokens.shape[1]]}
    program = chosen.program(run_config, mesh_config_of(mesh), sequence_parallel=sequence_parallel)
    params = jax.device_put(params, program.shardings(mesh))
    tokens = jax.device_put(tokens, program.batch_shardings(mesh)[0])
    out = make_forward_fn(program, mesh)(params, tokens)
    return out[..., :vocab].astype(jnp.float32)
