"""The Llama family's Hugging Face fixtures on whatever device jax has (a lent GPU): float32 logits
against transformers' (``tests/fixtures/hf/*/reference.npz``), and the bf16 forward on the
kernel ``attention="auto"`` picks there (cuDNN flash attention on an NVIDIA GPU, with Mistral's
local window; Gemma 3's local and global layers each on it, chosen per layer by a ``lax.cond``)
against the float32 logits. On a GPU, float32 matrix products run at jax's default precision
(TF32 on Hopper), which is what the float32 column measures there; the "highest precision" column
runs them under ``jax.default_matmul_precision("highest")``.

    PYTHONPATH=. python experiments/gpu_families.py --out DIR      # writes DIR/gpu_families.json

On CPU it runs too (XLA everywhere). The training side is ``jphantom train --model llama
--from-hf tests/fixtures/hf/<family> --precision bf16``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jphantom.models import hf
from jphantom.nn import attention

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="experiments/results/gpu_families")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    rows = {}
    for directory in sorted(p for p in FIXTURES.iterdir() if (p / "reference.npz").is_file()):
        ref = np.load(directory / "reference.npz")
        tokens = jnp.asarray(ref["tokens"], jnp.int32)
        model = hf.load(directory)
        wide = np.asarray(jax.jit(lambda t: model(t))(tokens), np.float64)
        scale = float(np.abs(ref["logits"]).max())
        row = {"float32_vs_transformers": float(np.abs(wide - ref["logits"]).max()) / scale}
        with jax.default_matmul_precision("highest"):  # full float32 products (no TF32)
            exact = np.asarray(jax.jit(lambda t: model(t))(tokens), np.float64)
        row["float32_highest_vs_transformers"] = float(np.abs(exact - ref["logits"]).max()) / scale
        bf16 = hf.load(directory)
        for _, module in nnx.iter_modules(bf16):  # bf16 compute, float32 parameters
            if getattr(module, "dtype", "absent") is None:
                module.dtype = jnp.bfloat16
        attention.configure(bf16, "auto", attention.platform_of(device))
        kernel = next((m.kernel(jnp.bfloat16, bf16.config.dim) for _, m in nnx.iter_modules(bf16)
                       if isinstance(m, attention.CausalAttention)), None)
        low = np.asarray(jax.jit(lambda t: bf16(t))(tokens).astype(jnp.float32), np.float64)
        row.update(bf16_vs_float32=float(np.abs(low - wide).max()) / scale,
                   bf16_kernel=kernel[0] if kernel else None,
                   mixed_layers=bf16.config.mixed_layers, window=bf16.config.sliding_window)
        rows[directory.name] = row
        print(f"{directory.name:12} float32 vs transformers {row['float32_vs_transformers']:.2e}"
              f" (highest precision {row['float32_highest_vs_transformers']:.2e})"
              f"  bf16 ({row['bf16_kernel']}{', local + global' if row['mixed_layers'] else ''})"
              f" vs float32 {row['bf16_vs_float32']:.2e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
              "families": rows}
    (out / "gpu_families.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{device.device_kind} (jax {jax.__version__}); wrote {out / 'gpu_families.json'}")


if __name__ == "__main__":
    main()
