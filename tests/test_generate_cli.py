"""``jphantom generate``: the fine-tuning walkthrough's last command (docs/fine-tuning.md) on a
folder laid out as ``train --save-hf`` writes it (the Qwen3 fixture with the chat tokenizer and
its ChatML template) answers a chat message, rendered with the generation prompt; the figures
are printed and written, the energy labelled modelled on CPU; bad input is one line and exit
status 2 before anything compiles."""

import json
import shutil
from pathlib import Path

import pytest

from jphantom.cli import main
from jphantom.data.chat_template import load_chat_template
from jphantom.data.documents import encode_with_offsets
from jphantom.data.tokenizers import load_tokenizer
from jphantom.models import hf

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def tuned(tmp_path):
    folder = tmp_path / "tuned"
    folder.mkdir()
    for source in (FIXTURES / "hf" / "qwen3" / "config.json",
                   FIXTURES / "hf" / "qwen3" / "model.safetensors",
                   FIXTURES / "chat" / "tokenizer.json",
                   FIXTURES / "chat" / "tokenizer_config.json"):
        shutil.copy(source, folder)
    return folder


def test_the_walkthroughs_command_answers_a_chat_message(tuned, tmp_path, capsys):
    out, results = tmp_path / "answers.jsonl", tmp_path / "results.json"
    code = main(["generate", "--from-hf", str(tuned), "--chat", "What colour is the sky?",
                 "--max-new-tokens", "4", "--out", str(out), "--results", str(results),
                 "--device", "h100-sxm"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "time to first token" in printed and "J/token (modelled)" in printed
    assert "roofline on h100-sxm (modelled): a decode step reads" in printed
    roofline = json.loads(results.read_text())["generate"]["roofline"]
    assert roofline["device"] == "h100-sxm" and not roofline["same_device"]  # priced, not run
    decode = roofline["decode"]
    assert decode["bytes_per_step"] == decode["weight_bytes"] + decode["cache_bytes"]
    assert decode["roofline_tokens_per_s"] == pytest.approx(
        decode["tokens"] / (decode["bytes_per_step"] / 3.35e12), rel=0.05)
    line = json.loads(out.read_text())
    assert line["prompt"] == [{"role": "user", "content": "What colour is the sky?"}]
    assert 1 <= len(line["tokens"]) <= 4
    figures = json.loads(results.read_text())["generate"]
    assert figures["energy_source"] == "modelled" and figures["cached"]
    assert figures["time_to_first_token_s"] > 0 and figures["joules_per_token"] > 0
    assert figures["weights_bytes"] == 4 * hf.load(tuned).config.param_count()  # float32
    assert figures["cache_bytes"] == 4 * 2 * 2 * 1 * 36 * 2 * 8  # K and V, 2 layers, T = 32 + 4
    text, _ = load_chat_template(tuned).render(
        [{"role": "user", "content": "What colour is the sky?"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")  # what the prompt's ids encode
    assert encode_with_offsets(load_tokenizer(str(tuned)), text)[0]


@pytest.mark.parametrize("flags, named", [
    ([], "no prompt: give --prompt TEXT"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature=-1.0"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p=1.5"),
    (["--prompts", "missing.txt"], "--prompts 'missing.txt' does not exist"),
    (["--prompts", "{bad}"], "line 1 is not JSON"),
    (["--prompts", "{row}"], "line 1: a row is"),
    (["--chat", "hi", "--from-hf", "HF"], "is a conversation but there is no chat template"),
    (["--prompt", "hi", "--device", "nowhere"], "nowhere"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, flags, named):
    (tmp_path / "bad.jsonl").write_text("not json\n")
    (tmp_path / "row.jsonl").write_text('{"question": "hi"}\n')
    swap = {"{bad}": str(tmp_path / "bad.jsonl"), "{row}": str(tmp_path / "row.jsonl"),
            "HF": str(FIXTURES / "hf" / "qwen2")}
    flags = [swap.get(f, f) for f in flags]
    if "--from-hf" not in flags:
        flags += ["--from-hf", str(FIXTURES / "hf" / "qwen2")]
    assert main(["generate", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err
