"""Packed training under every layout: the step's loss and every gradient on a packed and padded
batch ``(tokens, targets, segment_ids, positions)`` equal the one-device model's
(:func:`jphantom.verify`, float32 against float64, 1e-5): tensor + sequence parallelism, ring
and all-gather context attention (the balanced layout reorders the segment ids and positions
with the tokens; the ring passes each K/V chunk's segment ids with it), a 1F1B pipeline (the
packing rides with the activation between stages), dropless experts (Mixtral), ZeRO-3, and
GPT-2 and Gemma 3 (sliding-window local layers) under sequence parallelism."""

from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import jphantom
from jphantom.runtime.mesh import MeshConfig, first_devices
from jphantom.models import gpt2, hf, llama, packed_lm_loss
from jphantom.pipeline.runner import PipelineConfig

from conftest import require_devices

ROWS, S, VOCAB = 4, 16, 64


def packed_batch(seed=0):
    """Rows of documents of 2..7 tokens, odd rows ending in a pad; targets -100 on each
    document's last token and the pads."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, (ROWS, S)).astype(np.int32)
    segments, positions = np.zeros((ROWS, S), np.int32), np.zeros((ROWS, S), np.int32)
    targets = np.full((ROWS, S), -100, np.int32)
    for r in range(ROWS):
        start, document = 0, 1
        while start < S - r % 2:
            n = min(int(rng.integers(2, 8)), S - r % 2 - start)
            segments[r, start:start + n] = document
            positions[r, start:start + n] = np.arange(n)
            targets[r, start:start + n - 1] = tokens[r, start + 1:start + n]
            start, document = start + n, document + 1
    return tokens, targets, segments, positions


def _mesh(text):
    config = MeshConfig.parse(text)
    require_devices(config.device_count)
    return config.build(first_devices(config.device_count))


def _llama(experts=0):
    return llama.Llama(llama.LlamaConfig(vocab_size=VOCAB, hidden=32, intermediate=64, layers=2,
                                         heads=4, kv_heads=2, max_positions=S, experts=experts,
                                         top_k=2), rngs=nnx.Rngs(0))


CASES = {
    "ring": ("data=2,context=2", lambda m: jphantom.plans.context(m), {}),
    "all-gather": ("data=2,context=2",
                   lambda m: jphantom.plans.context(m, algorithm="all-gather"), {}),
    "sp": ("data=2,model=2", lambda m: jphantom.plans.megatron(m, sequence_parallel=True), {}),
    "1f1b": ("data=2,stage=2", lambda m: None,
             {"pipeline": PipelineConfig(microbatches=2, schedule="1f1b")}),
    "experts": ("data=2,expert=2,model=2", lambda m: jphantom.plans.megatron(m), {}),
    "zero3": ("data=2,model=2", lambda m: jphantom.plans.megatron(m), {"zero": 3}),
    "gpt2-sp": ("data=2,model=2", lambda m: jphantom.plans.megatron(m, sequence_parallel=True),
                {}),
    "gemma3-sp": ("data=2,model=2",  # local layers' window (4) shorter than most documents
                  lambda m: jphantom.plans.megatron(m, sequence_parallel=True), {}),
}
FAST = {"ring"}


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_packed_training_equals_one_device(case):
    mesh, plan, options = CASES[case]
    if case == "gemma3-sp":
        model = hf.load(Path(__file__).parents[1] / "fixtures" / "hf" / "gemma3_text")
    elif case == "gpt2-sp":
        model = gpt2.GPT2(gpt2.TransformerConfig(vocab_size=VOCAB, seq_len=S, hidden=32, heads=4,
                                                 layers=2), rngs=nnx.Rngs(0))
    else:
        model = _llama(experts=4 if case == "experts" else 0)
    batch = packed_batch()
    report = jphantom.verify(model, _mesh(mesh), plan(model), packed_lm_loss, *batch, **options)
    assert report.ok, str(report)

