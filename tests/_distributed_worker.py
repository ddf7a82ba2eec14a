"""One process of the 2-process test in tests/test_distributed.py (not collected by pytest).

Usage:
    python tests/_distributed_worker.py COORDINATOR PROCESS_ID NUM_PROCESSES LOCAL_DEVICES OUT.npz

Joins the run, builds the global mesh over every process's CPU devices, computes the phantom FFN's
loss and gradients under jax.jit on global arrays and writes them, gathered to host, to OUT.npz.
"""

from __future__ import annotations

import sys


def problem():
    """Deterministic shapes, input and target shared with the test (no jax needed)."""
    import numpy as np

    config = dict(width=64, ghost_width=3, num_shards=8, depth=2)
    batch = 16
    grid = np.arange(batch * config["width"], dtype=np.float64).reshape(batch, config["width"])
    x = np.sin(0.37 * grid).astype(np.float32)
    target = np.cos(0.11 * grid + 0.5).astype(np.float32)
    return config, x, target


def loss_fn(params, x, target, mesh):
    import jax.numpy as jnp

    from jphantom.sharding import phantom

    return jnp.mean((phantom.forward(params, x, mesh) - target) ** 2)


def main(argv: list[str]) -> None:
    coordinator, process_id, num_processes, local_devices, out = argv
    from jphantom import distributed

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
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jphantom.mesh import make_mesh
    from jphantom.sharding import phantom

    config, x, target = problem()
    assert jax.process_count() == int(num_processes), jax.process_count()
    assert jax.device_count() == config["num_shards"], jax.devices()
    mesh = make_mesh({"model": config["num_shards"]})

    # Every process computes the same parameters locally (same key, deterministic CPU kernels) and
    # contributes the shards its devices own.
    host_params = jax.tree.map(np.asarray, phantom.init(jax.random.PRNGKey(0), **config))

    def to_global(value, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    params = jax.tree.map(to_global, host_params, phantom.linear_specs("model"))
    x_global = to_global(x, P(None, "model"))
    target_global = to_global(target, P(None, "model"))
    assert not params["local"].is_fully_addressable

    step = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)
    loss, grads = step(params, x_global, target_global, mesh)
    loss_host = multihost_utils.process_allgather(loss, tiled=True)
    grads_host = multihost_utils.process_allgather(grads, tiled=True)

    flat = {f"grad/{name}": np.asarray(value) for name, value in grads_host.items()}
    np.savez(out, loss=np.asarray(loss_host), process_count=jax.process_count(), **flat)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
