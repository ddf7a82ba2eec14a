"""SAMO's model-state memory and compressed all-reduce against seed 004's Eqs. 4.1-4.5.

For the FFN (width 512, 4 layers, ``tensor`` with ``model=1`` on ``data=2``) pruned by magnitude to
sparsity s in {0, 0.25, 0.5, 0.8, 0.9} (weight matrices; biases dense), this script builds SAMO's
state (:mod:`jphantom.samo`, bf16 theta16), runs one step, and reports per device:

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
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jphantom import samo, strategies  # noqa: E402
from jphantom.analysis.hlo import collectives  # noqa: E402
from jphantom.mesh import MeshConfig, first_devices  # noqa: E402
from jphantom.models.ffn import FFNConfig  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--out", default="experiments/results/samo")
    args = parser.parse_args(argv)
    program = strategies.get("tensor").program(FFNConfig(args.width, args.depth),
                                               MeshConfig.parse("data=2,model=1"))
    mesh = program.mesh.build(first_devices(2))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (rng.standard_normal(a.shape) / np.sqrt(a.shape[-1]))
                          .astype(np.float32), jax.eval_shape(program.init, jax.random.PRNGKey(0)))
    batch = [jax.device_put(rng.standard_normal((64, args.width)).astype(np.float32), s)
             for s in program.batch_shardings(mesh)]
    phi = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    rows = []
    print(f"phi = {phi:,} parameters; bytes per device (MB)")
    print(f"{'s':>5}{'nnz/phi':>9}{'at rest':>10}{'formula':>10}{'ratio':>8}{'M(s)':>9}"
          f"{'20 phi':>9}{'saving':>8}{'all-reduce/phi':>16}")
    for sparsity in (0.0, 0.25, 0.5, 0.8, 0.9):
        config = samo.SamoConfig(sparsity, "bfloat16")
        masks = samo.magnitude_masks(params, sparsity)
        state = samo.init(program, mesh, params, masks, config)
        step = samo.make_step(program, mesh, config)
        hlo = step.lower(state, *batch).compile().as_text()
        state, _ = step(state, *batch)
        reduced = sum(int(np.prod(dims)) for c in collectives(hlo)
                      if c.kind == "all-reduce" and c.mesh_axes({"data": 2, "model": 1}) == ("data",)
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
