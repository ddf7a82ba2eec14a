"""Shared test utilities: the single-device oracle (the plain model a parallel model is, through
:func:`jphantom.plans.dense_equivalent`), gradients out of the real training step, compiled HLO of
abstract steps, and tree comparisons."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax


# jax 0.10's legacy CPU emitters (tests/conftest.py) are less exact in float64 and give NaN on
# FP8's FNUZ formats: a check at float64's 1e-10 or in FNUZ compiles with the fusion emitters, as
# jax >= 0.11 always does.
FUSION_EMITTERS = ({"xla_cpu_use_fusion_emitters": True}
                   if "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "")
                   else {})


def child_env(devices: int | None = None) -> dict[str, str]:
    """The environment for a process a test starts: this one's, with the suite's compile-speed
    XLA flags (tests/conftest.py: LLVM at -O0, jax 0.10's legacy emitters) but not its 8-device
    count, which the child sets itself (``--devices``) or takes from ``devices``. Without them a
    child compiled at XLA's default optimisation and, on jax 0.10, with the slower emitters."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def jit_exact(fn, **kwargs):
    """``jax.jit`` for a float64 check at 1e-10 or an FP8 step in FNUZ formats: compiled with
    jax's fusion emitters."""
    return jax.jit(fn, compiler_options=FUSION_EMITTERS or None, **kwargs)


def batch(width: int, size: int = 16, dtype=jnp.float64, seed: int = 1):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return (jax.random.normal(kx, (size, width), dtype), jax.random.normal(ky, (size, width), dtype))


def perturb(params, scale: float = 0.1, seed: int = 7):
    """Random non-zero biases and off-init weights, so that every parameter matters in the test."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(
        tree, [a + scale * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
    )


def param_shapes(program):
    """The parameters of a :class:`jphantom.registry.program.Program` as a dict of ShapeDtypeStructs (keys:
    the model's attribute paths, as ``TrainState.params``)."""
    from flax import nnx

    _, state, _ = nnx.split(program.model, nnx.Param, ...)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(state))


def random_params(program, seed: int = 7):
    """Parameters of ``program``'s shapes and dtype (a :class:`jphantom.registry.program.Program`) filled
    with numpy random numbers (no jax compilation): weights N(0, 1/fan_in) (fan_in: a kernel's
    dimension -2, else the last), biases N(0, 0.01) (0.1 standard deviation). Any values do for
    the oracle tests; phantom's own decompressor slot gets a random value too, which must have
    no effect."""
    shapes = param_shapes(program)
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = jax.tree_util.keystr(path)
        fan_in = leaf.shape[-2] if "kernel" in name else leaf.shape[-1]
        scale = 0.1 if "bias" in name else 1.0 / np.sqrt(fan_in)
        return (scale * rng.standard_normal(leaf.shape)).astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, shapes)


def mse(y, t):
    return jnp.mean(jnp.square(y - t))


@functools.lru_cache(maxsize=64)
def gradient_step(strategy: str, model_config, mesh: str, **options):
    """``(program, jax mesh, step, value_and_grad)`` of ``model_config`` under ``strategy`` on
    ``mesh`` (:func:`jphantom.registry.program.build`; step options such as ``zero``, ``remat``,
    ``pipeline`` in ``options``), ``value_and_grad(params, *batch) -> (loss, grads)`` jitted: the
    real step's ``shard_map`` with every reduction. Cached, so tests asking for the same
    configuration share one compilation."""
    from jphantom.registry import program as program_module
    from jphantom.runtime.mesh import first_devices

    program = program_module.build(model_config, strategy, mesh)
    mesh_obj = program.mesh.build(first_devices(program.mesh.device_count))
    step = program.train_step(mesh_obj, optax.sgd(0.1), donate=False, **options)
    return program, mesh_obj, step, jax.jit(step.value_and_grad())


def step_loss_and_grads(strategy: str, model_config, mesh: str, params, *batch, **options):
    """Loss and gradients of ``params`` (a dict like ``TrainState.params``) out of the compiled
    training step on ``mesh``."""
    _, _, _, value_and_grad = gradient_step(strategy, model_config, mesh, **options)
    return value_and_grad(params, *batch)


def _oracle_key(step):
    """What the oracle of ``step`` depends on: the model's structure (the same for every mesh of
    a strategy whose parameters keep their shapes, so that those share one compilation)."""
    layout = step.layout
    return (layout.graphdef, layout.state_treedef, layout.pure_treedef, layout.order,
            step.loss_fn)


_ORACLES = {}


def _oracle(step):
    from flax import nnx

    key = _oracle_key(step)
    if key in _ORACLES:
        return _ORACLES[key]
    layout = step.layout

    def loss(params, *batch):
        from jphantom.plans import dense_equivalent

        model = dense_equivalent(layout.model_of(jax.tree.leaves(params)))
        for _, module in nnx.iter_modules(model):  # compute in the parameters' float64
            if getattr(module, "dtype", None) is not None:
                module.dtype = None
        return step.loss_fn(model, *batch)

    _ORACLES[key] = jax.jit(jax.value_and_grad(loss))
    return _ORACLES[key]


def oracle_loss_and_grads(step, params, *batch):
    """Loss and gradients w.r.t. the *parallel* ``params`` computed on one device by
    differentiating ``step``'s loss of the plain model the parallel layers are
    (:func:`jphantom.plans.dense_equivalent`), in float64 so that float32 runs are compared with
    the exact answer."""
    from jphantom.step.exactness import on_one_device

    params64, batch64 = on_one_device((params, batch), jax.devices()[0], np.float64)
    return _oracle(step)(params64, *batch64)


def gradient_catcher() -> optax.GradientTransformation:
    """An "optimizer" whose state is the last gradient and whose update is zero: the training step
    then returns the exact gradients it computed (all reductions included) as its new state."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))


def abstract_state(step, optimizer=None):
    """A ``TrainState`` of ShapeDtypeStructs with the step's shardings (for lowering without
    creating anything)."""
    from jphantom.step.train_step import TrainState

    shapes = step.setup.pure(list(step.layout.shapes))
    shardings = step.param_shardings()
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          shapes, shardings)
    optimizer = optimizer or step.optimizer
    opt_shapes = jax.eval_shape(optimizer.init, shapes)
    opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       opt_shapes, step.update.state_shardings(shapes))
    return TrainState(params, opt)


def compiled_hlo(step, *batch_shapes):
    """The optimized HLO text of ``step`` (forward, backward, update) for abstract parameters and
    batch arrays of ``batch_shapes`` ((shape, dtype) pairs, in the step's batch shardings)."""
    from jax.sharding import NamedSharding

    specs = step.specs_of_batch(len(batch_shapes))
    batch = [jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(step.mesh, spec))
             for (shape, dtype), spec in zip(batch_shapes, specs)]
    return step.lower(abstract_state(step), *batch).compile().as_text()


def assert_tree_close(actual, expected, rtol, floor: float = 1e-30):
    """Every leaf: max |a - e| <= rtol * max(max |e|, floor) (a norm-wise relative error, robust
    near zeros; ``floor``: the scale below which a leaf is compared absolutely, for gradients
    that are zero in exact arithmetic). A leaf whose expected value is zero up to rounding (below
    1e-6 of the tree's largest, such as the gradient of an attention key bias, which softmax
    cancels exactly) is measured against the tree's largest instead: its computed value is
    rounding noise of the others."""
    a_leaves, a_tree = jax.tree.flatten(actual)
    e_leaves, e_tree = jax.tree.flatten(expected)
    assert a_tree == e_tree
    largest = max((float(np.max(np.abs(np.asarray(e, np.float64)))) for e in e_leaves
                   if np.size(e)), default=1.0)
    for path, a, e in zip(jax.tree_util.tree_flatten_with_path(expected)[0], a_leaves, e_leaves):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = max(np.max(np.abs(e)), floor) if e.size else 1.0
        scale = scale if scale > 1e-6 * largest else max(largest, 1e-30)
        err = np.max(np.abs(a - e)) / scale if e.size else 0.0
        assert err <= rtol, f"{jax.tree_util.keystr(path[0])}: relative error {err:.3e} > {rtol:g}"


TOLERANCE = {jnp.float64: 1e-10, jnp.float32: 1e-5}
DTYPE_NAME = {jnp.float64: "float64", jnp.float32: "float32"}


def exit_code(argv):
    """``jphantom.cli.main(argv)``'s exit status, argparse's SystemExit included."""
    from jphantom import cli

    try:
        return cli.main(argv)
    except SystemExit as exit_info:
        return exit_info.code


def assert_every_task_once(plan, kinds, local_chunks: int, microbatches: int) -> None:
    """Every device of a pipeline table (:func:`jphantom.pipeline.table.schedule_table`) runs each task of
    ``kinds`` once for every (local chunk, micro-batch): none twice, none missing."""
    from jphantom.pipeline.table import FIELDS, KINDS

    columns = [FIELDS.index("chunk"), FIELDS.index("mb")]
    for s in range(plan.table.shape[1]):
        rows = plan.table[:, s]
        for kind in kinds:
            ran = sorted(map(tuple, rows[rows[:, FIELDS.index("kind")] == KINDS.index(kind)]
                             [:, columns].tolist()))
            assert ran == [(v, m) for v in range(local_chunks) for m in range(microbatches)], \
                (s, kind)
