"""Dataset files: the rows of JSON Lines, JSON, Parquet and Arrow files, streamed.

``train --data`` takes one such file or a folder of them (searched recursively, sorted by
path). In a folder, a file's split is named by a whole word of its path below the folder (the
runs of letters: ``data/validation-00000-of-00001.parquet`` has ``data``, ``validation``,
``of``, ``parquet``), one rule for every split (:func:`split_of`): :data:`VALIDATION_NAMES`
the validation split, :data:`TEST_NAMES` a test split nothing reads, anything else training
(``values.jsonl`` and ``intervals/`` train; ``contest.jsonl`` too). Other files in the folder
are skipped and named (:func:`skipped_files`). The formats, and how each is read without
holding the file in memory:

- ``.jsonl`` (JSON Lines): the standard library's :mod:`json`, one line at a time;
- ``.json``: JSON Lines too (what Hugging Face ``datasets``' ``to_json`` writes), or one JSON
  array of rows (Alpaca-style files; :func:`_one_array`), decoded one row at a time from 1 MiB
  blocks with :meth:`json.JSONDecoder.raw_decode` (the standard library: pyarrow's JSON reader
  takes only newline-delimited JSON); a UTF-8 byte-order mark is read past (``utf-8-sig``);
- ``.parquet``: ``pyarrow.parquet.ParquetFile.iter_batches`` (record batches of 1024 rows);
- ``.arrow`` / ``.feather`` (Arrow IPC): memory-mapped by ``pyarrow``, the file format (Feather
  v2) or the stream format (what ``datasets``' ``save_to_disk`` writes), batch by batch.

A row is one of the three shapes TRL's ``SFTTrainer`` takes (other keys are ignored, and a key
whose value is null counts as absent):

- ``{"text": str}``: language modelling;
- ``{"prompt": ..., "completion": ...}``: both strings (standard) or both lists of messages
  (conversational);
- ``{"messages": [{"role": str, "content": ...}, ...]}``: a conversation; a ``content`` is a
  string or a list of text parts (``[{"type": "text", "text": "hi"}]``, OpenAI's form), whose
  text is the parts' concatenated (:func:`content_text`), any other part refused by its type.

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
VALIDATION_NAMES = frozenset({"val", "valid", "validation", "dev", "eval", "evaluation"})
TEST_NAMES = frozenset({"test", "testing"})
WORDS = re.compile(r"[a-z]+")  # a path's words: its runs of letters, lower-cased
VALIDATION_FILE = "a validation file (a file or folder named val, valid, validation, dev or eval)"
BLOCK_BYTES = 1 << 20
ARROW_BATCH_ROWS = 1024


def is_dataset_data(path: str | os.PathLike | None) -> bool:
    """Whether ``--data`` names dataset files: a file with one of :data:`SUFFIXES`, or a folder
    holding some (and no ``.bin`` token file, at any depth: that is token data); ``None`` (no
    ``--data``: the standard library's text) does not."""
    if path is None:
        return False
    path = Path(path)
    if path.is_dir():
        return not any(p.is_file() for p in path.rglob("*.bin")) and any(_found(path))
    return path.suffix.lower() in SUFFIXES


def _found(folder: Path) -> Iterator[Path]:
    return (p for p in folder.rglob("*") if p.is_file() and _skip_reason(p) is None)


def _skip_reason(path: Path) -> str | None:
    """Why a file of a ``--data`` folder is not read (None: it is a dataset file)."""
    if path.name in METADATA:
        return "datasets' metadata"
    if path.suffix.lower() not in SUFFIXES:
        return f"not a dataset file: {', '.join(SUFFIXES)}"
    return None


def skipped_files(data: str | os.PathLike) -> dict[Path, str]:
    """The files of a ``--data`` folder that are not read, sorted by path, each with why (none
    for a file): what ``train`` names in its ``data:`` line and results.json."""
    path = Path(data)
    if not path.is_dir():
        return {}
    found = sorted(p for p in path.rglob("*") if p.is_file())
    return {p: reason for p in found if (reason := _skip_reason(p)) is not None}


def split_of(relative: str) -> str:
    """``"validation"``, ``"test"`` or ``"train"``: the split a file's path below the ``--data``
    folder names, by a whole word of it (module docstring), validation first."""
    words = set(WORDS.findall(relative.lower()))
    if words & VALIDATION_NAMES:
        return "validation"
    return "test" if words & TEST_NAMES else "train"


class Splits(NamedTuple):
    """The files of ``--data``: ``train``, ``validation`` and ``test`` (never read)."""

    train: list[Path]
    validation: list[Path]
    test: list[Path]


def split_files(data: str | os.PathLike) -> Splits:
    """The files of ``--data``: a file is the training split alone; a folder's dataset files
    (searched recursively, Hugging Face ``datasets``' metadata files left out) sorted by path,
    each in the split a whole word of its path below the folder names (:func:`split_of`:
    ``val.jsonl``, ``validation/data-0.arrow``, ``data/test-00000-of-00001.parquet``); the test
    split is what nothing trains or validates on."""
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
    named = {f: split_of(relative[f]) for f in files}
    train, validation, test = ([f for f in files if named[f] == split]
                               for split in ("train", "validation", "test"))
    if not train:
        raise ConfigError(f"data={str(data)!r}: every file is a validation or test file (a word "
                          f"of its path is one of {sorted(VALIDATION_NAMES | TEST_NAMES)}): add "
                          "training files")
    return Splits(train, validation, test)


def data_files(data, validation_data=None) -> dict[str, list[Path] | dict[Path, str]]:
    """The files ``train`` reads of ``--data`` and ``--val-data``, by split (``"train"``,
    ``"validation"``, ``"test (not read)"``), and ``"skipped"``: every other file of their
    folders, with why (:func:`skipped_files`; with ``--val-data``, also ``--data``'s own
    validation files), so that no file is left out without a word. A file in both splits is a
    ConfigError."""
    train, validation, test = split_files(data)
    skipped = skipped_files(data)
    if validation_data is not None:
        named = split_files(validation_data)
        skipped.update({f: "a validation file of --data; --val-data replaces them"
                        for f in validation})
        skipped.update(skipped_files(validation_data))
        validation, test = named.train + named.validation, test + named.test
        both = sorted({p.resolve() for p in train} & {p.resolve() for p in validation})
        if both:
            raise ConfigError(f"val_data={str(validation_data)!r}: {str(both[0])!r} is also a "
                              "training file of --data: move it out of the --data folder")
    return {"train": train, "validation": validation, "test (not read)": test,
            "skipped": skipped}


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
    """JSON Lines, or (a ``.json`` file) one array of rows; a UTF-8 byte-order mark (what some
    editors and spreadsheet exports write) is read past."""
    with open(path, encoding="utf-8-sig") as handle:
        head = handle.read(BLOCK_BYTES)
        if _one_array(head):
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


def _one_array(head: str) -> bool:
    """Whether a JSON file starting with ``head`` is one array of rows: it opens with ``[`` and
    its first line is not a whole JSON value (the array spans lines), or is a list of objects
    with nothing after it. A first line such as ``[1, 2, 3]`` followed by others, or alone, is
    JSON Lines whose row is that list (then refused as one)."""
    text = head.lstrip()
    if not text.startswith("["):
        return False
    first, _, rest = text.partition("\n")
    try:
        value = json.loads(first)
    except json.JSONDecodeError:
        return True
    return not rest.strip() and all(isinstance(row, dict) for row in value)


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
        raise ConfigError(f"{where} is {json_type(row)} ({json.dumps(row, default=str)[:40]}), not an "
                          "object with 'text', 'prompt' and 'completion', or 'messages'")
    keys = {k for k, v in row.items() if v is not None}
    found = [kind for kind, need in KINDS.items() if set(need) <= keys]
    if len(found) != 1:
        what = "more than one shape" if found else "none of the shapes"
        raise ConfigError(f"{where} has keys {sorted(row)} ({what}): a row needs 'text', or "
                          "'prompt' and 'completion', or 'messages'")
    kind = found[0]
    if kind == "text" and not isinstance(row["text"], str):
        raise ConfigError(f"{where}: 'text' is {json_type(row['text'])}, not a string")
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
        _check_content(message.get("content"), f"{where}[{index}] 'content'")


def _check_content(content, where: str) -> None:
    """A message's content is None, a string, or a list of text parts (OpenAI's and
    transformers' form, ``[{"type": "text", "text": "hi"}]``); any other part is refused by its
    type (a text model reads no image or audio)."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, (list, tuple)):
        raise ConfigError(f"{where} is {json_type(content)}, not a string or a list of "
                          "{'type': 'text', 'text': ...} parts")
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else json_type(part)
        if kind != "text" or not isinstance(part.get("text"), str):
            what = f"a {kind!r} part" if isinstance(part, dict) else kind
            raise ConfigError(f"{where}[{index}] is {what}: only text parts ({{'type': 'text', "
                              "'text': ...}) are read, a text model takes no image or audio; "
                              "drop it or give its text")


def content_text(content):
    """A message's content as a template reads it: the list form's text parts concatenated
    (as TRL reads them for a text model), anything else as it is."""
    if isinstance(content, (list, tuple)):
        return "".join(part["text"] for part in content)
    return content


def json_type(value) -> str:
    """``value``'s JSON type, with an article, for messages: "a JSON array", "a number"..."""
    for kinds, name in (((bool,), "true or false"), ((int, float), "a number"),
                        ((str,), "a string"), ((list, tuple), "a JSON array"),
                        ((dict,), "a JSON object"), ((type(None),), "null")):
        if isinstance(value, kinds):
            return name
    return f"a {type(value).__name__}"
