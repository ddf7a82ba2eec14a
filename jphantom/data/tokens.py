"""Pre-tokenised data: flat token files read by memory map, and resumable batches of windows.

Token files are the ones nanoGPT and llm.c users already have, and what ``jphantom tokenize``
writes:

- **llm.c** (``.bin`` with a header): 256 little-endian int32, ``[magic, version, token count,
  0, ...]``, then the tokens: magic 20240520 / version 1 for ``uint16`` tokens (GPT-2's), magic
  20240801 / version 7 for ``uint32`` (Llama 3's vocabulary does not fit 16 bits);
- **nanoGPT** (``train.bin`` / ``val.bin``): the ``uint16`` tokens alone, no header.

:func:`read_token_file` tells them apart by the first int32 (a header's magic; as two GPT-2
``uint16`` tokens it would be ids 54472 and 308, and 54472 is past GPT-2's 50257) and checks a
header's token count against the file's size. Memory-mapped flat files need no extra service or
format library (unlike Grain's ArrayRecord): a file is opened in microseconds and only the windows
a batch takes are read.

A data set is one token file or a folder of them (``*.bin``, searched recursively, sorted by
path). In a folder, a file's split is named by a whole word of its path below the folder, the same
rule as dataset files' (:func:`jphantom.data.dataset_files.split_of`): ``val``, ``valid``,
``validation``, ``dev``, ``eval`` or ``evaluation`` the validation split (nanoGPT's ``val.bin``,
llm.c's ``*_val_*.bin``), ``test`` or ``testing`` a test split nothing reads, anything else
training (``values.bin`` and ``intervals/more.bin`` train). Without validation files, and for a
single file, the last ``validation_fraction`` of the tokens are held out.

:class:`TokenBatches` cuts the training tokens into windows of ``seq_len + 1`` tokens (a window
starts every ``seq_len`` tokens and never crosses a file's end), visits them in an order shuffled
anew every epoch (``numpy.random.default_rng((seed, epoch))``), and keeps its **position** (the
epoch and the windows consumed in it) as explicit state: :meth:`TokenBatches.state` is a small
JSON-ready dict that a checkpoint stores beside the step, and :meth:`TokenBatches.restore` puts a
new reader where the old one was, so a resumed run reads exactly the batches an uninterrupted run
would. Every process advances through the same global batches; a reader built with
``process_index`` / ``process_count`` (or given ``rows``) returns only its rows of each one.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from jphantom.data.dataset_files import TEST_NAMES, VALIDATION_NAMES, split_of
from jphantom.errors import ConfigError, check_int

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
LLMC = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}  # magic: version, dtype
MAGIC_OF = {np.dtype("<u2"): 20240520, np.dtype("<u4"): 20240801}
FORMATS = ("llm.c", "nanogpt")
SUFFIX = ".bin"
UNIGRAM_SAMPLE = 1 << 24  # tokens of each split the unigram baseline counts


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """One token file: where its tokens start, their type and count, and its format."""

    path: str
    format: str  # "llm.c" or "nanogpt"
    dtype: np.dtype
    count: int

    @property
    def offset(self) -> int:
        return HEADER_BYTES if self.format == "llm.c" else 0

    def tokens(self) -> np.ndarray:
        """The tokens, memory-mapped read-only (nothing is read until indexed)."""
        if self.count == 0:
            return np.zeros(0, self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset,
                         shape=(self.count,))


def read_token_file(path: str | os.PathLike) -> TokenFile:
    """The layout of a token file (module docstring): an llm.c header if the first int32 is one
    of its magics, else headerless ``uint16`` (nanoGPT)."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            raw = handle.read(HEADER_BYTES)
        head = np.frombuffer(raw[:len(raw) - len(raw) % 4], dtype="<i4")
    except OSError as error:
        raise ConfigError(f"data={path!r} cannot be read ({error.strerror}): give a readable "
                          "token file") from None
    if head.size and int(head[0]) in LLMC:
        version, dtype = LLMC[int(head[0])]
        if head.size < 3 or int(head[1]) != version:
            raise ConfigError(f"data={path!r} has llm.c's magic {int(head[0])} but version "
                              f"{int(head[1]) if head.size > 1 else '?'}, not {version}: "
                              "rewrite it with `jphantom tokenize`")
        count = int(head[2])
        if HEADER_BYTES + count * dtype.itemsize != size:
            raise ConfigError(f"data={path!r}: its header says {count} tokens of {dtype.itemsize} "
                              f"bytes but the file holds {size - HEADER_BYTES} bytes after the "
                              "header (truncated?): write it again")
        return TokenFile(path, "llm.c", dtype, count)
    if size % 2:
        raise ConfigError(f"data={path!r} has no llm.c header and an odd size ({size} bytes), so "
                          "it is not nanoGPT's uint16 tokens either: give a token file written by "
                          "`jphantom tokenize`, nanoGPT or llm.c")
    return TokenFile(path, "nanogpt", np.dtype("<u2"), size // 2)


def is_token_data(path: str | os.PathLike) -> bool:
    """Whether ``--data`` names token data: a ``.bin`` file, or a folder holding some."""
    path = Path(path)
    if path.is_dir():
        return any(_token_paths(path))
    return path.suffix == SUFFIX


def _token_paths(folder: Path) -> Iterator[Path]:
    """The token files of a ``--data`` folder, searched recursively (unsorted)."""
    return (p for p in folder.rglob(f"*{SUFFIX}") if p.is_file())


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest token type of a vocabulary: ``uint16`` up to 65,536 ids, else ``uint32``."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class TokenWriter:
    """Writes one token file, appending arrays as they come (``with TokenWriter(path, ...) as w:
    w.write(ids)``); an llm.c header's token count is filled in on close."""

    def __init__(self, path: str | os.PathLike, vocab_size: int, format: str = "llm.c"):
        if format not in FORMATS:
            raise ConfigError(f"format={format!r}; use one of {', '.join(FORMATS)}")
        self.dtype = token_dtype(check_int("vocab_size", vocab_size))
        if format == "nanogpt" and self.dtype != np.dtype("<u2"):
            raise ConfigError(f"format='nanogpt' holds uint16 tokens but the vocabulary has "
                              f"{vocab_size} ids: use --format llm.c (uint32 tokens)")
        self.path, self.format, self.vocab_size, self.count = Path(path), format, vocab_size, 0
        self.handle = open(self.path, "wb")
        if format == "llm.c":
            self.handle.write(np.zeros(HEADER_INTS, "<i4").tobytes())

    def write(self, ids) -> None:
        ids = np.asarray(ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ConfigError(f"token id {int(ids.max())} is outside the vocabulary of "
                              f"{self.vocab_size}")
        self.handle.write(ids.astype(self.dtype).tobytes())
        self.count += int(ids.size)

    def close(self) -> TokenFile:
        if self.format == "llm.c":
            if self.count >= 1 << 31:
                raise ConfigError(f"{self.count} tokens do not fit an llm.c header's int32 "
                                  "count: split the input into several files")
            header = np.zeros(HEADER_INTS, "<i4")
            header[:3] = MAGIC_OF[self.dtype], LLMC[MAGIC_OF[self.dtype]][0], self.count
            self.handle.seek(0)
            self.handle.write(header.tobytes())
        self.handle.close()
        return TokenFile(str(self.path), self.format, self.dtype, self.count)

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.handle.close()


def write_token_file(path, tokens, vocab_size: int, format: str = "llm.c") -> TokenFile:
    """``tokens`` (ids below ``vocab_size``) as one token file."""
    writer = TokenWriter(path, vocab_size, format)
    try:
        writer.write(tokens)
    except BaseException:
        writer.handle.close()
        raise
    return writer.close()


def token_files(data: str | os.PathLike) -> tuple[list[TokenFile], list[TokenFile]]:
    """(train, validation) token files of ``--data`` (a file or a folder; module docstring), a
    folder's sorted by path and split by a whole word of it (:func:`split_of`, test files left
    unread); the validation list is empty when nothing is named for it."""
    path = Path(data)
    if path.is_dir():
        relative = {p: p.relative_to(path).as_posix().lower() for p in _token_paths(path)}
        files = sorted(relative, key=relative.get)
        if not files:
            raise ConfigError(f"data={str(data)!r} is a folder without {SUFFIX} token files: "
                              "write some with `jphantom tokenize`, or give a text file")
        named = {f: split_of(relative[f]) for f in files}
        train = [read_token_file(f) for f in files if named[f] == "train"]
        validation = [read_token_file(f) for f in files if named[f] == "validation"]
        if not train:
            raise ConfigError(f"data={str(data)!r}: every token file is a validation or test "
                              f"file (a word of its path is one of "
                              f"{sorted(VALIDATION_NAMES | TEST_NAMES)}): add training files")
        return train, validation
    return [read_token_file(path)], []


def hold_out(arrays: Sequence[np.ndarray], fraction: float) -> tuple[list, list]:
    """The last ``fraction`` of the tokens of ``arrays`` (at least 1, at most all but 1) split
    off as validation: (train arrays, validation arrays), views, no copies."""
    total = sum(len(a) for a in arrays)
    held = min(total - 1, max(1, round(fraction * total)))
    train, validation = list(arrays), []
    while held > 0:
        last = train.pop()
        take = min(held, len(last))
        validation.insert(0, last[len(last) - take:])
        if take < len(last):
            train.append(last[:len(last) - take])
        held -= take
    return train, validation


class _Windows:
    """Windows of ``seq_len + 1`` tokens, one every ``seq_len`` tokens of each array."""

    def __init__(self, arrays: Sequence[np.ndarray], seq_len: int):
        self.arrays = [a for a in arrays if (len(a) - 1) // seq_len > 0]
        self.seq_len = seq_len
        counts = [(len(a) - 1) // seq_len for a in self.arrays]
        self.first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.count = int(self.first[-1])

    def take(self, indices: np.ndarray) -> np.ndarray:
        """int32 [len(indices), seq_len + 1]: the windows ``indices`` (global numbering)."""
        array_of = np.searchsorted(self.first, indices, side="right") - 1
        out = np.empty((len(indices), self.seq_len + 1), np.int32)
        for row, (index, a) in enumerate(zip(indices, array_of)):
            start = (int(index) - int(self.first[a])) * self.seq_len
            out[row] = self.arrays[a][start:start + self.seq_len + 1]
        return out


def process_rows(batch: int, process_index: int = 0, process_count: int = 1) -> slice:
    """The rows of a global batch that process ``process_index`` of ``process_count`` reads: an
    equal contiguous block each (as a batch split over a ``data`` axis whose ranks are laid out
    process by process)."""
    check_int("process_count", process_count)
    if not 0 <= process_index < process_count:
        raise ConfigError(f"process_index={process_index} must be in [0, {process_count})")
    if batch % process_count:
        raise ConfigError(f"batch={batch} is not divisible by the {process_count} processes: "
                          f"pick a multiple of {process_count}")
    share = batch // process_count
    return slice(process_index * share, (process_index + 1) * share)


class TokenBatches:
    """Training batches of ``batch`` windows in an epoch-shuffled order with an explicit position,
    and fixed validation batches (module docstring). ``train`` and ``validation`` are token arrays
    (memory maps or in-memory); ``source`` describes where they came from (results.json)."""

    def __init__(self, train: Sequence[np.ndarray], validation: Sequence[np.ndarray], *,
                 seq_len: int, batch: int, seed: int = 0, vocab_size: int | None = None,
                 process_index: int = 0, process_count: int = 1, source: dict | None = None):
        self.seq_len = check_int("seq_len", seq_len)
        self.batch = check_int("batch", batch)
        self.seed = check_int("seed", seed, 0)
        self.rows = process_rows(batch, process_index, process_count)
        self.train_windows = _Windows(train, seq_len)
        self.validation_arrays = list(validation)
        self.vocab_size = vocab_size
        self.source = dict(source or {})
        if self.train_windows.count == 0:
            raise ConfigError(f"the training tokens ({sum(len(a) for a in train)}) hold no "
                              f"window of seq_len + 1 = {seq_len + 1} tokens: lower seq_len or "
                              "give more data")
        self.train_tokens = int(sum(len(a) for a in train))
        self.epoch, self.index = 0, 0  # the position: windows consumed in this epoch
        self._order = (None, None)
        self._unigram: float | None = None

    # --------------------------------------------------------------------------- position
    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order[0] != epoch:
            rng = np.random.default_rng((self.seed, epoch))
            self._order = (epoch, rng.permutation(self.train_windows.count))
        return self._order[1]

    def state(self) -> dict:
        """The position and what it is a position in (JSON-ready; a checkpoint stores it)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "seq_len": self.seq_len, "windows": self.train_windows.count,
                "train_tokens": self.train_tokens}

    def restore(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state`, perhaps of another process or run): the
        same data, window length and seed, else a ConfigError."""
        mine = self.state()
        for key in ("seq_len", "windows", "train_tokens", "seed"):
            if state.get(key) != mine[key]:
                raise ConfigError(f"the checkpoint's data position is for {key}={state.get(key)} "
                                  f"but this run has {key}={mine[key]}: resume with the same "
                                  "--data, --tokenizer, --seq-len and --seed")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])

    # --------------------------------------------------------------------------- batches
    def next_indices(self) -> np.ndarray:
        """The windows of the next global batch (and advance past them)."""
        chosen, need = [], self.batch
        while need:
            order = self._permutation(self.epoch)
            take = order[self.index:self.index + need]
            chosen.append(take)
            need -= len(take)
            self.index += len(take)
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return np.concatenate(chosen)

    def next_batch(self, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, targets) int32 [rows, seq_len] of the next global batch: this reader's rows
        (``rows``, default those of its process), every process advancing alike."""
        indices = self.next_indices()[self.rows if rows is None else rows]
        windows = self.train_windows.take(indices)
        return windows[:, :-1], windows[:, 1:]

    def validation_batches(self, max_batches: int | None = 8
                           ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(tokens, targets) int32 [batch, seq_len] of non-overlapping validation windows spread
        evenly over the split; the same on every call. ConfigError (at once) if the split holds
        fewer than one batch of windows."""
        windows = _Windows(self.validation_arrays, self.seq_len)
        if windows.count < self.batch:
            raise ConfigError(f"the validation split holds {windows.count} windows of seq_len="
                              f"{self.seq_len}, fewer than one batch of {self.batch}: lower batch "
                              "or seq_len, or give more validation tokens")
        full = windows.count // self.batch
        count = full if max_batches is None else min(full, max_batches)
        chosen = (np.arange(count * self.batch) * windows.count) // (count * self.batch)

        def generate():
            for index in range(count):
                w = windows.take(chosen[index * self.batch:(index + 1) * self.batch])
                yield w[:, :-1], w[:, 1:]

        return generate()

    # --------------------------------------------------------------------------- baseline
    def unigram_cross_entropy(self) -> float:
        """Cross-entropy (nats/token) of the validation tokens under the training tokens'
        add-one smoothed frequencies, each split counted over its first :data:`UNIGRAM_SAMPLE`
        tokens: the baseline a model must beat."""
        if self._unigram is None:
            def counts(arrays):
                total, left = None, UNIGRAM_SAMPLE
                for a in arrays:
                    vocab = self._vocab()
                    part = np.bincount(np.asarray(a[:left]), minlength=vocab)[:vocab]
                    total = part if total is None else total + part
                    left -= min(left, len(a))
                    if not left:
                        break
                return (np.zeros(self._vocab()) if total is None else total).astype(np.float64)
            train = counts(self.train_windows.arrays) + 1.0
            validation = counts(self.validation_arrays)
            log_probs = np.log(train / train.sum())
            self._unigram = float(-(validation @ log_probs) / validation.sum())
        return self._unigram

    def _vocab(self) -> int:
        if self.vocab_size is None:
            self.vocab_size = max_token(self.train_windows.arrays) + 1
        return self.vocab_size

    def describe(self) -> dict:
        return {**self.source, "seq_len": self.seq_len, "seed": self.seed,
                "tokens": {"train": self.train_tokens,
                           "validation": int(sum(len(a) for a in self.validation_arrays))},
                "windows": self.train_windows.count, "vocab_size": self._vocab(),
                "unigram_cross_entropy": self.unigram_cross_entropy()}


def max_token(arrays: Sequence[np.ndarray], sample: int | None = UNIGRAM_SAMPLE) -> int:
    """The largest id among the first ``sample`` tokens of each array (``None``: all)."""
    found = -1
    for a in arrays:
        part = a if sample is None else a[:sample]
        if len(part):
            found = max(found, int(np.max(part)))
    return found


def tokenize_text(data: np.ndarray | bytes, tokenizer, chunk_bytes: int = 1 << 16) -> np.ndarray:
    """UTF-8 text (bytes or a ``uint8`` array) as one ``int32`` token array, encoded in chunks
    that end at line breaks (so a batch of chunks encodes in parallel)."""
    raw = bytes(data)
    pieces, start = [], 0
    while start < len(raw):
        stop = raw.rfind(b"\n", start, start + chunk_bytes) + 1 if start + chunk_bytes < len(
            raw) else len(raw)
        if stop <= start:
            stop = min(len(raw), start + chunk_bytes)
        pieces.append(raw[start:stop].decode("utf-8", "replace"))
        start = stop
    ids = tokenizer.encode_batch(pieces) if pieces else []
    return np.fromiter((i for chunk in ids for i in chunk), np.int32,
                       count=sum(len(c) for c in ids))


# ------------------------------------------------------------------------------------------------
# Text through a tokenizer, cached as token files
# ------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where tokenised text is cached: ``$JPHANTOM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/jphantom`` (default ``~/.cache/jphantom``), ``tokens/`` inside."""
    root = os.environ.get("JPHANTOM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jphantom")
    return Path(root) / "tokens"


def tokenizer_fingerprint(value: str) -> str:
    """What identifies a tokenizer's output: the bundled file's or a file's bytes, else the
    name (a tiktoken encoding: fixed by tiktoken)."""
    import hashlib
    import importlib.resources

    from jphantom.data.tokenizers import BUNDLED, BUNDLED_FILE

    path = Path(value)
    if value == BUNDLED:
        data = importlib.resources.files("jphantom.data").joinpath(BUNDLED_FILE).read_bytes()
    elif path.is_dir():
        data = (path / "tokenizer.json").read_bytes()
    elif path.is_file():
        data = path.read_bytes()
    else:
        data = value.encode()
    return hashlib.sha256(data).hexdigest()[:16]


def tokenize_corpus(corpus, tokenizer_value: str, *, progress: bool = False
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) token arrays of a :class:`jphantom.data.text.TextCorpus` through the
    tokenizer ``tokenizer_value`` names, each split's tokens cached as a token file
    (:func:`cache_dir`, keyed by the text's bytes and the tokenizer's fingerprint) so that only
    the first run tokenises (the standard library through the bundled BPE: a minute on 2 cores)."""
    import hashlib

    from jphantom.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_value)
    fingerprint = tokenizer_fingerprint(tokenizer_value)
    out = []
    for name, data in (("train", corpus.train), ("validation", corpus.validation)):
        digest = hashlib.sha256(memoryview(np.ascontiguousarray(data))).hexdigest()[:16]
        path = cache_dir() / f"{digest}-{fingerprint}{SUFFIX}"
        if not path.is_file():
            ids = _tokenize_with_bar(data, tokenizer, f"tokenizing the {name} split", progress)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            write_token_file(partial, ids, tokenizer.vocab_size)
            os.replace(partial, path)  # atomic: a concurrent run reads a whole file or none
        out.append(read_token_file(path).tokens())
    return out[0], out[1]


def _tokenize_with_bar(data, tokenizer, label: str, progress: bool,
                       chunk_bytes: int = 1 << 20) -> np.ndarray:
    from tqdm.auto import tqdm

    raw = memoryview(np.ascontiguousarray(data)).cast("B")
    pieces = []
    with tqdm(total=len(raw), unit="B", unit_scale=True, desc=label,
              disable=not progress) as bar:
        start = 0
        while start < len(raw):
            stop = min(len(raw), start + chunk_bytes)
            if stop < len(raw):  # end at a line break
                cut = bytes(raw[start:stop]).rfind(b"\n")
                stop = start + cut + 1 if cut >= 0 else stop
            pieces.append(tokenize_text(raw[start:stop], tokenizer))
            bar.update(stop - start)
            start = stop
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)


# ------------------------------------------------------------------------------------------------
# `jphantom tokenize`: text files in, one token file out
# ------------------------------------------------------------------------------------------------


def text_files(inputs: Sequence[str | os.PathLike], pattern: str = "*.txt") -> list[Path]:
    """The files ``inputs`` name: files as given, folders searched recursively for ``pattern``
    (sorted by path); a ConfigError if an input does not exist or nothing is found."""
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found += sorted(p for p in path.rglob(pattern) if p.is_file())
        elif path.is_file():
            found.append(path)
        else:
            raise ConfigError(f"input {str(item)!r} does not exist: give text files or folders")
    if not found:
        raise ConfigError(f"no file matches --pattern {pattern!r} in {', '.join(map(str, inputs))}: "
                          "pass --pattern (e.g. '*.py' or '*') or other inputs")
    return found


def check_text_file(name: str, path) -> None:
    """``path`` holds UTF-8 text (its first MiB decodes; a file cut inside a character at that
    boundary passes): not empty, not binary."""
    with open(path, "rb") as handle:
        head = handle.read(1 << 20)
    if not head:
        raise ConfigError(f"{name}={str(path)!r} is empty: give a file with text in it")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 4 or b"\0" in head:
            raise ConfigError(f"{name}={str(path)!r} is not UTF-8 text (byte {error.start} is "
                              f"0x{head[error.start]:02x}): give a text file, or a .bin token "
                              "file written by `jphantom tokenize`") from None


def tokenize_files(inputs: Sequence[str | os.PathLike], out: str | os.PathLike,
                   tokenizer_value: str, *, pattern: str = "*.txt", format: str = "llm.c",
                   eot: bool = True, progress: bool = True,
                   block_bytes: int = 1 << 24) -> dict:
    """Tokenise text files (and folders' files matching ``pattern``) into the token file ``out``
    (``.bin``): each file a document, read as UTF-8 (undecodable bytes replaced) in blocks that
    end at line breaks, preceded by the tokenizer's end-of-text id when ``eot`` and it has one (as
    llm.c writes documents). Returns what was written."""
    from tqdm.auto import tqdm

    from jphantom.data.tokenizers import load_tokenizer

    out = Path(out)
    if out.suffix != SUFFIX:
        raise ConfigError(f"--out {str(out)!r} must end in {SUFFIX}: `jphantom train --data` "
                          f"recognises token files by it")
    if out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a folder: give a file name, e.g. "
                          f"{out / ('train' + SUFFIX)}")
    tokenizer = load_tokenizer(tokenizer_value)
    files = text_files(inputs, pattern)
    if out.resolve() in {f.resolve() for f in files}:
        raise ConfigError(f"--out {str(out)!r} is also an input: write elsewhere")
    for path in files:
        check_text_file("input", path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_name(out.name + ".probe").touch()
        out.with_name(out.name + ".probe").unlink()
    except OSError as error:
        raise ConfigError(f"--out {str(out)!r}: cannot write there ({error.strerror}): pick "
                          "another path") from None
    total = sum(f.stat().st_size for f in files)
    separator = eot and tokenizer.eot is not None
    partial = out.with_name(out.name + ".partial")
    writer = TokenWriter(partial, tokenizer.vocab_size, format)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                  desc=f"tokenizing {len(files)} file(s)") as bar:
            for path in files:
                if separator:
                    writer.write([tokenizer.eot])
                with open(path, "rb") as handle:
                    rest = b""
                    while True:
                        block = handle.read(block_bytes)
                        data = rest + block
                        cut = data.rfind(b"\n") + 1 if block else len(data)
                        if block and cut == 0:
                            cut = len(data)  # no line break in a whole block: split anyway
                        writer.write(tokenize_text(data[:cut], tokenizer))
                        bar.update(len(block))
                        rest = data[cut:]
                        if not block:
                            break
        written = writer.close()
    except BaseException:
        writer.handle.close()
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)
    return {"path": str(out), "files": len(files), "bytes": total, "tokens": written.count,
            "format": format, "dtype": str(written.dtype.newbyteorder("=")),
            "tokenizer": tokenizer_value, "vocab_size": tokenizer.vocab_size,
            "eot": tokenizer.eot if separator else None}
