"""Dataset files: the rows of JSON Lines, JSON, Parquet and Arrow files, streamed.

``train --data`` takes one such file or a folder of them (searched recursively, sorted by
path); in a folder, files whose path contains ``val`` are the validation split, as for token
files (:mod:`jphantom.data.tokens`), and a test split (:func:`split_files`) is left out. The
formats, and how each is read without holding the file
in memory:

- ``.jsonl`` (JSON Lines): the standard library's :mod:`json`, one line at a time;
- ``.json``: JSON Lines too (what Hugging Face ``datasets``' ``to_json`` writes), or one JSON
  array of rows (Alpaca-style files), decoded one row at a time from 1 MiB blocks with
  :meth:`json.JSONDecoder.raw_decode` (the standard library: pyarrow's JSON reader takes only
  newline-delimited JSON);
- ``.parquet``: ``pyarrow.parquet.ParquetFile.iter_batches`` (record batches of 1024 rows);
- ``.arrow`` / ``.feather`` (Arrow IPC): memory-mapped by ``pyarrow``, the file format (Feather
  v2) or the stream format (what ``datasets``' ``save_to_disk`` writes), batch by batch.

A row is one of the three shapes TRL's ``SFTTrainer`` takes (other keys are ignored, and a key
whose value is null counts as absent):

- ``{"text": str}``: language modelling;
- ``{"prompt": ..., "completion": ...}``: both strings (standard) or both lists of messages
  (conversational);
- ``{"messages": [{"role": str, "content": ...}, ...]}``: a conversation.

Anything else is refused with one line naming the file, the row (1-based) and the keys found.
pyarrow is the ``data`` extra (``pip install 'jphantom[data]'``); JSON needs nothing.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator, NamedTuple

from jphantom.errors import ConfigError

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".feather")
KINDS = {"text": ("text",), "prompt_completion": ("prompt", "completion"),
         "messages": ("messages",)}
METADATA = ("dataset_info.json", "state.json", "dataset_dict.json")  # datasets' save_to_disk
TEST = re.compile(r"(^|[/_.-])test")  # a test split's path part
BLOCK_BYTES = 1 << 20
ARROW_BATCH_ROWS = 1024


def is_dataset_data(path: str | os.PathLike) -> bool:
    """Whether ``--data`` names dataset files: a file with one of :data:`SUFFIXES`, or a folder
    holding some (and no ``.bin`` token file)."""
    path = Path(path)
    if path.is_dir():
        return not any(path.glob("*.bin")) and any(_found(path))
    return path.suffix.lower() in SUFFIXES


def _found(folder: Path) -> Iterator[Path]:
    return (p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
            and p.name not in METADATA)


class Splits(NamedTuple):
    """The files of ``--data``: ``train``, ``validation`` and ``test`` (never read)."""

    train: list[Path]
    validation: list[Path]
    test: list[Path]


def split_files(data: str | os.PathLike) -> Splits:
    """The files of ``--data``: a file is the training split alone; a folder's files (searched
    recursively, Hugging Face ``datasets``' metadata files left out) sorted by path, those whose
    path below the folder contains ``val`` the validation split, those with a ``test`` part
    (``test.jsonl``, ``test/...``, ``data/test-00000-of-00001.parquet``) the test split, which
    nothing trains or validates on."""
    path = Path(data)
    if not path.is_dir():
        if not path.is_file():
            raise ConfigError(f"data={str(data)!r} does not exist: give a .jsonl, .json, .parquet "
                              "or .arrow file, or a folder of them")
        return Splits([path], [], [])
    relative = {p: p.relative_to(path).as_posix().lower() for p in _found(path)}
    files = sorted(relative, key=relative.get)
    if not files:
        raise ConfigError(f"data={str(data)!r} holds no {', '.join(SUFFIXES)} file")
    validation = [f for f in files if "val" in relative[f]]
    test = [f for f in files if f not in validation and TEST.search(relative[f])]
    train = [f for f in files if f not in validation and f not in test]
    if not train:
        raise ConfigError(f"data={str(data)!r}: every file is a validation or test file (its path "
                          "contains 'val' or 'test'): add training files")
    return Splits(train, validation, test)


def read_rows(path: str | os.PathLike) -> Iterator[dict]:
    """The rows of one dataset file, in order, each a dict, read as the module docstring says
    (never the whole file at once)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(f"data file {str(path)!r}: {suffix or 'no suffix'} is not one of "
                          f"{', '.join(SUFFIXES)}")
    if suffix in (".jsonl", ".json"):
        return _json_rows(path)
    return _arrow_rows(path, parquet=suffix == ".parquet")


def _json_rows(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as handle:
        head = handle.read(BLOCK_BYTES)
        if head.lstrip().startswith("["):
            yield from _json_array(handle, head, path)
            return
        handle.seek(0)
        for number, line in enumerate(handle, 1):  # the file object's buffered line reader
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"data file {str(path)!r} line {number} is not JSON "
                                  f"({error.msg}): give one JSON object per line") from None


def _json_array(handle, buffer: str, path: Path) -> Iterator[dict]:
    """The elements of a top-level JSON array, decoded one at a time from blocks (the buffer
    keeps the undecoded rest of the last block, plus the next block when a row spans both)."""
    decoder = json.JSONDecoder()
    at = buffer.index("[") + 1
    while True:
        while at < len(buffer) and buffer[at] in " \t\r\n,":
            at += 1
        if at == len(buffer):
            block = handle.read(BLOCK_BYTES)
            if not block:
                raise ConfigError(f"data file {str(path)!r}: the JSON array is not closed")
            buffer, at = block, 0
            continue
        if buffer[at] == "]":
            return
        try:
            row, at = decoder.raw_decode(buffer, at)
        except json.JSONDecodeError as error:
            block = handle.read(BLOCK_BYTES)
            if not block:
                raise ConfigError(f"data file {str(path)!r} is not a JSON array of objects "
                                  f"({error.msg} at character {error.pos})") from None
            buffer, at = buffer[at:] + block, 0
            continue
        yield row


def _arrow_rows(path: Path, parquet: bool) -> Iterator[dict]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"data file {str(path)!r} needs pyarrow: pip install 'jphantom[data]' "
                          "(or pyarrow)") from None
    try:
        if parquet:
            batches = pq.ParquetFile(path).iter_batches(batch_size=ARROW_BATCH_ROWS)
        else:
            source = pa.memory_map(str(path), "r")
            try:
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # not the file format: the stream format (datasets' .arrow)
                source.seek(0)
                batches = pa.ipc.open_stream(source)
        for batch in batches:
            yield from batch.to_pylist()
    except (pa.ArrowInvalid, OSError) as error:
        kind = "Parquet" if parquet else "Arrow IPC"
        raise ConfigError(f"data file {str(path)!r} is not a {kind} file that pyarrow reads "
                          f"({str(error).splitlines()[0][:120]})") from None


def row_kind(row, path, number: int) -> str:
    """The shape of ``row`` (row ``number``, 1-based, of ``path``): ``"text"``,
    ``"prompt_completion"`` or ``"messages"``; anything else a ConfigError in one line."""
    where = f"data file {str(path)!r} row {number}"
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is a {type(row).__name__}, not an object with 'text', "
                          "'prompt' and 'completion', or 'messages'")
    keys = {k for k, v in row.items() if v is not None}
    found = [kind for kind, need in KINDS.items() if set(need) <= keys]
    if len(found) != 1:
        what = "more than one shape" if found else "none of the shapes"
        raise ConfigError(f"{where} has keys {sorted(row)} ({what}): a row needs 'text', or "
                          "'prompt' and 'completion', or 'messages'")
    kind = found[0]
    if kind == "text" and not isinstance(row["text"], str):
        raise ConfigError(f"{where}: 'text' is a {type(row['text']).__name__}, not a string")
    if kind == "messages":
        check_messages(row["messages"], f"{where} 'messages'")
    if kind == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) != isinstance(completion, str):
            raise ConfigError(f"{where}: 'prompt' and 'completion' must both be strings or both "
                              "lists of messages")
        if not isinstance(prompt, str):
            check_messages(prompt, f"{where} 'prompt'")
            check_messages(completion, f"{where} 'completion'")
    return kind


def check_messages(messages, where: str) -> None:
    """``messages`` is a non-empty list of objects with a string ``role`` and a ``content``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError(f"{where} must be a non-empty list of messages, not "
                          f"{type(messages).__name__}")
    for index, message in enumerate(messages):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or "content" not in message and "tool_calls" not in message):
            keys = sorted(message) if isinstance(message, dict) else type(message).__name__
            raise ConfigError(f"{where}[{index}] has {keys}: a message needs 'role' and "
                              "'content'")
