"""SAMO's model-state memory and compressed all-reduce against Singh's Eqs. 4.1-4.5.

For an MLP of ``nnx.Linear`` layers (width 512, 4 layers, ReLU; written here), on ``data=2``
through ``make_samo_step(..., SamoConfig(s), precision="bf16")``, pruned by magnitude to
sparsity s in {0, 0.25, 0.5, 0.8, 0.9} (weight matrices; biases dense), this script builds SAMO's
state (:mod:`jphantom.experimental.samo`, bf16 theta16), runs one step, and reports per device:

- measured bytes between steps (theta16, the int32 index, the float32 master weights and Adam's
  two moments: from the arrays) against the formula's at-rest part 2 phi + 16 (1 - s) phi;
- the whole formula M = 24 (1 - s) phi + 2 phi (adding the float32 and 16-bit compressed
  gradients and the 16-bit copy made while expanding, 8 (1 - s) phi, which exist inside the step:
  counted from their shapes, not measured) against dense mixed-precision Adam's 20 phi;
- the all-reduce over ``data`` in the compiled step: elements of the compressed gradient
  against the dense model's phi.

Run: ``.venv/bin/python experiments/samo.py`` (seconds); writes
``experiments/results/samo/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jphantom.experimental import samo  # noqa: E402
from jphantom.analysis.hlo import collectives  # noqa: E402
from jphantom.runtime.mesh import first_devices, make_mesh  # noqa: E402


class MLP(nnx.Module):
    """``depth`` square ``nnx.Linear`` layers of ``width``, ReLU between them."""

    def __init__(self, width: int, depth: int, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == 0 else layer(jax.nn.relu(x))
        return x


def loss_fn(model, x, t):
    return jnp.mean(jnp.square(model(x) - t))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--out", default="experiments/results/samo")
    args = parser.parse_args(argv)
    mesh = make_mesh("data=2", first_devices(2))
    rng = np.random.default_rng(0)
    x, t = (rng.standard_normal((64, args.width)).astype(np.float32) for _ in range(2))
    model = MLP(args.width, args.depth)
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
    phi = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    rows = []
    print(f"phi = {phi:,} parameters; bytes per device (MB)")
    print(f"{'s':>5}{'nnz/phi':>9}{'at rest':>10}{'formula':>10}{'ratio':>8}{'M(s)':>9}"
          f"{'20 phi':>9}{'saving':>8}{'all-reduce/phi':>16}")
    for sparsity in (0.0, 0.25, 0.5, 0.8, 0.9):
        step = samo.make_samo_step(model, mesh, optax.adam(1e-3), loss_fn,
                                   samo.SamoConfig(sparsity), precision="bf16")
        masks = samo.magnitude_masks(params, sparsity)
        state = step.init()  # the same magnitude masks, from the model's parameters
        hlo = step.lower(state, x, t).compile().as_text()
        state, _ = step(state, x, t)
        reduced = sum(int(np.prod(dims)) for c in collectives(hlo)
                      if c.kind == "all-reduce" and c.mesh_axes({"data": 2}) == ("data",)
                      for _, dims in c.shapes if dims)
        nonzeros = sum(int(np.sum(m)) for m in jax.tree.leaves(masks))
        measured = samo.state_bytes(state)
        formula = samo.formula_bytes(phi, nonzeros)
        row = {"sparsity": sparsity, "nonzeros": nonzeros, "phi": phi, "measured": measured,
               "formula": formula, "at_rest_ratio": measured["total"] / formula["at_rest"],
               "saving_vs_dense": 1 - formula["total"] / formula["dense"],
               "all_reduce_elements": reduced, "all_reduce_over_phi": reduced / phi}
        rows.append(row)
        print(f"{sparsity:>5.2f}{nonzeros / phi:>9.3f}{measured['total'] / 1e6:>10.3f}"
              f"{formula['at_rest'] / 1e6:>10.3f}{row['at_rest_ratio']:>8.4f}"
              f"{formula['total'] / 1e6:>9.3f}{formula['dense'] / 1e6:>9.3f}"
              f"{row['saving_vs_dense']:>8.1%}{row['all_reduce_over_phi']:>16.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "width": args.width,
                                                  "depth": args.depth}, indent=1))
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
