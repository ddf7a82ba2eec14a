"""The model of byo_flax_model.py made phantom-parallel (Seal et al.): every linear a phantom layer
of k ghost neurons per rank, embeddings and norms split over features. A phantom model is a
different (smaller) model than the dense one it starts from, so the check is against its own
dense equivalent on one device.

    python examples/byo_phantom.py
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jphantom  # noqa: E402
from byo_flax_model import TinyLM, batches, loss_fn  # noqa: E402


def main(steps: int = 20, ghost_width: int = 4) -> int:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    model = TinyLM()
    jphantom.parallelize(model, mesh, jphantom.plans.phantom(model, ghost_width=ghost_width))
    step = jphantom.make_train_step(model, mesh, optax.adam(3e-3), loss_fn)
    state = step.init()
    # the oracle: the dense model the phantom layers are, trained on one device
    dense = jphantom.dense_equivalent(step.model(state))
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    reference = jphantom.make_train_step(dense, one, optax.adam(3e-3), loss_fn)
    ref_state = reference.init()
    losses = []
    for tokens, targets in batches(steps):
        state, loss = step(state, tokens, targets)
        losses.append(float(loss))
    ref_loss = float(reference.value_and_grad()(ref_state.params, *next(batches(1)))[0])
    print(f"phantom, k={ghost_width}, data=2,model=4: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"its dense equivalent on one device, step 0: {ref_loss:.4f} (phantom: {losses[0]:.4f})")
    return 0 if abs(ref_loss - losses[0]) < 1e-4 and np.isfinite(losses).all() else 1


if __name__ == "__main__":
    sys.exit(main())
