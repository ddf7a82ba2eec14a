"""The tokenizer a run's dataset files (``--data`` with JSON Lines, JSON, Parquet or Arrow files)
go through, a cheap check of the configuration: the files themselves are read and tokenised by the
data layer (:func:`jphantom.data.document_data.read_document_data`), once per run, by whoever
prepares it (:func:`jphantom.loop.sources.document_data`)."""

from __future__ import annotations

from pathlib import Path

from jphantom.errors import ConfigError


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
