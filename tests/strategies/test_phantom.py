"""Phantom parallelism (Seal et al.) against the single-device dense oracle, and its validation."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jphantom.registry import program as program_module
from jphantom.errors import ConfigError, JPhantomWarning
from jphantom.models.ffn import FFNConfig
from jphantom.nn.phantom import ops as phantom

from conftest import require_devices
from helpers import (DTYPE_NAME, TOLERANCE, assert_tree_close, batch, gradient_step,
                     oracle_loss_and_grads, random_params, step_loss_and_grads)

WIDTH = 48  # divisible by 1, 2, 4, 8 -> n/p = 48, 24, 12, 6

# k = 8 at p = 8 and any k at p = 1 break Eq. 8's bound: legal, warned about, tested on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::jphantom.errors.JPhantomWarning")


def _config(ghost_width, depth, dtype, width=WIDTH):
    return FFNConfig(width=width, depth=depth, ghost_width=ghost_width, dtype=DTYPE_NAME[dtype])


def _case(num_shards, ghost_width, depth, dtype, width=WIDTH, strategy="phantom"):
    """The compiled step (cached) and random parameters of the phantom FFN's shapes (numpy: no
    compilation), own decompressor slots included."""
    require_devices(num_shards)
    config = _config(ghost_width, depth, dtype, width)
    program, _, step, _ = gradient_step(strategy, config, f"model={num_shards}")
    return config, step, random_params(program)


# Every p with every k at depth 3 in float64; depth 1 and float32 on a few (each case compiles a
# training step and the oracle: about 1 s).
CASES = ([(p, k, 3, jnp.float64) for p in (1, 2, 4, 8) for k in (1, 3, 8)]
         + [(2, 3, 1, jnp.float64), (8, 8, 1, jnp.float64)]
         + [(4, 3, 3, jnp.float32), (8, 8, 3, jnp.float32)])
# make test: one k per p (each k on some p), a depth 1 and a float32 case; the rest: make test-all
DEFAULT_CASES = {(1, 8, 3, jnp.float64), (2, 1, 3, jnp.float64), (4, 3, 3, jnp.float64),
                 (8, 8, 3, jnp.float64), (2, 3, 1, jnp.float64), (4, 3, 3, jnp.float32)}


@pytest.mark.parametrize("num_shards, ghost_width, depth, dtype", [
    pytest.param(*case, marks=() if case in DEFAULT_CASES else pytest.mark.slow) for case in CASES],
    ids=[f"p{p}-k{k}-L{d}-{DTYPE_NAME[t]}" for p, k, d, t in CASES])
# of those, make test runs p=2 at depth 1 in float64 and p=4 in float32; the rest: make test-all
@pytest.mark.slow_cells("p1-k8-L3-float64", "p2-k1-L3-float64", "p4-k3-L3-float64",
                        "p8-k8-L3-float64")
def test_phantom_matches_dense_equivalent(num_shards, ghost_width, depth, dtype):
    """Loss and every gradient of the training step (custom_vjp backward, Eqs. 15-21, under
    lax.scan inside one shard_map) equal jax.grad of the dense equivalent on one device."""
    config, step, params = _case(num_shards, ghost_width, depth, dtype)
    x, t = batch(WIDTH, dtype=dtype)
    loss, grads = step_loss_and_grads("phantom", config, f"model={num_shards}", params, x, t)
    want_loss, want_grads = oracle_loss_and_grads(step, params, x, t)
    np.testing.assert_allclose(loss, want_loss, rtol=TOLERANCE[dtype])
    assert_tree_close(grads, want_grads, TOLERANCE[dtype])


@pytest.mark.parametrize("num_shards", [2, pytest.param(8, marks=pytest.mark.slow)])  # test: 2
def test_unfused_decompressor_equals_fused(num_shards):
    """The paper's p-1 separate decompressor GEMMs give the same loss and gradients as one GEMM."""
    config, _, params = _case(num_shards, 3, 3, jnp.float64)
    x, t = batch(WIDTH)
    mesh = f"model={num_shards}"
    fused = step_loss_and_grads("phantom", config, mesh, params, x, t)
    unfused = step_loss_and_grads("phantom-unfused", config, mesh, params, x, t)
    assert_tree_close(unfused, fused, 1e-12)


def _decompress(params):
    return params["layers"]["block"]["linear"]["decompress"]


def test_own_decompressor_slot_has_no_effect_and_no_gradient():
    """D^(j,j) is not part of the model (Seal et al. Sec. III): changing it changes nothing, and it
    gets an exactly zero gradient, so training never turns it on (digest Sec. 2.5)."""
    p = 4
    config, _, params = _case(p, 3, 3, jnp.float64)
    x, t = batch(WIDTH)
    mesh = f"model={p}"
    loss, grads = step_loss_and_grads("phantom", config, mesh, params, x, t)
    own = jnp.arange(p)
    poisoned = jax.tree.map(lambda a: a, params)
    poisoned["layers"]["block"]["linear"]["decompress"] = (
        jnp.asarray(_decompress(params)).at[:, own, own].set(1e3))
    loss_poisoned, grads_poisoned = step_loss_and_grads("phantom", config, mesh, poisoned, x, t)
    assert float(loss_poisoned) == float(loss)
    assert np.all(np.asarray(_decompress(grads)[:, own, own]) == 0.0)
    assert np.all(np.asarray(_decompress(grads_poisoned)[:, own, own]) == 0.0)
    assert_tree_close(grads_poisoned, grads, 1e-14)


def _layer0(params):
    """Layer 0's phantom arrays (the stack's leading [L] axis dropped)."""
    return jax.tree.map(lambda a: jnp.asarray(a)[0], params["layers"]["block"]["linear"])


def test_dense_equivalent_block_structure():
    """Diagonal blocks are L^(j); block (j, i) is D^(i,j) C^(i), of rank <= k (Sec. III): the
    kernel of the plain layer the phantom layer is (jphantom.plans.dense_equivalent)."""
    from flax import nnx

    from jphantom.plans import dense_equivalent

    p, k = 4, 2
    _, step, params = _case(p, k, 1, jnp.float64)
    layer = _layer0(params)
    dense = dense_equivalent(step.layout.model_of(jax.tree.leaves(params)))
    assert isinstance(dense.layers.block.linear, nnx.Linear)
    weight = np.asarray(dense.layers.block.linear.kernel[...][0]).T  # y = x W^T + b
    m = WIDTH // p
    block = lambda j, i: weight[j * m:(j + 1) * m, i * m:(i + 1) * m]
    for j in range(p):
        np.testing.assert_array_equal(block(j, j), layer["local"][j])
        for i in range(p):
            if i != j:
                np.testing.assert_allclose(block(j, i), layer["decompress"][j, i] @ layer["compress"][i])
                assert np.linalg.matrix_rank(block(j, i)) <= k


@pytest.mark.parametrize(
    "num_shards, ghost_width, millions",
    [(8, 16, 71), (16, 6, 37), (32, 4, 21), (64, 2, 13), (128, 2, 13), (256, 4, 36)],
)
def test_param_count_reproduces_table_one(num_shards, ghost_width, millions):
    """Table I model sizes for n = 16384, L = 2 (weights only)."""
    count = phantom.param_count(16384, ghost_width, num_shards, 2)
    assert round(count / 1e6) == millions
    assert count == 2 * (16384**2 // num_shards + ghost_width * 16384 * num_shards)


def test_tensor_parallel_model_size_of_table_one():
    """The dense model TP trains, n = 16384, L = 2: L n^2 weights (+ L n biases), built abstract."""
    program = program_module.build(FFNConfig(16384, 2), "tensor-t1", "model=8")
    assert program.param_count == 2 * 16384**2 + 2 * 16384
    assert round(program.param_count / 1e6) == 537


def test_param_count_matches_initialised_arrays():
    """L(n^2/p + knp) counts exactly the stored weights of the phantom FFN minus the unused own
    decompressor slots (and the program's count is that plus the slots and the biases)."""
    from helpers import param_shapes

    p, k, depth = 4, 3, 2
    program = program_module.build(FFNConfig(WIDTH, depth, k), "phantom", f"model={p}")
    params = param_shapes(program)["layers"]["block"]["linear"]
    assert params["decompress"].shape == (depth, p, p, WIDTH // p, k)
    stored = sum(params[name].size for name in ("local", "compress", "decompress"))
    own_slots = depth * p * (WIDTH // p) * k
    assert stored - own_slots == phantom.param_count(WIDTH, k, p, depth)
    biases = params["bias"].size
    assert phantom.param_count(WIDTH, k, p, depth, include_bias=True) == stored - own_slots + biases
    assert program.param_count == stored + biases


def test_ghost_width_above_eq8_bound_warns_with_the_bound():
    with pytest.warns(JPhantomWarning, match=r"ghost_width=448 .*\(n/p\)\(1-1/p\)=448 .*Eq\. 8"):
        phantom.PhantomConfig(width=4096, ghost_width=448, num_shards=8, depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        phantom.PhantomConfig(width=4096, ghost_width=447, num_shards=8, depth=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(width=100, ghost_width=4, num_shards=8, depth=2), r"width=100 is not divisible by num_shards=8.*96 or 104"),
        (dict(width=64, ghost_width=0, num_shards=8, depth=2), r"ghost_width=0 must be an integer >= 1"),
        (dict(width=64, ghost_width=2, num_shards=8, depth=0), r"depth=0"),
    ],
)
def test_bad_shapes_raise_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        phantom.PhantomConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(width=100, ghost_width=4), r"width=100 is not divisible by num_shards=8.*96 or 104"),
    (dict(width=64), r"strategy 'phantom' needs ghost_width"),
])
def test_bad_phantom_programs_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        program_module.build(FFNConfig(depth=2, **kwargs), "phantom", "model=8")


def test_build_warns_above_eq8_bound_once():
    with pytest.warns(JPhantomWarning, match=r"ghost_width=448 .*Eq\. 8") as record:
        program_module.build(FFNConfig(4096, 1, 448), "phantom", "model=8")
    assert len([w for w in record if issubclass(w.category, JPhantomWarning)]) == 1


def test_mesh_without_axis_and_mismatched_shards_are_errors():
    """A phantom model's p is part of its shapes: a mesh without ``model`` is refused when the
    program is built, and a model built for p=4 stepped on model=2 when the step is traced."""
    import optax

    from jphantom.runtime.mesh import first_devices
    from jphantom.step.train_step import make_train_step

    require_devices(4)
    config = _config(2, 1, jnp.float32)
    with pytest.raises(ConfigError, match=r"shards features over the 'model' axis: add it"):
        program_module.build(config, "phantom", "data=4")
    program = program_module.build(config, "phantom", "model=4")
    mesh = jax.make_mesh((2,), ("model",), devices=first_devices(2))
    step = make_train_step(program.model, mesh, optax.sgd(0.1), program.loss_fn,
                           batch_specs=program.batch_specs)
    x, t = batch(WIDTH, dtype=jnp.float32)
    with pytest.raises(ConfigError, match=r"num_shards=4 but mesh axis 'model' has size 2"):
        jax.eval_shape(step.value_and_grad(), random_params(program), x, t)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_rank_compute_is_the_layer_without_its_collectives(fused):
    """rank_compute (E11's timing kernel) does a rank's exact arithmetic: fed the all-gather's and the
    reduce-scatter's results by hand, every rank's z and gradients equal the dense layer's VJP."""
    p, k, width = 4, 3, 24
    m = width // p
    layer = _layer0(_case(p, k, 1, jnp.float64, width=width)[2])
    x, dz = batch(width, size=5)

    def dense(prm, x):
        weight, bias = phantom.linear_dense_equivalent(prm)
        return x @ weight.T + bias

    z_dense, vjp = jax.vjp(dense, layer, x)
    want_grads, want_dx = vjp(dz)
    ys = [x[:, j * m:(j + 1) * m] for j in range(p)]
    gathered = jnp.stack([ys[i] @ layer["compress"][i].T for i in range(p)])  # the all-gather
    args = lambda j, gamma: (ys[j], gathered, gamma, dz[:, j * m:(j + 1) * m], layer["local"][j],
                             layer["compress"][j], layer["decompress"][j], layer["bias"][j])
    zeros = jnp.zeros((5, k))
    messages = [phantom.rank_compute(*args(j, zeros), rank=j, fused=fused)["messages"]
                for j in range(p)]
    for j in range(p):
        gamma = sum(messages[i][j] for i in range(p))  # the reduce-scatter
        out = phantom.rank_compute(*args(j, gamma), rank=j, fused=fused)
        np.testing.assert_allclose(out["ghosts"], gathered[j], rtol=1e-12)
        np.testing.assert_allclose(out["z"], z_dense[:, j * m:(j + 1) * m], rtol=1e-10)
        d_y, d_local, d_compress, d_decompress, d_bias = out["grads"]
        np.testing.assert_allclose(d_y, want_dx[:, j * m:(j + 1) * m], rtol=1e-10)
        for got, name in [(d_local, "local"), (d_compress, "compress"),
                          (d_decompress, "decompress"), (d_bias, "bias")]:
            np.testing.assert_allclose(got, want_grads[name][j], rtol=1e-10, atol=1e-12,
                                       err_msg=name)


@pytest.mark.parametrize("ghost_width", [2.0, None, True, "2"])
def test_a_ghost_width_that_is_not_an_integer_is_a_config_error(ghost_width):
    from jphantom.errors import ConfigError
    from jphantom.nn.phantom.ops import PhantomConfig

    with pytest.raises(ConfigError, match="ghost_width=.* must be an integer"):
        PhantomConfig(16, ghost_width, 2, 2)
