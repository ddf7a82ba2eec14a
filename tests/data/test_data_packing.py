"""Packed and padded batches (jphantom.data.packing) hold the batch contract: segments 1, 2, ...
per row and 0 for padding, positions restarting per segment, targets -100 on pads, at document
ends and outside the loss; packing loses and reorders nothing (the rows, read in order, are the
documents of each epoch's shuffled order); a resumed reader and each process's rows give what one
uninterrupted reader gives."""

import json

import numpy as np
import pytest

from jphantom.data.documents import IGNORE, Documents, RowTokenizer, read_documents
from jphantom.data.packing import DocumentBatches, empty_rows, pack, pad
from jphantom.data.tokenizers import load_tokenizer
from jphantom.errors import ConfigError


def _documents(lengths, seed=0):
    """Documents of ``lengths`` with distinct random ids; the loss on every other token."""
    rng = np.random.default_rng(seed)
    return Documents.of((rng.integers(1, 500, n).tolist(), [i % 2 for i in range(n)])
                        for n in lengths)


def _check_contract(tokens, targets, segments, positions):
    """Every row: segments 1..k in order then 0s; positions count from 0 within each segment;
    padding has target -100 and position 0."""
    for row in range(len(tokens)):
        seg, pos = segments[row], positions[row]
        used = seg > 0
        assert np.all(np.diff(seg[used]) >= 0) and (not used.any() or seg[used][0] == 1)
        assert np.all(np.diff(np.unique(seg[used])) == 1)
        assert not np.any(used[1:] & ~used[:-1])  # padding only at the end
        for s in np.unique(seg[used]):
            assert list(pos[seg == s]) == list(range(np.count_nonzero(seg == s)))
        assert np.all(targets[row][~used] == IGNORE) and np.all(pos[~used] == 0)


def test_targets_never_cross_a_document():
    docs = Documents.of([([5, 6, 7], [1, 1, 1]), ([8, 9], [0, 1])])
    assert docs.targets.tolist() == [6, 7, IGNORE, 9, IGNORE]
    assert docs.summary() == {"rows": 2, "tokens": 5, "loss_tokens": 3}
    assert docs.summary(1) == {"rows": 2, "tokens": 2, "loss_tokens": 2}  # what padded rows keep


def test_packed_rows_are_the_shuffled_stream():
    """Rows read in order are epoch 0's documents in its shuffled order, then epoch 1's: every
    token and target once, a document crossing a row's end split into two segments."""
    docs = _documents([5, 11, 3, 7, 2, 9])
    reader = DocumentBatches(docs, _documents([4]), seq_len=8, batch=2, packed=True, seed=3)
    rows = [reader.next_batch() for _ in range(6)]  # 96 tokens: 2.6 epochs of 37
    tokens, targets, segments, positions = (np.concatenate(a) for a in zip(*rows))
    assert tokens.shape == (12, 8)
    _check_contract(tokens, targets, segments, positions)
    stream_tokens, stream_targets = [], []
    for epoch in range(3):
        order = np.random.default_rng((3, epoch)).permutation(docs.count)
        for index in order:
            t, y = docs.document(int(index))
            stream_tokens += t.tolist()
            stream_targets += y.tolist()
    assert tokens.ravel().tolist() == stream_tokens[:96]
    assert targets.ravel().tolist() == stream_targets[:96]
    # one-pass packing (validation) of the same order: the same first rows, the last padded
    order = np.random.default_rng((3, 0)).permutation(docs.count)
    once = pack(docs, order, 8, 0, 5)
    _check_contract(*once)
    assert once[0].ravel()[:37].tolist() == stream_tokens[:37]
    assert np.all(once[2].ravel()[37:] == 0)


def test_padded_rows_hold_one_truncated_document():
    docs = _documents([5, 11, 3])
    tokens, targets, segments, positions = pad(docs, np.array([1, 2]), 8, pad_id=99)
    _check_contract(tokens, targets, segments, positions)
    assert tokens[0].tolist() == docs.document(1)[0][:8].tolist()  # truncated: first 8 kept
    assert tokens[1, :3].tolist() == docs.document(2)[0].tolist()
    assert tokens[1, 3:].tolist() == [99] * 5 and segments[1].tolist() == [1] * 3 + [0] * 5
    assert np.all(segments[0] == 1)


@pytest.mark.parametrize("packed", [True, False])
def test_resume_and_process_rows_read_what_one_reader_reads(packed):
    docs = _documents([5, 11, 3, 7, 2, 9, 4])
    make = lambda **k: DocumentBatches(docs, _documents([4]), seq_len=6, batch=4,
                                       packed=packed, seed=1, **k)
    whole = make()
    expected = [whole.next_batch() for _ in range(5)]
    first = make()
    for _ in range(2):
        first.next_batch()
    resumed = make()
    resumed.restore(json.loads(json.dumps(first.state())))
    halves = [make(process_index=i, process_count=2) for i in range(2)]
    for half in halves:
        half.restore(first.state())
    for batch in expected[2:]:
        for a, b in zip(resumed.next_batch(), batch):
            np.testing.assert_array_equal(a, b)
        parts = [h.next_batch() for h in halves]
        for index, array in enumerate(batch):
            np.testing.assert_array_equal(np.concatenate([p[index] for p in parts]), array)
    other = DocumentBatches(docs, _documents([4]), seq_len=6, batch=4, packed=not packed)
    with pytest.raises(ConfigError, match="data position is for .*packed"):
        other.restore(first.state())


def test_validation_batches_are_fixed_and_filled():
    docs = _documents([5, 11, 3])
    reader = DocumentBatches(_documents([9]), docs, seq_len=8, batch=4, packed=False)
    batches = list(reader.validation_batches())
    assert len(batches) == 1 and batches[0][0].shape == (4, 8)
    empty = empty_rows(1, 8)
    for array, pad_row in zip(batches[0], empty):
        np.testing.assert_array_equal(array[3:], pad_row)  # the 4th row: empty
    again = list(reader.validation_batches())
    np.testing.assert_array_equal(again[0][0], batches[0][0])
    packed = DocumentBatches(_documents([9]), docs, seq_len=8, batch=2, packed=True)
    rows = list(packed.validation_batches())
    assert len(rows) == 2 and sum(int(np.count_nonzero(b[2])) for b in rows) == 19


def test_read_documents_holds_out_the_last_rows(tmp_path):
    """Without a validation file, the last 1% of the rows (at least one) is validation; with one
    in the folder, its rows are."""
    rows = [{"text": f"row {i}"} for i in range(10)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tokenizer = RowTokenizer(load_tokenizer("bytes"))
    train, validation, source = read_documents(tmp_path / "train.jsonl", tokenizer)
    assert (train.count, validation.count) == (9, 1)
    assert validation.tokens.tobytes() == np.frombuffer(b"row 9", np.uint8).astype(
        np.int32).tobytes()
    assert "1%" in source["validation_split"]
    (tmp_path / "val.jsonl").write_text(json.dumps({"text": "held"}))
    train, validation, source = read_documents(tmp_path, tokenizer)
    assert (train.count, validation.count) == (10, 1) and source["validation_split"] == "files"
    train, validation, _ = read_documents(tmp_path / "train.jsonl", tokenizer,  # --val-data
                                          tmp_path / "val.jsonl")
    assert (train.count, validation.count) == (10, 1)
    assert validation.tokens.tobytes() == np.frombuffer(b"held", np.uint8).astype(
        np.int32).tobytes()
