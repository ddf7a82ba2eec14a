"""Data sets. :mod:`jphantom.data.teacher` is Seal et al.'s synthetic teacher; :mod:`jphantom.data.text`
is an offline byte-level text corpus (the Python standard library by default) for a small GPT;
:mod:`jphantom.data.tokenizers` loads tokenizers from local files (the bundled BPE, a
``tokenizer.json``, tiktoken) and :mod:`jphantom.data.tokens` reads and writes flat token files
(llm.c's, nanoGPT's) with a resumable, per-process batch reader."""

from jphantom.data.teacher import Teacher, TeacherConfig
from jphantom.data.text import TextConfig, TextCorpus

__all__ = ["Teacher", "TeacherConfig", "TextConfig", "TextCorpus"]
