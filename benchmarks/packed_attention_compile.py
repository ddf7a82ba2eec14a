"""Packed attention on an H100, compiled ahead of time on this CPU machine: a Llama-3-8B-width
step (hidden 4096, 32 heads, 8 key/value heads, FFN 14336) in bf16 at S = 8192, one GPU, with a
packed batch ``(tokens, targets, segment_ids, positions)`` against the same step unpacked
``(tokens, targets)``. Reports, from the optimised HLO and XLA's memory analysis, which fused
attention kernel each step runs (cuDNN's ``__cudnn$fmha*`` custom calls unpacked; jax's Pallas
Triton kernels ``packed_attention_forward_causal`` / ``packed_attention_backward_causal``, with
segment ids, packed) and each step's temporary bytes (of its gradient program, forward and backward: the
packed step must stay within 1.2x of the unpacked's), and, for scale, the packed step on XLA's path under the segment mask
(``attention="xla"``), which holds [B, H, S, S] float32 scores.

Needs the GPU compiler (``pip install 'jphantom[aot]'``; here ``.venv-aot``)::

    .venv-aot/bin/python benchmarks/packed_attention_compile.py [--layers 2] [--seq 8192]

writes ``benchmarks/results/packed_attention_compile.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "packed_attention_compile.json"


def compile_step(packed: bool, layers: int, seq: int, devices, attention: str = "auto") -> dict:
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jphantom
    from jphantom.analysis.compiled import compiled_memory
    from jphantom.analysis.hlo.kernel_census import kernels
    from jphantom.models import packed_lm_loss
    from jphantom.models.llama import Llama, LlamaConfig, lm_loss
    from jphantom.nn.attention import kernels_of

    config = LlamaConfig(vocab_size=128256, hidden=4096, intermediate=14336, layers=layers,
                         heads=32, kv_heads=8, max_positions=seq, rope_theta=500000.0)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    mesh = Mesh(np.array(devices[:1]), ("data",))
    step = jphantom.make_train_step(model, mesh, optax.adamw(1e-4),
                                    packed_lm_loss if packed else lm_loss, precision="bf16",
                                    attention=attention, remat="dots_saveable")
    batch = jax.ShapeDtypeStruct((1, seq), np.int32, sharding=NamedSharding(mesh, P("data")))
    start = time.perf_counter()
    # the gradient program (forward and backward, where attention runs): the whole step's
    # update adds the optimizer's work alike to both and a host callback (the token mean's
    # weight guard) that an ahead-of-time GPU target without a GPU backend cannot lower
    lowered = jax.jit(step.value_and_grad()).lower(step.abstract_state().params,
                                                   *[batch] * (4 if packed else 2))
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    custom_calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    pallas = sorted(set(re.findall(r'"name":\s*"([a-z_]*attention[a-z_]*)"', text))
                    | set(re.findall(r'(packed_attention_(?:forward|backward))', text)))
    platform = jphantom.nn.attention.platform_of(devices[0])
    return {
        "packed": packed, "attention": attention,
        "batch_arrays": ["tokens", "targets"] + (["segment_ids", "positions"] if packed else []),
        "kernel_choice": kernels_of(model, attention, platform, "bfloat16", config.dim,
                                    packed=packed),
        "attention_custom_calls": [c for c in custom_calls if "fmha" in c or "triton" in c],
        "pallas_kernels": pallas,
        "kernels": kernels(text),
        "memory": compiled_memory(compiled),
        "compile_seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()

    from jphantom.costs.aot import Target, versions

    target = Target.parse("gpu:h100")
    devices = target.devices()
    unpacked = compile_step(False, args.layers, args.seq, devices)
    packed = compile_step(True, args.layers, args.seq, devices)
    masked = compile_step(True, args.layers, args.seq, devices, attention="xla")  # for scale
    ratio = packed["memory"]["temp_bytes"] / unpacked["memory"]["temp_bytes"]
    report = {
        "target": "gpu:h100 (1 GPU)", "model": "Llama-3-8B width", "layers": args.layers,
        "seq_len": args.seq, "batch": 1, "precision": "bf16", "remat": "dots_saveable",
        "unpacked": unpacked, "packed": packed, "packed_on_xla_path": masked,
        "temp_bytes_ratio_packed_over_unpacked": round(ratio, 4),
        "within_1_2x": ratio <= 1.2,
        "fused_packed_kernel": bool(packed["pallas_kernels"]),
        "versions": versions(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for name in ("unpacked", "packed", "packed_on_xla_path"):
        row = report[name]
        print(f"{name:18s} temp {row['memory']['temp_bytes'] / 2**30:7.2f} GiB  "
              f"custom calls {row['attention_custom_calls']}  pallas {row['pallas_kernels']}  "
              f"choice {row['kernel_choice']}  ({row['compile_seconds']} s)")
    print(f"temp ratio packed / unpacked {ratio:.3f} (within 1.2x: {ratio <= 1.2}); "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
