"""Docs that cannot rot: every ``jphantom.X`` dotted name written in the README, the docs and the
library's own docstrings and comments resolves to a module or an attribute that exists."""

from __future__ import annotations

import importlib
import pathlib
import re
import warnings

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAME = re.compile(r"(?<![\w./-])jphantom(?:\.[A-Za-z_]\w*)+(?![\w/-])")
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
           *sorted((ROOT / "jphantom").rglob("*.py"))]


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute (a dataclass field included) of the
    longest importable module before it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():  # a renamed module's deprecated alias resolves too
                warnings.simplefilter("ignore", DeprecationWarning)
                found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            fields = getattr(found, "__dataclass_fields__", {})
            if hasattr(found, name):
                found = getattr(found, name)
            elif name in fields or name in getattr(found, "__annotations__", {}):
                return True
            else:
                return False
        return True
    return False


def test_every_dotted_jphantom_name_in_the_docs_and_docstrings_resolves():
    names: dict[str, list[str]] = {}
    for path in SOURCES:
        text = path.read_text()
        for number, line in enumerate(text.splitlines(), 1):
            for match in NAME.finditer(line):
                names.setdefault(match[0].rstrip("."), []).append(
                    f"{path.relative_to(ROOT)}:{number}")
    broken = {name: where for name, where in names.items() if not resolves(name)}
    assert not broken, "names that do not resolve:\n" + "\n".join(
        f"  {name}  ({', '.join(where[:3])})" for name, where in sorted(broken.items()))
    assert len(names) > 100  # the scan found the docs' names
