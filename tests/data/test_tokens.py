"""Real data: tokenizers through their libraries (local files only), llm.c and nanoGPT token files
read by memory map, `jphantom tokenize`, and a token reader whose position is checkpointed, so
that a resumed run reads exactly the batches of an uninterrupted one, each process its rows."""

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from jphantom import cli
from jphantom.config import RunConfig
from jphantom.data import tokens
from jphantom.data.tokenizers import load_tokenizer, train_bpe
from jphantom.errors import ConfigError

TEXT = ("def greet(name):\n    return f'héllo, {name} ✓'\n\n"
        "class Point:\n    x: int = 0\n    y: int = 0\n") * 3


# ---------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("name", ["bpe", "bytes"])
def test_bundled_and_byte_tokenizers_round_trip_any_text(name):
    tokenizer = load_tokenizer(name)
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert max(ids) < tokenizer.vocab_size
    if name == "bpe":  # a real BPE: fewer tokens than bytes, <|endoftext|> last
        assert tokenizer.vocab_size == 1024 and tokenizer.eot == 1023
        assert len(ids) < 0.6 * len(TEXT.encode())
        assert tokenizer.encode_batch([TEXT, "x"]) == [ids, tokenizer.encode("x")]
    else:
        assert tokenizer.vocab_size == 256 and ids == list(TEXT.encode())


def test_a_tokenizer_json_and_its_folder_load_through_tokenizers(tmp_path):
    trained = train_bpe([TEXT * 20], vocab_size=300)
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    trained.save(str(folder / "tokenizer.json"))
    for value in (str(folder / "tokenizer.json"), str(folder)):
        tokenizer = load_tokenizer(value)
        assert tokenizer.vocab_size == 300 and tokenizer.eot == 299
        assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_a_tiktoken_file_loads_without_network_and_a_missing_encoding_is_refused(
        tmp_path, monkeypatch):
    pytest.importorskip("tiktoken")
    ranks = [bytes([b]) for b in range(256)] + [b"re", b"ret", b"retu", b"retur", b"return"]
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    tokenizer = load_tokenizer(str(path))
    assert tokenizer.vocab_size == 262 and tokenizer.eot == 261  # <|endoftext|> after the ranks
    assert 260 in tokenizer.encode("    return x") and tokenizer.decode(
        tokenizer.encode(TEXT)) == TEXT
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(ConfigError, match="tokenizer='cl100k_base'.*nothing downloads"):
        load_tokenizer("cl100k_base")


@pytest.mark.parametrize("value, message", [
    ("missing/tokenizer.json", "does not exist"),
    ("no-such-encoding", "neither a file nor a tiktoken encoding"),
])
def test_a_tokenizer_that_is_not_here_is_one_config_error(value, message):
    with pytest.raises(ConfigError, match=message):
        load_tokenizer(value)


# ---------------------------------------------------------------------------- token files


@pytest.mark.parametrize("fmt, vocab, dtype", [("llm.c", 50257, "uint16"),
                                               ("llm.c", 128256, "uint32"),
                                               ("nanogpt", 50257, "uint16")])
def test_token_files_of_both_formats_are_detected_and_memory_mapped(tmp_path, fmt, vocab, dtype):
    ids = np.random.default_rng(0).integers(0, vocab, size=1000)
    path = tmp_path / "train.bin"
    tokens.write_token_file(path, ids, vocab, fmt)
    found = tokens.read_token_file(path)
    assert (found.format, found.dtype, found.count) == (fmt, np.dtype(dtype), 1000)
    data = found.tokens()
    assert isinstance(data, np.memmap) and np.array_equal(data, ids)
    raw = np.fromfile(path, dtype="<i4", count=3)
    if fmt == "llm.c":  # llm.c's header: magic, version, count
        assert tuple(raw) == ((20240520, 1, 1000) if dtype == "uint16" else (20240801, 7, 1000))
    else:
        assert path.stat().st_size == 2000  # nanoGPT: the tokens alone


def test_a_nanogpt_file_written_by_numpy_reads_as_nanogpt_tokens(tmp_path):
    ids = np.arange(10, 510, dtype=np.uint16)  # as nanoGPT's prepare.py writes val.bin
    ids.tofile(tmp_path / "val.bin")
    found = tokens.read_token_file(tmp_path / "val.bin")
    assert found.format == "nanogpt" and np.array_equal(found.tokens(), ids)


def test_damaged_token_files_are_refused_by_name(tmp_path):
    path = tmp_path / "cut.bin"
    tokens.write_token_file(path, np.arange(100), 1000)
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    with pytest.raises(ConfigError, match="header says 100 tokens.*truncated"):
        tokens.read_token_file(path)
    path.write_bytes(b"abc")
    with pytest.raises(ConfigError, match="odd size"):
        tokens.read_token_file(path)


def test_a_folder_splits_by_name_and_a_lone_file_holds_out_its_tail(tmp_path):
    for name, start in (("a_train_000.bin", 0), ("b_train_001.bin", 100), ("a_val_000.bin", 900)):
        tokens.write_token_file(tmp_path / name, np.arange(start, start + 100), 1000)
    train, validation = tokens.token_files(tmp_path)
    assert [f.path.split("/")[-1] for f in train] == ["a_train_000.bin", "b_train_001.bin"]
    assert [f.path.split("/")[-1] for f in validation] == ["a_val_000.bin"]
    kept, held = tokens.hold_out([np.arange(100), np.arange(100, 110)], 0.1)
    assert np.array_equal(np.concatenate(held), np.arange(99, 110))  # 11 of 110 tokens
    assert np.array_equal(np.concatenate(kept), np.arange(99))


def test_a_folder_splits_by_whole_words_as_dataset_files_do(tmp_path):
    """One rule for token and dataset folders (dataset_files.split_of): ``values.bin`` and
    ``intervals/more.bin`` train, ``val.bin`` validates, ``test.bin`` is left unread."""
    for name in ("train.bin", "values.bin", "intervals/more.bin", "val.bin", "test.bin"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        tokens.write_token_file(tmp_path / name, np.arange(10), 16)
    assert tokens.is_token_data(tmp_path / "intervals") and tokens.is_token_data(tmp_path)
    train, validation = tokens.token_files(tmp_path)
    below = lambda files: [Path(f.path).relative_to(tmp_path).as_posix() for f in files]
    assert below(train) == ["intervals/more.bin", "train.bin", "values.bin"]
    assert below(validation) == ["val.bin"]
    for name in ("train.bin", "values.bin", "intervals/more.bin"):
        (tmp_path / name).unlink()
    with pytest.raises(ConfigError, match="every token file is a validation or test file"):
        tokens.token_files(tmp_path)


# ---------------------------------------------------------------------------- jphantom tokenize


def test_tokenize_cli_writes_what_train_reads(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "one.txt").write_text(TEXT)
    (corpus / "sub" / "two.txt").write_text("second document\n")
    (corpus / "skip.md").write_text("not matched by *.txt")
    out = tmp_path / "data" / "train.bin"
    assert cli.main(["tokenize", str(corpus), "--out", str(out), "--no-progress"]) == 0
    assert "train with --data" in capsys.readouterr().out
    bpe = load_tokenizer("bpe")
    ids = tokens.read_token_file(out).tokens()
    expected = [bpe.eot, *bpe.encode(TEXT), bpe.eot, *bpe.encode("second document\n")]
    assert ids.tolist() == expected  # each file a document after <|endoftext|>
    assert cli.main(["tokenize", str(corpus / "one.txt"), "--out", str(tmp_path / "n.bin"),
                     "--format", "nanogpt", "--tokenizer", "bytes", "--no-progress"]) == 0
    found = tokens.read_token_file(tmp_path / "n.bin")
    assert found.format == "nanogpt" and bytes(found.tokens().astype(np.uint8)) == TEXT.encode()


def test_tokenize_cli_refuses_bad_input_in_one_line(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("x")
    for argv, message in ((["tokenize", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o.txt")],
                           "must end in .bin"),
                          (["tokenize", str(tmp_path), "--pattern", "*.rst", "--out",
                            str(tmp_path / "o.bin")], "no file matches"),
                          (["tokenize", str(tmp_path), "--tokenizer", "nope.json", "--out",
                            str(tmp_path / "o.bin")], "does not exist")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("jphantom: error:") and message in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "o.bin").exists()


# ---------------------------------------------------------------------------- the reader


def _reader(data, **options):
    options = {"seq_len": 8, "batch": 4, "seed": 3, **options}
    return tokens.TokenBatches([data[:700], data[700:1000]], [data[1000:]], **options)


def test_resuming_from_the_saved_position_reads_the_uninterrupted_batches():
    """Across epochs (each file's windows, reshuffled every epoch) and through JSON, as a
    checkpoint stores it."""
    data = np.random.default_rng(1).integers(0, 500, size=1200).astype(np.uint16)
    whole = _reader(data)
    assert whole.train_windows.count == 87 + 37  # (700 - 1) // 8 + (300 - 1) // 8
    straight = [whole.next_batch() for _ in range(70)]  # > 2 epochs of 31 batches
    part = _reader(data)
    for _ in range(40):
        part.next_batch()
    saved = json.loads(json.dumps(part.state()))
    assert saved["epoch"] == 1 and saved["index"] == 160 - 124
    resumed = _reader(data)
    resumed.restore(saved)
    for expected in straight[40:]:
        got = resumed.next_batch()
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))
    tokens_, targets = straight[0]
    assert tokens_.shape == (4, 8) and np.array_equal(tokens_[:, 1:], targets[:, :-1])
    epoch = np.concatenate([whole._permutation(0)])
    assert sorted(epoch.tolist()) == list(range(124))  # every window once per epoch
    with pytest.raises(ConfigError, match="seq_len=8 but this run has seq_len=4"):
        _reader(data, seq_len=4).restore(saved)


@pytest.mark.parametrize("processes", [2, 4])
def test_each_process_reads_its_rows_and_together_the_global_batch(processes):
    data = np.random.default_rng(2).integers(0, 500, size=1200).astype(np.uint16)
    whole = _reader(data, batch=8)
    ranks = [_reader(data, batch=8, process_index=p, process_count=processes)
             for p in range(processes)]
    for _ in range(20):
        expected = whole.next_batch()
        shares = [rank.next_batch() for rank in ranks]
        assert all(len(s[0]) == 8 // processes for s in shares)
        for i in range(2):
            assert np.array_equal(np.concatenate([s[i] for s in shares]), expected[i])
    assert len({json.dumps(r.state()) for r in ranks}) == 1  # every process at one position
    with pytest.raises(ConfigError, match="batch=8 is not divisible by the 3 processes"):
        _reader(data, batch=8, process_index=0, process_count=3)


# ---------------------------------------------------------------------------- training on tokens

TINY = dict(model="gpt2", layers=1, hidden=16, heads=2, seq_len=8, batch=4, eval_every=2,
            eval_batches=1, progress=False, vocab=1024)


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokens")
    ids = np.random.default_rng(3).integers(0, 1000, size=3000)
    tokens.write_token_file(folder / "train.bin", ids[:2500], 1024)
    tokens.write_token_file(folder / "val.bin", ids[2500:], 1024, "nanogpt")
    return folder


@pytest.mark.slow  # make test-all: a faster test of this file covers its path
def test_a_resumed_token_run_trains_on_the_batches_of_an_uninterrupted_one(tmp_path,
                                                                              token_folder):
    from jphantom.loop.trainer import run

    settings = dict(TINY, data=str(token_folder))
    whole = run(RunConfig.from_flags(**settings, steps=4, out=None))
    ckpt = str(tmp_path / "ckpt")
    run(RunConfig.from_flags(**settings, steps=2, out=None, checkpoint_dir=ckpt))
    resumed = run(RunConfig.from_flags(**settings, steps=4, out=None, checkpoint_dir=ckpt,
                                       resume=True))
    assert resumed.history["train_loss"] == whole.history["train_loss"]
    assert resumed.data["files"] == {"train": ["train.bin"], "validation": ["val.bin"]}
    assert resumed.data["format"] == ["llm.c", "nanogpt"]


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer", "bpe"], "vocab=256 is smaller than tokenizer='bpe' (1024 ids): pass "
                             "--vocab 1024"),
    (["--data", "{folder}"], "vocab=256 is smaller than the token ids of data="),
    (["--tokenizer", "nowhere/tokenizer.json"], "tokenizer='nowhere/tokenizer.json' does not exist"),
    (["--data", "{empty}"], "is a folder without .bin token files"),
    (["--model", "ffn", "--data", "{folder}"], "--data and --tokenizer feed language models"),
])
def test_data_settings_are_refused_in_one_line_before_anything_compiles(
        argv, message, tmp_path, token_folder, capsys):
    (tmp_path / "empty").mkdir()
    argv = [a.format(folder=token_folder, empty=tmp_path / "empty") for a in argv]
    shape = [] if "ffn" in argv else ["--layers", "1", "--hidden", "16", "--heads", "2"]
    code = cli.main(["train", *argv, *shape, "--steps", "1", "--no-progress", "--out",
                     str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.startswith("jphantom: error:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # nothing ran


def test_text_through_a_tokenizer_is_tokenised_once_and_cached(tmp_path, monkeypatch):
    from jphantom.data.text import TextConfig, TextCorpus

    monkeypatch.setenv("JPHANTOM_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    ascii_text = TEXT.encode("ascii", "replace").decode() * 10  # bytes split: no UTF-8 cut
    text.write_text(ascii_text)
    corpus = TextCorpus(TextConfig(path=str(text), seq_len=8))
    train, validation = tokens.tokenize_corpus(corpus, "bpe")
    bpe = load_tokenizer("bpe")
    assert bpe.decode(train) + bpe.decode(validation) == ascii_text
    cached = sorted((tmp_path / "cache" / "tokens").glob("*.bin"))
    assert len(cached) == 2
    stamps = [p.stat().st_mtime_ns for p in cached]
    again, _ = tokens.tokenize_corpus(corpus, "bpe")  # read back, not tokenised again
    assert np.array_equal(again, train) and [p.stat().st_mtime_ns for p in cached] == stamps


def test_a_process_reads_the_rows_its_devices_hold_and_whole_batches_otherwise(monkeypatch):
    """What ``run`` gives the reader with two processes: process 0's devices hold rows 0-3 of
    8 (data split over processes) -> rows 0:4; replicated, or a sequence split -> every row."""
    import jax

    from jphantom.loop.sources import process_rows

    class Held:
        def __init__(self, *indices):
            self.indices = indices

        def addressable_devices_indices_map(self, shape):
            return dict(enumerate(self.indices))

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    whole = slice(None)
    assert process_rows(Held((slice(0, 2), whole), (slice(2, 4), whole)), (8, 16)) == slice(0, 4)
    assert process_rows(Held((whole, whole)), (8, 16)) is None  # replicated: all rows
    assert process_rows(Held((slice(0, 4), slice(0, 8))), (8, 16)) is None  # half sequences
    assert process_rows(Held((slice(0, 2), whole), (slice(4, 6), whole)), (8, 16)) is None
