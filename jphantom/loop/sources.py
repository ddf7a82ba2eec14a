"""The data a training run reads, as host arrays its loop places on the mesh: byte-level text
(:class:`TextSource`), tokens from files or through a tokenizer (:class:`TokenSource`, whose
reader's position is saved in checkpoints and restored on resume), dataset files' documents
(:class:`DocumentSource`, read once per run by :func:`document_data`) and Seal et al.'s teacher
task for the FFN (:class:`TeacherSource`). Each has ``train(step)``, ``validation()``, ``describe()``
and ``tokens_per_batch``; a source with a position also ``state()`` and ``restore(state)``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from jphantom.config import RunConfig
from jphantom.data.document_data import DocumentData
from jphantom.errors import ConfigError


class TextSource:
    """Byte-level text (:mod:`jphantom.data.text`): batches of ``[batch, seq_len]`` tokens, a
    pure function of (seed, step)."""

    def __init__(self, config: RunConfig, seq_len: int):
        from jphantom.data.text import TextConfig, TextCorpus
        self.corpus = TextCorpus(TextConfig(path=config.train.data, seq_len=seq_len,
                                            seed=config.train.seed))
        self.batch, self.eval_batches = config.train.batch, config.train.eval_batches
        self.tokens_per_batch = config.train.batch * seq_len

    def train(self, step):
        return self.corpus.train_batch(step, self.batch)

    def validation(self):
        return self.corpus.validation_batches(self.batch, self.eval_batches)

    def unigram_cross_entropy(self):
        return self.corpus.unigram_cross_entropy()

    def describe(self):
        return self.corpus.describe()


class _ReaderSource:
    """A source whose batches come from a reader with an explicit position (``self.batches``:
    :class:`jphantom.data.tokens.TokenBatches` or :class:`jphantom.data.packing.DocumentBatches`),
    saved in checkpoints (:meth:`state`) and restored on resume; ``self.rows``: the rows of each
    global batch this process reads."""

    def train(self, step):
        del step  # the reader's position says where the next batch is
        return self.batches.next_batch(self.rows)

    def validation(self):
        return self.batches.validation_batches(self.eval_batches)

    def state(self) -> dict:
        return self.batches.state()

    def restore(self, state: dict) -> None:
        self.batches.restore(state)

    def unigram_cross_entropy(self):
        return self.batches.unigram_cross_entropy()

    def describe(self):
        return self.batches.describe()


class TokenSource(_ReaderSource):
    """Tokens (:mod:`jphantom.data.tokens`): token files (``--data`` a ``.bin`` file or a folder
    of them), or text (``--data`` a text file, or the standard library) through ``--tokenizer``.
    Batches come from a reader with an explicit position, saved in checkpoints (:meth:`state`)
    and restored on resume; ``rows``: the rows of each global batch this process reads (default
    all)."""

    def __init__(self, config: RunConfig, seq_len: int, rows: slice | None = None):
        from jphantom.data import tokens
        from jphantom.data.text import TextConfig, TextCorpus

        train = config.train
        vocab = None
        if train.tokenizer is not None:
            from jphantom.data.tokenizers import load_tokenizer
            vocab = load_tokenizer(train.tokenizer).vocab_size
        if train.data is not None and tokens.is_token_data(train.data):
            train_files, validation_files = tokens.token_files(train.data)
            arrays = [f.tokens() for f in train_files]
            held = [f.tokens() for f in validation_files]
            if not held:
                arrays, held = tokens.hold_out(arrays, TextConfig.validation_fraction)
            source = {"source": str(Path(train.data).resolve()), "files": {
                "train": [_below(f.path, train.data) for f in train_files],
                "validation": [_below(f.path, train.data) for f in validation_files]},
                "format": sorted({f.format for f in train_files + validation_files}),
                "validation_split": "files" if validation_files else "last tokens held out"}
        else:
            corpus = TextCorpus(TextConfig(path=train.data, seq_len=seq_len, seed=train.seed))
            first, second = tokens.tokenize_corpus(corpus, train.tokenizer,
                                                   progress=train.progress)
            arrays, held = [first], [second]
            source = {"source": corpus.describe()["source"], "split": corpus.describe()["split"]}
        source["tokenizer"] = train.tokenizer
        self.batches = tokens.TokenBatches(arrays, held, seq_len=seq_len, batch=train.batch,
                                           seed=train.seed, vocab_size=vocab, source=source)
        self.rows, self.eval_batches = rows, train.eval_batches
        self.tokens_per_batch = train.batch * seq_len
        self.batches.validation_batches(self.eval_batches)  # enough held out? (before training)


class DocumentSource(_ReaderSource):
    """Dataset files (:mod:`jphantom.data.dataset_files`): ``documents``, the rows read and
    tokenised with the loss on ``--loss-on``'s tokens (:func:`document_data`, once per run),
    packed or padded into ``(tokens, targets, segment_ids, positions)`` batches by a reader whose
    position is saved in checkpoints (:mod:`jphantom.data.packing`)."""

    arrays = 4  # the batch arrays: jphantom.models.packed_lm_loss's

    def __init__(self, config: RunConfig, seq_len: int, documents: DocumentData,
                 rows: slice | None = None):
        from jphantom.data.packing import DocumentBatches

        train = config.train
        self.batches = DocumentBatches(documents.train, documents.validation, seq_len=seq_len,
                                       batch=train.batch, packed=train.pack, seed=train.seed,
                                       pad_id=documents.pad_id, source=documents.source)
        self.rows, self.eval_batches = rows, train.eval_batches
        self.tokens_per_batch = train.batch * seq_len

    def save_tokenizer(self, folder) -> None:
        """Beside a ``--save-hf`` checkpoint: the tokenizer's files (``tokenizer.json``,
        ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja`` of its
        folder) and, when the template came from elsewhere, that template as
        ``chat_template.jinja`` (which transformers reads before the config's), so the folder
        loads as a chat model with the template it was tuned with."""
        import shutil

        value = Path(self.batches.source["tokenizer"])
        home = value if value.is_dir() else value.parent
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                     "chat_template.jinja"):
            found = value if name == "tokenizer.json" and value.is_file() else home / name
            if found.is_file() and not (Path(folder) / name).exists():
                shutil.copyfile(found, Path(folder) / name)
        template = self.batches.source.get("chat_template")
        if template is not None and Path(template).parent.resolve() != home.resolve():
            from jphantom.data.chat_template import TEMPLATE_FILE, load_chat_template

            (Path(folder) / TEMPLATE_FILE).write_text(load_chat_template(template).source)


def document_data(config: RunConfig) -> DocumentData | None:
    """The run's dataset files read and tokenised, once, by whoever prepares the run, before
    anything compiles (:func:`jphantom.data.document_data.read_document_data`: a bad row is
    refused first), and checked for the rows the model sees (:meth:`DocumentData.check`: lost
    characters, something to learn); None when ``--data`` is not dataset files."""
    from jphantom.config.dataset import dataset_tokenizer
    from jphantom.data.dataset_files import is_dataset_data
    from jphantom.data.document_data import read_document_data

    train, model = config.train, config.model
    if not model.family.is_language_model or not is_dataset_data(train.data):
        return None
    documents = read_document_data(train.data, dataset_tokenizer(config), train.val_data,
                                   train.chat_template, train.loss_on, model.from_hf,
                                   train.progress)
    seq_len = min(getattr(config.family_config(), "seq_len", model.seq_len), model.seq_len)
    documents.check(seq_len, train.pack, train.loss_on, train.refuse_lost_text)
    return documents


def text_source(config: RunConfig, seq_len: int, rows: slice | None = None,
                documents: DocumentData | None = None):
    """The data of a language model: :class:`DocumentSource` for dataset files (``documents``,
    as whoever prepares the run read them with :func:`document_data`; read here when not
    given), :class:`TokenSource` for token files or a tokenizer, else byte-level
    :class:`TextSource` (the default)."""
    from jphantom.data.dataset_files import is_dataset_data
    from jphantom.data.tokens import is_token_data

    data = config.train.data
    if is_dataset_data(data):
        documents = documents if documents is not None else document_data(config)
        return DocumentSource(config, seq_len, documents, rows)
    if config.train.tokenizer is not None or (data is not None and is_token_data(data)):
        return TokenSource(config, seq_len, rows)
    return TextSource(config, seq_len)


class TeacherSource:
    """Seal et al.'s teacher task: ``[batch, width]`` inputs and the teacher's outputs; validation
    is the first ``eval_batches`` held-out batches (every one of them with a teacher given)."""

    def __init__(self, config: RunConfig, teacher=None):
        from jphantom.data import Teacher, TeacherConfig
        self.teacher = teacher or Teacher(TeacherConfig(width=config.model.width,
                                                        seed=config.train.seed),
                                          jax.numpy.dtype(config.model.dtype))
        if self.teacher.config.width != config.model.width:
            raise ConfigError(f"teacher width {self.teacher.config.width} != model width "
                              f"{config.model.width}")
        self.batch, self.eval_batches = config.train.batch, config.train.eval_batches
        self.everything = teacher is not None
        self.tokens_per_batch = config.train.batch

    def train(self, step):
        return self.teacher.train_batch(step, self.batch)

    def validation(self):
        for index, pair in enumerate(self.teacher.eval_batches(self.batch)):
            if index >= self.eval_batches and not self.everything:
                return
            yield pair

    def describe(self):
        return {"source": "Seal et al. teacher", **dataclasses.asdict(self.teacher.config)}


def process_rows(sharding, shape: tuple[int, ...]) -> slice | None:
    """With several processes: the rows of a global array of ``shape`` this process's devices
    hold under ``sharding``, when they are one contiguous block of whole rows (the reader then
    reads only those); else ``None`` (every process reads the whole batch)."""
    if jax.process_count() == 1:
        return None
    held = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if any(i.indices(n) != (0, n, 1) for i, n in zip(index[1:], shape[1:])):
            return None  # a device holds part of a row (its sequence split): read every row
        held.update(range(*index[0].indices(shape[0])))
    low, high = min(held), max(held) + 1
    return slice(low, high) if len(held) == high - low and high - low < shape[0] else None


def _below(path: str, data: str) -> str:
    """A token file's path below the ``--data`` folder (its name for a lone file)."""
    folder = Path(data)
    return Path(path).relative_to(folder).as_posix() if folder.is_dir() else Path(path).name
