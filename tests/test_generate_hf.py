"""Greedy generation equals transformers' ``generate`` for every family fixture: the five of
tests/fixtures/hf/ (Mistral's sliding window, Qwen2, Qwen3, Qwen3-MoE, Gemma 3's local and global
layers) and GPT-2, Llama and Mixtral (tests/fixtures/generate/), references made by
tests/fixtures/make_generate_reference.py. The two prompts (5 and 11 tokens) run as one
right-padded batch here, alone there; the tokens are equal and each step's logits within float32
tolerance."""

from pathlib import Path

import numpy as np
import pytest

import jphantom
from jphantom.models import hf

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ("mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gpt2", "llama", "mixtral")


def _checkpoint(family):
    made = FIXTURES / "generate" / family
    return made if made.is_dir() else FIXTURES / "hf" / family


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow_cells("qwen2", "qwen3", "llama", "mistral", "mixtral")  # make test-all
def test_greedy_tokens_and_logits_equal_transformers(family):
    ref = dict(np.load(FIXTURES / "generate" / f"{family}.npz"))
    model = hf.load(_checkpoint(family))
    prompts = [ref["prompt0"].tolist(), ref["prompt1"].tolist()]
    new = ref["tokens0"].shape[0]
    out = jphantom.generate(model, prompts, jphantom.GenerationConfig(
        max_new_tokens=new, return_logits=True, bucket=8))
    assert out.cached and out.bucket == 16 and out.steps == new
    for row in range(2):
        assert out.completions[row] == ref[f"tokens{row}"].tolist(), (family, row)
        theirs = ref[f"logits{row}"]
        assert np.abs(out.logits[row] - theirs).max() <= 1e-4 * np.abs(theirs).max(), row
