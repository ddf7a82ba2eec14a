"""The gradient sink on a toy, the measurement that preceded :mod:`jphantom.nn.sink` (which the
step now uses): does a layer scan whose backward adds each layer's weight gradient into a
carried float32 accumulator (Megatron-LM's ``main_grad``, which its weight-gradient GEMM
accumulates into) keep XLA from holding a micro-batch's whole [L, ...] gradient stack in the
compute dtype?

Why: with ``--accumulate k`` jphantom's step differentiates each micro-batch's loss, so the
backward layer scan writes every layer's gradient into a bf16 [L, ...] stack, which is then added
to the float32 accumulator: 15 GiB on top of the accumulator's 30 GiB for NeMo's Llama3.1-8B
with CP 2 on 8 H100 (docs/predict.md), the difference between fitting 80 GB and not.

The toy: L tanh(h @ W_l) layers in bf16 under ``lax.scan``, accumulated over N micro-batches in
one loop, two ways:

- ``plain``: ``grad`` of each micro-batch's loss w.r.t. W, then ``acc + g.astype(f32)`` (the
  step's way today);
- ``sink``: a ``custom_vjp`` over the stack whose forward saves each layer's ``jax.vjp``
  residuals and whose backward is its own reverse scan carrying the accumulator, adding each
  layer's gradient into its slice; the step asks for the gradient w.r.t. the accumulator, which
  is the accumulator plus the gradient.

Reports XLA's temporaries of each (CPU, and H100 compiled ahead of time when the GPU compiler is
installed: ``.venv-aot``) and the largest difference of the two accumulators (CPU, run).

    .venv-aot/bin/python benchmarks/gradient_sink.py   # writes benchmarks/results/gradient_sink/
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROOT = Path(__file__).resolve().parents[1]
L, D, B, N = 8, 1024, 64, 4  # layers, width, rows per micro-batch, micro-batches


def layer(w, h):
    return jnp.tanh(h @ w)


def loss_of(h):
    return jnp.sum(h.astype(jnp.float32) ** 2)


def stack(weights, x):
    return lax.scan(lambda h, w: (layer(w, h), None), x, weights)[0]


@jax.custom_vjp
def stack_into(weights, acc, x):
    """``stack(weights, x)``, whose gradient w.r.t. ``acc`` is ``acc`` plus the weights'."""
    return stack(weights, x)


def _forward(weights, acc, x):
    h, pullbacks = lax.scan(lambda h, w: jax.vjp(layer, w, h), x, weights)
    return h, (pullbacks, acc)


def _backward(saved, ct):
    pullbacks, acc = saved

    def one(carry, item):
        ct_h, acc = carry
        index, pullback = item
        dw, dh = pullback(ct_h)
        row = lax.dynamic_index_in_dim(acc, index, keepdims=False) + dw.astype(acc.dtype)
        return (dh, lax.dynamic_update_index_in_dim(acc, row, index, 0)), None

    (dx, acc), _ = lax.scan(one, (ct, acc), (jnp.arange(acc.shape[0]), pullbacks), reverse=True)
    return None, acc, dx


stack_into.defvjp(_forward, _backward)


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
