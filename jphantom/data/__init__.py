"""Data sets. :mod:`jphantom.data.teacher` is seed 000's synthetic teacher."""

from jphantom.data.teacher import Teacher, TeacherConfig

__all__ = ["Teacher", "TeacherConfig"]
