"""How an FP8 GEMM is written decides what XLA:GPU runs around cuBLAS-LT's FP8 call, and what the
same program computes on CPU. Three ways to write ``bf16(x_q W_q s_x s_W)`` (x_q, W_q in E4M3, s_x,
s_W their float32 per-tensor scales, float32 accumulation):

``f32-result``     ``(dot(x_q, W_q) -> float32 * (s_x s_W)).astype(bf16)``: jphantom's until
                   its scales became powers of two
``bf16-result``    ``dot(x_q, W_q) -> bf16 * bf16(s_x s_W)``: jphantom's
                   (:func:`jphantom.step.fp8._gemm`, with power-of-two scales)
``dequantised``    ``dot(bf16(x_q) bf16(s_x), bf16(W_q) bf16(s_W)) -> bf16`` (Flax's
                   dequantise-then-dot in bf16)

Per form: the kernels of its ahead-of-time compile for an H100 with the FP8 run's options
(``gpu_defaults.fp8_gemm_options``): the GEMM kernels by kind, the FP8 call's output type, the
other kernels of the program by output (``f32[]``: the scales' product; ``f8e4m3fn[n,n]``: W_q
transposed to the K-major layout the call takes; ``bf16[n,n]``: a float32 -> bf16 pass); and, on
CPU, its largest error relative to the result rounded once (float64 product of the 8-bit values
and the scales, then bf16: what cuBLAS-LT's float32 epilogue computes), in units of bf16's
rounding, 2^-8, with arbitrary scales and with powers of two (:mod:`jphantom.step.fp8`'s).

    .venv-aot/bin/python benchmarks/fp8_gemm_forms.py    # about 20 s; needs the aot extra

Prints a table and writes ``benchmarks/results/fp8_gemm_forms/results.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

OUT = Path(__file__).resolve().parent / "results" / "fp8_gemm_forms"
DIMS = (((1,), (0,)), ((), ()))  # y = x W, x [N, in], W [in, out]: the forward GEMM
BF16 = jnp.bfloat16
FORMS = {
    "f32-result": lambda x, w, sx, sw: (lax.dot_general(
        x, w, DIMS, preferred_element_type=jnp.float32) * (sx * sw)).astype(BF16),
    "bf16-result": lambda x, w, sx, sw: lax.dot_general(
        x, w, DIMS, preferred_element_type=BF16) * (sx * sw).astype(BF16),
    "dequantised": lambda x, w, sx, sw: lax.dot_general(
        x.astype(BF16) * sx.astype(BF16), w.astype(BF16) * sw.astype(BF16), DIMS),
}


def h100_kernels(form, n: int = 4096) -> dict:
    """The form's ENTRY kernels compiled for an H100 (no GPU needed) with the FP8 run's options."""
    from jax.sharding import SingleDeviceSharding

    from jphantom.analysis.hlo import kernels
    from jphantom.costs.aot import deviceless_node
    from jphantom.runtime import gpu_defaults

    _, devices = deviceless_node("gpu:h100")
    one = SingleDeviceSharding(devices[0])
    f8 = jax.ShapeDtypeStruct((n, n), jnp.float8_e4m3fn, sharding=one)
    scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=one)
    text = jax.jit(form).lower(f8, f8, scale, scale).compile(
        compiler_options=gpu_defaults.fp8_gemm_options(devices[0], {})).as_text()
    entry = text[text.index("\nENTRY"):]
    call = re.search(r"= \((\w+)\[[\d,]+\]\{[\d,]+\}, s8\[\d+\]\{0\}\) custom-call\(", entry)
    return {"gemms": kernels(text)["gemms"]["by_kind"],
            "fp8_call_output": call.group(1) if call else None,
            "other_kernels": re.findall(r"= (\w+\[[\d,]*\])\S* fusion\(", entry)}


SCALES = {"arbitrary": (0.0123, 0.00771), "power_of_two": (2.0**-6, 2.0**-7)}


def cpu_error(form, n: int = 256, seed: int = 0, scales: str = "arbitrary") -> float:
    """max |form - once-rounded| / max |once-rounded| on CPU, in units of 2^-8."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n, n)) * 3, jnp.float8_e4m3fn)
    w = jnp.asarray(rng.normal(size=(n, n)) * 3, jnp.float8_e4m3fn)
    sx, sw = (jnp.float32(v) for v in SCALES[scales])
    exact = (np.asarray(x, np.float64) @ np.asarray(w, np.float64)) * (float(sx) * float(sw))
    once = np.asarray(jnp.asarray(exact, BF16), np.float64)
    got = np.asarray(jax.jit(form)(*jax.device_put((x, w, sx, sw), jax.devices("cpu")[0])),
                     np.float64)
    return float(np.max(np.abs(got - once)) / np.max(np.abs(once)) * 2 ** 8)


def main() -> int:
    rows = {}
    for name, form in FORMS.items():
        rows[name] = {**h100_kernels(form), "cpu_error_bf16_ulps": cpu_error(form),
                      "cpu_error_bf16_ulps_power_of_two_scales": cpu_error(
                          form, scales="power_of_two")}
        row = rows[name]
        print(f"{name:<12} GEMMs {row['gemms']}, FP8 call output {row['fp8_call_output']}, "
              f"other kernels {row['other_kernels'] or 'none'}, CPU error "
              f"{row['cpu_error_bf16_ulps']:.3f} x 2^-8 (power-of-two scales: "
              f"{row['cpu_error_bf16_ulps_power_of_two_scales']:.3f})", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(
        {"jax": jax.__version__, "target": "gpu:h100 (ahead of time)", "forms": rows},
        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
