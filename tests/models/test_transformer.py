"""The GPT transformer under every strategy equals the single-device model, and its compiled step
moves exactly the collectives the Megatron (seeds 002, 003) and phantom (Seal et al. Sec. 5) designs
predict, with loop trip counts applied.

Each oracle test computes the loss and every gradient on the mesh (the step's shard_map without
the optimizer) and compares them with ``jax.value_and_grad`` of the plain GPT-2 NNX module on one
device, in float64, through the parallel model's dense equivalent (``plans.dense_equivalent``;
tensor, gspmd and pmm3d keep the dense model's parameters, so theirs is the identity).
"""

import functools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jphantom import plans
from jphantom.registry import program as programs
from jphantom.costs.inventory import collective_inventory
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import MeshConfig, first_devices
from jphantom.models.gpt2 import TransformerConfig

from conftest import require_devices
from helpers import assert_tree_close, jit_exact

VOCAB, SEQ, HIDDEN, HEADS, LAYERS, BATCH = 32, 8, 16, 8, 2, 4
TOLERANCE = {"float32": 1e-5, "float64": 1e-10}


def _config(strategy, dtype="float32", **kw):
    base = dict(vocab_size=VOCAB, seq_len=SEQ, hidden=HIDDEN, heads=HEADS, layers=LAYERS,
                dtype=dtype, tied_head=not strategy.startswith("phantom"),
                ghost_width=3 if strategy.startswith("phantom") else None)
    return TransformerConfig(**{**base, **kw})


@functools.lru_cache(maxsize=None)
def _program(strategy, mesh_text, sequence_parallel=False, **kw):
    """The program, its jax mesh and its step (SGD), shared by the tests of one layout."""
    prog = programs.build(_config(strategy, **kw), strategy, mesh_text,
                          sequence_parallel=sequence_parallel)
    require_devices(prog.mesh.device_count)
    mesh = prog.mesh.build(first_devices(prog.mesh.device_count))
    return prog, mesh, prog.train_step(mesh, optax.sgd(0.1))


def _pure(model):
    return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])


def _perturbed(prog, step, seed=7):
    """The model's initial parameters (phantom's the SVD of a dense init) with every bias and
    norm moved off its initial 0 / 1 (so every parameter matters), placed in their shards."""
    rng = np.random.default_rng(seed)

    def move(path, leaf):
        name = jax.tree_util.keystr(path)
        if "bias" in name or "scale" in name:
            return (leaf + 0.1 * rng.standard_normal(leaf.shape)).astype(leaf.dtype)
        return leaf

    params = jax.tree_util.tree_map_with_path(move, jax.device_get(_pure(prog.create(jax.random.PRNGKey(0)))))
    return jax.device_put(params, step.param_shardings())


def _batch(batch=BATCH, seed=1):
    keys = jax.random.split(jax.random.PRNGKey(seed))
    return (np.asarray(jax.random.randint(keys[0], (batch, SEQ), 0, VOCAB)),
            np.asarray(jax.random.randint(keys[1], (batch, SEQ), 0, VOCAB)))


@functools.lru_cache(maxsize=None)
def _oracle_fn(strategy, mesh_text, **kw):
    """jitted value_and_grad, float64 on one device, of the loss of the strategy's dense
    equivalent w.r.t. the strategy's parameters (every dense-family layout shares one)."""
    if not programs.get(strategy).family == "phantom":
        strategy, mesh_text = "dense", "model=1"
    prog = programs.build(_config(strategy, **{**kw, "dtype": "float64"}), strategy, mesh_text)
    graphdef = nnx.split(prog.model, nnx.Param, ...)[0]
    _, _, rest = nnx.split(prog.model, nnx.Param, ...)

    def loss(params, tokens, targets):
        state = nnx.split(prog.model, nnx.Param, ...)[1]
        nnx.replace_by_pure_dict(state, params)
        model = plans.dense_equivalent(nnx.merge(graphdef, state, rest))
        return model.loss(tokens, targets)

    return jit_exact(jax.value_and_grad(loss))


def _oracle(prog, mesh_text, params, tokens, targets, **kw):
    fn = _oracle_fn(prog.strategy, mesh_text, **kw)
    host = jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float64), params)
    return fn(jax.device_put(host, jax.devices()[0]), tokens, targets)


def _check_against_dense(strategy, mesh_text, sequence_parallel=False, dtype="float32", **kw):
    prog, mesh, step = _program(strategy, mesh_text, sequence_parallel, dtype=dtype, **kw)
    params = _perturbed(prog, step)
    tokens, targets = _batch()
    jit = jit_exact if dtype == "float64" else jax.jit
    loss, grads = jit(step.value_and_grad())(params, tokens, targets)
    want_loss, want_grads = _oracle(prog, mesh_text, params, tokens, targets, **kw)
    rtol = TOLERANCE[dtype]
    assert abs(float(loss) - float(want_loss)) <= rtol * abs(float(want_loss))
    assert_tree_close(grads, want_grads, rtol)


_DEFAULT_TENSOR_CASES = {("model=2", False), ("data=2,model=4", True)}  # float64: two more


@pytest.mark.parametrize("mesh, sequence_parallel", [
    pytest.param(mesh, sp, marks=() if (mesh, sp) in _DEFAULT_TENSOR_CASES else pytest.mark.slow)
    for mesh in ("model=1", "model=2", "model=4", "model=8", "data=2,model=4", "data=4,model=2")
    for sp in (False, True)])
@pytest.mark.slow_cells("model=2-False", "data=2,model=4-True")
def test_tensor_transformer_equals_dense(mesh, sequence_parallel):
    """Megatron tensor parallelism, with and without sequence parallelism, alone and beside data
    parallelism: the loss and every gradient of the dense model (float32, 1e-5)."""
    _check_against_dense("tensor", mesh, sequence_parallel)


@pytest.mark.parametrize("strategy, mesh, sequence_parallel", [
    ("tensor", "model=4", True), ("tensor", "data=2,model=2", False),
    pytest.param("phantom", "data=2,model=4", False, marks=pytest.mark.slow),
    pytest.param("gspmd", "data=2,model=4", False,  # make test: test_data_parallel.py, Llama
                 marks=pytest.mark.slow),
])
# make test: float64 on the tensor-parallel FFN (test_tensor.py); transformers under tensor
# parallelism in float32 (test_llama.py, test_user_models.py, test_hf_families.py)
@pytest.mark.slow_cells("tensor-model=4-True", "tensor-data=2,model=2-False")
def test_transformer_equals_dense_in_float64(strategy, mesh, sequence_parallel):
    _check_against_dense(strategy, mesh, sequence_parallel, dtype="float64")


@pytest.mark.parametrize("strategy, mesh", [
    pytest.param("phantom", "model=2", marks=pytest.mark.slow),
    pytest.param("phantom", "model=4", marks=pytest.mark.slow),
    pytest.param("phantom", "model=8", marks=pytest.mark.slow),
    ("phantom", "data=4,model=2"),
    pytest.param("phantom-unfused", "model=4", marks=pytest.mark.slow),
])
@pytest.mark.slow_cells("phantom-data=4,model=2")
def test_phantom_transformer_equals_its_dense_equivalent(strategy, mesh):
    _check_against_dense(strategy, mesh)


def test_vocabulary_parallel_cross_entropy_equals_optax():
    from jax.sharding import PartitionSpec as P

    from jphantom.nn.vocab import cross_entropy_sum

    require_devices(4)
    mesh = MeshConfig.parse("model=4").build(first_devices(4))
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 32)) * 4
    targets = jax.random.randint(jax.random.PRNGKey(1), (3, 5), 0, 32)
    sharded = jax.jit(jax.shard_map(lambda lg, t: cross_entropy_sum(lg, t, "model"), mesh=mesh,
                                    in_specs=(P(None, None, "model"), P()), out_specs=P()))
    want = optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum()
    assert float(sharded(logits, targets)) == pytest.approx(float(want), rel=1e-6)


# --------------------------------------------------------------------------------------------------
# Collectives of the compiled step
# --------------------------------------------------------------------------------------------------


def _compiled_buffers(prog, step, axis):
    """Per-device result elements of every collective over ``axis``, each repeated as often as it
    runs in one step (loop trip counts applied)."""
    state = step.abstract_state()
    batch = BATCH * prog.mesh.size("data")
    tokens = jax.ShapeDtypeStruct((batch, SEQ), jnp.int32)
    text = step.lower(state, tokens, tokens).compile().as_text()
    buffers = {}
    for op in collectives(text):
        if op.mesh_axes(prog.mesh.shape) != (axis,):
            continue
        for _, shape in op.shapes:
            buffers.setdefault(op.kind, []).extend([int(np.prod(shape))] * op.count)
    return {kind: sorted(sizes) for kind, sizes in buffers.items()}


def _inventory(prog, **kw):
    found = collective_inventory(_config(prog.strategy, **kw), prog.strategy, prog.mesh, BATCH,
                                          sequence_parallel=prog.options["sequence_parallel"])
    return {kind: sorted(sizes) for kind, sizes in found.items() if sizes}


@pytest.mark.parametrize("layers", [pytest.param(1, marks=pytest.mark.slow), 3])  # make test: 3
def test_megatron_block_has_two_all_reduces_forward_and_two_backward(layers):
    """Per block, g after the attention output and after MLP-down (forward) and f before QKV and
    before MLP-up (backward): four all-reduces of B*S*h, inside the scan over blocks."""
    require_devices(4)
    prog, mesh, step = _program("tensor", "model=4", layers=layers)
    buffers = _compiled_buffers(prog, step, "model")
    assert buffers == _inventory(prog, layers=layers)
    tokens = BATCH * SEQ
    assert Counter(buffers["all-reduce"])[tokens * HIDDEN] == 4 * layers + 2  # + embedding, head


def test_sequence_parallel_turns_each_all_reduce_into_reduce_scatter_and_all_gather():
    require_devices(4)
    prog, mesh, step = _program("tensor", "model=4", sequence_parallel=True)
    buffers = _compiled_buffers(prog, step, "model")
    assert buffers == _inventory(prog)
    plain_prog, _, plain_step = _program("tensor", "model=4")
    plain = _compiled_buffers(plain_prog, plain_step, "model")
    tokens, p = BATCH * SEQ, 4
    # the same network volume, an all-reduce of n moving what a reduce-scatter + all-gather
    # move, and the backward gathering each block's two column inputs again from their kept
    # shards (Korthikanti et al. Sec. 4.2.2): 2 more all-gathers a block
    assert buffers["reduce-scatter"] == [tokens * HIDDEN // p] * Counter(plain["all-reduce"])[
        tokens * HIDDEN]
    assert buffers["all-gather"] == [tokens * HIDDEN] * (len(buffers["reduce-scatter"])
                                                         + 2 * prog.config.layers)


def test_phantom_block_moves_what_its_docstring_says():
    require_devices(4)
    prog, mesh, step = _program("phantom", "model=4")
    buffers = _compiled_buffers(prog, step, "model")
    assert buffers == _inventory(prog)
    tokens, k, p = BATCH * SEQ, 3, 4
    assert set(buffers["all-gather"]) == {tokens * p * k}  # only k ghosts per token cross
    assert set(buffers["reduce-scatter"]) == {tokens * k}


def test_data_parallelism_adds_one_gradient_reduction_per_parameter():
    require_devices(8)
    prog, mesh, step = _program("tensor", "data=2,model=4")
    data = _compiled_buffers(prog, step, "data")
    local = [a.sharding.shard_shape(a.shape) for a in jax.tree.leaves(step.abstract_state().params)]
    params = sorted(int(np.prod(s)) for s in local)
    assert data == {"all-reduce": sorted(params + [1])}  # every gradient once, and the loss
    assert _compiled_buffers(prog, step, "model") == _inventory(prog)


@pytest.mark.parametrize("strategy, mesh, kw, message", [
    ("tensor", "model=8", dict(heads=4), "heads=4 is not divisible"),
    ("phantom", "model=4", dict(ghost_width=None), "needs ghost_width"),
    ("dense", "model=2", {}, "runs on one device"),
    ("tensor-t1", "model=2", {}, "does not run the model family"),
])
def test_bad_transformer_layouts_are_named_errors(strategy, mesh, kw, message):
    with pytest.raises(ConfigError, match=message):
        programs.build(_config(strategy, **kw), strategy, mesh)


def test_sequence_parallelism_needs_a_divisible_sequence_and_the_tensor_strategy():
    with pytest.raises(ConfigError, match="seq_len=6 is not divisible"):
        programs.build(_config("tensor", seq_len=6), "tensor", "model=4", sequence_parallel=True)
    with pytest.raises(ConfigError, match="sequence_parallel .*applies to the transformer"):
        programs.build(_config("phantom"), "phantom", "model=4", sequence_parallel=True)


def test_phantom_plan_finds_the_head_when_the_mlp_is_as_wide_as_the_vocabulary():
    """plans.phantom tells the LM head by its place, not only by its V outputs: an MLP of width
    4h = V stays a feature-split phantom layer (it once became a second vocabulary head)."""
    from jphantom.models.gpt2 import GPT2

    config = _config("phantom", vocab_size=64, hidden=16)  # 4h = 64 = V
    model = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    plan = plans.phantom(model, ghost_width=2)
    assert not plan["blocks.block.mlp.up"].vocab_output
    assert plan["head"].vocab_output


def test_a_vocabulary_the_model_axis_does_not_divide_is_replicated_with_a_warning():
    """GPT-2's 50257 tokens do not split over 2, 4 or 8 ranks: under Megatron the embedding, the
    tied head and the final norm then stay replicated (a warning says so); sequence
    parallelism, which needs the split head, is refused by name."""
    from jphantom.errors import JPhantomWarning

    with pytest.warns(JPhantomWarning, match="vocab_size=30 is not divisible"):
        prog, _, _ = _program("tensor", "data=2,model=4", vocab_size=30)
    assert prog.mesh.size("model") == 4
    with pytest.raises(ConfigError, match="vocab_size=30 is not divisible by the model axis"):
        programs.build(_config("tensor", vocab_size=30), "tensor", "model=4",
                       sequence_parallel=True)


@pytest.mark.slow  # make test: the warning and the refusal above
def test_a_vocabulary_the_model_axis_does_not_divide_runs_replicated_and_exact():
    """... and that step equals one device."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog, _, step = _program("tensor", "data=2,model=4", vocab_size=30)
    params = _perturbed(prog, step)
    tokens, targets = (np.minimum(a, 29) for a in _batch())
    loss, grads = jax.jit(step.value_and_grad())(params, tokens, targets)
    want_loss, want_grads = _oracle(prog, "data=2,model=4", params, tokens, targets,
                                    vocab_size=30)
    assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert_tree_close(grads, want_grads, 1e-5)
