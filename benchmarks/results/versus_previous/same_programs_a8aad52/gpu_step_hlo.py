"""The optimised HLO of ``benchmarks/gpu_step.py``'s ``jphantom-bf16`` step (the 1.24B Llama,
S=4096, batch 4, one device, bf16, attention="auto", AdamW b2=0.95 wd=0.1), compiled ahead of
time for one H100 (``jax.experimental.topologies``, no GPU needed) with jphantom's GPU XLA
defaults, on abstract parameters. Runs against either source layout (before and after the
package reorganisation): the imports try the new module paths, then the old.

    PYTHONPATH=<a jphantom checkout> /work/main/.venv-aot/bin/python gpu_step_hlo.py OUT.hlo [--small]

Prints the fingerprint of ``benchmarks/versus_previous.py`` (:func:`hlo_fingerprint`: the HLO's
hash without its source metadata) and writes the HLO text to OUT.hlo.
"""

import hashlib
import json
import re
import sys

import jax

jax.config.update("jax_platforms", "cpu")

import jphantom  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jphantom.models.llama import Llama, LlamaConfig, lm_loss  # noqa: E402

try:
    from jphantom.costs.aot import Target
    from jphantom.runtime import gpu_defaults
    from jphantom.runtime.mesh import MeshConfig
except ImportError:  # the layout before a8aad52
    from jphantom.aot import Target
    from jphantom import gpu_defaults
    from jphantom.mesh import MeshConfig

FULL = dict(layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, vocab=128256,
            seq_len=4096, batch=4)
SMALL = dict(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=512,
             seq_len=128, batch=2)  # gpu_step.py's --small: a smoke test of this script


def hlo_fingerprint(text: str) -> str:
    """As benchmarks/versus_previous.py's."""
    text = re.sub(r",? metadata=\{[^}]*\}", "", text)
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?\n\n", "", text,
                  flags=re.S | re.M)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(out: str, small: bool) -> None:
    shape = SMALL if small else FULL
    target = Target.parse("gpu:h100", gpus_per_node=1)
    devices = target.devices()
    config = LlamaConfig(vocab_size=shape["vocab"], hidden=shape["hidden"],
                         intermediate=shape["intermediate"], layers=shape["layers"],
                         heads=shape["heads"], kv_heads=shape["kv_heads"],
                         max_positions=shape["seq_len"], tie_word_embeddings=True,
                         rope_theta=500000.0)
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    mesh = MeshConfig.parse("model=1").build(devices[:1])
    optimizer = optax.adamw(3e-4, b2=0.95, weight_decay=0.1)
    step = jphantom.make_train_step(model, mesh, optimizer, lm_loss, precision="bf16",
                                    attention="auto")
    rows = (shape["batch"], shape["seq_len"])
    batch = [jax.ShapeDtypeStruct(rows, "int32", sharding=s) for s in step.batch_shardings(2)]
    wanted = gpu_defaults.current(precision="bf16")
    flags, _ = gpu_defaults.merge_flags("", wanted)
    compiled = step.lower(step.abstract_state(), *batch).compile(
        compiler_options=gpu_defaults.compiler_options(flags, wanted))
    text = compiled.as_text()
    with open(out, "w") as f:
        f.write(text)
    memory = compiled.memory_analysis()
    print(json.dumps({"jphantom": jphantom.__file__, "hlo_fingerprint": hlo_fingerprint(text),
                      "temp_bytes": memory.temp_size_in_bytes, "hlo_chars": len(text),
                      "cudnn_fmha": text.count("__cudnn$fmha")}))


if __name__ == "__main__":
    main(sys.argv[1], "--small" in sys.argv[2:])
