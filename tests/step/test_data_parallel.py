"""Data parallelism: every FFN strategy on ``data=2,model=4`` and ``data=4,model=2`` meshes trains
the same model as on one device, and adds exactly one gradient all-reduce per parameter and step,
over the ``data`` axis.

The batch is split over ``data`` and the features over ``model``; parameters are replicated over
``data`` and each data rank differentiates its own share of the global mean loss, so the training
step (:func:`jphantom.make_train_step`) sums the gradients over ``data`` once, after the
backward pass.
"""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jphantom.registry import program as program_module
from jphantom.analysis.hlo import collectives, summarize
from jphantom.errors import JPhantomWarning
from jphantom.models.ffn import FFNConfig

from conftest import require_devices
from helpers import (DTYPE_NAME, TOLERANCE, assert_tree_close, batch, compiled_hlo, gradient_step,
                     oracle_loss_and_grads, random_params)

WIDTH, BATCH, GHOST = 32, 16, 2
STRATEGIES = ["gspmd", "tensor", "tensor-t1", "phantom", "phantom-unfused"]
# Both meshes, an even and an odd depth (Megatron ends with its scatter or a lone column layer),
# float32 once: each case compiles one training step.
CASES = [("data=2,model=4", 2, jnp.float64), ("data=4,model=2", 3, jnp.float64),
         ("data=2,model=4", 3, jnp.float32)]


def _config(name, depth, dtype=jnp.float64):
    family = program_module.get(name).family
    return FFNConfig(width=WIDTH, depth=depth, ghost_width=GHOST if family == "phantom" else None,
                     dtype=DTYPE_NAME[dtype])


def _step(name, mesh, depth, dtype=jnp.float64):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JPhantomWarning)
        return gradient_step(name, _config(name, depth, dtype), mesh)


@pytest.mark.parametrize("name, mesh, depth, dtype", [
    pytest.param(name, *case, marks=() if case == CASES[0] or name in ("tensor", "phantom")
                 else pytest.mark.slow)  # make test: every strategy on the first case
    for name in STRATEGIES for case in CASES],
    ids=[f"{name}-{m}-L{d}-{DTYPE_NAME[t]}" for name in STRATEGIES for m, d, t in CASES])
@pytest.mark.slow_cells(
    "phantom-unfused-data=2,model=4-L2-float64", "phantom-data=4,model=2-L3-float64",
    "tensor-data=2,model=4-L3-float32", "phantom-data=2,model=4-L2-float64")
def test_loss_and_gradients_equal_the_dense_model(name, mesh, depth, dtype):
    """Loss and every gradient of the training step on a data x model mesh equal jax.grad of the
    dense model on one device, over the whole (global) batch."""
    require_devices(8)
    program, _, step, value_and_grad = _step(name, mesh, depth, dtype)
    params = random_params(program)
    x, t = batch(WIDTH, size=BATCH, dtype=dtype)
    loss, grads = value_and_grad(params, x, t)
    want_loss, want_grads = oracle_loss_and_grads(step, params, x, t)
    np.testing.assert_allclose(loss, want_loss, rtol=TOLERANCE[dtype])
    assert_tree_close(jax.device_get(grads), want_grads, TOLERANCE[dtype])


def _param_bytes_per_device(name, mesh):
    _, mesh_obj, step, _ = _step(name, mesh, 2, jnp.float32)
    return sum(math.prod(NamedSharding(mesh_obj, spec).shard_shape(a.shape)) * a.dtype.itemsize
               for a, spec in zip(step.layout.shapes, step.layout.specs))


@functools.lru_cache(maxsize=None)
def _collectives(name, mesh, batch_size):
    _, _, step, _ = _step(name, mesh, 2, jnp.float32)
    shape = ((batch_size, WIDTH), np.float32)
    return collectives(compiled_hlo(step, shape, shape))


@pytest.mark.parametrize("name", ["tensor", "tensor-t1", "phantom"])
def test_data_parallelism_adds_one_gradient_all_reduce_per_parameter(name):
    """data=2,model=4 at batch 16 against model=4 at batch 8 (the same per-rank work): the
    collectives over ``model`` are identical, the scalar loss all-reduce now spans both axes, and
    the only addition is all-reduce over ``data`` whose bytes are exactly the parameters one device
    holds: each parameter's gradient summed once per step (XLA may pack several into one tuple
    all-reduce, so bytes and axes are asserted, not the number of ops)."""
    require_devices(8)
    axes = {"data": 2, "model": 4}
    alone = _collectives(name, "model=4", BATCH // 2)
    data = _collectives(name, "data=2,model=4", BATCH)
    scalar = lambda c: all(dims == () for _, dims in c.shapes)
    over = lambda found, mesh_axes, span: sorted(
        (c.kind, c.shapes, c.count) for c in found
        if c.mesh_axes(mesh_axes) == span and not scalar(c))
    assert over(data, axes, ("model",)) == over(alone, {"model": 4}, ("model",))
    assert [(c.kind, c.mesh_axes(axes), c.bytes) for c in data if scalar(c)] == [
        ("all-reduce", ("data", "model"), 4)]  # the loss, once
    rows = summarize(data, axes=axes)
    assert {r["axes"] for r in rows} == {("model",), ("data",), ("data", "model")}
    gradients = [r for r in rows if r["axes"] == ("data",)]
    assert [r["kind"] for r in gradients] == ["all-reduce"]
    param_bytes = _param_bytes_per_device(name, "data=2,model=4")
    assert param_bytes == _param_bytes_per_device(name, "model=4")  # replicated over data
    assert gradients[0]["bytes"] == param_bytes
    leaves = _step(name, "model=4", 2, jnp.float32)[2].layout.shapes
    assert 1 <= gradients[0]["count"] <= len(leaves)


def test_inspect_breakdown_times_the_step_with_and_without_its_reductions():
    """Cheng et al.'s breakdown: both steps run; the shares add up to one; the all-reduce over data is
    modelled by Eq. 26."""
    from jphantom.analysis.timing import breakdown
    from jphantom.config import RunConfig

    require_devices(2)
    config = RunConfig.from_flags(model="ffn", strategy="tensor", width=16, depth=2, batch=8,
                                  mesh="data=2,model=1", optimizer="sgd", out=None)
    result = breakdown(config, steps=2, warmup=1)
    assert result["t_iter"] > 0 and result["t_compute"] > 0
    assert result["t_comm"] == max(result["t_iter"] - result["t_compute"], 0.0)
    assert result["r_comm"] == pytest.approx(result["t_comm"] / result["t_iter"])
    assert result["t_comm_eq26_frontier_modelled"] > 0
