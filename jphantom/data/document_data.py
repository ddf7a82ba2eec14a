"""A run's dataset files (``--data`` with JSON Lines, JSON, Parquet or Arrow files, and
``--val-data``) read and tokenised into one value, :class:`DocumentData`: the training and
validation :class:`~jphantom.data.documents.Documents`, what results.json records of them, and
the pad id. Whoever prepares a run reads it once (:func:`read_document_data`), before anything
compiles, so a bad row is refused first; checks it (:meth:`DocumentData.check`); and hands it to
the training source (:class:`jphantom.loop.sources.DocumentSource`), which packs or pads it."""

from __future__ import annotations

import dataclasses
import warnings

from jphantom.data.chat_template import tokenizer_and_template
from jphantom.data.documents import Documents, LostText, RowTokenizer, read_documents
from jphantom.errors import ConfigError, JPhantomWarning


@dataclasses.dataclass(frozen=True)
class DocumentData:
    """The documents of a run's dataset files: ``train`` and ``validation``; ``source``, what
    results.json records (:func:`jphantom.data.documents.read_documents`'s description, with the
    tokenizer and the chat template's file); ``pad_id``, the id padded rows are filled with."""

    train: Documents
    validation: Documents
    source: dict
    pad_id: int

    def lost_text(self) -> str | None:
        """One line on the characters the tokenizer could not represent (None: none)."""
        return LostText(**self.source["lost_characters"]).message(self.source["tokenizer"])

    def check(self, seq_len: int, packed: bool, loss_on: str | None,
              refuse_lost_text: bool = False) -> None:
        """Characters the tokenizer cannot represent: a warning, a ConfigError with
        ``refuse_lost_text``; each split holding a target that counts in the rows the model sees
        (padded rows keep a document's first ``seq_len`` tokens; ``packed`` rows every token),
        else a ConfigError saying why there is nothing to learn."""
        lost = self.lost_text()
        if lost is not None and refuse_lost_text:
            raise ConfigError(f"--refuse-lost-text: {lost}")
        if lost is not None:
            warnings.warn(lost, JPhantomWarning, stacklevel=2)
        limit = None if packed else seq_len
        for split, documents in (("training", self.train), ("validation", self.validation)):
            if documents.summary(limit)["loss_tokens"] == 0:
                why = _why_none(documents, loss_on, seq_len)
                raise ConfigError(f"the {split} split has nothing to learn (0 loss tokens in "
                                  f"{documents.count} row(s)): {why}")


def read_document_data(data, tokenizer: str, val_data=None, chat_template: str | None = None,
                       loss_on: str | None = None, from_hf: str | None = None,
                       progress: bool = False) -> DocumentData:
    """Every row of ``data`` (and ``val_data``) read and tokenised, a bad one refused. The
    tokenizer: ``tokenizer`` (a ``tokenizer.json`` or its folder); the chat template:
    ``chat_template``, else the ``from_hf`` checkpoint's, else the tokenizer folder's; the
    special tokens (EOS appended to standard rows, the pad id) from the first of those folders'
    ``tokenizer_config.json``, else the tokenizer's end-of-text. ``progress``: a bar of the
    rows tokenised."""
    loaded, template, special = tokenizer_and_template(tokenizer, from_hf, chat_template)
    if chat_template and template is None:  # a folder without one
        raise ConfigError(f"chat_template={chat_template!r} is a folder without a "
                          "chat_template.jinja or a tokenizer_config.json with a 'chat_template': "
                          "give the template's .jinja file, or the checkpoint folder that has one")
    ids = getattr(getattr(loaded, "tokenizer", None), "token_to_id", lambda token: None)
    eos = ids(special["eos_token"]) if "eos_token" in special else None
    eos = loaded.eot if eos is None else eos
    pad = ids(special["pad_token"]) if "pad_token" in special else None
    train, validation, source = read_documents(data, RowTokenizer(loaded, template, eos, loss_on),
                                               val_data, progress)
    source.update(tokenizer=tokenizer, chat_template=None if template is None else template.name)
    return DocumentData(train, validation, source, pad if pad is not None else eos or 0)


def _why_none(documents: Documents, loss_on: str | None, seq_len: int) -> str:
    """Why ``documents`` have no loss token in their rows, and the fix."""
    counted = documents.targets >= 0
    if counted.any():  # only past the rows' end
        start = int(documents.offsets()[counted].min())
        return (f"every loss token lies past the first {seq_len} tokens of its document, where "
                f"a padded row of --seq-len {seq_len} ends (the earliest is token {start}): give "
                f"--seq-len {start + 1} or more, or --pack")
    if loss_on in ("assistant", "completion"):
        answer = "assistant turn" if loss_on == "assistant" else "completion"
        return (f"no row has an {answer} for --loss-on {loss_on}: give rows with answers, "
                "or --loss-on all")
    return "every row is at most one token (a text of '' is its EOS alone): give rows with text"
