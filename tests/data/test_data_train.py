"""``jphantom train --data chat.jsonl`` end to end: the Qwen3 fixture fine-tuned on
conversations through the chat fixture's tokenizer and template, packed, the loss on the
assistant turns, the data's counts in results.json; a resumed run reads the batches the
uninterrupted one read; the options that need documents are refused with other data, and a bad
row before anything compiles."""

import json
import pathlib

import numpy as np
import pytest

from jphantom.config import RunConfig, check_vocabulary
from jphantom.errors import ConfigError
from jphantom.loop.sources import document_data, text_source
from helpers import child_env

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
CHAT = FIXTURES / "chat"
CONVERSATIONS = json.loads((CHAT / "reference.json").read_text())["conversations"]


def _chat_file(folder: pathlib.Path, copies: int = 4) -> pathlib.Path:
    path = folder / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c["messages"]}) + "\n"
                            for c in CONVERSATIONS * copies))
    return path


def _config(data, out=None, **flags) -> RunConfig:
    settings = dict(model="qwen3", from_hf=str(FIXTURES / "hf" / "qwen3"), tokenizer=str(CHAT),
                    data=str(data), seq_len=32, batch=2, steps=2, eval_every=2, eval_batches=1,
                    out=out, progress=False, learning_rate=1e-3, warmup_steps=0)
    return RunConfig.from_flags(**{**settings, **flags})


def test_options_without_documents_are_refused(tmp_path):
    tokens = tmp_path / "train.bin"
    tokens.write_bytes(b"\0" * 64)
    text = tmp_path / "notes.txt"
    text.write_text("plain text\n")
    for data, flags, words in ((tokens, {"pack": True}, "--pack applies to dataset files"),
                               (text, {"loss_on": "assistant"}, "--loss-on assistant applies"),
                               (None, {"chat_template": str(CHAT)}, "the standard library's"),
                               (tokens, {"val_data": str(text)}, "--val-data applies")):
        config = RunConfig.from_flags(data=None if data is None else str(data), **flags)
        with pytest.raises(ConfigError, match=words):
            config.train.check_paths()
    with pytest.raises(ConfigError, match="val_data=.*notes.txt' is not a dataset file"):
        RunConfig.from_flags(data=str(_chat_file(tmp_path)), val_data=str(text)
                             ).train.check_paths()
    with pytest.raises(ConfigError, match="loss_on='answers'; use one of assistant"):
        RunConfig.from_flags(loss_on="answers")


def test_a_bad_row_is_refused_before_anything_is_built(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"input": "x"}) + "\n")
    with pytest.raises(ConfigError, match="rows.jsonl' row 2 has keys \\['input'\\]"):
        document_data(_config(path))
    no_tokenizer = RunConfig.from_flags(model="llama", data=str(path))
    with pytest.raises(ConfigError, match="give --tokenizer"):
        check_vocabulary(no_tokenizer)


def test_a_run_refuses_a_bad_row_before_it_builds_or_compiles(tmp_path, monkeypatch):
    """``run`` reads the dataset first (the data layer, :func:`document_data`): a bad row is
    refused before the program is built or the step compiled."""
    from jphantom.loop import trainer

    def boom(*args, **kwargs):
        raise AssertionError("built or compiled before the data was read")

    monkeypatch.setattr(RunConfig, "build", boom)
    monkeypatch.setattr(trainer, "check_memory", boom)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"input": "x"}) + "\n")
    with pytest.raises(ConfigError, match="rows.jsonl' row 2 has keys \\['input'\\]"):
        trainer.run(_config(path))


def _counted_rows(monkeypatch) -> list:
    """The rows tokenised from now on, in order (each call of ``RowTokenizer.encode``)."""
    from jphantom.data.documents import RowTokenizer

    seen, encode = [], RowTokenizer.encode
    monkeypatch.setattr(RowTokenizer, "encode",
                        lambda self, row, *rest: seen.append(row) or encode(self, row, *rest))
    return seen


def test_a_run_tokenises_its_dataset_once(tmp_path, monkeypatch):
    """The configuration's checks tokenise no row; preparing a run (all it does before its first
    step, the step's compilation left out here) reads the dataset once and hands the documents
    to its source as a value: each row tokenised once (``text_source`` given no documents, as
    a loop of one's own may call it, reads them itself)."""
    from jphantom.loop import trainer

    seen = _counted_rows(monkeypatch)
    config = _config(_chat_file(tmp_path), steps=1, eval_every=1, pack=True)
    config.train.check_paths()
    check_vocabulary(config)
    config.build()
    assert seen == []
    monkeypatch.setattr(trainer, "check_memory", lambda *args, **kwargs: {})  # no compilation
    prepare = trainer.Trainer(config)
    prepared = prepare._setup()
    prepare._close(prepared)  # the signal handlers, the watchdog and the checkpointer
    assert seen == [{"messages": c["messages"]} for c in CONVERSATIONS * 4]
    described = prepared.data.source.describe()
    assert described["train"]["rows"] == 4 * len(CONVERSATIONS) - 1
    assert text_source(config, 32).describe() == described  # a caller that read none: read there


def _turn(user: str, answer: str | None) -> dict:
    turns = [{"role": "user", "content": user}]
    return {"messages": turns + ([{"role": "assistant", "content": answer}] if answer else [])}


@pytest.mark.parametrize("rows, flags, words", [
    ([_turn("word " * 300, "yes it is")] * 4, {"loss_on": "assistant"},
     "every loss token lies past the first 32 tokens of its document, where a padded row of "
     "--seq-len 32 ends (the earliest is token 312): give --seq-len 313 or more, or --pack"),
    ([_turn("hi there", None)] * 4, {"loss_on": "assistant", "pack": True},
     "no row has an assistant turn for --loss-on assistant: give rows with answers"),
    ([{"text": ""}] * 4, {}, "every row is at most one token (a text of '' is its EOS alone)"),
])
def test_nothing_to_learn_is_refused_before_anything_is_built(tmp_path, rows, flags, words):
    """Loss tokens are counted in the rows the model sees (after padding's
    truncation), and a split with none is one line naming why, before the build."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as error:
        document_data(_config(path, **flags))
    message = str(error.value)
    assert message.startswith("the training split has nothing to learn (0 loss tokens in 3 row")
    assert words in message and "\n" not in message


def test_text_the_tokenizer_cannot_represent_is_counted_or_refused(tmp_path):
    """The chat fixture's 120-id byte-level BPE has no token for 'Ü' or '日' and drops
    them; the count and the first row are a warning, or with --refuse-lost-text a refusal."""
    from jphantom.errors import JPhantomWarning

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "Hello the sky"}) + "\n"
                    + json.dumps({"text": "Ünïcödé 日本語 😀"}) + "\n" * 3)
    first = f"the first: data file {str(path)!r} row 2 ('Ü')"
    with pytest.warns(JPhantomWarning, match="cannot represent 8 character\\(s\\) of 1 row") as caught:
        document_data(_config(path))
    assert first in str(caught[0].message)
    with pytest.raises(ConfigError, match="--refuse-lost-text: .* 8 character") as error:
        document_data(_config(path, refuse_lost_text=True))
    assert first in str(error.value)


def test_a_chat_template_refusal_blames_the_template(tmp_path):
    """An empty --chat-template file, and a folder without a template, are named as
    such (not "the data holds 0 row(s)", not "give --chat-template FILE")."""
    data = _chat_file(tmp_path, copies=1)
    empty = tmp_path / "empty.jinja"
    empty.write_text("")
    with pytest.raises(ConfigError, match=f"chat template {str(empty)!r} is empty: give its"):
        document_data(_config(data, chat_template=str(empty)))
    (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match="folder' is a folder without a chat_template.jinja"):
        document_data(_config(data, chat_template=str(tmp_path / "folder")))


@pytest.mark.slow
def test_fine_tune_packed_on_the_answers_and_resume(tmp_path, monkeypatch):
    """Packed conversations, the loss on the assistant turns: the run trains (the loss falls over
    6 steps), reports the data's counts, and a run resumed at step 3 from its checkpoint gives
    the uninterrupted run's losses (the reader's position is in the checkpoint)."""
    from jphantom.loop.trainer import run

    data = _chat_file(tmp_path)
    flags = dict(pack=True, loss_on="assistant", steps=6, eval_every=6)
    seen = _counted_rows(monkeypatch)
    whole = run(_config(data, **flags))
    assert len(seen) == 4 * len(CONVERSATIONS)  # a whole run tokenises each row once
    counts = whole.data
    assert counts["packed"] and counts["loss_on"] == "assistant"
    assert counts["train"]["rows"] == 11 and counts["validation"]["rows"] == 1
    assert 0 < counts["train"]["loss_tokens"] < counts["train"]["tokens"]
    losses = whole.history["train_loss"]
    assert losses[-1] < losses[0]
    checkpoints = str(tmp_path / "ckpt")
    run(_config(data, checkpoint_dir=checkpoints, save_every=3, **{**flags, "steps": 3}))
    resumed = run(_config(data, checkpoint_dir=checkpoints, resume=True, **flags))
    assert resumed.history["train_loss"][3:] == pytest.approx(losses[3:], rel=1e-5)


@pytest.mark.slow
def test_fine_tune_padded_and_save_a_chat_model(tmp_path):
    """One padded conversation per row; --save-hf writes the model with the tokenizer and the
    template it was tuned with, and the folder loads (jphantom's reader; transformers reads the
    same files) and renders the conversations as the fixture's template does."""
    from jphantom.data.chat_template import load_chat_template
    from jphantom.models import hf
    from jphantom.loop.trainer import run

    out = tmp_path / "tuned"
    results = run(_config(_chat_file(tmp_path), loss_on="assistant", save_hf=str(out)))
    assert not results.data["packed"] and results.data["truncated_documents"] > 0
    assert results.final_validation_loss > 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    hf.load(out)
    record = CONVERSATIONS[0]
    assert load_chat_template(out).render(record["messages"])[0] == record["text"]


@pytest.mark.slow  # two trainings, three processes: 83 s on 2 cores
def test_two_processes_read_their_rows_and_train_as_one(tmp_path):
    """``jphantom launch -n 2``: each process builds only its rows of each packed batch, and the
    run's losses equal one process's on the same 8 devices."""
    import subprocess
    import sys

    data = _chat_file(tmp_path)
    train = ["train", "--model", "qwen3", "--from-hf", str(FIXTURES / "hf" / "qwen3"),
             "--tokenizer", str(CHAT), "--data", str(data), "--pack", "--loss-on", "assistant",
             "--strategy", "tensor", "--mesh", "data=4,model=2", "--seq-len", "32",
             "--batch", "8", "--steps", "3", "--eval-every", "3", "--eval-batches", "1",
             "--no-progress"]
    env = child_env()
    found = []
    for name, command in (("one", ["--devices", "8"]),
                          ("two", ["launch", "-n", "2", "--devices-per-process", "4", "--",
                                   "jphantom"])):
        out = tmp_path / name
        argv = (command + train if name == "two" else train + command) + ["--out", str(out)]
        done = subprocess.run([sys.executable, "-m", "jphantom.cli", *argv], env=env,
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        found.append(json.loads((out / "results.json").read_text()))
    one, two = found
    assert len(two["devices"]) == 8 and two["data"]["train"] == one["data"]["train"]
    np.testing.assert_allclose(two["history"]["train_loss"], one["history"]["train_loss"],
                               rtol=1e-5)
