"""The module path (a Flax NNX model under ``jphantom.parallelize``) against the built-in
``transformer`` program, side by side: the same GPT-2 maths, Megatron tensor parallelism.

One process, 8 simulated CPU devices (``--devices``), mesh ``data=2,model=4`` (``--mesh``):

- *step time*: the median wall time of one jitted AdamW step of each, over ``--steps`` round-robin
  rounds after ``--warmup`` (:func:`jphantom.analysis.timing.time_round_robin`), and their ratio;
- *collective bytes* per device and step of each compiled step;
- *compile time* of the module step at 2 and ``--compile-layers`` (default 12) layers: the blocks
  are a :class:`jphantom.nn.Stacked` under ``lax.scan``, so it stays flat in depth
  (target: 12 layers < 5 s, printed PASS/MISS, never asserted in tests).

The NNX model is written here with plain Flax layers (``nnx.Linear`` q, k, v instead of one fused
QKV: the same FLOPs; a tied head through ``jphantom.nn.cross_entropy``), the built-in one is
:mod:`jphantom.models.transformer`.

Usage::

    python benchmarks/nnx_step.py            # L=4, h=256, 8 heads, S=128, B=16
    python benchmarks/nnx_step.py --quick    # tiny, seconds

Results: ``<out>/results.json`` (default ``benchmarks/results/nnx_step/``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "nnx_step"
COMPILE_SECONDS = 5.0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    parser.add_argument("--mesh", default="data=2,model=4", help="mesh (default data=2,model=4)")
    parser.add_argument("--layers", type=int, default=4, help="blocks (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="width h (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (128)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="the update both steps run (default adamw)")
    parser.add_argument("--compile-layers", type=int, default=12, help="layers of the compile "
                                                                        "time check (default 12)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run (results "
                                                             "go to a scratch folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq_len, args.batch = 1, 64, 16, 4
        args.steps, args.warmup, args.compile_layers = 2, 1, 2
        if args.out == DEFAULT_OUT:
            import tempfile
            args.out = Path(tempfile.mkdtemp(prefix="jphantom-nnx-step-"))
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jphantom
    from jphantom import strategies
    from jphantom.analysis.hlo import collectives
    from jphantom.analysis.inspect import normalise_collectives
    from jphantom.analysis.timing import Runner, build_program_step, time_round_robin
    from jphantom.mesh import MeshConfig, first_devices
    from jphantom.models.transformer import TransformerConfig

    h, heads, seq, vocab = args.hidden, args.heads, args.seq_len, 256

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln_1, self.ln_2 = (nnx.LayerNorm(h, epsilon=1e-5, rngs=rngs) for _ in range(2))
            self.q, self.k, self.v, self.out = (nnx.Linear(h, h, rngs=rngs) for _ in range(4))
            self.up, self.down = nnx.Linear(h, 4 * h, rngs=rngs), nnx.Linear(4 * h, h, rngs=rngs)

        def __call__(self, x):
            y = self.ln_1(x)
            q, k, v = self.q(y), self.k(y), self.v(y)
            b, s, _ = q.shape
            q, k, v = (a.reshape(b, s, -1, h // heads) for a in (q, k, v))
            scores = jnp.einsum("bqad,bkad->baqk", q, k) / (h // heads) ** 0.5
            scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores,
                               jnp.finfo(scores.dtype).min)
            attn = jnp.einsum("baqk,bkad->bqad", jax.nn.softmax(scores, -1), v)
            x = x + self.out(attn.reshape(b, s, -1))
            return x + self.down(jax.nn.gelu(self.up(self.ln_2(x)), approximate=True))

    class GPT(nnx.Module):
        def __init__(self, layers, seed=0):
            rngs = nnx.Rngs(seed)
            self.wte, self.wpe = nnx.Embed(vocab, h, rngs=rngs), nnx.Embed(seq, h, rngs=rngs)
            self.blocks = jphantom.nn.Stacked(Block, layers, rngs=rngs)
            self.ln_f = nnx.LayerNorm(h, epsilon=1e-5, rngs=rngs)

        def loss(self, tokens, targets):
            x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))
            return jphantom.nn.cross_entropy(self.wte, self.ln_f(self.blocks(x)), targets,
                                             tied=True)

    def loss_fn(model, tokens, targets):
        return model.loss(tokens, targets)

    mesh_config = MeshConfig.parse(args.mesh)
    mesh = mesh_config.build(first_devices(mesh_config.device_count))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, (args.batch, seq)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, vocab, (args.batch, seq)), jnp.int32)
    optimizer = optax.adamw(1e-3) if args.optimizer == "adamw" else optax.sgd(1e-3)

    def module_step(layers):
        model = GPT(layers)
        jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))
        step = jphantom.make_train_step(model, mesh, optimizer, loss_fn)
        state = step.init()
        start = time.perf_counter()
        compiled = step.lower(state, tokens, targets).compile()
        return compiled, state, time.perf_counter() - start

    class ModuleRunner(Runner):
        def run(self) -> float:
            start = time.perf_counter()
            state, loss = self.compiled(self.state[0], *self.state[1:])
            jax.block_until_ready(loss)
            self.state = (state, *self.state[1:])
            return time.perf_counter() - start

    compiled, state, compile_main = module_step(args.layers)
    module_bytes = sum(c.total_bytes for c in normalise_collectives(
        collectives(compiled.as_text())) if not c.trivial)
    module_runner = ModuleRunner("module", compiled, (state, tokens, targets),
                                 threads_state=False, flops_per_device=0, devices=0)
    config = TransformerConfig(vocab_size=vocab, seq_len=seq, hidden=h, heads=heads,
                               layers=args.layers)
    program = strategies.get("tensor").program(config, mesh_config)
    batch = tuple(jax.device_put(a, s) for a, s in zip((tokens, targets),
                                                        program.batch_shardings(mesh)))
    program_runner, report = build_program_step(program, mesh, batch, optimizer,
                                                jax.random.PRNGKey(0), label="program")
    times = time_round_robin([module_runner, program_runner], args.steps, args.warmup)
    compiles = {}
    for layers in sorted({2, args.compile_layers}):
        compiles[layers] = module_step(layers)[2]
    ratio = times["module"] / times["program"]
    results = {
        "machine": {"host": platform.node(), "jax": jax.__version__,
                    "devices": jax.device_count(), "platform": jax.devices()[0].platform},
        "shape": {"layers": args.layers, "hidden": h, "heads": heads, "seq_len": seq,
                  "batch": args.batch, "mesh": args.mesh, "optimizer": args.optimizer},
        "median_step_seconds": times, "module_over_program": ratio,
        "collective_bytes_per_device": {"module": module_bytes,
                                        "program": report["collective_bytes_per_device"]},
        "compile_seconds": {"module_main": compile_main, "program_main": report["compile_seconds"],
                            **{f"module_{k}_layers": v for k, v in compiles.items()}},
        "targets": {"compile_12_layers_under_5s": compiles[args.compile_layers] < COMPILE_SECONDS},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"step time  module {times['module'] * 1e3:8.1f} ms   program "
          f"{times['program'] * 1e3:8.1f} ms   module/program {ratio:.3f}")
    print(f"collective bytes per device  module {module_bytes:,}   program "
          f"{report['collective_bytes_per_device']:,}")
    for layers, seconds in compiles.items():
        print(f"module step compile, {layers} layers: {seconds:.2f} s")
    verdict = "PASS" if compiles[args.compile_layers] < COMPILE_SECONDS else "MISS"
    print(f"target: {args.compile_layers}-layer compile < {COMPILE_SECONDS:.0f} s: {verdict}")
    print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
