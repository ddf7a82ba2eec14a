"""Data sets. :mod:`jphantom.data.teacher` is Seal et al.'s synthetic teacher; :mod:`jphantom.data.text`
is an offline byte-level text corpus (the Python standard library by default) for a small GPT;
:mod:`jphantom.data.tokenizers` loads tokenizers from local files (the bundled BPE, a
``tokenizer.json``, tiktoken) and :mod:`jphantom.data.tokens` reads and writes flat token files
(llm.c's, nanoGPT's) with a resumable, per-process batch reader.

Fine-tuning data, for a loop of one's own as for ``jphantom train``:
:mod:`jphantom.data.dataset_files` streams the rows of JSON Lines, JSON, Parquet and Arrow files
(:func:`read_rows`, :func:`split_files`); :mod:`jphantom.data.chat_template` renders a
checkpoint's chat template as transformers does (:class:`ChatTemplate`,
:func:`load_chat_template`); :mod:`jphantom.data.documents` tokenises rows into documents with
the loss on the answers (:class:`RowTokenizer`, :class:`Documents`, :func:`read_documents`);
:mod:`jphantom.data.document_data` reads a run's dataset files into one value
(:func:`read_document_data`, :class:`DocumentData`: the documents of both splits, checked); and
:mod:`jphantom.data.packing` packs or pads them into ``(tokens, targets, segment_ids,
positions)`` batches with a resumable position (:class:`DocumentBatches`, :func:`pack`,
:func:`pad`)."""

from jphantom.data.chat_template import ChatTemplate, load_chat_template
from jphantom.data.dataset_files import read_rows, split_files
from jphantom.data.document_data import DocumentData, read_document_data
from jphantom.data.documents import Documents, RowTokenizer, read_documents
from jphantom.data.packing import DocumentBatches, pack, pad
from jphantom.data.teacher import Teacher, TeacherConfig
from jphantom.data.text import TextConfig, TextCorpus

__all__ = ["ChatTemplate", "DocumentBatches", "DocumentData", "Documents", "RowTokenizer",
           "Teacher", "TeacherConfig", "TextConfig", "TextCorpus", "load_chat_template",
           "pack", "pad", "read_document_data", "read_documents", "read_rows", "split_files"]
