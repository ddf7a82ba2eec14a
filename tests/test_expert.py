"""The expert-parallel MoE layer (:mod:`jphantom.sharding.expert`): equal to the dense oracle when
nothing is dropped, exact dropped counts, two all-to-alls each way, named errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jphantom.analysis.hlo import collectives
from jphantom.errors import ConfigError
from jphantom.mesh import MeshConfig, first_devices
from jphantom.sharding import expert

from conftest import require_devices
from helpers import assert_tree_close

HIDDEN, EXPERTS, TOKENS = 8, 8, 32
SPECS = {"router": P(), "w_in": P("expert"), "b_in": P("expert"), "w_out": P("expert"),
         "b_out": P("expert")}


def _config(**kw):
    base = dict(hidden=HIDDEN, experts=EXPERTS, top_k=2, capacity_factor=EXPERTS / 2, ffn=16)
    return expert.MoEConfig(**{**base, **kw})


def _inputs(seed=0):
    params = expert.init(jax.random.PRNGKey(seed), _config())
    params["router"] = params["router"] * 50  # decisive routing, varied gates
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.PRNGKey(seed + 1),
                                                                 a.shape), params)
    x = jax.random.normal(jax.random.PRNGKey(seed + 2), (TOKENS, HIDDEN))
    return params, x


@functools.lru_cache(maxsize=None)
def _sharded(ranks, config):
    mesh = MeshConfig.parse(f"expert={ranks}").build(first_devices(ranks))

    def per_rank(params, x):
        y, aux = expert.moe_per_rank(params, x, config)
        loss = lax.psum(jnp.sum(jnp.square(y)), "expert") / TOKENS
        return loss, lax.psum(aux["dropped"], "expert")

    def loss_and_grads(params, x):  # gradients of the parameters and of the input tokens
        (loss, dropped), grads = jax.value_and_grad(per_rank, argnums=(0, 1), has_aux=True)(
            params, x)
        return loss, grads, dropped

    fn = jax.shard_map(loss_and_grads, mesh=mesh, in_specs=(SPECS, P("expert")),
                       out_specs=(P(), (SPECS, P("expert")), P()), check_vma=True)
    return jax.jit(fn), mesh


def _dense(params, x, config):
    loss = lambda p, x: jnp.sum(jnp.square(expert.dense_moe(p, x, config)[0])) / TOKENS
    return jax.value_and_grad(loss, argnums=(0, 1))(params, x)


@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2, 4,
                                   pytest.param(8, marks=pytest.mark.slow)])
def test_expert_parallel_moe_equals_the_dense_moe(ranks):
    """Capacity large enough to drop nothing: loss and every gradient (parameters and input
    tokens) equal the dense single-device MoE (every expert on every token, combined by the
    gates), float32 1e-5."""
    require_devices(ranks)
    config = _config()
    params, x = _inputs()
    fn, _ = _sharded(ranks, config)
    loss, grads, dropped = fn(params, x)
    want_loss, want_grads = _dense(params, x, config)
    assert int(dropped) == 0
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert_tree_close(grads, want_grads, 1e-5)


def test_dropped_tokens_are_counted_exactly():
    """A router sending every token's first choice to expert 0: with capacity C per rank, each of
    the G ranks keeps C of its T/G first choices there and drops the rest; second choices spread."""
    require_devices(2)
    config = _config(top_k=1, capacity_factor=1.0)  # C = ceil(T/G / E) per rank
    params, x = _inputs()
    params["router"] = jnp.zeros_like(params["router"]).at[:, 0].set(1.0)
    x = jnp.abs(x) + 0.1  # positive features: expert 0's logit is the largest for every token
    fn, _ = _sharded(2, config)
    _, _, dropped = fn(params, x)
    per_rank = TOKENS // 2
    assert int(dropped) == 2 * (per_rank - config.capacity(per_rank))


def test_two_all_to_alls_forward_and_two_backward():
    """Dispatch and combine forward; their transposes backward (the input's gradient needs the
    dispatch's), each of one [E, C, h] capacity buffer."""
    require_devices(4)
    config = _config()
    params, x = _inputs()
    fn, mesh = _sharded(4, config)
    hlo = fn.lower(params, x).compile().as_text()
    found = [c for c in collectives(hlo) if c.kind == "all-to-all"]
    assert sum(c.count for c in found) == 4
    capacity = config.capacity(TOKENS // 4)
    assert {c.elements for c in found} == {EXPERTS * capacity * HIDDEN}


def test_aux_losses_equal_their_formulas():
    config = _config()
    params, x = _inputs()
    logits, probs, experts, _ = expert.route(params["router"], x, config)
    aux = expert.aux_losses(logits, probs, experts, config)
    p = np.asarray(probs)
    first = np.bincount(np.asarray(experts[:, 0]), minlength=EXPERTS) / TOKENS
    assert float(aux["load_balance"]) == pytest.approx(EXPERTS * np.sum(first * p.mean(0)),
                                                       rel=1e-6)
    lse = np.log(np.sum(np.exp(np.asarray(logits, np.float64)), axis=-1))
    assert float(aux["z_loss"]) == pytest.approx(np.mean(lse ** 2), rel=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=9), "top_k=9 > experts=8"),
    (dict(capacity_factor=0), "capacity_factor=0"),
])
def test_impossible_routing_is_a_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _config(**kwargs)


def test_experts_must_divide_over_the_expert_axis():
    with pytest.raises(ConfigError, match="experts=6 is not divisible by the expert axis size 4"):
        expert.MoEConfig(hidden=8, experts=6).check_axis(4)


TED_SPECS = {"router": P(), "w_in": P("expert", None, "model"), "b_in": P("expert", "model"),
             "w_out": P("expert", "model", None), "b_out": P("expert")}


@functools.lru_cache(maxsize=None)
def _ted(mesh_text, dtd, config):
    mesh_config = MeshConfig.parse(mesh_text)
    mesh = mesh_config.build(first_devices(mesh_config.device_count))

    def per_rank(params, x):
        y, _ = expert.moe_per_rank(params, x, config, model_axis="model", dtd=dtd)
        return lax.psum(jnp.sum(jnp.square(y)), "expert") / TOKENS

    def loss_and_grads(params, x):
        return jax.value_and_grad(per_rank, argnums=(0, 1))(params, x)

    fn = jax.shard_map(loss_and_grads, mesh=mesh, in_specs=(TED_SPECS, P("expert")),
                       out_specs=(P(), (TED_SPECS, P("expert"))), check_vma=True)
    return jax.jit(fn), mesh


@pytest.mark.parametrize("mesh, dtd", [("expert=2,model=2", False), ("expert=2,model=4", True),
                                       pytest.param("expert=2,model=2", True, marks=pytest.mark.slow),
                                       pytest.param("expert=2,model=4", False,
                                                    marks=pytest.mark.slow)])
def test_ted_experts_tensor_parallel_equal_the_dense_moe(mesh, dtd):
    """TED (seed 004 Eq. 7.1): experts tensor-parallel over model inside expert parallelism, with
    duplicate token dropping on and off: loss and every gradient of the dense MoE."""
    require_devices(MeshConfig.parse(mesh).device_count)
    config = _config()
    params, x = _inputs()
    fn, _ = _ted(mesh, dtd, config)
    loss, grads = fn(params, x)
    want_loss, want_grads = _dense(params, x, config)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert_tree_close(grads, want_grads, 1e-5)


def test_dtd_divides_the_all_to_all_bytes_by_the_tensor_ranks():
    require_devices(8)
    config = _config()
    params, x = _inputs()
    sizes = {}
    for dtd in (False, True):
        fn, _ = _ted("expert=2,model=4", dtd, config)
        hlo = fn.lower(params, x).compile().as_text()
        found = [c for c in collectives(hlo) if c.kind == "all-to-all"]
        assert sum(c.count for c in found) == 4
        sizes[dtd] = {c.elements for c in found}
    (plain,), (dropped,) = sizes[False], sizes[True]
    assert plain == 4 * dropped


@pytest.mark.parametrize("policy, all_to_alls", [("nothing_saveable", 6),
                                                 ("collectives_saveable", 4)])
def test_cac_keeps_the_all_to_all_outputs_so_the_recompute_repeats_none(policy, all_to_alls):
    """Seed 004's CAC: a checkpointed MoE layer recomputes its forward in the backward; saving the
    collectives' outputs by name (remat's ``collectives_saveable``) keeps the two all-to-alls out
    of the recompute (6 become 4)."""
    require_devices(4)
    from jphantom import remat

    config = _config()
    params, x = _inputs()
    mesh = MeshConfig.parse("expert=4").build(first_devices(4))
    layer = jax.checkpoint(lambda p, x: expert.moe_per_rank(p, x, config)[0],
                           policy=remat.POLICIES[policy])
    loss = lambda p, x: lax.psum(jnp.sum(jnp.square(layer(p, x))), "expert")
    fn = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                               in_specs=(SPECS, P("expert")), out_specs=(SPECS, P("expert")),
                               check_vma=True))
    hlo = fn.lower(params, x).compile().as_text()
    found = [c for c in collectives(hlo) if c.kind == "all-to-all"]
    assert sum(c.count for c in found) == all_to_alls
    assert {c.elements for c in found} == {EXPERTS * config.capacity(TOKENS // 4) * HIDDEN}


@functools.lru_cache(maxsize=None)
def _dropless(ranks):
    config = _config(capacity_factor=None)
    mesh = MeshConfig.parse(f"expert={ranks}").build(first_devices(ranks))

    def per_rank(params, x):
        y, aux = expert.moe_per_rank(params, x, config)
        return lax.psum(jnp.sum(jnp.square(y)), "expert") / TOKENS

    fn = jax.shard_map(jax.value_and_grad(per_rank, argnums=(0, 1)), mesh=mesh,
                       in_specs=(SPECS, P("expert")), out_specs=(P(), (SPECS, P("expert"))),
                       check_vma=True)
    return jax.jit(fn)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_dropless_path_equals_the_fixed_capacity_path_that_drops_nothing(ranks):
    """Sort, ragged exchange (``lax.ragged_all_to_all`` where the backend has it, its padded
    all_to_all emulation elsewhere), grouped matmuls (``lax.ragged_dot``): the same loss and
    gradients as the capacity path with a capacity that drops nothing, and the dense oracle."""
    require_devices(ranks)
    params, x = _inputs()
    loss, grads = _dropless(ranks)(params, x)
    fixed_loss, fixed_grads, dropped = _sharded(ranks, _config())[0](params, x)
    assert int(dropped) == 0
    assert float(loss) == pytest.approx(float(fixed_loss), rel=1e-5)
    assert_tree_close(grads, fixed_grads, 1e-5)


def test_ragged_all_to_all_support_is_detected_not_assumed():
    """XLA:CPU has no ragged-all-to-all (jax-ml/jax#34755): the probe compiles one and says so;
    on a backend that has it, the dropless test above runs the real primitive."""
    supported = expert.ragged_all_to_all_supported(jax.devices()[0].platform)
    assert supported == (jax.devices()[0].platform != "cpu")
