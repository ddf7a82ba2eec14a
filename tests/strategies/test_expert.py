"""The routed MoE layers (:class:`jphantom.nn.moe.SwitchMoE` and its expert-parallel
:class:`jphantom.nn.expert_parallel.ExpertParallelMoE`): equal to the dense oracle (every expert on every
token, weighted by the router's gates) when nothing is dropped, the load-balancing loss of the
whole batch on every mesh, exact dropped counts, two all-to-alls each way, TED and DTD, CAC, the
dropless path, named errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jphantom
from jphantom.step import remat
from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import MeshConfig, first_devices
from jphantom.nn import expert_parallel as expert
from jphantom.nn import metadata
from jphantom.nn.moe import SwitchMoE

from conftest import require_devices
from helpers import assert_tree_close

HIDDEN, WIDTH, EXPERTS, TOKENS = 8, 16, 8, 32


@functools.lru_cache(maxsize=None)
def _moe(seed=0, **kw) -> SwitchMoE:
    """A SwitchMoE with decisive routing (router N(0, 1)), varied gates and non-zero biases
    (created under jax.jit; shared: tests read it, never change it)."""
    kw = {"top_k": 2, "capacity_factor": EXPERTS / 2, **kw}
    build = lambda: SwitchMoE(HIDDEN, WIDTH, EXPERTS, rngs=nnx.Rngs(seed),
                              router_init=nnx.initializers.normal(1.0), **kw)

    def create():
        state = nnx.split(build())[1]
        keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 16))
        return jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape,
                                                                   a.dtype), state)

    return nnx.merge(nnx.split(nnx.eval_shape(build))[0], jax.jit(create)())


def _tokens(seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed + 2), (TOKENS, HIDDEN))


def _pure(module):
    return nnx.to_pure_dict(nnx.split(module)[1])


@functools.lru_cache(maxsize=None)
def _plain(moe_kw=()):
    """The single-device layer ``_moe(**moe_kw)``, jitted: (pure params, x) -> (y, aux)."""
    graphdef, state = nnx.split(_moe(**dict(moe_kw)))
    return jax.jit(lambda pure, x: nnx.merge(graphdef, _replaced(state, pure))(x))


@functools.lru_cache(maxsize=None)
def _dense_fn():
    """The oracle: every expert on every token, combined by the router's top-k gates; jitted
    value_and_grad of sum(y^2) / T with respect to the parameters and the tokens."""
    graphdef, state = nnx.split(_moe())

    def loss(pure, x):
        m = nnx.merge(graphdef, _replaced(state, pure))
        return jnp.sum(jnp.square(m.experts(x, m.dense_gates(x)))) / TOKENS

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _dense(moe, x):
    return _dense_fn()(_pure(moe), x)


@functools.lru_cache(maxsize=None)
def _layer_fn(mesh_text, moe_kw=(), layer_kw=(), policy=None):
    """The parallel layer of ``_moe(**moe_kw)`` on ``mesh_text`` (tokens split over ``expert``,
    replicated over ``model``) as one jitted shard_map: (leaves, x) -> (loss, (grads of the
    leaves, of x), (dropped, load balance)); loss = sum(y^2) / T. ``policy``: the layer under
    ``jax.checkpoint`` with that remat policy."""
    mesh_config = MeshConfig.parse(mesh_text)
    require_devices(mesh_config.device_count)
    mesh = mesh_config.build(first_devices(mesh_config.device_count))
    layer = expert.ExpertParallelMoE.from_module(_moe(**dict(moe_kw)), batch_axes=("expert",),
                                                 **dict(layer_kw))
    graphdef, state = nnx.split(layer)
    leaves, treedef = jax.tree.flatten(state)
    variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    specs = [metadata.spec_of(v, mesh.axis_names) for v in variables]

    def apply(leaves, x):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(x)

    if policy is not None:
        apply = jax.checkpoint(apply, policy=remat.POLICIES[policy])

    def per_rank(leaves, x):
        y, aux = apply(leaves, x)
        loss = lax.psum(jnp.sum(jnp.square(y)), "expert") / TOKENS
        return loss, (lax.psum(aux["dropped"], "expert"), aux["load_balance"])

    def loss_and_grads(leaves, x):
        return jax.value_and_grad(per_rank, argnums=(0, 1), has_aux=True)(leaves, x)

    x_spec = jax.sharding.PartitionSpec("expert")
    fn = jax.jit(jax.shard_map(loss_and_grads, mesh=mesh, in_specs=(specs, x_spec),
                               out_specs=((jax.sharding.PartitionSpec(),) * 2, (specs, x_spec)),
                               check_vma=True))
    to_pure = lambda grads: nnx.to_pure_dict(jax.tree.unflatten(treedef, grads))
    to_leaves = lambda pure: jax.tree.leaves(_replaced(state, pure))
    return fn, leaves, to_pure, to_leaves


def _replaced(state, pure):
    state = jax.tree.map(lambda a: a, state)
    nnx.replace_by_pure_dict(state, pure)
    return state


def _run(mesh_text, moe_kw=(), layer_kw=()):
    """(loss, pure grads, grad of x, dropped, load balance) of the parallel layer."""
    fn, leaves, to_pure, _ = _layer_fn(mesh_text, tuple(moe_kw), tuple(layer_kw))
    (loss, (dropped, balance)), (grads, dx) = fn(leaves, _tokens())
    return loss, to_pure(grads), dx, dropped, balance


@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2, 4,
                                   pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.slow_cells("2")
def test_expert_parallel_moe_equals_the_dense_moe(ranks):
    """Capacity large enough to drop nothing: loss and every gradient (parameters and input
    tokens) equal the dense single-device MoE (every expert on every token, combined by the
    gates), float32 1e-5; the load-balancing loss is the whole batch's (its statistics summed
    over the ranks), the single-device layer's."""
    moe, x = _moe(), _tokens()
    loss, grads, dx, dropped, balance = _run(f"expert={ranks}")
    want_loss, (want_grads, want_dx) = _dense(moe, x)
    assert int(dropped) == 0
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert_tree_close((grads, dx), (want_grads, want_dx), 1e-5)
    y, aux = _plain()(_pure(moe), x)  # the plain layer: the capacity path on one device
    assert float(jnp.sum(jnp.square(y)) / TOKENS) == pytest.approx(float(want_loss), rel=1e-5)
    assert float(balance) == pytest.approx(float(aux["load_balance"]), rel=1e-6)


def test_dropped_tokens_are_counted_exactly():
    """A router sending every token's first choice to expert 0: with capacity C per rank, each of
    the G ranks keeps C of its T/G first choices there and drops the rest (the single-device
    layer: C of T)."""
    kw = (("top_k", 1), ("capacity_factor", 1.0))  # C = ceil(T/G / E) per rank
    fn, leaves, to_pure, to_leaves = _layer_fn("expert=2", kw)
    router = jnp.zeros((HIDDEN, EXPERTS)).at[:, 0].set(1.0)
    leaves = to_leaves({**to_pure(leaves), "router": router})
    x = jnp.abs(_tokens()) + 0.1  # positive features: expert 0's logit is the largest
    (_, (dropped, _)), _ = fn(leaves, x)
    config = _moe(**dict(kw)).config
    per_rank = TOKENS // 2
    assert int(dropped) == 2 * (per_rank - config.capacity(per_rank))
    _, aux = _plain(kw)({**_pure(_moe(**dict(kw))), "router": router}, x)
    assert int(aux["dropped"]) == TOKENS - config.capacity(TOKENS)


def test_two_all_to_alls_forward_and_two_backward():
    """Dispatch and combine forward; their transposes backward (the input's gradient needs the
    dispatch's), each of one [E, C, h] capacity buffer."""
    fn, leaves, *_ = _layer_fn("expert=4")
    hlo = fn.lower(leaves, _tokens()).compile().as_text()
    found = [c for c in collectives(hlo) if c.kind == "all-to-all"]
    assert sum(c.count for c in found) == 4
    capacity = _moe().config.capacity(TOKENS // 4)
    assert {c.elements for c in found} == {EXPERTS * capacity * HIDDEN}


def test_aux_losses_equal_their_formulas():
    moe, x = _moe(), _tokens()
    _, aux = _plain()(_pure(moe), x)
    logits = np.asarray(x @ moe.router[...], np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    first = np.bincount(np.argmax(p, axis=-1), minlength=EXPERTS) / TOKENS
    assert float(aux["load_balance"]) == pytest.approx(EXPERTS * np.sum(first * p.mean(0)),
                                                       rel=1e-5)
    lse = np.log(np.sum(np.exp(logits), axis=-1))
    assert float(aux["z_loss"]) == pytest.approx(np.mean(lse ** 2), rel=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=9), "top_k=9 > experts=8"),
    (dict(capacity_factor=0), "capacity_factor=0"),
])
def test_impossible_routing_is_a_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SwitchMoE(HIDDEN, WIDTH, EXPERTS, rngs=nnx.Rngs(0), **kwargs)


def test_experts_must_divide_over_the_expert_axis():
    class Holder(nnx.Module):
        def __init__(self):
            self.moe = SwitchMoE(8, 16, 6, rngs=nnx.Rngs(0))

    with pytest.raises(ConfigError, match="moe: experts=6 is not divisible by the expert axis "
                                          "size 4"):
        jphantom.parallelize(nnx.eval_shape(Holder), {"expert": 4, "model": 1}, {"moe": "experts"})


@pytest.mark.parametrize("mesh, dtd", [("expert=2,model=2", False), ("expert=2,model=4", True),
                                       pytest.param("expert=2,model=2", True,
                                                    marks=pytest.mark.slow),
                                       pytest.param("expert=2,model=4", False,
                                                    marks=pytest.mark.slow)])
def test_ted_experts_tensor_parallel_equal_the_dense_moe(mesh, dtd):
    """TED (Singh's thesis Eq. 7.1): experts tensor-parallel over model inside expert parallelism, with
    duplicate token dropping on and off: loss and every gradient of the dense MoE."""
    loss, grads, dx, dropped, _ = _run(mesh, layer_kw=(("model_axis", "model"), ("dtd", dtd)))
    want_loss, (want_grads, want_dx) = _dense(_moe(), _tokens())
    assert int(dropped) == 0
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert_tree_close((grads, dx), (want_grads, want_dx), 1e-5)


def test_dtd_divides_the_all_to_all_bytes_by_the_tensor_ranks():
    sizes = {}
    for dtd in (False, True):
        fn, leaves, *_ = _layer_fn("expert=2,model=4", (),
                                  (("model_axis", "model"), ("dtd", dtd)))
        hlo = fn.lower(leaves, _tokens()).compile().as_text()
        found = [c for c in collectives(hlo) if c.kind == "all-to-all"]
        assert sum(c.count for c in found) == 4
        sizes[dtd] = {c.elements for c in found}
    (plain,), (dropped,) = sizes[False], sizes[True]
    assert plain == 4 * dropped


@pytest.mark.parametrize("policy, all_to_alls", [("nothing_saveable", 6),
                                                 ("collectives_saveable", 4)])
def test_cac_keeps_the_all_to_all_outputs_so_the_recompute_repeats_none(policy, all_to_alls):
    """Singh's CAC: a checkpointed MoE layer recomputes its forward in the backward; saving the
    collectives' outputs by name (remat's ``collectives_saveable``) keeps the two all-to-alls out
    of the recompute (6 become 4)."""
    fn, leaves, *_ = _layer_fn("expert=4", policy=policy)
    hlo = fn.lower(leaves, _tokens()).compile().as_text()
    found = [c for c in collectives(hlo) if c.kind == "all-to-all"]
    assert sum(c.count for c in found) == all_to_alls
    assert {c.elements for c in found} == {EXPERTS * _moe().config.capacity(TOKENS // 4) * HIDDEN}


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow), 4])
@pytest.mark.slow_cells("1")
def test_dropless_path_equals_the_fixed_capacity_path_that_drops_nothing(ranks):
    """Sort, ragged exchange (``lax.ragged_all_to_all`` where the backend has it, its padded
    all_to_all emulation elsewhere), grouped matmuls (``lax.ragged_dot``): the same loss and
    gradients as the capacity path with a capacity that drops nothing, and the dense oracle; the
    single-device dropless layer too."""
    dropless = (("capacity_factor", None),)
    loss, grads, dx, dropped, _ = _run(f"expert={ranks}", dropless)
    fixed_loss, fixed_grads, fixed_dx, fixed_dropped, _ = _run(f"expert={ranks}")
    assert int(dropped) == 0 and int(fixed_dropped) == 0
    assert float(loss) == pytest.approx(float(fixed_loss), rel=1e-5)
    assert_tree_close((grads, dx), (fixed_grads, fixed_dx), 1e-5)
    y, _ = _plain(dropless)(_pure(_moe(**dict(dropless))), _tokens())
    assert float(jnp.sum(jnp.square(y)) / TOKENS) == pytest.approx(float(loss), rel=1e-5)


def test_the_ragged_all_to_all_table_says_what_this_backend_compiles():
    """XLA:CPU has no ragged-all-to-all (jax-ml/jax#34755): compiling one here agrees with
    :func:`jphantom.runtime.mesh.has_ragged_all_to_all`; on a backend that has it, the dropless test
    above runs the real primitive."""
    from jphantom.runtime.mesh import has_ragged_all_to_all

    device = jax.devices()[0]
    mesh = jax.sharding.Mesh([device], ("probe",))
    spec = jax.sharding.PartitionSpec("probe")

    def probe(x):
        sizes, zero = jnp.ones((1,), jnp.int32), jnp.zeros((1,), jnp.int32)
        return lax.ragged_all_to_all(x, jnp.zeros_like(x), zero, sizes, zero, sizes,
                                     axis_name="probe")

    try:
        jax.jit(jax.shard_map(probe, mesh=mesh, in_specs=spec, out_specs=spec)).lower(
            jax.ShapeDtypeStruct((1, 1), jnp.float32,
                                 sharding=jax.sharding.NamedSharding(mesh, spec))).compile()
        compiles = True
    except Exception:  # noqa: BLE001 - any failure to compile means "not supported here"
        compiles = False
    assert has_ragged_all_to_all(device.platform) == compiles


def test_parallel_layers_give_back_the_plain_layer():
    """``dense_equivalent``: the expert-parallel layer holds the plain layer's parameters
    unchanged; the phantom-parallel one the dense experts it is (equal outputs on one device
    for k = n/p, where the factorisation is exact)."""
    moe, x = _moe(), _tokens()
    back = expert.ExpertParallelMoE.from_module(moe, model_axis="model").dense_equivalent()
    assert_tree_close(_pure(back), _pure(moe), 0)
    graphdef, state = nnx.split(moe)

    @jax.jit
    def outputs(pure, x):
        plain = nnx.merge(graphdef, _replaced(state, pure))
        phantom = expert.PhantomMoE.from_module(plain, ghost_width=HIDDEN, num_shards=2)
        return phantom.dense_equivalent()(x)[0], plain(x)[0]

    got, want = outputs(_pure(moe), x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
