"""Data sets. :mod:`jphantom.data.teacher` is seed 000's synthetic teacher; :mod:`jphantom.data.text`
is an offline byte-level text corpus (the Python standard library by default) for a small GPT."""

from jphantom.data.teacher import Teacher, TeacherConfig
from jphantom.data.text import TextConfig, TextCorpus

__all__ = ["Teacher", "TeacherConfig", "TextConfig", "TextCorpus"]
