"""Documents into batches of rows: packed, or one padded document per row; resumable.

A batch is four int32 arrays [rows, seq_len] (the step passes them to
``jphantom.models.packed_lm_loss``):

- ``tokens``; ``targets``: the next token where the loss is taken, -100 elsewhere
  (:func:`jphantom.data.documents.targets`; pads: -100);
- ``segment_ids``: the pieces of documents in a row numbered 1, 2, 3... in order, 0 for padding
  (MaxText's and Pallas' convention: a token attends only to earlier tokens of its segment);
- ``positions``: each token's position in its segment, from 0 (pads: 0).

**Packed** (``--pack``, :func:`pack`): the documents of every epoch, in an order shuffled per
epoch (``numpy.random.default_rng((seed, epoch))``), are one endless stream of tokens cut into
rows of ``seq_len`` (TRL's ``wrapped`` packing; nothing is dropped or padded). A document that
crosses a row's end goes on at the start of the next row: each piece is its own segment and its
positions restart at 0 (as a window of a long text does in pretraining, and as the model sees a
context of that length at inference; positions never exceed ``seq_len - 1``, so RoPE tables of
``seq_len`` hold). Each piece keeps its tokens' targets, so the last token of a piece that is not
its document's last still predicts the document's next token. (MaxText's Hugging Face pipeline
truncates a document to the row length when it tokenises and packs whole documents first-fit
with Grain's ``PackAndBatchOperation``; here the rest of a long document trains.)

**Padded** (:func:`pad`): one document per row, in the same shuffled order, truncated to its
first ``seq_len`` tokens (TRL's ``keep_start``; the rest is dropped), padded with ``pad_id``,
segment 0 and target -100.

:class:`DocumentBatches` keeps its **position**, the global row it reads next, as explicit state
(:meth:`DocumentBatches.state`, :meth:`DocumentBatches.restore`), as
:class:`jphantom.data.tokens.TokenBatches` does: a checkpoint stores it and a resumed run reads
the batches an uninterrupted run would. Every process advances through the same global batches
and builds only its rows of each (``rows``). Validation rows are the validation documents in file
order, packed or padded the same way (a packed split's last row padded), in batches of ``batch``
rows, a last partial batch filled with empty rows.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from jphantom.data.dataset_files import VALIDATION_FILE
from jphantom.data.documents import IGNORE, Documents
from jphantom.data.tokens import process_rows
from jphantom.errors import ConfigError, check_int


def empty_rows(count: int, seq_len: int, pad_id: int = 0) -> tuple[np.ndarray, ...]:
    """Rows of padding only: (tokens = ``pad_id``, targets -100, segments 0, positions 0)."""
    return (np.full((count, seq_len), pad_id, np.int32),
            np.full((count, seq_len), IGNORE, np.int32),
            np.zeros((count, seq_len), np.int32), np.zeros((count, seq_len), np.int32))


def _place(row: int, column: int, tokens, targets, segment: int, out) -> int:
    """Writes one piece into row ``row`` of ``out`` at ``column``; returns the next column."""
    end = column + len(tokens)
    out[0][row, column:end], out[1][row, column:end] = tokens, targets
    out[2][row, column:end] = segment
    out[3][row, column:end] = np.arange(len(tokens))
    return end


def pack(documents: Documents, order: np.ndarray, seq_len: int, first_row: int, count: int,
         pad_id: int = 0) -> tuple[np.ndarray, ...]:
    """Rows ``first_row .. first_row + count - 1`` of ``documents`` concatenated in ``order``
    (one pass; :func:`pack_stream` for the endless, shuffled stream) and cut every ``seq_len``
    tokens; tokens past the end are padding."""
    out = empty_rows(count, seq_len, pad_id)
    lengths = documents.lengths[order]
    ends = np.cumsum(lengths)
    for row in range(count):
        start = (first_row + row) * seq_len
        stop, column, segment = start + seq_len, 0, 0
        index = int(np.searchsorted(ends, start, side="right"))
        while index < len(order) and column < seq_len:
            doc_start = int(ends[index] - lengths[index])
            a, b = max(start, doc_start) - doc_start, min(stop, int(ends[index])) - doc_start
            tokens, targets = documents.document(int(order[index]))
            segment += 1
            column = _place(row, column, tokens[a:b], targets[a:b], segment, out)
            index += 1
    return out


def pad(documents: Documents, order: np.ndarray, seq_len: int, pad_id: int = 0
        ) -> tuple[np.ndarray, ...]:
    """One row per document of ``order``: its first ``seq_len`` tokens, then padding."""
    out = empty_rows(len(order), seq_len, pad_id)
    for row, index in enumerate(order):
        tokens, targets = documents.document(int(index))
        _place(row, 0, tokens[:seq_len], targets[:seq_len], 1, out)
    return out


def packed_rows(documents: Documents, seq_len: int) -> int:
    """How many rows the documents fill packed, the last one partly."""
    return -(-int(documents.starts[-1]) // seq_len)


class DocumentBatches:
    """Training batches of ``batch`` rows (packed or padded) with an explicit position, and fixed
    validation batches (module docstring). ``source``: what results.json records of the data."""

    def __init__(self, train: Documents, validation: Documents, *, seq_len: int, batch: int,
                 packed: bool, seed: int = 0, pad_id: int = 0, process_index: int = 0,
                 process_count: int = 1, source: dict | None = None):
        self.seq_len = check_int("seq_len", seq_len)
        self.batch = check_int("batch", batch)
        self.seed = check_int("seed", seed, 0)
        self.rows = process_rows(batch, process_index, process_count)
        self.train, self.validation = train, validation
        self.packed, self.pad_id = bool(packed), int(pad_id)
        self.source = dict(source or {})
        if train.count == 0 or len(train.tokens) == 0:
            raise ConfigError("the training split holds no document: give rows with text in them")
        if validation.count == 0:
            raise ConfigError(f"the validation split holds no document: give {VALIDATION_FILE} "
                              "with rows, or more rows")
        self.row = 0  # the position: the next global row
        self._orders: dict[int, np.ndarray] = {}
        self._ends: dict[int, np.ndarray] = {}

    # --------------------------------------------------------------------------- position
    def state(self) -> dict:
        """The position and what it is a position in (JSON-ready; a checkpoint stores it)."""
        return {"row": self.row, "seed": self.seed, "seq_len": self.seq_len,
                "packed": self.packed, "documents": self.train.count,
                "train_tokens": int(len(self.train.tokens)),
                "loss_tokens": int(np.count_nonzero(self.train.targets >= 0))}

    def restore(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state`): the same documents, row length, packing
        and seed, else a ConfigError."""
        mine = self.state()
        for key in ("seq_len", "packed", "documents", "train_tokens", "loss_tokens", "seed"):
            if state.get(key) != mine[key]:
                raise ConfigError(f"the checkpoint's data position is for {key}={state.get(key)} "
                                  f"but this run has {key}={mine[key]}: resume with the same "
                                  "--data, --tokenizer, --chat-template, --loss-on, --pack, "
                                  "--seq-len and --seed")
        self.row = int(state["row"])

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
                self._ends.clear()
            order = np.random.default_rng((self.seed, epoch)).permutation(self.train.count)
            self._orders[epoch] = order
            self._ends[epoch] = np.cumsum(self.train.lengths[order])
        return self._orders[epoch]

    # --------------------------------------------------------------------------- batches
    def next_batch(self, rows: slice | None = None) -> tuple[np.ndarray, ...]:
        """(tokens, targets, segment_ids, positions) int32 [rows, seq_len] of the next global
        batch: this reader's rows (``rows``, default those of its process), every process
        advancing alike."""
        rows = self.rows if rows is None else rows
        first = self.row + (rows.start or 0)
        count = len(range(*rows.indices(self.batch)))
        self.row += self.batch
        if self.packed:
            return self._packed(first, count)
        parts = []
        for row in range(first, first + count):
            epoch, index = divmod(row, self.train.count)
            parts.append(pad(self.train, self._order(epoch)[index:index + 1], self.seq_len,
                             self.pad_id))
        return tuple(np.concatenate(p) for p in zip(*parts))

    def _packed(self, first: int, count: int) -> tuple[np.ndarray, ...]:
        """Rows of the endless stream: epoch e's documents in their order, then epoch e + 1's."""
        total, parts = int(len(self.train.tokens)), []
        for row in range(first, first + count):
            start = row * self.seq_len
            out = empty_rows(1, self.seq_len, self.pad_id)
            column, segment = 0, 0
            while column < self.seq_len:
                epoch, offset = divmod(start + column, total)
                order, ends = self._order(epoch), self._ends[epoch]
                index = int(np.searchsorted(ends, offset, side="right"))
                doc_start = int(ends[index]) - int(self.train.lengths[order[index]])
                tokens, targets = self.train.document(int(order[index]))
                a = offset - doc_start
                b = min(len(tokens), a + self.seq_len - column)
                segment += 1
                column = _place(0, column, tokens[a:b], targets[a:b], segment, out)
            parts.append(out)
        if not parts:
            return empty_rows(0, self.seq_len, self.pad_id)
        return tuple(np.concatenate(p) for p in zip(*parts))

    def validation_rows(self) -> tuple[np.ndarray, ...]:
        """Every validation row, in file order (packed or padded as training is)."""
        order = np.arange(self.validation.count)
        if self.packed:
            return pack(self.validation, order, self.seq_len, 0,
                        packed_rows(self.validation, self.seq_len), self.pad_id)
        return pad(self.validation, order, self.seq_len, self.pad_id)

    def validation_batches(self, max_batches: int | None = 8
                           ) -> Iterator[tuple[np.ndarray, ...]]:
        """Batches of ``batch`` validation rows (the last filled with empty rows), at most
        ``max_batches``, those with a target that counts; the same on every call."""
        rows = self.validation_rows()
        count = -(-len(rows[0]) // self.batch)
        count = count if max_batches is None else min(count, max_batches)

        def generate():
            for index in range(count):
                part = [a[index * self.batch:(index + 1) * self.batch] for a in rows]
                short = self.batch - len(part[0])
                if short:
                    part = [np.concatenate([a, e]) for a, e in zip(
                        part, empty_rows(short, self.seq_len, self.pad_id))]
                if np.any(part[1] >= 0):
                    yield tuple(part)

        return generate()

    # --------------------------------------------------------------------------- report
    def unigram_cross_entropy(self) -> float:
        """Cross-entropy (nats/token) of the validation targets that count under the training
        targets' add-one smoothed frequencies: the baseline a model must beat."""
        counted = lambda d: d.targets[d.targets >= 0]
        train, held = counted(self.train), counted(self.validation)
        vocab = int(max(self.train.tokens.max(initial=0), self.validation.tokens.max(initial=0),
                        train.max(initial=0), held.max(initial=0))) + 1
        frequencies = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
        log_probs = np.log(frequencies / frequencies.sum())
        return float(-log_probs[held].mean()) if len(held) else float("nan")

    def describe(self) -> dict:
        limit = None if self.packed else self.seq_len  # what rows keep: padded, truncated
        train, held = self.train.summary(limit), self.validation.summary(limit)
        per_epoch = (train["tokens"] / self.seq_len if self.packed else train["rows"])
        return {**self.source, "seq_len": self.seq_len, "seed": self.seed,
                "packed": self.packed, "train": train, "validation": held,
                "rows_per_epoch": per_epoch,
                "truncated_documents": 0 if self.packed else int(
                    np.count_nonzero(self.train.lengths > self.seq_len)),
                "unigram_cross_entropy": self.unigram_cross_entropy()}
