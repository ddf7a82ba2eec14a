"""The byte-level text corpus: deterministic batches, a by-file split, a unigram baseline, validation."""

import math
import os
import zlib

import numpy as np
import pytest

from jphantom.data import TextConfig, TextCorpus
from jphantom.data.text import FILE_SEPARATOR, is_validation_file, stdlib_dir, stdlib_files
from jphantom.errors import ConfigError


@pytest.fixture(scope="module")
def stdlib():
    return TextCorpus(TextConfig(seq_len=32, seed=1))


def write(tmp_path, data: bytes, name="corpus.txt"):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def test_train_batches_depend_only_on_seed_and_step(stdlib):
    tokens, targets = stdlib.train_batch(5, 4)
    assert tokens.shape == targets.shape == (4, 32) and tokens.dtype == targets.dtype == np.int32
    again = TextCorpus(TextConfig(seq_len=32, seed=1)).train_batch(5, 4)
    np.testing.assert_array_equal(tokens, again[0])
    np.testing.assert_array_equal(targets, again[1])
    stdlib.train_batch(6, 4)  # drawing another step in between changes nothing
    np.testing.assert_array_equal(tokens, stdlib.train_batch(5, 4)[0])
    assert not np.array_equal(tokens, stdlib.train_batch(6, 4)[0])
    assert not np.array_equal(tokens, TextCorpus(TextConfig(seq_len=32, seed=2)).train_batch(5, 4)[0])


def test_targets_are_the_next_bytes_of_the_train_split(stdlib):
    tokens, targets = stdlib.train_batch(3, 8)
    starts = stdlib.train_windows(3, 8)
    for row, start in enumerate(starts):
        np.testing.assert_array_equal(tokens[row], stdlib.train[start : start + 32])
        np.testing.assert_array_equal(targets[row], stdlib.train[start + 1 : start + 33])
    np.testing.assert_array_equal(tokens[:, 1:], targets[:, :-1])
    assert tokens.min() >= 0 and tokens.max() < stdlib.vocab_size == 256


def test_stdlib_split_is_by_file_and_disjoint(stdlib):
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any(part in {"site-packages", "dist-packages"} for f in files for part in f.split("/"))
    assert any(f.startswith("test/") for f in files)  # the tests are stdlib sources too
    assert set(stdlib.train_files).isdisjoint(stdlib.validation_files)
    assert sorted(stdlib.train_files + stdlib.validation_files) == files
    assert list(stdlib.validation_files) == [f for f in files if is_validation_file(f, 0.05)]
    assert all(zlib.crc32(f.encode()) % 1000 < 50 for f in stdlib.validation_files)
    assert 0.02 < len(stdlib.validation_files) / len(files) < 0.1
    # Each split is exactly its own files' bytes joined with a newline.
    root = stdlib_dir()
    want = FILE_SEPARATOR.join((root / f).read_bytes() for f in stdlib.validation_files)
    assert stdlib.validation.tobytes() == want
    sizes = [os.path.getsize(root / f) for f in stdlib.train_files]
    assert stdlib.train.size == sum(sizes) + len(sizes) - 1


def test_validation_batches_are_spread_non_overlapping_windows_and_repeatable(stdlib):
    first = list(stdlib.validation_batches(4, max_batches=3))
    second = list(stdlib.validation_batches(4, max_batches=3))
    assert len(first) == 3
    for (t1, y1), (t2, y2) in zip(first, second):
        np.testing.assert_array_equal(t1, t2)
        np.testing.assert_array_equal(y1, y2)
    tokens = np.concatenate([t for t, _ in first])
    targets = np.concatenate([y for _, y in first])
    slots = (stdlib.validation.size - 1) // 32
    starts = (np.arange(12) * slots // 12) * 32  # evenly spread over the whole split
    for row, start in enumerate(starts):
        np.testing.assert_array_equal(tokens[row], stdlib.validation[start:start + 32])
        np.testing.assert_array_equal(targets[row], stdlib.validation[start + 1:start + 33])
    assert np.all(np.diff(starts) >= 32) and starts[-1] > stdlib.validation.size // 2
    assert len(list(stdlib.validation_batches(4))) == 8  # the default cap
    full = (stdlib.validation.size - 1) // 32 // 64
    assert stdlib.num_validation_batches(64, None) == full == len(list(stdlib.validation_batches(64, None)))


def test_unigram_cross_entropy_of_stdlib_is_a_sensible_baseline(stdlib):
    ce = stdlib.unigram_cross_entropy()
    assert 2.9 < ce < 3.6  # 3.23 nats on CPython 3.11; uniform bytes would be log(256) = 5.55
    describe = stdlib.describe()
    assert describe["split"] == "by_file" and describe["unigram_cross_entropy"] == ce
    assert describe["bytes"] == {"train": stdlib.train.size, "validation": stdlib.validation.size}
    assert describe["files"]["validation"] == len(stdlib.validation_files)


def test_single_file_is_split_by_bytes_and_unigram_matches_hand_computation(tmp_path):
    data = b"aaab" * 6 + b"abcd"  # 28 bytes; the last 25% (7 bytes) = b"aababcd" is validation
    corpus = TextCorpus(TextConfig(path=write(tmp_path, data), validation_fraction=0.25, seq_len=2))
    assert corpus.train.tobytes() == data[:21] and corpus.validation.tobytes() == data[21:] == b"aababcd"
    # train: 16 'a', 5 'b'; add-one smoothing over 256 bytes -> total 21 + 256 = 277.
    p = {"a": 17 / 277, "b": 6 / 277, "c": 1 / 277, "d": 1 / 277}
    want = -(3 * math.log(p["a"]) + 2 * math.log(p["b"]) + math.log(p["c"]) + math.log(p["d"])) / 7
    assert corpus.unigram_cross_entropy() == pytest.approx(want, rel=1e-12)
    # 7 validation bytes -> 3 windows of 2 tokens; one batch of 3, identical every call.
    (tokens, targets), = list(corpus.validation_batches(3))
    np.testing.assert_array_equal(tokens, [[97, 97], [98, 97], [98, 99]])
    np.testing.assert_array_equal(targets, [[97, 98], [97, 98], [99, 100]])
    with pytest.raises(ConfigError, match="fewer than one batch"):
        corpus.validation_batches(4)
    assert corpus.describe()["split"] == "by_bytes"


def test_edited_file_is_reloaded(tmp_path):
    path = write(tmp_path, b"x" * 100)
    assert TextCorpus(TextConfig(path=path, seq_len=4)).train.tobytes() == b"x" * 95
    with open(path, "wb") as handle:
        handle.write(b"y" * 120)
    assert TextCorpus(TextConfig(path=path, seq_len=4)).train.tobytes() == b"y" * 114


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"seq_len": 0}, "seq_len=0"),
        ({"seq_len": -3}, "seq_len=-3"),
        ({"validation_fraction": 1.5}, "validation_fraction=1.5"),
        ({"validation_fraction": 0.0}, "validation_fraction=0.0"),
        ({"seed": -1}, "seed=-1"),
        ({"path": "/no/such/file.txt"}, "/no/such/file.txt"),
    ],
)
def test_bad_configs_raise_config_error_naming_the_value(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        TextConfig(**kwargs)


def test_bad_corpus_arguments_raise_config_error(tmp_path, stdlib):
    with pytest.raises(ConfigError, match="is not a regular file"):
        TextConfig(path=str(tmp_path))
    with pytest.raises(ConfigError, match="seq_len=64"):
        TextCorpus(TextConfig(path=write(tmp_path, b"short text"), seq_len=64))
    with pytest.raises(ConfigError, match="batch=0"):
        stdlib.train_batch(0, 0)
    with pytest.raises(ConfigError, match="step=-1"):
        stdlib.train_batch(-1, 2)
