"""docs/design.md's "A batch's path" cannot rot: each row's ``file:line`` is the line that defines
the function the row names (its qualified name, ``Class.method``, read from the file's syntax
tree), and the rows and files the section counts are the table's. Text and ``ast`` only: nothing
is imported, so the check is fast."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w/.]+\.py):(\d+)`\s*\|\s*`([\w.]+)`\s*\|")
COUNTS = re.compile(r"\*\*(\d+) rows, (\d+)\s+files\*\*")


def section(title: str = "## A batch's path") -> str:
    """The text of ``title``'s section of docs/design.md, up to the next ``## `` heading."""
    page = (ROOT / "docs" / "design.md").read_text()
    start = page.index(title + "\n")
    end = page.find("\n## ", start + len(title))
    return page[start:end if end >= 0 else len(page)]


def rows(text: str) -> list[tuple[int, str, int, str]]:
    """``(hop, file, line, function)`` of each table row."""
    return [(int(m[1]), m[2], int(m[3]), m[4])
            for m in map(ROW.match, text.splitlines()) if m]


def definitions(source: str) -> dict[int, str]:
    """Line of each ``def`` (decorators aside) -> its qualified name (``Class.method``)."""
    found: dict[int, str] = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    found[child.lineno] = name
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return found


def test_the_rows_are_numbered_in_order_and_the_counts_are_the_tables():
    text = section()
    table = rows(text)
    assert table, "no rows found in docs/design.md's \"A batch's path\" table"
    assert [hop for hop, *_ in table] == list(range(1, len(table) + 1))
    counts = COUNTS.search(text)
    assert counts, "the section states its counts as **N rows, M files**"
    assert (int(counts[1]), int(counts[2])) == (len(table), len({f for _, f, _, _ in table}))


def test_each_row_names_the_function_defined_at_its_line():
    wrong = []
    for hop, file, line, function in rows(section()):
        path = ROOT / file
        if not path.is_file():
            wrong.append(f"hop {hop}: {file} does not exist")
            continue
        defined = definitions(path.read_text())
        if defined.get(line) != function:
            where = [n for n, f in sorted(defined.items()) if f == function]
            wrong.append(f"hop {hop}: {file}:{line} defines {defined.get(line)!r}, not "
                         f"{function!r}" + (f" (now at line {where[0]})" if where else
                                            " (no such function in the file)"))
    assert not wrong, "docs/design.md's batch path is out of date:\n" + "\n".join(wrong)


def test_the_check_fails_on_a_moved_function():
    """The check itself: a row whose line is off by one is caught."""
    hop, file, line, function = rows(section())[0]
    defined = definitions((ROOT / file).read_text())
    assert defined.get(line) == function and defined.get(line + 1) != function
