"""Forward-only pricing (:mod:`jphantom.perf.inference`): the decode roofline against a hand
computation at tiny sizes, the forward's collectives of phantom and tensor parallelism against the
compiled program on the 8 simulated devices, and ``benchmarks/inference_forward.py --quick``."""

import importlib.util
import json
from pathlib import Path

import pytest

from jphantom.errors import ConfigError
from jphantom.models.ffn import FFNConfig
from jphantom.models.llama import LlamaConfig
from jphantom.perf import inference
from jphantom.perf.axonn_model import GPTShape
from jphantom.predict.device import load

from conftest import require_devices

TINY = GPTShape(layers=2, hidden=64, heads=4, seq_len=16, vocab_size=256, family="llama",
                intermediate=128, kv_heads=2)
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "inference_forward.py"


def test_decode_roofline_is_weights_and_cache_over_the_hbm_bandwidth():
    """One device, batch 2, context 16, bf16, counted by hand: per block q 64x64, k and v 64x32,
    o 64x64, gate and up 64x128, down 128x64 (36,864 weights) and two norms (128); the head
    64 x 256, the final norm (64), the two embedding rows read (128); the cache K and V of 2
    layers x 2 sequences x 16 positions x 2 heads x 16 features."""
    h100 = load("h100-sxm")
    r = inference.decode_roofline(TINY, 2, 16, h100)
    weights = 2 * (36864 + 128) + 64 * 256 + 64 + 2 * 64
    cache = 2 * 2 * 2 * 16 * 2 * 16
    assert r["weight_bytes"] == 2 * weights and r["cache_bytes"] == 2 * cache
    assert r["bytes_per_step"] == 2 * (weights + cache)
    flops = 2 * 2 * (2 * 36864 + 64 * 256) + 2 * 4 * 2 * 16 * 64  # weights; q.k and p.v
    assert r["flops"] == flops
    memory_s = 2 * (weights + cache) / (h100["memory.hbm_gbps"] * 1e9)
    assert r["seconds"] == pytest.approx(memory_s) and r["bound"] == "memory"
    assert r["roofline_tokens_per_s"] == pytest.approx(2 / memory_s)
    sustained = memory_s / h100["memory.stream_efficiency"]
    assert r["comm_seconds"] == 0 and r["collectives"] == []
    assert r["step_seconds"] == pytest.approx(sustained)
    assert r["joules_per_token"] == pytest.approx(h100["power.busy_watts"] * sustained / 2)
    assert "modelled" in r["label"] and "h100-sxm" in r["label"]


def test_decode_split_over_model_and_data():
    """model=2: a rank reads half the linears and one of the two KV heads; Megatron's forward
    all-reduces B h five times (2 L + 1) and gathers the logits; data=2 halves each replica's
    batch and doubles the devices Eq. 1 sums over."""
    one = inference.decode_roofline(TINY, 2, 16, "h100-sxm")
    two = inference.decode_roofline(TINY, 2, 16, "h100-sxm", "model=2")
    assert two["cache_bytes"] == one["cache_bytes"] / 2
    assert two["collectives"] == [["all-reduce", 2 * 64, 5], ["all-gather", 2 * 256, 1]]
    assert two["comm_seconds"] > 0 and two["collective_result_bytes"] == 2 * (5 * 128 + 512)
    replicas = inference.decode_roofline(TINY, 4, 16, "h100-sxm", "data=2,model=2")
    assert replicas["tokens"] == 4 and replicas["cache_bytes"] == two["cache_bytes"]
    phantom = inference.decode_roofline(TINY, 2, 16, "h100-sxm", {"model": 2},
                                        strategy="phantom", ghost_width=4)
    block = sum(o // 2 * (i // 2) + 4 * (i // 2) + 2 * (o // 2) * 4 for i, o in (
        (64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)))
    head = 128 * 32 + 4 * 32 + 2 * 128 * 4
    assert phantom["weight_bytes"] == 2 * (2 * (block + 64) + head + 32 + 64)
    ghosts = 2 * 4 * 2  # p k B, combined as XLA:GPU compiles them: q|k|v, gate|up
    assert phantom["collectives"] == [["all-gather", ghosts, 5], ["all-gather", 2 * ghosts, 2],
                                      ["all-gather", 3 * ghosts, 2], ["all-reduce", 2, 5],
                                      ["all-gather", 2 * 256, 1]]
    assert phantom["collective_result_bytes"] == 2 * (15 * ghosts + 5 * 2 + 512)


def test_prefill_is_compute_bound_and_the_inputs_are_checked():
    llama8b = GPTShape(32, 4096, 32, 8192, 128256, "llama", 14336, 8)
    assert inference.prefill_bound(llama8b, 1, 2048, "h100-sxm")["bound"] == "compute"
    assert inference.decode_roofline(llama8b, 1, 2048, "mi250x-gcd")["bound"] == "memory"
    for kwargs, match in [(dict(strategy="pmm3d"), "knows"), (dict(strategy="phantom"), "k >= 1"),
                          (dict(strategy="tensor-t1"), "FFN baseline"),
                          (dict(dtype="fp8"), "dtype")]:
        with pytest.raises(ConfigError, match=match):
            inference.decode_roofline(TINY, 2, 16, "h100-sxm", "model=2", **kwargs)
    config = LlamaConfig(vocab_size=256, hidden=64, intermediate=128, layers=2, heads=4,
                         kv_heads=2, max_positions=16)  # a model's own config prices the same
    assert (inference.decode_roofline(config, 2, 16, "h100-sxm")
            == inference.decode_roofline(TINY, 2, 16, "h100-sxm"))
    with pytest.raises(ConfigError, match="GPT-2"):
        inference.decode_roofline(GPTShape(2, 64, 4), 1, 16, "h100-sxm")
    with pytest.raises(ConfigError, match="model and data only"):
        inference.decode_roofline(TINY, 2, 16, "h100-sxm", "context=2")


def _agree(formula, compiled):
    return sorted((k, e, c, 4 * e) for k, e, c in formula) == compiled


@pytest.mark.parametrize("strategy, ghost", [("phantom", 3), ("tensor", None),
                                             ("tensor-t1", None)])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_ffn_forward_collectives_are_the_compiled_forwards(strategy, ghost, depth):
    """Phantom: one all-gather of p k B per layer (Table II's forward row); Megatron: the input's
    all-gather and an all-reduce per column/row pair; T1: an all-gather of B n per layer."""
    require_devices(8)
    formula = inference.ffn_forward(64, depth, 8, 16, strategy, ghost).collectives
    compiled = inference.compiled_forward(FFNConfig(width=64, depth=depth, ghost_width=ghost),
                                          strategy, "model=8", (16, 64), ghost_width=ghost)
    assert _agree(formula, compiled), (formula, compiled)


@pytest.mark.parametrize("strategy, ghost", [("phantom", 4), ("tensor", None)])
def test_decode_collectives_are_the_compiled_forward_of_one_token(strategy, ghost):
    """A decode step's forward (one token for each of 4 sequences) of a 2-layer Llama on
    model=8: the formula's kinds, sizes and counts are the compiled program's."""
    require_devices(8)
    config = LlamaConfig(vocab_size=256, hidden=64, intermediate=128, layers=2, heads=8,
                         kv_heads=8, max_positions=16)
    shape = GPTShape(2, 64, 8, 16, 256, "llama", 128, 8)
    formula = inference.llama_forward(shape, 4, 1, 1, 8, strategy, ghost, "f32",
                                      combined=False).collectives  # XLA:CPU: one per projection
    compiled = inference.compiled_forward(config, strategy, "model=8", (4, 1), ghost_width=ghost)
    assert _agree(formula, compiled), (formula, compiled)


@pytest.mark.slow  # make test-all: the fast suite's budget
def test_quick_benchmark_checks_every_row_against_its_compile(tmp_path):
    require_devices(8)
    spec = importlib.util.spec_from_file_location("inference_forward", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--quick", "--out", str(tmp_path), "--no-plot"])
    data = json.loads((tmp_path / "inference_forward.json").read_text())
    assert {r["bytes_source"] for r in data["ffn"]} == {"compiled"}
    assert all(c["agree"] for c in data["decode_check"])
    assert {r["strategy"] for r in data["ffn"]} == set(inference.STRATEGIES)
    assert {r["device"] for r in data["decode"]} == set(bench.DEVICES)
    text = (tmp_path / "inference_forward.txt").read_text()
    assert "J ph/TP" in text and "roofline ms" in text
