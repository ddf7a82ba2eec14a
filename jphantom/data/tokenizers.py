"""Tokenisers through the ecosystem's libraries, read from local files only (nothing downloads).

:func:`load_tokenizer` takes what ``--tokenizer`` takes:

- ``"bpe"``: the bundled byte-level BPE tokenizer (:data:`BUNDLED`, vocabulary 1024), a
  ``tokenizer.json`` shipped in the package. It was trained with :func:`train_bpe` on a fixed,
  deterministic slice of the Python standard library (:func:`bundled_training_text`: the first
  64 KB of each of :data:`BUNDLED_MODULES`) by ``python -m jphantom.data.tokenizers --write-bundled``;
  committing it (55 KB) keeps every interpreter's tokenizer identical, where training at run
  time would give each Python version's stdlib its own.
- a ``tokenizer.json`` (Hugging Face ``tokenizers``, as shipped beside every GPT-2, Llama or
  Mistral checkpoint), or a folder holding one;
- a tiktoken encoding: a ``.tiktoken`` file (its name picks the split pattern and special tokens
  of the encoding it is named after, ``cl100k_base.tiktoken``; any other name gets GPT-2's), or an
  encoding's name (``cl100k_base``, ``o200k_base``, ``gpt2``) whose files are already in tiktoken's
  cache (``TIKTOKEN_CACHE_DIR``): tiktoken would download a missing one, and here that is refused.
- ``"bytes"``: the identity on UTF-8 bytes (vocabulary 256): what the default run trains on.

Every tokenizer has ``name``, ``vocab_size`` (the ids it can emit, special tokens included),
``eot`` (the end-of-text id that separates documents, or ``None``), ``encode(text) -> list[int]``,
``encode_batch(texts)`` and ``decode(ids) -> str``; the byte-level ones round-trip any text.
"""

from __future__ import annotations

import base64
import functools
import importlib.resources
import os
from pathlib import Path

from jphantom.errors import ConfigError

BUNDLED = "bpe"
BUNDLED_FILE = "bpe-1024.json"
BUNDLED_VOCAB = 1024
END_OF_TEXT = "<|endoftext|>"
BUNDLED_MODULES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py",
                   "inspect.py", "json/decoder.py", "logging/__init__.py", "pathlib.py",
                   "subprocess.py", "textwrap.py", "typing.py", "unittest/case.py")
BUNDLED_BYTES_PER_MODULE = 65536
EOT_NAMES = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
INSTALL = {"tokenizers": "pip install tokenizers", "tiktoken": "pip install tiktoken"}


def _require(module: str, value: str):
    try:
        return __import__(module)
    except ImportError:
        raise ConfigError(f"tokenizer={value!r} needs the {module} package: "
                          f"{INSTALL[module]}") from None


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256, no end-of-text token)."""

    name = "bytes"
    vocab_size = 256
    eot = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (a ``tokenizer.json``); ``encode`` adds no special
    tokens (documents are separated by :attr:`eot` where the caller wants)."""

    def __init__(self, tokenizer, name: str):
        self.tokenizer, self.name = tokenizer, name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.eot = next((vocab[t] for t in EOT_NAMES if t in vocab), None)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class TiktokenTokenizer:
    """A ``tiktoken.Encoding``; ``encode`` treats special tokens' text as ordinary text."""

    def __init__(self, encoding, name: str):
        self.encoding, self.name = encoding, name
        self.vocab_size = encoding.n_vocab
        self.eot = encoding._special_tokens.get(END_OF_TEXT)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])


def load_tokenizer(value: str):
    """The tokenizer ``value`` names (module docstring); a :class:`ConfigError` naming the value
    and the fix when it is not on this machine. Loaded once per value and process."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"tokenizer={value!r} must be 'bpe', 'bytes', a tokenizer.json, a "
                          ".tiktoken file or a tiktoken encoding name")
    path = Path(value)
    key = (value, os.path.realpath(value), _mtime(path))
    return _load(*key)


def _mtime(path: Path):
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


@functools.lru_cache(maxsize=8)
def _load(value: str, real: str, _mtime):
    path = Path(value)
    if value == "bytes":
        return ByteTokenizer()
    if value == BUNDLED:
        tokenizers = _require("tokenizers", value)
        text = importlib.resources.files("jphantom.data").joinpath(BUNDLED_FILE).read_text()
        return HFTokenizer(tokenizers.Tokenizer.from_str(text), BUNDLED)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ConfigError(f"tokenizer={value!r} is a folder without a tokenizer.json: give "
                              "the folder of a Hugging Face checkpoint, or the file itself")
        path = path / "tokenizer.json"
    if path.is_file():
        if path.suffix == ".tiktoken":
            return _tiktoken_file(value, path)
        tokenizers = _require("tokenizers", value)
        try:
            return HFTokenizer(tokenizers.Tokenizer.from_file(str(path)), value)
        except Exception as error:  # noqa: BLE001 (the Rust side raises plain Exceptions)
            raise ConfigError(f"tokenizer={value!r} is not a tokenizer.json that the tokenizers "
                              f"library reads ({str(error).splitlines()[0][:120]}): give a "
                              "Hugging Face tokenizer.json, a .tiktoken file, or 'bpe'") from None
    if os.sep in value or value.endswith((".json", ".tiktoken")):
        raise ConfigError(f"tokenizer={value!r} does not exist: give an existing tokenizer.json "
                          "or .tiktoken file, or 'bpe' for the bundled tokenizer")
    return _tiktoken_name(value)


def _tiktoken_constructor(name: str):
    tiktoken = _require("tiktoken", name)
    from tiktoken import registry

    if name not in tiktoken.list_encoding_names():
        raise ConfigError(f"tokenizer={name!r} is neither a file nor a tiktoken encoding "
                          f"({', '.join(tiktoken.list_encoding_names())}): give a tokenizer.json, "
                          "a .tiktoken file, a tiktoken encoding name, or 'bpe'")
    return registry.ENCODING_CONSTRUCTORS[name]


class _WouldDownload(Exception):
    pass


def _tiktoken_name(name: str) -> TiktokenTokenizer:
    """A tiktoken encoding by name, from tiktoken's cache only: a read that would go to the
    network raises instead (tiktoken reads files through ``tiktoken.load.read_file``)."""
    from unittest import mock

    constructor = _tiktoken_constructor(name)
    import tiktoken
    import tiktoken.load

    def local_only(blobpath):
        if "://" in blobpath:
            raise _WouldDownload(blobpath)
        with open(blobpath, "rb") as handle:
            return handle.read()

    try:
        with mock.patch.object(tiktoken.load, "read_file", local_only):
            return TiktokenTokenizer(tiktoken.Encoding(**constructor()), name)
    except _WouldDownload:
        raise ConfigError(f"tokenizer={name!r}: tiktoken's file for it is not on this machine "
                          "and nothing downloads at run time: pass the .tiktoken file's path, or "
                          "set TIKTOKEN_CACHE_DIR to a folder where tiktoken has cached it") from None


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A ``.tiktoken`` file's mergeable ranks: one ``base64(token) rank`` per line."""
    ranks = {}
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
        except ValueError:
            raise ConfigError(f"tokenizer={str(path)!r}: line {number} is not 'base64-token "
                              "rank': give a tiktoken .tiktoken file") from None
    return ranks


def _tiktoken_file(value: str, path: Path) -> TiktokenTokenizer:
    """A ``.tiktoken`` file with the pattern and special tokens of the encoding named like it
    (GPT-2's pattern and ``<|endoftext|>`` after the last rank for any other name)."""
    from unittest import mock

    tiktoken = _require("tiktoken", value)
    ranks = read_tiktoken_ranks(path)
    settings = None
    if path.stem in tiktoken.list_encoding_names():
        import tiktoken_ext.openai_public as public

        constructor = _tiktoken_constructor(path.stem)
        with mock.patch.object(public, "load_tiktoken_bpe", lambda *a, **k: ranks), \
                mock.patch.object(public, "data_gym_to_mergeable_bpe_ranks",
                                  lambda *a, **k: ranks):
            settings = constructor()
    if settings is None:
        import tiktoken_ext.openai_public as public

        settings = {"name": path.stem, "pat_str": public.r50k_pat_str,
                    "mergeable_ranks": ranks,
                    "special_tokens": {END_OF_TEXT: max(ranks.values(), default=-1) + 1}}
    return TiktokenTokenizer(tiktoken.Encoding(**settings), value)


# ------------------------------------------------------------------------------------------------
# The bundled tokenizer
# ------------------------------------------------------------------------------------------------


def train_bpe(texts, vocab_size: int = BUNDLED_VOCAB):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids (the 256 bytes, the merges,
    then ``<|endoftext|>``) trained on ``texts`` (strings): GPT-2's pre-tokenisation, so any text
    round-trips exactly."""
    tokenizers = _require("tokenizers", BUNDLED)
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


def bundled_training_text(stdlib=None) -> list[str]:
    """What the bundled tokenizer learnt from: the first :data:`BUNDLED_BYTES_PER_MODULE` bytes
    of each of :data:`BUNDLED_MODULES` in the standard library ``stdlib`` (default: this
    interpreter's)."""
    from jphantom.data.text import stdlib_dir

    root = Path(stdlib) if stdlib is not None else stdlib_dir()
    return [(root / name).read_bytes()[:BUNDLED_BYTES_PER_MODULE].decode("utf-8", "replace")
            for name in BUNDLED_MODULES]


def write_bundled(path: str | os.PathLike | None = None) -> Path:
    """Train the bundled tokenizer again and write it (default: into the package)."""
    target = Path(path) if path is not None else Path(__file__).with_name(BUNDLED_FILE)
    train_bpe(bundled_training_text()).save(str(target))
    return target


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write-bundled"]:
        print(f"wrote {write_bundled()}")
    else:
        sys.exit("usage: python -m jphantom.data.tokenizers --write-bundled")
