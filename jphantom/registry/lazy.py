"""A reference to a module's attribute, imported when it is first read: how a registry row that
imports no jax (a :class:`jphantom.registry.families.Family`, a :class:`jphantom.registry.strategies.Strategy`)
names what needs jax or sits in a higher layer (an NNX module, a checkpoint reader, a cost
model's formulas)."""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Lazy:
    """The attribute ``attribute`` of the module ``module``, imported when a registry field given
    as it is first read (module docstring)."""

    module: str
    attribute: str

    def load(self):
        """The attribute, its module imported."""
        return getattr(importlib.import_module(self.module), self.attribute)


def resolved(row, name: str):
    """The field ``name`` of the frozen registry row ``row``; a :class:`Lazy` one is imported on
    this first read and kept as the field's value (a row's ``__getattribute__`` calls this)."""
    value = object.__getattribute__(row, name)
    if isinstance(value, Lazy):
        value = value.load()
        object.__setattr__(row, name, value)
    return value
