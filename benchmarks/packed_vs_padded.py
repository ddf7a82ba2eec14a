"""Packed against padded batches of variable-length documents: training throughput counted in
*real* tokens (segment id > 0; pads do not count), on the same documents, model and mesh.

- **padded**: one document per row, truncated to ``--seq-len`` and padded
  (:func:`jphantom.data.packing.pad`), trained as ``(tokens, targets)`` with
  :func:`jphantom.models.llama.lm_loss` (pads after each document are never attended by it and
  their targets are -100): the unsplit core's usual kernel (cuDNN on NVIDIA GPUs in bf16);
- **packed**: the documents laid end to end in rows (:func:`jphantom.data.packing.pack`), trained
  as ``(tokens, targets, segment_ids, positions)`` with :func:`jphantom.models.packed_lm_loss`:
  attention within each document (jax's Pallas Triton flash kernel with segment ids on NVIDIA
  GPUs, :func:`jphantom.nn.attention.choose`).

Both read the same documents (lengths drawn log-normally between ``--min-len`` and
``--seq-len``, tokens at random), over data parallelism on every device. Prints and writes real
tokens per second, steps, pad fraction and the attention kernel each picked::

    python benchmarks/packed_vs_padded.py                   # a GPU node: Llama-1B-ish, S = 4096
    python benchmarks/packed_vs_padded.py --quick --devices 2   # CPU smoke check, tiny shapes

writes ``benchmarks/results/packed_vs_padded.json`` (``--out``). Timing excludes the first
``--warmup`` steps (compilation).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "results" / "packed_vs_padded.json"


def documents(count: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    """``count`` documents of log-normal lengths in [min_len, max_len], random tokens, every
    token's next token a target."""
    from jphantom.data.documents import Documents

    rng = np.random.default_rng(seed)
    middle = np.sqrt(min_len * max_len)
    lengths = np.clip(rng.lognormal(np.log(middle), 0.8, count), min_len, max_len).astype(int)
    return Documents.of((rng.integers(1, vocab, n), [1] * n) for n in lengths)


def batches(docs, seq_len: int, batch: int, packed: bool):
    """Every whole batch of ``batch`` rows, packed or padded, as lists of four arrays."""
    from jphantom.data.packing import pack, packed_rows, pad

    order = np.arange(docs.count)
    if packed:
        rows = pack(docs, order, seq_len, 0, packed_rows(docs, seq_len))
    else:
        rows = pad(docs, order, seq_len)
    count = len(rows[0]) // batch
    return [[a[i * batch:(i + 1) * batch] for a in rows] for i in range(count)]


def measure(args, packed: bool, docs) -> dict:
    import jax
    import optax
    from flax import nnx

    import jphantom
    from jphantom.models import packed_lm_loss
    from jphantom.models.llama import Llama, LlamaConfig, lm_loss
    from jphantom.nn.attention import kernels_of, platform_of

    config = LlamaConfig(vocab_size=args.vocab, hidden=args.hidden, intermediate=args.ffn,
                         layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                         max_positions=args.seq_len)
    devices = jax.devices()[:args.devices or len(jax.devices())]
    mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
    model = Llama(config, rngs=nnx.Rngs(0))
    step = jphantom.make_train_step(model, mesh, optax.adamw(1e-4),
                                    packed_lm_loss if packed else lm_loss,
                                    precision=args.precision, attention="auto")
    state = step.init()
    work = batches(docs, args.seq_len, args.batch, packed)
    if not work:
        raise SystemExit(f"fewer than {args.batch} rows: add --documents")
    arrays = 4 if packed else 2
    placed = [tuple(jax.device_put(a, s) for a, s in zip(b[:arrays], step.batch_shardings(arrays)))
              for b in work]
    real = [int(np.count_nonzero(b[2])) for b in work]  # segment id > 0
    total = args.warmup + args.steps
    seconds, counted = 0.0, 0
    for i in range(total):
        j = i % len(placed)
        start = time.perf_counter()
        state, loss = step(state, *placed[j])
        loss.block_until_ready()
        if i >= args.warmup:
            seconds += time.perf_counter() - start
            counted += real[j]
    dtype = "bfloat16" if args.precision == "bf16" else "float32"
    return {
        "mode": "packed" if packed else "padded",
        "batches_available": len(work), "rows_per_batch": args.batch,
        "pad_fraction": 1.0 - sum(real) / (len(work) * args.batch * args.seq_len),
        "steps_timed": args.steps, "seconds": seconds, "real_tokens": counted,
        "real_tokens_per_second": counted / seconds if seconds else None,
        "final_loss": float(loss),
        "attention": kernels_of(model, "auto", platform_of(jax.devices()[0]), dtype,
                                config.dim, packed=packed),
    }


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU (smoke check)")
    parser.add_argument("--devices", type=int, default=None,
                        help="devices to use (default all; without a GPU, that many simulated "
                        "CPU devices)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="rows per step (global)")
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None,
                        help=f"the JSON file (default {OUT}; --quick: in a scratch folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.__dict__.update(seq_len=64, batch=8, documents=96, min_len=4, layers=2, hidden=32,
                             heads=4, kv_heads=2, ffn=64, vocab=128, precision="float32",
                             steps=3, warmup=1)
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.devices:  # without a GPU: that many CPU devices (a GPU machine keeps its GPUs)
        from jphantom.runtime.mesh import simulate_cpu_devices

        try:
            simulate_cpu_devices(args.devices)
        except RuntimeError:  # jax already started (a test): the first --devices of its devices
            pass
    import jax


    docs = documents(args.documents, args.min_len, args.seq_len, args.vocab)
    rows = {mode: measure(args, mode == "packed", docs) for mode in ("padded", "packed")}
    speedup = (rows["packed"]["real_tokens_per_second"] / rows["padded"]["real_tokens_per_second"]
               if rows["padded"]["real_tokens_per_second"] else None)
    from jphantom.analysis.machine import output_folder

    args.out = str(args.out or output_folder(None, OUT.parent, quick=args.quick,
                                             name="packed_vs_padded") / OUT.name)
    report = {"config": {k: v for k, v in vars(args).items() if k != "out"},
              "devices": [str(d) for d in jax.devices()],
              "documents": docs.summary() | {"mean_length": float(docs.lengths.mean())},
              "padded": rows["padded"], "packed": rows["packed"],
              "packed_over_padded_real_tokens_per_second": speedup}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for mode in ("padded", "packed"):
        row = rows[mode]
        print(f"{mode:7s} {row['real_tokens_per_second']:12.1f} real tokens/s  pad "
              f"{row['pad_fraction']:.2f}  loss {row['final_loss']:.3f}  {row['attention']}")
    print(f"packed / padded: {speedup:.2f}x; wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
