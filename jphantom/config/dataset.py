"""A run's dataset files (``--data`` with JSON Lines, JSON, Parquet or Arrow files), read and
tokenised once per process: the configuration's checks read them before anything compiles (a bad
row is refused first) and the training source (:class:`jphantom.loop.sources.DocumentSource`) packs or
pads the same documents."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import numpy as np

from jphantom.errors import ConfigError, JPhantomWarning


def dataset_tokenizer(config) -> str:
    """The tokenizer dataset files go through: ``--tokenizer``, else the ``--from-hf``
    checkpoint's ``tokenizer.json``; a ConfigError when there is neither."""
    train = config.train
    if train.tokenizer is not None:
        return train.tokenizer
    if config.model.from_hf and (Path(config.model.from_hf) / "tokenizer.json").is_file():
        return config.model.from_hf
    raise ConfigError(f"data={train.data!r} holds text to tokenise: give --tokenizer (a "
                      "tokenizer.json or its folder), or --from-hf a checkpoint folder with its "
                      "tokenizer.json")


def read_document_data(config):
    """(train documents, validation documents, description, pad id) of ``config``'s dataset
    files, read and tokenised once per process for the same files and settings (the
    configuration's checks read them before anything compiles: a bad row is refused first). The
    tokenizer: ``--tokenizer``, else the ``--from-hf`` checkpoint's; the chat template:
    ``--chat-template``, else the checkpoint's, else the tokenizer folder's; the special tokens
    (EOS appended to standard rows, the pad id) from the first of those folders'
    ``tokenizer_config.json``, else the tokenizer's end-of-text."""
    from jphantom.data.dataset_files import split_files

    train = config.train
    value = dataset_tokenizer(config)
    files = [p for split in split_files(train.data)[:2] for p in split]
    if train.val_data is not None:
        files += [p for split in split_files(train.val_data)[:2] for p in split]
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    return _document_data(train.data, train.val_data, value, train.chat_template, train.loss_on,
                          config.model.from_hf, stamp, train.progress)


def check_document_data(config) -> None:
    """Before anything is built: every row of ``config``'s dataset files read and tokenised (a
    bad one refused, :func:`read_document_data`; characters the tokenizer cannot represent a
    warning, refused with ``--refuse-lost-text``), and each split holding a target that counts
    in the rows the model sees (padded rows keep a document's first ``seq_len`` tokens; packed
    rows every token); else a ConfigError saying why there is nothing to learn."""
    from jphantom.data.documents import LostText

    first, held, source, _ = read_document_data(config)
    lost = LostText(**source["lost_characters"]).message(source["tokenizer"])
    if lost is not None and config.train.refuse_lost_text:
        raise ConfigError(f"--refuse-lost-text: {lost}")
    if lost is not None:
        warnings.warn(lost, JPhantomWarning, stacklevel=2)
    model = config.model
    seq_len = min(getattr(config.family_config(), "seq_len", model.seq_len), model.seq_len)
    limit = None if config.train.pack else seq_len
    for split, documents in (("training", first), ("validation", held)):
        if documents.summary(limit)["loss_tokens"] == 0:
            why = _why_none(documents, config.train, seq_len)
            raise ConfigError(f"the {split} split has nothing to learn (0 loss tokens in "
                              f"{documents.count} row(s)): {why}")


def _why_none(documents, train, seq_len: int) -> str:
    """Why ``documents`` have no loss token in their rows, and the fix."""
    counted = documents.targets >= 0
    if counted.any():  # only past the rows' end
        start = int(documents.offsets()[counted].min())
        return (f"every loss token lies past the first {seq_len} tokens of its document, where "
                f"a padded row of --seq-len {seq_len} ends (the earliest is token {start}): give "
                f"--seq-len {start + 1} or more, or --pack")
    if train.loss_on in ("assistant", "completion"):
        answer = "assistant turn" if train.loss_on == "assistant" else "completion"
        return (f"no row has an {answer} for --loss-on {train.loss_on}: give rows with answers, "
                "or --loss-on all")
    return "every row is at most one token (a text of '' is its EOS alone): give rows with text"


@functools.lru_cache(maxsize=4)
def _document_data(data, val_data, value, chat_template, loss_on, from_hf, stamp, progress):
    from jphantom.data.chat_template import tokenizer_and_template
    from jphantom.data.documents import RowTokenizer, read_documents

    del stamp  # part of the cache's key only: a file that changed is read again
    tokenizer, template, special = tokenizer_and_template(value, from_hf, chat_template)
    if chat_template and template is None:  # a folder without one
        raise ConfigError(f"chat_template={chat_template!r} is a folder without a "
                          "chat_template.jinja or a tokenizer_config.json with a 'chat_template': "
                          "give the template's .jinja file, or the checkpoint folder that has one")
    ids = getattr(getattr(tokenizer, "tokenizer", None), "token_to_id", lambda token: None)
    eos = ids(special["eos_token"]) if "eos_token" in special else None
    eos = tokenizer.eot if eos is None else eos
    pad = ids(special["pad_token"]) if "pad_token" in special else None
    first, held, source = read_documents(data, RowTokenizer(tokenizer, template, eos, loss_on),
                                         val_data, progress)
    source.update(tokenizer=value, chat_template=None if template is None else template.name)
    return first, held, source, pad if pad is not None else eos or 0
