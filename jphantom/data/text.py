"""An offline byte-level text corpus for training a small GPT transformer (vocabulary 256 = bytes).

Two sources, both available without a network:

* ``TextConfig(path=None)`` (the default): the Python standard library of the running interpreter,
  i.e. every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, recursively, tests included,
  except anything under ``site-packages`` / ``dist-packages`` (third-party code). Files are sorted by their
  POSIX relative path. The train/validation split is **by file** and deterministic: a file goes to
  validation iff ``zlib.crc32(relative_path) % 1000 < validation_fraction * 1000``; if that rule
  leaves either split empty, the last ``ceil(validation_fraction * N)`` files (in sorted order) form
  the validation split instead. Each split is its files' bytes joined with ``b"\\n"``. On CPython 3.11
  this is about 1790 files / 31.5 MB (19 MB of them under ``test``), loaded in about a second. The corpus depends on the
  interpreter version, which :meth:`TextCorpus.describe` records.
* ``TextConfig(path="some.txt")``: any file, read as raw bytes and split **by bytes**: the last
  ``validation_fraction`` of the bytes are the validation split.

Loaded corpora are cached in a module-level dict keyed by the source (the stdlib directory, or the
file's real path plus its size and modification time), so building many :class:`TextCorpus` objects
(one per run of a sweep) reads the disk once per process. The split arrays are read-only numpy views
shared between corpora; the batch methods always return fresh arrays.

Batches are plain numpy ``int32`` arrays ``[batch, seq_len]``; the caller places them on devices.
``targets`` are the next bytes (``tokens`` shifted left by one). Training batches are random windows
drawn with ``numpy.random.default_rng((seed, step))``, so a batch depends only on (seed, step), never
on what was drawn before. Validation batches are consecutive non-overlapping windows from the start of
the validation split, identical on every call. :meth:`TextCorpus.unigram_cross_entropy` is the
baseline a model has to beat: the validation bytes' cross-entropy under the train split's add-one
smoothed byte frequencies.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import sysconfig
import zlib
from pathlib import Path
from typing import Iterator

import numpy as np

from jphantom.errors import ConfigError, check_int

VOCAB_SIZE = 256
DEFAULT_VALIDATION_BATCHES = 8
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
FILE_SEPARATOR = b"\n"


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Which text, how it is split and how it is windowed.

    ``path``: ``None`` for the Python standard-library corpus, else a readable text file (any bytes).
    ``validation_fraction``: share of files (stdlib) or of bytes (single file) held out, in (0, 1).
    ``seq_len``: tokens per window. ``seed``: seeds the training-window positions only (the split is
    fixed by the source and ``validation_fraction``).
    """

    path: str | None = None
    validation_fraction: float = 0.05
    seq_len: int = 128
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, (int, np.integer)) or self.seq_len < 1:
            raise ConfigError(f"seq_len={self.seq_len!r} must be an integer >= 1; pass e.g. seq_len=128")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be an integer >= 0; pass e.g. seed=0")
        fraction = self.validation_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float, np.integer, np.floating))
            or not 0.0 < float(fraction) < 1.0
        ):
            raise ConfigError(
                f"validation_fraction={fraction!r} must be a number with 0 < validation_fraction < 1; "
                "pass e.g. validation_fraction=0.05"
            )
        if self.path is not None:
            if not isinstance(self.path, (str, os.PathLike)):
                raise ConfigError(
                    f"path={self.path!r} must be a file path (str) or None for the Python standard-library corpus"
                )
            path = os.fspath(self.path)
            object.__setattr__(self, "path", path)
            if not os.path.exists(path):
                raise ConfigError(
                    f"path={path!r} does not exist; pass an existing text file, or path=None for the "
                    "Python standard-library corpus"
                )
            if not os.path.isfile(path):
                raise ConfigError(
                    f"path={path!r} is not a regular file; pass a text file, or path=None for the stdlib corpus"
                )
            if not os.access(path, os.R_OK):
                raise ConfigError(f"path={path!r} is not readable; fix its permissions or pass another file")


@dataclasses.dataclass(frozen=True)
class _Documents:
    """A loaded source: named byte strings in corpus order."""

    source: str
    by_file: bool  # True: split by file (stdlib); False: one file split by bytes
    names: tuple[str, ...]
    contents: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class _Split:
    train: np.ndarray
    validation: np.ndarray
    train_files: tuple[str, ...]
    validation_files: tuple[str, ...]


_DOCUMENTS: dict[tuple, _Documents] = {}
_SPLITS: dict[tuple, _Split] = {}


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """POSIX relative paths of the stdlib corpus' files, sorted (see the module docstring for the rules)."""
    root = Path(root) if root is not None else stdlib_dir()
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in EXCLUDED_DIRS)
        for name in files:
            if name.endswith(".py"):
                found.append(Path(directory, name).relative_to(root).as_posix())
    return sorted(found)


def is_validation_file(relative_path: str, validation_fraction: float) -> bool:
    """The stable by-file rule: ``crc32(relative_path) % 1000 < validation_fraction * 1000``."""
    return zlib.crc32(relative_path.encode("utf-8")) % 1000 < validation_fraction * 1000


def _source_key(path: str | None) -> tuple:
    if path is None:
        return ("stdlib", str(stdlib_dir()))
    stat = os.stat(path)
    return ("file", os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


def _load_documents(path: str | None) -> _Documents:
    key = _source_key(path)
    if key in _DOCUMENTS:
        return _DOCUMENTS[key]
    if path is None:
        root = stdlib_dir()
        names = stdlib_files(root)
        contents = []
        for name in names:
            with open(root / name, "rb") as handle:
                contents.append(handle.read())
        version = ".".join(map(str, sys.version_info[:3]))
        documents = _Documents(f"python-stdlib {version} ({root})", True, tuple(names), tuple(contents))
    else:
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as error:
            raise ConfigError(f"path={path!r} could not be read ({error}); pass a readable text file") from error
        documents = _Documents(os.path.realpath(path), False, (path,), (data,))
    _DOCUMENTS[key] = documents
    return documents


def _as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)  # read-only: the cached splits are shared


def _split(path: str | None, validation_fraction: float) -> _Split:
    key = (_source_key(path), float(validation_fraction))
    if key in _SPLITS:
        return _SPLITS[key]
    documents = _load_documents(path)
    if documents.by_file:
        count = len(documents.names)
        if count < 2:
            raise ConfigError(
                f"the stdlib corpus at {documents.source} has {count} .py file(s); a by-file split needs "
                "at least 2; pass path=<a text file> instead"
            )
        in_validation = [is_validation_file(name, validation_fraction) for name in documents.names]
        if all(in_validation) or not any(in_validation):
            held_out = min(count - 1, max(1, math.ceil(validation_fraction * count)))
            in_validation = [index >= count - held_out for index in range(count)]
        train_idx = [i for i, held in enumerate(in_validation) if not held]
        val_idx = [i for i, held in enumerate(in_validation) if held]
        split = _Split(
            train=_as_array(FILE_SEPARATOR.join(documents.contents[i] for i in train_idx)),
            validation=_as_array(FILE_SEPARATOR.join(documents.contents[i] for i in val_idx)),
            train_files=tuple(documents.names[i] for i in train_idx),
            validation_files=tuple(documents.names[i] for i in val_idx),
        )
    else:
        data = _as_array(documents.contents[0])
        size = data.size
        if size < 2:
            raise ConfigError(
                f"path={path!r} holds {size} byte(s); a train/validation split needs at least 2 "
                "(and training needs more than seq_len + 1); pass a larger file"
            )
        held_out = min(size - 1, max(1, round(validation_fraction * size)))
        split = _Split(data[: size - held_out], data[size - held_out :], documents.names, documents.names)
    _SPLITS[key] = split
    return split


def clear_cache() -> None:
    """Forget every loaded corpus (the next :class:`TextCorpus` reads the disk again)."""
    _DOCUMENTS.clear()
    _SPLITS.clear()


class TextCorpus:
    """Byte-level train/validation splits of a :class:`TextConfig` source, with batch samplers.

    Attributes: ``config``; ``train`` and ``validation`` (read-only ``uint8`` arrays); ``train_files``
    and ``validation_files`` (relative paths for the stdlib corpus; for a single file both are
    ``(path,)`` since that file is split by bytes); ``vocab_size`` (256); ``seq_len``.
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, config: TextConfig):
        if not isinstance(config, TextConfig):
            raise ConfigError(f"config={config!r} must be a TextConfig")
        self.config = config
        self.seq_len = config.seq_len
        split = _split(config.path, config.validation_fraction)
        self._documents = _load_documents(config.path)
        self.train, self.validation = split.train, split.validation
        self.train_files, self.validation_files = split.train_files, split.validation_files
        if self.train.size < self.seq_len + 1:
            raise ConfigError(
                f"the train split has {self.train.size} bytes but seq_len={self.seq_len} needs at least "
                f"{self.seq_len + 1}; lower seq_len or use a larger corpus"
            )
        self._unigram_ce: float | None = None

    # ---------------------------------------------------------------- training
    def train_windows(self, step: int, batch: int) -> np.ndarray:
        """Start offsets into ``train`` of the windows of training batch ``step`` (int64 [batch])."""
        step = check_int("step", step, 0)
        batch = check_int("batch", batch, 1)
        rng = np.random.default_rng((self.config.seed, step))
        return rng.integers(0, self.train.size - self.seq_len, size=batch)

    def train_batch(self, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, targets), int32 [batch, seq_len]: random windows that depend only on (seed, step)."""
        starts = self.train_windows(step, batch)
        windows = self.train[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)
        return windows[:, :-1], windows[:, 1:]

    # -------------------------------------------------------------- validation
    def num_validation_batches(self, batch: int, max_batches: int | None = DEFAULT_VALIDATION_BATCHES) -> int:
        """How many batches :meth:`validation_batches` yields for these arguments (ConfigError if none)."""
        batch = check_int("batch", batch, 1)
        if max_batches is not None:
            max_batches = check_int("max_batches", max_batches, 1)
        windows = (self.validation.size - 1) // self.seq_len
        if windows < batch:
            raise ConfigError(
                f"the validation split has {self.validation.size} bytes = {windows} windows of "
                f"seq_len={self.seq_len}, fewer than one batch of {batch}: lower --batch or "
                f"--seq-len, or use a larger corpus (the validation split is "
                f"{self.config.validation_fraction:.0%} of it)"
            )
        full = windows // batch
        return full if max_batches is None else min(full, max_batches)

    def validation_batches(
        self, batch: int, max_batches: int | None = DEFAULT_VALIDATION_BATCHES
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(tokens, targets) int32 [batch, seq_len] over non-overlapping windows of the validation
        split, spread evenly over all of it (so that a few batches sample every validation file,
        like the unigram baseline, rather than the first few); the same batches on every call. At
        most ``max_batches`` batches (default 8, ``None`` for every full batch). Raises ConfigError
        (immediately, not on first ``next``) if the split is shorter than one batch."""
        count = self.num_validation_batches(batch, max_batches)
        offsets = np.arange(self.seq_len + 1)
        slots = (len(self.validation) - 1) // self.seq_len  # non-overlapping windows that fit
        chosen = (np.arange(count * batch) * slots) // max(count * batch, 1)  # evenly spread

        def generate():
            for index in range(count):
                starts = chosen[index * batch:(index + 1) * batch] * self.seq_len
                windows = self.validation[starts[:, None] + offsets].astype(np.int32)
                yield windows[:, :-1], windows[:, 1:]

        return generate()

    # ---------------------------------------------------------------- baseline
    def unigram_cross_entropy(self) -> float:
        """Cross-entropy (nats/token) of all validation bytes under the train split's byte
        frequencies with add-one smoothing: the baseline a model must beat."""
        if self._unigram_ce is None:
            counts = np.bincount(self.train, minlength=VOCAB_SIZE).astype(np.float64) + 1.0
            log_probs = np.log(counts / counts.sum())
            val_counts = np.bincount(self.validation, minlength=VOCAB_SIZE).astype(np.float64)
            self._unigram_ce = float(-(val_counts @ log_probs) / self.validation.size)
        return self._unigram_ce

    def describe(self) -> dict:
        """A JSON-ready summary for results.json."""
        return {
            "source": self._documents.source,
            "split": "by_file" if self._documents.by_file else "by_bytes",
            "files": {"train": len(self.train_files), "validation": len(self.validation_files)},
            "bytes": {"train": int(self.train.size), "validation": int(self.validation.size)},
            "validation_fraction": float(self.config.validation_fraction),
            "seq_len": self.seq_len,
            "seed": self.config.seed,
            "vocab_size": VOCAB_SIZE,
            "unigram_cross_entropy": self.unigram_cross_entropy(),
        }
