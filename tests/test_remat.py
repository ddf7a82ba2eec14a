"""Activation checkpointing per layer (:mod:`jphantom.remat`): the same gradients under every
policy, less compiled temp memory by what the policy predicts, and ``collectives_saveable``
recomputes no collective."""

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphantom import remat, strategies
from jphantom.analysis.hlo import collectives
from jphantom.analysis.inspect import compiled_memory
from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig, first_devices
from jphantom.models import transformer as tr
from jphantom.sharding import dense
from jphantom.step import make_value_and_grad

from conftest import require_devices
from helpers import assert_tree_close, random_params

CONFIG = tr.TransformerConfig(vocab_size=32, seq_len=16, hidden=32, heads=4, layers=4,
                              dtype="float32")
BATCH = 8


@functools.lru_cache(maxsize=None)
def _case(mesh_text):
    mesh_config = MeshConfig.parse(mesh_text)
    require_devices(mesh_config.device_count)
    program = strategies.get("tensor").program(CONFIG, mesh_config)
    mesh = program.mesh.build(first_devices(program.mesh.device_count))
    params = random_params(program)
    for name in ("ln1", "ln2"):
        params["blocks"][name]["scale"] += 1.0
    params["ln_f"]["scale"] += 1.0
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len)) for _ in range(2)]
    placed = jax.device_put(params, program.shardings(mesh))
    batch = [jax.device_put(b, s) for b, s in zip(batch, program.batch_shardings(mesh))]
    return program, mesh, placed, batch


@functools.lru_cache(maxsize=None)
def _run(mesh_text, policy):
    program, mesh, params, batch = _case(mesh_text)
    fn = make_value_and_grad(program, mesh, remat=policy)
    compiled = fn.lower(params, *batch).compile()
    loss, grads = compiled(params, *batch)
    return float(loss), grads, compiled_memory(compiled)["temp_bytes"], compiled.as_text()


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "collectives_saveable"])
def test_every_policy_gives_the_same_gradients(policy):
    loss, grads, _, _ = _run("model=2", policy)
    want_loss, want_grads, _, _ = _run("model=2", "none")
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert_tree_close(grads, want_grads, 1e-5)


def _block_residual_bytes(policy):
    """Per block, what the policy keeps for the backward: abstract vjp of one dense block."""
    layers = dense.TransformerLayers(CONFIG.layer_norm_eps)
    shapes = jax.eval_shape(lambda key: tr.init_dense(key, CONFIG), jax.random.PRNGKey(0))
    block = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes["blocks"])
    h = jax.ShapeDtypeStruct((BATCH, CONFIG.seq_len, CONFIG.hidden), jnp.float32)
    return remat.residual_bytes(lambda p, x: tr.block(layers, CONFIG, p, x), block, h, policy)


def test_nothing_saveable_lowers_temp_memory_by_what_it_predicts():
    """One device's model (model=1): the compiled temp bytes drop by about L x (the residuals a
    block keeps without checkpointing - those it keeps under the policy)."""
    _, _, temp_none, _ = _run("model=1", "none")
    _, _, temp_remat, _ = _run("model=1", "nothing_saveable")
    predicted = CONFIG.layers * (_block_residual_bytes("none")
                                 - _block_residual_bytes("nothing_saveable"))
    assert predicted > 0
    assert temp_none - temp_remat == pytest.approx(predicted, rel=0.25)


def test_collectives_saveable_recomputes_no_collective():
    """Megatron on model=2: nothing_saveable repeats, in each block's backward, the attention
    output's all-reduce (the MLP half needs its result again; the MLP-down all-reduce gives the
    block's output, which no backward needs); collectives_saveable keeps the collectives' outputs
    and runs exactly the collectives of the step without checkpointing."""
    count = lambda text: Counter((c.kind, c.elements) for c in collectives(text)
                                 for _ in range(c.count))
    plain = count(_run("model=2", "none")[3])
    assert count(_run("model=2", "collectives_saveable")[3]) == plain
    block_output = BATCH * CONFIG.seq_len * CONFIG.hidden  # one all-reduce of B S h per block
    assert count(_run("model=2", "nothing_saveable")[3]) - plain == Counter(
        {("all-reduce", block_output): CONFIG.layers})


def test_unknown_policy_is_a_config_error():
    program, mesh, _, _ = _case("model=1")
    with pytest.raises(ConfigError, match="remat='everything'"):
        make_value_and_grad(program, mesh, remat="everything")
