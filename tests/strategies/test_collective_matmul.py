"""Collective matmul (jphantom.nn.tensor: all_gather_matmul, matmul_reduce_scatter): Megatron-SP's
all-gathers and reduce-scatters inside the blocks as rings of collective-permutes under the
GEMMs. Exact against one device; from the compiled HLO, the same bytes as the collectives they
replace and nothing else over ``model`` inside the blocks."""

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers import assert_tree_close, compiled_hlo, oracle_loss_and_grads, random_params
from jphantom import plans
from jphantom.registry import program as program_module
from jphantom.analysis.hlo import collectives
from jphantom.config import ParallelConfig
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import first_devices
from jphantom.models.gpt2 import TransformerConfig
from jphantom.models.llama import LlamaConfig
from jphantom.nn import tensor

SEQ, VOCAB, LAYERS = 16, 64, 2
LLAMA = LlamaConfig(vocab_size=VOCAB, hidden=32, intermediate=64, layers=LAYERS, heads=4,
                    kv_heads=4, max_positions=SEQ)
GPT2 = TransformerConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=4, layers=LAYERS)


@functools.lru_cache(maxsize=None)
def _step(config, mesh, collective_matmul=True):
    program = program_module.build(config, "tensor", mesh, sequence_parallel=True,
                                   collective_matmul=collective_matmul)
    mesh_obj = program.mesh.build(first_devices(program.mesh.device_count))
    return program, program.train_step(mesh_obj, optax.sgd(0.1), donate=False)


def _batch():
    rng = np.random.default_rng(0)
    return tuple(rng.integers(0, VOCAB, (8, SEQ)).astype(np.int32) for _ in range(2))


@pytest.mark.parametrize("config, mesh", [
    (LLAMA, "data=2,model=4"), (GPT2, "model=2"),
    (TransformerConfig(vocab_size=VOCAB, seq_len=SEQ, hidden=32, heads=8, layers=1), "model=8"),
], ids=["llama-4", "gpt2-2", "gpt2-8"])
@pytest.mark.slow_cells("gpt2-8", "llama-4")
def test_collective_matmul_equals_one_device(config, mesh):
    program, step = _step(config, mesh)
    params = random_params(program)
    want, want_grads = oracle_loss_and_grads(step, params, *_batch())
    got, grads = jax.jit(step.value_and_grad())(params, *_batch())
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert_tree_close(jax.device_get(grads), jax.device_get(want_grads), 1e-5)


def test_collective_matmul_replaces_the_blocks_collectives_byte_for_byte():
    """Per block and step: 4 rings forward (attention's input, o_proj's output, the MLP's input,
    down_proj's output) and 4 backward, each p-1 collective-permutes of one chunk
    [B, S/p, h]; the all-gathers and reduce-scatters over ``model`` left are the embedding's
    and the head's, as without collective matmul."""
    p, rows, h = 4, 8 // 2, LLAMA.hidden
    _, step = _step(LLAMA, "data=2,model=4")
    _, plain = _step(LLAMA, "data=2,model=4", False)
    shapes = (((8, SEQ), jnp.int32), ((8, SEQ), jnp.int32))
    axes = dict(step.mesh.shape)

    def over_model(text):
        return [c for c in collectives(text) if not c.trivial and c.mesh_axes(axes) == ("model",)]

    ring = over_model(compiled_hlo(step, *shapes))
    whole = over_model(compiled_hlo(plain, *shapes))
    permutes = [c for c in ring if c.kind == "collective-permute"]
    assert sum(c.count for c in permutes) == LAYERS * 8 * (p - 1)
    assert {c.bytes for c in permutes} == {rows * SEQ // p * h * 4}
    ring_bytes = sum(c.bytes * c.count for c in permutes)
    # the plain blocks: 4 all-gathers (of a [B, S, h] result) and 4 reduce-scatters (of a
    # [B, S/p, h] result) a block, and the backward's 2 gathers again of the column layers'
    # inputs from their kept shards (remat.regathering; collective matmul keeps its gathered
    # input instead); the rings move what the 4 + 4 move per rank, (p-1)/p of the sequence each
    blocks = Counter(c.kind for c in whole if c.count == LAYERS for _ in range(c.count))
    assert (blocks["all-gather"], blocks["reduce-scatter"]) == (6 * LAYERS, 4 * LAYERS)
    sequence = rows * SEQ * h * 4
    moved = 4 * LAYERS * (sequence * (p - 1) // p + sequence // p * (p - 1))
    assert ring_bytes == moved
    rest = lambda found: sorted((c.kind, c.bytes, c.count) for c in found
                                if c.kind != "collective-permute" and c.count != LAYERS)
    assert rest(ring) == rest(whole)


def test_collective_matmul_needs_sequence_parallelism():
    with pytest.raises(ConfigError, match="sequence-parallel"):
        ParallelConfig(strategy="tensor", mesh="model=2", collective_matmul=True)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        plans.megatron(program_module.build(LLAMA, "dense", "model=1").model,
                       collective_matmul=True)
    with pytest.raises(ConfigError, match="sequence parallelism"):
        tensor.RowParallelLinear(np.zeros((4, 4), np.float32), collective_matmul=True)
    with pytest.raises(ConfigError, match="'sequence'"):
        plans.Style("column", collective_matmul=True)


def test_megatron_plan_rings_only_where_column_layers_follow():
    """The final norm (before the head) and a Mixtral block's MLP norm (before the router) keep
    the all-gather; the attention norms and the row layers ring."""
    mixtral = LlamaConfig(vocab_size=VOCAB, hidden=32, intermediate=32, layers=1, heads=4,
                          kv_heads=4, max_positions=SEQ, experts=4, top_k=2)
    model = program_module.build(mixtral, "dense", "model=1").model
    plan = plans.megatron(model, sequence_parallel=True, collective_matmul=True)
    ring = {path for path, style in plan.items()
            if getattr(style, "collective_matmul", False)}
    assert ring == {"layers.block.input_layernorm", "layers.block.self_attn.o_proj"}
