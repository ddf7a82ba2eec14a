"""The gradient sink on a toy, the measurement that preceded :mod:`jphantom.nn.sink` (which the
step now uses): does a layer scan whose backward adds each layer's weight gradient into a
carried float32 accumulator (Megatron-LM's ``main_grad``, which its weight-gradient GEMM
accumulates into) keep XLA from holding a micro-batch's whole [L, ...] gradient stack in the
compute dtype?

Why: with ``--accumulate k`` jphantom's step differentiated each micro-batch's loss, so the
backward layer scan wrote every layer's gradient into a bf16 [L, ...] stack, which was then added
to the float32 accumulator: 15 GiB on top of the accumulator's 30 GiB for NeMo's Llama3.1-8B
with CP 2 on 8 H100 (docs/predict.md), the difference between fitting 80 GB and not.

The toy: L tanh(h @ W_l) layers in bf16 under ``lax.scan``, accumulated over N micro-batches in
one loop, two ways:

- ``plain``: ``grad`` of each micro-batch's loss w.r.t. W, then ``acc + g.astype(f32)`` (the
  step's way before the sinks);
- ``sink``: the library's :func:`jphantom.nn.sink.scan_into` (a ``custom_vjp`` over the stack
  whose forward saves each layer's ``jax.vjp`` residuals and whose backward is its own reverse
  scan carrying the accumulator, adding each layer's gradient into its row); the step asks for
  the gradient w.r.t. the accumulator, which is the accumulator plus the gradient.

Reports XLA's temporaries of each (CPU, and H100 compiled ahead of time when the GPU compiler is
installed: ``.venv-aot``) and the largest difference of the two accumulators (CPU, run).

    .venv-aot/bin/python benchmarks/gradient_sink.py   # writes benchmarks/results/gradient_sink/
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the H100 program is compiled without a GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
L, D, B, N = 8, 1024, 64, 4  # layers, width, rows per micro-batch, micro-batches


def layer(w, h):
    return jnp.tanh(h @ w)


def loss_of(h):
    return jnp.sum(h.astype(jnp.float32) ** 2)


def stack(weights, x):
    return lax.scan(lambda h, w: (layer(w, h), None), x, weights)[0]


def stack_into(weights, acc, x):
    """``stack(weights, x)`` through :func:`jphantom.nn.sink.scan_into`: its gradient w.r.t.
    ``acc`` is ``acc`` plus the weights'."""
    from jphantom.nn.sink import scan_into

    return scan_into(lambda w, h, _, __: layer(w, h), weights, [acc], x,
                     jnp.arange(weights.shape[0]))


def accumulated(step):
    def run(weights, xs):
        zeros = jnp.zeros(weights.shape, jnp.float32)
        return lax.fori_loop(0, lax.optimization_barrier(jnp.int32(N)),
                             lambda i, acc: step(weights, xs[i], acc), zeros)
    return run


plain = accumulated(lambda w, x, acc: acc + jax.grad(lambda w: loss_of(stack(w, x)))(w)
                    .astype(jnp.float32))
sink = accumulated(lambda w, x, acc: jax.grad(lambda a: loss_of(stack_into(w, a, x)))(acc))


def temporaries(fn, args) -> float:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def main() -> int:
    weights = (jax.random.normal(jax.random.PRNGKey(0), (L, D, D)) / np.sqrt(D)).astype(
        jnp.bfloat16)
    xs = jax.random.normal(jax.random.PRNGKey(1), (N, B, D)).astype(jnp.bfloat16)
    want, got = (np.asarray(jax.jit(f)(weights, xs)) for f in (plain, sink))
    result = {"layers": L, "width": D, "rows": B, "microbatches": N, "jax": jax.__version__,
              "bf16_stack_mib": L * D * D * 2 / 2**20, "f32_accumulator_mib": L * D * D * 4 / 2**20,
              "max_relative_difference": float(np.max(np.abs(got - want)) / np.max(np.abs(want))),
              "temp_mib": {"cpu": {name: temporaries(f, (weights, xs))
                                   for name, f in (("plain", plain), ("sink", sink))}}}
    try:
        from jax.sharding import SingleDeviceSharding

        from jphantom.costs import aot

        device = aot.Target.parse("gpu:h100", nodes=1).devices()[0]
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=SingleDeviceSharding(device))
                  for a in (weights, xs)]
        result["temp_mib"]["h100"] = {name: temporaries(f, shapes)
                                      for name, f in (("plain", plain), ("sink", sink))}
    except Exception as error:  # noqa: BLE001 - no GPU compiler here: say so in the results
        result["temp_mib"]["h100"] = f"not compiled: {type(error).__name__}: {error}"[:300]
    out = ROOT / "benchmarks" / "results" / "gradient_sink"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
