"""The code counts a maintainability change is judged by, at any git revision: the longest
functions (and how many run over 80 lines), the comparisons of strategy names in the library
(the plans' style names, which share some of the words, and the ``spmd`` mode left out), and the
places each cross-option rule's message is written.

Usage::

    python benchmarks/code_counts.py                     # HEAD
    python benchmarks/code_counts.py 5142bd5 HEAD        # before and after, side by side

Results: printed, and ``benchmarks/results/code_counts/<commit>.json``.
"""

from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "code_counts"
NAMES = ("dense", "gspmd", "tensor", "tensor-t1", "phantom", "phantom-unfused", "pmm3d",
         "pmm3d-regather", "pmm3d-deferred")
_ALT = "|".join(re.escape(n) for n in sorted(NAMES, key=len, reverse=True))
# a strategy name compared with ==, !=, in, startswith, or a hand-kept group of names
COMPARISON = re.compile(
    rf"""\b(strategy|name)\w*\s*(==|!=|\bin\b|\bnot in\b)\s*["']({_ALT})["']"""
    rf"""|strateg\w*\.startswith\(["'](phantom|pmm3d|tensor)"""
    rf"""|\bin (PAIRED|PMM3D_WEIGHTS)\b|\(["']phantom["'], ["']phantom-unfused["']\)""")
NOT_STRATEGIES = re.compile(r"style\.name|s\.name|self\.name|spmd|op\.|eqn\.|primitive")
RULES = {
    "sequence parallelism needs tensor": r"sequence.parallel\w*\W+(\(--sequence-parallel\) )?"
                                         r"applies",
    "collective matmul needs SP": r"raise ConfigError\(\"collective.matmul\W",
    "DTD needs routed MoE under tensor": r"dtd \((--dtd, )?duplicate token dropping\) applies",
    "ghost width must be given": r"needs (--)?ghost.width",
    "dense runs in no stage": r"'dense' does not run inside pipeline stages|"
                              r"\{strategy!r\} does not run inside pipeline stages",
}


def sources(revision: str) -> Path:
    """The library's files at ``revision``, extracted to a temporary folder."""
    data = subprocess.run(["git", "archive", revision, "jphantom"], cwd=ROOT, check=True,
                          capture_output=True).stdout
    folder = Path(tempfile.mkdtemp())
    tarfile.open(fileobj=io.BytesIO(data)).extractall(folder)
    return folder / "jphantom"


def counts(revision: str) -> dict:
    root = sources(revision)
    files = sorted(root.rglob("*.py"))
    sizes = sorted(((node.end_lineno - node.lineno + 1, f"{p.relative_to(root)}::{node.name}")
                    for p in files for node in ast.walk(ast.parse(p.read_text()))
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))), reverse=True)
    where: dict[str, int] = {}
    for p in files:
        if p.relative_to(root).parts[0] == "plans":  # style names ("phantom", "pmm3d" layers)
            continue
        for line in p.read_text().splitlines():
            if COMPARISON.search(line) and not NOT_STRATEGIES.search(line):
                key = str(p.relative_to(root))
                where[key] = where.get(key, 0) + 1
    text = "\n".join(p.read_text() for p in files)
    return {"revision": revision,
            "longest_functions": [[n, name] for n, name in sizes[:10]],
            "functions_over_80_lines": sum(1 for n, _ in sizes if n > 80),
            "strategy_name_comparisons": sum(where.values()),
            "files_comparing_strategy_names": dict(sorted(where.items())),
            "rule_messages": {rule: len(re.findall(rx, text)) for rule, rx in RULES.items()}}


def main(revisions: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for revision in revisions or ["HEAD"]:
        result = counts(revision)
        sha = subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
        (OUT / f"{sha}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"== {revision}")
        print("longest functions:", ", ".join(f"{n} {name}"
                                             for n, name in result["longest_functions"]))
        print("functions over 80 lines:", result["functions_over_80_lines"])
        print(f"strategy-name comparisons: {result['strategy_name_comparisons']} in "
              f"{len(result['files_comparing_strategy_names'])} files "
              f"{result['files_comparing_strategy_names']}")
        for rule, n in result["rule_messages"].items():
            print(f"rule '{rule}': written in {n} place(s)")


if __name__ == "__main__":
    main(sys.argv[1:])
