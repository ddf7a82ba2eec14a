"""One process of the 2-process test in tests/run/test_distributed.py (not collected by pytest).

Usage:
    python tests/run/_distributed_worker.py COORDINATOR PROCESS_ID NUM_PROCESSES LOCAL_DEVICES OUT.npz

Joins the run, builds the global mesh over every process's CPU devices, computes the phantom FFN's
loss and gradients with the training step's ``value_and_grad`` (one jit of one shard_map, every
reduction included) on global arrays and writes them, gathered to host, to OUT.npz.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/, for helpers


def problem():
    """Deterministic shapes, input and target shared with the test (no jax needed)."""
    import numpy as np

    config = dict(width=64, ghost_width=3, num_shards=8, depth=2)
    batch = 16
    grid = np.arange(batch * config["width"], dtype=np.float64).reshape(batch, config["width"])
    x = np.sin(0.37 * grid).astype(np.float32)
    target = np.cos(0.11 * grid + 0.5).astype(np.float32)
    return config, x, target


def build(mesh):
    """The phantom FFN's program (:func:`jphantom.registry.program.build`), its training step on ``mesh``
    and the parameters as host arrays (numpy random numbers from a fixed seed: every process
    computes the same ones without running jax)."""
    import optax

    from helpers import random_params
    from jphantom.registry import program as programs
    from jphantom.models.ffn import FFNConfig

    config, _, _ = problem()
    program = programs.build(FFNConfig(config["width"], config["depth"], config["ghost_width"]),
                             "phantom", f"model={config['num_shards']}")
    step = program.train_step(mesh, optax.sgd(0.1), donate=False)
    return program, step, random_params(program)


def flat_names(tree) -> dict:
    """``{"layers/block/linear/local": array, ...}`` of a nested dictionary."""
    import jax

    return {"/".join(str(k.key) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def main(argv: list[str]) -> None:
    coordinator, process_id, num_processes, local_devices, out = argv
    from jphantom.runtime import distributed

    distributed.initialize(
        coordinator,
        int(num_processes),
        int(process_id),
        local_device_count=int(local_devices),
        initialization_timeout=60,
        platform="cpu",
    )

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jphantom.runtime.mesh import make_mesh

    config, x, target = problem()
    assert jax.process_count() == int(num_processes), jax.process_count()
    assert jax.device_count() == config["num_shards"], jax.devices()
    mesh = make_mesh({"model": config["num_shards"]})
    _, step, host_params = build(mesh)

    def to_global(value, sharding):
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    # Every process contributes the shards its devices own.
    params = jax.tree.map(to_global, host_params, step.param_shardings())
    x_global, target_global = (to_global(a, s) for a, s in zip((x, target),
                                                                 step.batch_shardings(2)))
    assert not any(a.is_fully_addressable for a in jax.tree.leaves(params))

    loss, grads = jax.jit(step.value_and_grad())(params, x_global, target_global)
    loss_host = multihost_utils.process_allgather(loss, tiled=True)
    grads_host = multihost_utils.process_allgather(grads, tiled=True)

    flat = {f"grad/{name}": np.asarray(value) for name, value in flat_names(grads_host).items()}
    np.savez(out, loss=np.asarray(loss_host), process_count=jax.process_count(), **flat)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
