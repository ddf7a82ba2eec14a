"""Rows of dataset files as tokenised documents with a loss mask, as TRL's ``SFTTrainer``
tokenises them.

Each row (:mod:`jphantom.data.dataset_files`) becomes one document: its token ids and, per token,
whether the loss is taken on it (``--loss-on``):

- ``{"text"}``: the text through the tokenizer with its special tokens (a ``tokenizer.json``'s
  post-processor: Llama's BOS), then the end-of-sequence id unless the text ends with it (TRL's
  ``add_eos``); the loss on every token (``all``, the only choice);
- ``{"prompt", "completion"}`` as strings: the prompt, then prompt + completion + EOS tokenised
  together; the completion is what follows the prompt's tokens. ``completion`` (the default, as
  TRL's ``completion_only_loss=None`` is for prompt-completion data) takes the loss on it, ``all``
  on everything;
- ``{"messages"}``: the conversation through the chat template (no special tokens added: the
  template writes them), ``all`` by default (TRL's ``assistant_only_loss=False``); ``assistant``
  takes the loss on the assistant turns (:meth:`ChatTemplate.assistant_spans`);
- ``{"prompt", "completion"}`` as messages: the prompt rendered with the generation prompt, then
  prompt + completion; ``completion`` (default: what follows the prompt), ``assistant`` (the
  assistant turns of the completion: TRL's completion mask times its assistant mask) or ``all``.

A choice that does not apply to a row (``assistant`` for text and for prompt/completion strings,
``completion`` for messages) is a ConfigError naming the file and row. :func:`targets` turns a document into the step's targets:
the next token where the loss is taken on it, -100 elsewhere and at the document's last token
(Hugging Face's ignore index; no target crosses a document's end). :class:`Documents` holds every
document of a split in three flat arrays (tokens, targets, starts) and counts rows, tokens and
loss tokens (the targets that count).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from jphantom.data.chat_template import token_mask
from jphantom.data.dataset_files import (VALIDATION_FILE, content_text, data_files, read_rows,
                                         row_kind)
from jphantom.errors import ConfigError

IGNORE = -100
LOSS_ON = ("assistant", "completion", "all")  # --loss-on
HELD_OUT = 0.01  # the validation rows held out when no validation file is named
DEFAULT_LOSS_ON = {"text": "all", "prompt_completion": "completion", "messages": "all"}
APPLIES = {"text": ("all",), "prompt_completion": LOSS_ON, "messages": ("assistant", "all")}


def encode_with_offsets(tokenizer, text: str, special: bool = False
                        ) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids, character offsets) of ``text``: a Hugging Face tokenizer's own offsets (with its
    post-processor's special tokens when ``special``), one per UTF-8 byte for bytes."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "encode"):
        encoding = inner.encode(text, add_special_tokens=special)
        return list(encoding.ids), list(encoding.offsets)
    if getattr(tokenizer, "name", None) == "bytes":
        ids, offsets = [], []
        for index, char in enumerate(text):
            for byte in char.encode("utf-8"):
                ids.append(byte)
                offsets.append((index, index + 1))
        return ids, offsets
    raise ConfigError(f"tokenizer={getattr(tokenizer, 'name', tokenizer)!r} gives no character "
                      "offsets, which chat templates need: use a Hugging Face tokenizer.json")


def encode_ids(tokenizer, text: str, special: bool = False) -> list[int]:
    """The ids of ``text``: a Hugging Face tokenizer's with its post-processor's special tokens
    when ``special``; any other tokenizer's ``encode``."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and hasattr(inner, "encode"):
        return list(inner.encode(text, add_special_tokens=special).ids)
    return list(tokenizer.encode(text))


@dataclasses.dataclass(frozen=True)
class RowTokenizer:
    """Tokenises rows (module docstring). ``tokenizer``: a :mod:`jphantom.data.tokenizers`
    tokenizer; ``template``: a :class:`~jphantom.data.chat_template.ChatTemplate` (None: rows with
    messages are refused); ``eos``: the end-of-sequence id appended to standard rows (None:
    nothing appended); ``loss_on``: one of :data:`LOSS_ON`, or None for each row's default."""

    tokenizer: object
    template: object = None
    eos: int | None = None
    loss_on: str | None = None

    def __post_init__(self):
        if self.loss_on is not None and self.loss_on not in LOSS_ON:
            raise ConfigError(f"loss_on={self.loss_on!r}; use one of {', '.join(LOSS_ON)}")

    def __call__(self, row: dict, path="row", number: int = 1) -> tuple[list[int], list[int]]:
        """(ids, mask): the row's tokens and 1 where the loss is taken on a token."""
        ids, mask, _ = self.encode(row, path, number)
        return ids, mask

    def encode(self, row: dict, path="row", number: int = 1) -> tuple[list[int], list[int], str]:
        """(ids, mask, lost): the row's tokens, 1 where the loss is taken on a token, and the
        characters of its text the tokenizer cannot represent (:func:`lost_characters`)."""
        kind = row_kind(row, path, number)
        loss_on = self.loss_on or DEFAULT_LOSS_ON[kind]
        if loss_on not in APPLIES[kind]:
            what = {"text": "a text row has no answer", "messages": "a messages row has no "
                    "completion (its answers are the assistant turns)"}[kind]
            raise ConfigError(f"--loss-on {loss_on} does not apply to data file {str(path)!r} row "
                              f"{number}: {what}; use --loss-on "
                              f"{' or '.join(APPLIES[kind])}")
        if kind == "text":
            text = row["text"]
            ids = self._standard(text)
            mask = [1] * len(ids)
        elif kind == "messages" or not isinstance(row["prompt"], str):
            ids, mask, text = self._conversation(row, kind, loss_on, path, number)
        else:
            ids, mask, text = self._strings(row, loss_on, path, number)
        return ids, mask, lost_characters(self.tokenizer, text, ids)

    def _strings(self, row, loss_on, path, number) -> tuple[list[int], list[int], str]:
        """A prompt/completion row of strings: (ids, mask, text)."""
        if loss_on == "assistant":
            raise ConfigError(f"--loss-on assistant does not apply to data file {str(path)!r} row "
                              f"{number}: a prompt/completion row of strings has no assistant "
                              "turns; use --loss-on completion or all")
        prompt = encode_ids(self.tokenizer, row["prompt"], special=True)
        text = row["prompt"] + row["completion"]
        ids = self._standard(text)
        mask = [1] * len(ids) if loss_on == "all" else [0] * len(prompt) + [1] * (
            len(ids) - len(prompt))
        return ids, mask[:len(ids)], text

    def _standard(self, text: str) -> list[int]:
        ids = encode_ids(self.tokenizer, text, special=True)
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            ids.append(self.eos)
        return ids

    def _conversation(self, row, kind, loss_on, path, number) -> tuple[list[int], list[int], str]:
        if self.template is None:
            raise ConfigError(f"data file {str(path)!r} row {number} is a conversation but there "
                              "is no chat template: give --chat-template FILE, or --from-hf a "
                              "checkpoint whose folder has one")
        try:
            return self._rendered(row, kind, loss_on)
        except ConfigError as error:  # the template's own, named here with the row it was on
            raise ConfigError(f"data file {str(path)!r} row {number}: {error}") from None

    def _rendered(self, row, kind, loss_on) -> tuple[list[int], list[int], str]:
        """(ids, mask, text) of a conversation row through the template (module docstring); a
        message's list of text parts is its text (TRL's reading)."""
        options = {"tools": row.get("tools"), **(row.get("chat_template_kwargs") or {})}
        flat = lambda turns: [{**m, "content": content_text(m.get("content"))} if "content" in m
                              else m for m in turns]
        prompt_turns = flat(row["prompt"]) if kind == "prompt_completion" else []
        messages = (flat(row["messages"]) if kind == "messages" else
                    prompt_turns + flat(row["completion"]))
        if loss_on == "assistant":
            text, spans = self.template.assistant_spans(messages, **options)
        else:
            text, spans = self.template.render(messages, **options)
        if not text.strip():
            raise ConfigError(f"{self.template.name} renders the conversation as {text!r}: check "
                              "the template writes the messages' content")
        ids, offsets = encode_with_offsets(self.tokenizer, text)
        if loss_on == "all":
            return ids, [1] * len(ids), text
        mask = [1] * len(ids)
        if loss_on == "assistant":
            mask = token_mask(offsets, spans)
        if kind == "prompt_completion":  # the completion only (with assistant: its turns)
            prompt_text, _ = self.template.render(prompt_turns, add_generation_prompt=True,
                                                  **options)
            if not text.startswith(prompt_text):
                raise ConfigError(f"{self.template.name} renders the prompt (with the generation "
                                  "prompt) otherwise than the start of prompt + completion, so "
                                  "the completion cannot be found: a completion starts with the "
                                  "assistant's turn")
            prompt = len(encode_ids(self.tokenizer, prompt_text))
            mask = [0] * prompt + mask[prompt:]
        return ids, mask, text


def lost_characters(tokenizer, text: str, ids: Sequence[int]) -> str:
    """The characters of ``text`` (whitespace aside, in order) that ``ids`` do not give back: a
    Hugging Face tokenizer drops a character it has no token for (a byte-level BPE without a
    byte's token, a model without an unknown token) or maps it to its unknown token. Counted as
    the text, through the tokenizer's normaliser (lower-casing, NFKC), less the characters of
    the decoded ids; bytes and tiktoken (byte-level, every byte a token) lose none, and a
    tokenizer without a decoder (whose ids cannot be read back as text) is not checked."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is None or getattr(inner, "decoder", None) is None:
        return ""
    normal = inner.normalizer.normalize_str(text) if inner.normalizer is not None else text
    missing = Counter("".join(normal.split())) - Counter(
        "".join(inner.decode(list(ids), skip_special_tokens=False).split()))
    lost = []
    for char in normal:
        if missing[char] > 0:
            missing[char] -= 1
            lost.append(char)
    return "".join(lost)


def targets(ids: Sequence[int], mask: Sequence[int]) -> np.ndarray:
    """int32 targets of one document: ``ids[t + 1]`` where ``mask[t + 1]``, else -100; -100 at
    the last token."""
    ids, mask = np.asarray(ids, np.int32), np.asarray(mask, bool)
    out = np.full(len(ids), IGNORE, np.int32)
    if len(ids) > 1:
        out[:-1] = np.where(mask[1:], ids[1:], IGNORE)
    return out


@dataclasses.dataclass
class Documents:
    """The documents of a split: ``tokens`` and ``targets`` (int32, every document's one after
    another) and ``starts`` (int64 [documents + 1]: document d is ``starts[d]:starts[d + 1]``),
    one document per row of the files."""

    tokens: np.ndarray
    targets: np.ndarray
    starts: np.ndarray

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    def document(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.starts[index]), int(self.starts[index + 1])
        return self.tokens[a:b], self.targets[a:b]

    def kept(self, limit: int | None = None) -> np.ndarray:
        """bool per token: whether it is among its document's first ``limit`` tokens (all when
        None), those a padded row of ``limit`` keeps (:func:`jphantom.data.packing.pad`)."""
        if limit is None:
            return np.ones(len(self.tokens), bool)
        return self.offsets() < limit

    def offsets(self) -> np.ndarray:
        """int64 per token: its position in its document, from 0."""
        return np.arange(len(self.tokens)) - np.repeat(self.starts[:-1], self.lengths)

    def summary(self, limit: int | None = None) -> dict:
        """Rows, tokens and loss tokens (targets that count) that rows keep: every token
        packed (``limit`` None), each document's first ``limit`` padded."""
        kept = self.kept(limit)
        return {"rows": self.count, "tokens": int(np.count_nonzero(kept)),
                "loss_tokens": int(np.count_nonzero((self.targets >= 0) & kept))}

    def hold_out(self, fraction: float = HELD_OUT) -> tuple["Documents", "Documents"]:
        """(train, validation): the last ``fraction`` of the documents (at least 1, at most all
        but 1) held out, in file order."""
        if self.count < 2:
            raise ConfigError(f"the data holds {self.count} row(s) with a token: holding out "
                              "validation rows "
                              "needs at least 2; add rows, or "
                              f"{VALIDATION_FILE}")
        held = min(self.count - 1, max(1, round(fraction * self.count)))
        return self.split(self.count - held)

    def split(self, count: int) -> tuple["Documents", "Documents"]:
        """(the first ``count`` documents, the rest)."""
        cut = int(self.starts[count])
        return (Documents(self.tokens[:cut], self.targets[:cut], self.starts[:count + 1]),
                Documents(self.tokens[cut:], self.targets[cut:], self.starts[count:] - cut))

    @classmethod
    def of(cls, pairs: Iterable[tuple[Sequence[int], Sequence[int]]]) -> "Documents":
        """From (ids, mask) pairs (:class:`RowTokenizer`'s)."""
        tokens, target_parts, lengths = [], [], [0]
        for ids, mask in pairs:
            tokens.append(np.asarray(ids, np.int32))
            target_parts.append(targets(ids, mask))
            lengths.append(len(ids))
        join = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int32)
        return cls(join(tokens), join(target_parts), np.cumsum(lengths, dtype=np.int64))


@dataclasses.dataclass
class LostText:
    """The characters the tokenizer could not represent (:func:`lost_characters`), over rows:
    how many, in how many rows, and the first such row and character."""

    characters: int = 0
    rows: int = 0
    first: str | None = None  # "data file 'chat.jsonl' row 3 ('Ü')"

    def add(self, lost: str, path, number: int) -> None:
        if lost:
            self.characters, self.rows = self.characters + len(lost), self.rows + 1
            self.first = self.first or f"data file {str(path)!r} row {number} ({lost[0]!r})"

    def message(self, tokenizer) -> str | None:
        """One line naming the count, the first row and the fix; None when nothing was lost."""
        if not self.characters:
            return None
        return (f"tokenizer {tokenizer!r} cannot represent {self.characters:,} character(s) of "
                f"{self.rows:,} row(s), which it drops; the first: {self.first}: use a tokenizer "
                "that covers the data's characters (a byte-level one), or clean the data")


def tokenize_files(paths, row_tokenizer: RowTokenizer, progress: bool = False,
                   lost: LostText | None = None) -> Documents:
    """Every row of the dataset files ``paths``, tokenised, as :class:`Documents` (rows with no
    token are dropped); ``progress``: a tqdm bar of the rows; ``lost``: counts the characters
    the tokenizer cannot represent."""
    from tqdm.auto import tqdm

    lost = LostText() if lost is None else lost

    def pairs():
        with tqdm(unit=" rows", disable=not progress, desc="tokenizing") as bar:
            for path in paths:
                bar.set_description_str(f"tokenizing {os.path.basename(path)}")
                for number, row in enumerate(read_rows(path), 1):
                    ids, mask, dropped = row_tokenizer.encode(row, path, number)
                    lost.add(dropped, path, number)
                    bar.update()
                    if ids:
                        yield ids, mask

    return Documents.of(pairs())


def read_documents(data, row_tokenizer: RowTokenizer, validation_data=None,
                   progress: bool = False) -> tuple[Documents, Documents, dict]:
    """(train, validation, description) of ``--data`` (a dataset file or a folder of them,
    :func:`jphantom.data.dataset_files.data_files`): the rows of ``validation_data`` (a file or
    a folder: ``--val-data``), else of the folder's validation files, else the last
    :data:`HELD_OUT` of the rows (at least one); ``progress``: a bar of the rows tokenised. The
    description names every file by split, and every file skipped with why, and counts the
    characters the tokenizer cannot represent (:class:`LostText`)."""
    from pathlib import Path

    files, lost = data_files(data, validation_data), LostText()
    train = tokenize_files(files["train"], row_tokenizer, progress, lost)
    if files["validation"]:
        validation = tokenize_files(files["validation"], row_tokenizer, progress, lost)
    else:
        train, validation = train.hold_out()
    return train, validation, {
        "source": str(Path(data).resolve()),
        "files": {split: ({str(p): why for p, why in found.items()} if split == "skipped"
                          else [str(p) for p in found]) for split, found in files.items()},
        "validation_split": ("files" if files["validation"] else
                             f"the last {HELD_OUT:.0%} of the rows held out (at least 1)"),
        "lost_characters": dataclasses.asdict(lost),
        "loss_on": row_tokenizer.loss_on or "each row's default (" + ", ".join(
            f"{kind}: {on}" for kind, on in DEFAULT_LOSS_ON.items()) + ")"}
