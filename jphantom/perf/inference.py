"""Forward-only (inference) pricing: the decode roofline, the prefill bound, and the forward pass
of Seal et al.'s FFN under phantom and tensor parallelism, per device, from a device description
(:mod:`jphantom.predict.device`: its HBM bandwidth, peaks, network and power). Every number here
is modelled, and says so in its ``label``.

**Decode** (one new token per sequence) reads every weight a device holds and its share of the
key/value cache once per step, and does little arithmetic with them, so it is bound by HBM
bandwidth (the roofline of Williams et al.; the scaling book's "memory-bound" regime):

    bytes_per_step  = weights per device + KV cache per device        (bytes read per step)
    memory_s        = bytes_per_step / hbm_gbps                       (the datasheet peak)
    compute_s       = FLOPs per device / peak_tflops                  (2 per weight and token, plus
                                                                       attention's 4 x context x
                                                                       query features)
    seconds         = max(memory_s, compute_s)                        (the roofline)

**Prefill** (the prompt, B x S tokens at once) does 2 x weights x tokens FLOPs, plus causal
attention's 2 x S^2 x query features per sequence, so it is compute-bound: ``seconds`` is the same
max with the compute term dominant.

**Communication** of the forward is the strategy's collectives per device (the formulas below,
checked against the compiled forward in ``tests/predict/test_inference.py`` on XLA:CPU and by
``benchmarks/inference_forward.py`` on XLA:GPU for an H100 node; MI250X is priced with the
same schedule, assumed), priced by
:class:`jphantom.predict.Network` (NCCL's ring or tree on the group's placement): it is added to
the roofline, none hidden (an upper bound). **Energy** is Seal et al.'s Eq. 1 per token,

    (1)   e = A alpha + B beta      joules per step, every device; per token: e / tokens

with alpha the sustained seconds (the roofline's terms at the description's
``stream_efficiency`` and ``gemm_efficiency``: the GPU busy, at ``busy_watts`` A) and beta the
collectives' seconds (the GPU waiting, at ``idle_watts`` B), as ``plan --objective energy``
prices a training step (:attr:`jphantom.planner.PlanRow.joules_per_token`). The predicted step
is alpha + beta; the roofline (``seconds``, ``roofline_tokens_per_s``) is the bound a measured
decode is held against.

Collectives of one forward pass per device, as result elements (the compiled HLO's convention),
for tokens T (a decode step: T = B; prefill: B x S):

====================  ======================================================================
Llama under tensor    all-reduce T h x (2 L + 1)  (Megatron's g of every attention and MLP, and
                      the vocabulary-parallel embedding's); all-gather T V x 1 (the logits)
Llama under phantom   all-gather p k T x (7 L + 1) (Seal et al.'s Eq. 11 ghost exchange: every
                      projection q, k, v, o, gate, up, down, and the head; XLA:GPU combines
                      the q|k|v and the gate|up ones, which read the same input: p k T x
                      (2 L + 1), 2 p k T x L, 3 p k T x L, the same bytes); all-reduce T x
                      (2 L + 1) (each RMSNorm's sum of squares over the split features);
                      all-gather T V x 1 (the logits)
FFN under phantom     all-gather p k B x L (Table II's forward row)
FFN under tensor      all-gather B n x 1 (the feature-split input), all-reduce B n x floor(L/2)
FFN under tensor-t1   all-gather B n x L (Table II's TP all-gather, (n/p) B from each rank)
====================  ======================================================================

Weights per device: tensor splits every linear's weight over ``model`` (i o / p); phantom keeps
Seal et al.'s local block, compressor and p decompressors (the own slot stored, masked:
:func:`jphantom.planner.pricing.phantom_linear`), i.e. (o/p)(i/p) + k i/p + p (o/p) k, which is
smaller than i o / p while k < (n/p)(1 - 1/p) (Eq. 8). The KV cache is split by key/value heads
over ``model`` (a head is never split; with fewer heads than ranks each rank keeps one).
"""

from __future__ import annotations

import dataclasses
import math

from jphantom.registry import layer_plans, strategies
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import DATA, MODEL, MeshConfig
from jphantom.perf.axonn_model import GPTShape
from jphantom.planner.pricing import phantom_linear
from jphantom.predict import network as networks
from jphantom.predict.device import DeviceModel, load

ELEMENT_BYTES = {"bf16": 2, "f32": 4}
"""Bytes per element of the dtypes priced, named as the device descriptions' peaks are
(:data:`jphantom.predict.device.DTYPES`): weights, cache and messages in bf16 or f32."""
PROJECTIONS_PER_BLOCK = 7  # Llama: q, k, v, o, gate, up, down
FFN_COLLECTIVES = {  # a registry row's layers' plan -> (n, L, p, k, B) -> (kind, elements, count)
    layer_plans.PHANTOM: lambda n, L, p, k, b: (("all-gather", p * k * b, L),),
    layer_plans.MEGATRON: lambda n, L, p, k, b: (("all-gather", b * n, 1),
                                                 ("all-reduce", b * n, L // 2)),
    layer_plans.T1: lambda n, L, p, k, b: (("all-gather", b * n, L),),
}
"""The FFN's forward collectives per device by the strategy's plan (module docstring)."""
STRATEGIES = tuple(name for name, row in strategies.STRATEGIES.items()
                   if row.layers in FFN_COLLECTIVES and row.fused)
"""The strategies priced: Megatron's ``tensor``, ``phantom`` (Seal et al.) and Seal et al.'s
``tensor-t1`` (the FFN only)."""


@dataclasses.dataclass(frozen=True)
class Forward:
    """One forward pass per device: ``weight_bytes`` and ``cache_bytes`` read, ``flops``,
    ``collectives`` as (kind, result elements, count), ``tokens`` over all devices."""

    weight_bytes: float
    cache_bytes: float
    flops: float
    collectives: tuple[tuple[str, int, int], ...]
    tokens: int


def _model_ranks(mesh) -> tuple[int, int]:
    """(model ranks, data ranks) of ``mesh``: a MeshConfig, its text ("data=2,model=4"), a
    mapping, or a whole number of model ranks."""
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        mesh = {MODEL: mesh}
    mesh = MeshConfig.parse(mesh) if isinstance(mesh, str) else MeshConfig.of(mesh)
    other = set(mesh.shape) - {MODEL, DATA}
    if other:
        raise ConfigError(f"mesh {mesh}: inference pricing splits over model and data only, "
                          f"not {sorted(other)}")
    return mesh.size(MODEL), mesh.size(DATA)


def _row(strategy: str, ghost_width, p: int, dtype: str) -> strategies.Strategy:
    """The registry row of ``strategy``, checked with the other inputs."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r}: inference pricing knows {STRATEGIES}")
    row = strategies.get(strategy)
    if dtype not in ELEMENT_BYTES:
        raise ConfigError(f"dtype={dtype!r}: use one of {sorted(ELEMENT_BYTES)}")
    if row.needs_ghost_width and (ghost_width is None or ghost_width < 1):
        raise ConfigError(f"strategy={strategy!r} needs ghost_width k >= 1 (Seal et al.'s "
                          "ghost neurons per rank)")
    if p < 1:
        raise ConfigError(f"model ranks {p} must be >= 1")
    return row


def _linear_elements(i: int, o: int, p: int, phantom: bool, k: int | None) -> float:
    """Weights of one bias-free linear i -> o per device."""
    if phantom and p > 1:
        return phantom_linear(i, o, p, k) - o // p  # phantom_linear counts a bias of o/p
    return i * o / p


def llama_forward(shape: GPTShape, batch: int, seq: int, context: int, p: int, strategy: str,
                  ghost_width: int | None, dtype: str, *, combined: bool = True) -> Forward:
    """A Llama forward of ``seq`` new tokens per sequence over ``batch`` sequences on one of
    ``p`` model ranks, attending to ``context`` positions (decode: seq 1; prefill: seq =
    context), with the KV cache of ``context`` positions read (module docstring). ``combined``:
    phantom's ghost all-gathers as XLA:GPU compiles them (q|k|v and gate|up combined, the same
    bytes in 4 L + 1 collectives), else one per projection as XLA:CPU does (7 L + 1)."""
    row = _row(strategy, ghost_width, p, dtype)
    if shape.kv_heads is None:
        raise ConfigError("a GPT-2 shape: the decode formulas are Llama's (RMSNorm, SwiGLU, "
                          "grouped-query attention, untied head)")
    if not row.pairs and not row.needs_ghost_width:
        raise ConfigError(f"{strategy} is Seal et al.'s FFN baseline: price a Llama under "
                          "'tensor' or 'phantom'")
    nbytes, h, L, k = ELEMENT_BYTES[dtype], shape.hidden, shape.layers, ghost_width
    phantom, head_dim = row.needs_ghost_width and p > 1, h // shape.heads
    kv = shape.kv_heads * head_dim
    linears = ((h, h), (h, kv), (h, kv), (h, h), (h, shape.intermediate),
               (h, shape.intermediate), (shape.intermediate, h))  # q k v o gate up down
    block = sum(_linear_elements(i, o, p, phantom, k) for i, o in linears)
    head = _linear_elements(h, shape.vocab_size, p, phantom, k)
    tokens, split = batch * seq, p if phantom else 1  # phantom splits norms, embeddings too
    weights = L * (block + 2 * h / split) + head + (h + tokens * h) / split  # + rows looked up
    cache = 2 * L * batch * context * max(1.0, shape.kv_heads / p) * head_dim
    pairs = batch * (seq * context - seq * (seq - 1) / 2)  # causal: new tokens x positions seen
    flops = 2 * tokens * (L * block + head) + L * 4 * pairs * shape.heads * head_dim / p
    if p == 1:
        collectives = ()
    elif phantom and combined:  # XLA:GPU's combiner: q|k|v and gate|up share one all-gather
        ghosts = p * k * tokens
        collectives = (("all-gather", ghosts, 2 * L + 1), ("all-gather", 2 * ghosts, L),
                       ("all-gather", 3 * ghosts, L), ("all-reduce", tokens, 2 * L + 1),
                       ("all-gather", tokens * shape.vocab_size, 1))
    elif phantom:
        collectives = (("all-gather", p * k * tokens, PROJECTIONS_PER_BLOCK * L + 1),
                       ("all-reduce", tokens, 2 * L + 1),
                       ("all-gather", tokens * shape.vocab_size, 1))
    else:
        collectives = (("all-reduce", tokens * h, 2 * L + 1),
                       ("all-gather", tokens * shape.vocab_size, 1))
    return Forward(weights * nbytes, cache * nbytes, flops, collectives, tokens)


def ffn_forward(width: int, depth: int, p: int, batch: int, strategy: str,
                ghost_width: int | None = None, dtype: str = "f32") -> Forward:
    """Seal et al.'s FFN (L layers n x n with biases, features split over ``p`` ranks), one
    forward over ``batch`` samples on one rank (module docstring's collectives; FLOPs 2 B x
    weights, phantom's decompressor GEMM over all p slots)."""
    row = _row(strategy, ghost_width, p, dtype)
    n, L, k = width, depth, ghost_width
    if n % p:
        raise ConfigError(f"width {n} must divide over {p} ranks")
    m = n // p
    weights = L * (phantom_linear(n, n, p, k) if row.needs_ghost_width else n * m + m)
    collectives = FFN_COLLECTIVES[row.layers](n, L, p, k, batch) if p > 1 else ()
    return Forward(weights * ELEMENT_BYTES[dtype], 0.0, 2 * batch * weights,
                   tuple(c for c in collectives if c[2]), batch)


def wire_bytes(kind: str, result_bytes: float, p: int) -> float:
    """Bytes one device sends for a ring collective whose result buffer is ``result_bytes``
    (:mod:`jphantom.predict.network`'s table): all-gather (p-1)/p R, all-reduce 2 (p-1)/p R."""
    if p <= 1:
        return 0.0
    return {"all-gather": (p - 1) / p, "all-reduce": 2 * (p - 1) / p}[kind] * result_bytes


def _group(device: DeviceModel, p: int):
    """Where a group of ``p`` GPUs sits, packed onto as few nodes (and packages) as the device
    allows (:func:`jphantom.predict.network.placement`)."""
    per_node = int(device["network.gpus_per_node"])
    per_package = int(device.get("network.gpus_per_package", 1))
    return networks.placement([list(range(p))], lambda i: i // per_node,
                              (lambda i: i // per_package) if per_package > 1 else None)


def price(forward: Forward, device: DeviceModel, p: int, data: int, dtype: str,
          what: str) -> dict:
    """A forward on ``p`` x ``data`` devices priced on ``device`` (module docstring): the
    roofline (``seconds``: datasheet peaks) and the sustained time (``sustained_seconds``: the
    description's stream and GEMM efficiencies), the collectives, and from their sum
    (``step_seconds``) tokens/s and Eq. 1's joules per token, with its label."""
    nbytes = ELEMENT_BYTES[dtype]
    hbm, peak = device["memory.hbm_gbps"] * 1e9, device.peak_flops(dtype)
    read = forward.weight_bytes + forward.cache_bytes
    memory_s, compute_s = read / hbm, forward.flops / peak
    seconds = max(memory_s, compute_s)
    sustained = max(device.memory_seconds(read),
                    compute_s / device[f"gemm_efficiency.{dtype}"])
    network, where = networks.Network.of(device), _group(device, p)
    comm_s = sum(count * network.seconds(kind, elements * nbytes, where)
                 for kind, elements, count in forward.collectives)
    devices, tokens, step_s = p * data, forward.tokens * data, sustained + comm_s
    busy, idle = device["power.busy_watts"], device["power.idle_watts"]
    return {
        "bytes_per_step": read, "weight_bytes": forward.weight_bytes,
        "cache_bytes": forward.cache_bytes, "flops": forward.flops,
        "memory_seconds": memory_s, "compute_seconds": compute_s, "seconds": seconds,
        "bound": "memory" if memory_s >= compute_s else "compute",
        "roofline_tokens_per_s": tokens / seconds, "sustained_seconds": sustained,
        "comm_seconds": comm_s, "collectives": [list(c) for c in forward.collectives],
        "collective_result_bytes": sum(c * e * nbytes for _, e, c in forward.collectives),
        "wire_bytes": sum(c * wire_bytes(kind, e * nbytes, p)
                          for kind, e, c in forward.collectives),
        "step_seconds": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s,
        "joules_per_token": devices * (busy * sustained + idle * comm_s) / tokens,
        "device": device.name,
        "label": (f"modelled: {what} on {device.name} ({devices} devices, {p} per model "
                  f"replica): roofline max(bytes / {device['memory.hbm_gbps']:g} GB/s HBM, "
                  f"FLOPs / {peak / 1e12:g} TFLOP/s {dtype}); predicted = the same at the "
                  f"description's stream and GEMM efficiencies + collectives "
                  f"(jphantom.predict.Network, none hidden); J/token by Seal et al.'s Eq. 1, "
                  f"A = {busy:g} W x compute + B = {idle:g} W x collectives"),
    }


def _llama(shape, batch, seq, context, device, mesh, strategy, ghost_width, dtype, what):
    device = load(device) if isinstance(device, str) else device
    p, data = _model_ranks(mesh)
    if batch % data:
        raise ConfigError(f"batch {batch} must divide over data={data}")
    shape = GPTShape.of(shape)
    forward = llama_forward(shape, batch // data, seq, context, p, strategy, ghost_width, dtype)
    return price(forward, device, p, data, dtype, what)


def decode_roofline(shape, batch: int, context_len: int, device: DeviceModel | str,
                    mesh="model=1", *, strategy: str = "tensor", ghost_width: int | None = None,
                    dtype: str = "bf16") -> dict:
    """One decode step (one new token for each of ``batch`` sequences that hold
    ``context_len`` positions in their KV cache) of the Llama ``shape`` (a
    :class:`~jphantom.perf.axonn_model.GPTShape` or a LlamaConfig) on ``mesh`` (model and data
    axes) of ``device`` (a :class:`~jphantom.predict.DeviceModel` or a shipped name,
    ``h100-sxm``): ``bytes_per_step`` (weights + cache read per device), ``seconds`` (the HBM
    roofline) and ``roofline_tokens_per_s``, ``comm_seconds``, ``step_seconds`` (predicted),
    ``tokens_per_s``, ``joules_per_token`` and ``label`` (module docstring; all modelled)."""
    return _llama(shape, batch, 1, context_len, device, mesh, strategy, ghost_width, dtype,
                  f"decode step, batch {batch}, context {context_len}")


def prefill_bound(shape, batch: int, prompt_len: int, device: DeviceModel | str,
                  mesh="model=1", *, strategy: str = "tensor", ghost_width: int | None = None,
                  dtype: str = "bf16") -> dict:
    """The prompt's forward (``batch`` x ``prompt_len`` tokens, causal attention over the
    prompt), as :func:`decode_roofline` prices a step: compute-bound for any real prompt;
    ``step_seconds`` is the modelled time to the first token."""
    return _llama(shape, batch, prompt_len, prompt_len, device, mesh, strategy, ghost_width,
                  dtype, f"prefill, batch {batch} x {prompt_len} tokens")


def compiled_forward(config, strategy: str, mesh: str, batch_shape: tuple[int, ...], *,
                     ghost_width: int | None = None) -> list[tuple[str, int, int, int]]:
    """The collectives of ``config``'s forward pass (an FFN, or a Llama given token ids of
    ``batch_shape``: (B, 1) is a decode step's) under ``strategy`` on ``mesh``, compiled for
    abstract parameters on this process's devices, or inside :func:`jphantom.runtime.mesh.device_pool`
    on a target's (``jphantom.costs.aot.deviceless_node("gpu:h100")``: XLA:GPU without a GPU; nothing
    allocated): sorted (kind, result elements, count, bytes per execution), to check the
    formulas above against."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding

    from jphantom.registry import program as programs
    from jphantom.analysis import hlo
    from jphantom.runtime.mesh import first_devices
    from jphantom.models.ffn import FFNConfig

    options = {} if ghost_width is None else {"ghost_width": ghost_width}
    program = programs.build(config, strategy, mesh, **options)
    devices = program.mesh.build(first_devices(program.mesh.device_count))
    step = program.train_step(devices, optax.sgd(0.1), donate=False)
    ffn = isinstance(config, FFNConfig)
    spec = program.batch_specs[0] if ffn else step.specs_of_batch(1)[0]
    inputs = jax.ShapeDtypeStruct(batch_shape, np.float32 if ffn else np.int32,
                                  sharding=NamedSharding(devices, spec))

    def per_rank(leaves, x):
        return step.layout.model_of(leaves)(x)

    @jax.jit
    def forward(params, x):  # the step's own shard_map: its parameters' specs, then the input's
        fn = step.over_mesh(per_rank, 0, out_specs=spec, after=(spec,))
        return fn(tuple(jax.tree.leaves(params)), x)

    text = forward.lower(step.abstract_state().params, inputs).compile().as_text()
    found = {}
    for op in hlo.collectives(text):
        key = (op.kind, op.elements, op.bytes)
        found[key] = found.get(key, 0) + op.count
    return sorted((kind, elements, count, nbytes)
                  for (kind, elements, nbytes), count in found.items())
