"""What a run reads and writes on this machine, checked before anything is built: its output
folders can be made and written, its data is readable, its tokenizer loads, and the model's
vocabulary holds every id the data gives. The one part of the configuration that looks at the
file system: constructing a configuration does not (:meth:`RunConfig.build` calls these)."""

import functools
import os
from pathlib import Path

from jphantom.errors import ConfigError


@functools.lru_cache(maxsize=64)  # once per process and set of paths: build() runs it each time
def check_paths(out, checkpoint_dir, save_hf, data, tokenizer) -> None:
    """What a run reads and writes, on this machine: the output folders can be made and written,
    ``data`` is readable, the tokenizer loads (:meth:`TrainConfig.check_paths`)."""
    for name, value in (("out", out), ("checkpoint_dir", checkpoint_dir), ("save_hf", save_hf)):
        if value is not None:
            _writable_folder(name, value)
    if data is not None:
        _readable_data(data)
    if tokenizer is not None:
        from jphantom.data.tokenizers import load_tokenizer

        load_tokenizer(tokenizer)  # on this machine, readable, its library installed


def check_document_options(data, pack: bool, loss_on, chat_template, val_data=None,
                           refuse_lost_text: bool = False) -> None:
    """``--pack``, ``--loss-on``, ``--chat-template``, ``--val-data`` and ``--refuse-lost-text``
    apply to dataset files (documents), not to text or token files; a ``--chat-template`` file
    exists and ``--val-data`` is dataset files."""
    given = [flag for flag, value in (("--pack", pack), (f"--loss-on {loss_on}", loss_on),
                                      ("--chat-template", chat_template),
                                      ("--val-data", val_data),
                                      ("--refuse-lost-text", refuse_lost_text)) if value]
    if not given and val_data is None:
        return
    from jphantom.data.dataset_files import is_dataset_data  # (jax: only when asked)

    if given and not is_dataset_data(data):
        what = "the standard library's text" if data is None else f"data={data!r}"
        raise ConfigError(f"{given[0]} applies to dataset files (.jsonl, .json, .parquet, "
                          f".arrow), whose rows are documents; {what} has none: give such a "
                          f"file, or leave {given[0].split()[0]} out")
    if val_data is not None and not (Path(val_data).exists() and is_dataset_data(val_data)):
        raise ConfigError(f"val_data={val_data!r} is not a dataset file (.jsonl, .json, .parquet, "
                          ".arrow) or a folder of them")
    if chat_template is not None and not Path(chat_template).exists():
        raise ConfigError(f"chat_template={chat_template!r} does not exist: give a .jinja file, a "
                          "tokenizer_config.json or a checkpoint folder")


def _readable_data(value: str) -> None:
    """``--data`` is a readable file (text, tokens or dataset rows) or a folder of token or
    dataset files."""
    data = Path(value)
    if data.is_dir():
        if not any(data.glob("*.bin")):
            from jphantom.data.dataset_files import is_dataset_data  # (jax: only when asked)

            if not is_dataset_data(value):
                raise ConfigError(f"data={value!r} is a folder without .bin token files or "
                                  "dataset files (.jsonl, .json, .parquet, .arrow): write token "
                                  "files with `jphantom tokenize`, or give a text file")
        return
    if not data.is_file() or not os.access(data, os.R_OK):
        raise ConfigError(f"data={value!r} is not a readable file or folder: give a text file, a "
                          "token file (.bin) or a folder of them (or leave --data out for the "
                          "Python standard library's sources)")
    if data.suffix != ".bin":
        from jphantom.data.dataset_files import is_dataset_data

        if not is_dataset_data(value):
            from jphantom.data.tokens import check_text_file

            check_text_file("data", data)


def check_vocabulary(config) -> None:
    """Before anything is built or compiled: the data and tokenizer of ``config`` (a
    :class:`RunConfig`) apply to a language model, and its vocabulary holds every id they give
    (the tokenizer's ids; a token file's largest id among its first 16M tokens per file; 256 for
    bytes); a ConfigError naming the fix."""
    train = config.train
    if not config.model.family.is_language_model:
        if train.data is not None or train.tokenizer is not None:
            raise ConfigError("--data and --tokenizer feed language models (--model gpt2 or "
                              "llama); the FFN trains on Seal et al.'s teacher: leave them out")
        return
    from jphantom.data import tokens
    from jphantom.data.dataset_files import is_dataset_data

    if train.tokenizer is not None or is_dataset_data(train.data):
        from jphantom.config.dataset import dataset_tokenizer
        from jphantom.data.tokenizers import load_tokenizer

        value = dataset_tokenizer(config)
        need = load_tokenizer(value).vocab_size
        what = f"tokenizer={value!r} ({need} ids)"
    elif train.data is not None and tokens.is_token_data(train.data):
        train_files, validation_files = tokens.token_files(train.data)
        need = tokens.max_token([f.tokens() for f in train_files + validation_files]) + 1
        what = f"the token ids of data={train.data!r} (up to {need - 1})"
    else:
        need, what = 256, "byte-level text (256 ids)"
    vocab = config.family_config().vocab_size
    if vocab < need:
        if config.model.from_hf:
            raise ConfigError(f"the checkpoint's vocabulary ({vocab}) is smaller than {what}: "
                              "use the tokenizer the checkpoint was trained with")
        raise ConfigError(f"vocab={vocab} is smaller than {what}: pass --vocab {need} (or more)")


def _writable_folder(name: str, value: str) -> None:
    """``value`` is a folder or can be made one: not an existing file, and its nearest existing
    ancestor a folder this process can write in."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{name}={value!r} is an existing file: give a folder")
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or not _can_create(
            parent):
        raise ConfigError(f"{name}={value!r}: {str(parent)!r} is not a folder this process can "
                          "write in: pick another path")


def _can_create(folder: Path) -> bool:
    """Whether a folder can be made in ``folder`` (tried: ``os.access`` says yes for root in
    /proc or on a read-only mount)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".jphantom-probe-", dir=folder))
    except OSError:
        return False
    return True
