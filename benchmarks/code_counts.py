r"""The code counts a maintainability change is judged by, at any git revision, all over
the library (``jphantom/``):

- **functions**: the longest, and how many run over 80 lines (the AST measure
  ``tests/test_layering.py`` exempts by name);
- **strategy-name comparisons** outside the registry (``registry/strategies.py``) and the plans' style
  names (``plans/``, which share some of the words): a line matching :data:`COMPARISON`, i.e. ::

      \b(strategy|name)\w*(["']\])?\s*(==|!=|in|not in)\s*["'](<a strategy name>)["']
      | strateg\w*\.startswith\(["'](phantom|pmm3d|tensor)
      | \bin (PAIRED|PMM3D_WEIGHTS)\b
      | \(["'](<a strategy name>)["'],\s*["'](<a strategy name>)["']     (a hand-kept group)

  and not :data:`NOT_STRATEGIES` (``style.name``, ``s.name``, ``self.name``, ``spmd``, the
  HLO's ``op.``/``eqn.``/``primitive``); ``r["strategy"] == "phantom"`` is one;
- **family-name comparisons** outside the registry (``registry/families.py``) and the families' own
  packages (``models/``): a line matching :data:`FAMILY_COMPARISON`, i.e. ::

      (==|!=|in|not in)\s*\(?["'](<a family name>)["'] | ["'](<a family name>)["']\s*(==|!=)
      | \(["'](<a family name>)["'],\s*["'](<a family name>)["']     (a hand-kept group)

  and not ``.program`` (a family's builder kind, which is spelled ``"ffn"`` too);
- **string-keyed reads** of a strategy or family: :data:`KEYED_READ`,
  ``\[["'](strategy|family)["']\]|\.get\(["'](strategy|family)["']`` (``r["strategy"]``), all
  of them and those compared on the same line (``r["strategy"] == "phantom"``);
- **modules at the package root** (``jphantom/*.py`` but ``__init__`` and ``__main__``), and the
  test files (``tests/**/test_*.py``) that sit flat in ``tests/`` rather than in a topic folder;
- **step data in module state**: ``contextvars.ContextVar`` objects made at module level, module
  names rebound through ``global``, and module-level lists, dicts and sets that a function
  mutates (``.append``, ``.pop``, ``[k] =``, ...); all of them listed, and those in the step's
  modules (:data:`STEP_MODULES`) counted as carrying step data;
- **``config.build()`` call sites**: a ``.build()`` with no argument on a receiver whose text
  names a configuration (``config``, ``RunConfig``, ``from_flags``), or ``self.build()`` inside
  ``config/`` (:data:`BUILD_CALL`);
- **classes sharing a name**: class names defined in more than one module;
- **facts written twice**: modules defining :data:`DEFINED_ONCE` functions (``lm_loss``,
  ``is_dataset_data``) and the files holding the H100's dense bf16 peak (a ``989.x`` literal in
  a module, or a device description's ``bf16 = { value = 989.x``);
- **rules**: the places each cross-option rule's message is written.

Usage::

    python benchmarks/code_counts.py                     # HEAD
    python benchmarks/code_counts.py 80f51fc HEAD        # before and after, side by side

Results: printed, and ``benchmarks/results/code_counts/<commit>.json`` and ``.txt``
(:func:`jphantom.analysis.machine.write_results`).
"""

from __future__ import annotations

import ast
import io
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
    rf"""\b(strategy|name)\w*(["']\])?\s*(==|!=|\bin\b|\bnot in\b)\s*["']({_ALT})["']"""
    rf"""|strateg\w*\.startswith\(["'](phantom|pmm3d|tensor)"""
    rf"""|\bin (PAIRED|PMM3D_WEIGHTS)\b|\(["']({_ALT})["'],\s*["']({_ALT})["']""")
NOT_STRATEGIES = re.compile(r"style\.name|\bs\.name|self\.name|\bspmd\b|\bop\.|eqn\.|primitive")
FAMILIES = ("ffn", "gpt2", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3")
_FAM = "|".join(re.escape(n) for n in sorted(FAMILIES, key=len, reverse=True))
# a family name compared with ==, !=, in, or a hand-kept group of family names
FAMILY_COMPARISON = re.compile(
    rf"""(==|!=|\bnot in\b|\bin\b)\s*\(?["']({_FAM})["']|["']({_FAM})["']\s*(==|!=)"""
    rf"""|\(["']({_FAM})["'],\s*["']({_FAM})["']""")
NOT_FAMILIES = re.compile(r"\.program\b")
KEYED_READ = re.compile(r"""\[["'](strategy|family)["']\]|\.get\(["'](strategy|family)["']""")
COMPARED = re.compile(r"==|!=")
BUILD_CALL = re.compile(r"(config|RunConfig|from_flags)\S*\.build\(\)")
STEP_MODULES = ("token_mean.py", "train_step.py", "zero.py", "precision.py", "remat.py", "fp8.py",
                "step/", "nn/", "models/", "loop/step")
"""The modules a training step runs (the step's own, its layers and models)."""
DEFINED_ONCE = ("lm_loss", "is_dataset_data")
_MUTATORS = {"append", "extend", "pop", "insert", "remove", "clear", "update", "add", "discard",
             "setdefault", "popitem"}
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
    """The library's files at ``revision``, extracted to a temporary folder (its tests beside
    it)."""
    data = subprocess.run(["git", "archive", revision, "jphantom", "tests"], cwd=ROOT, check=True,
                          capture_output=True).stdout
    folder = Path(tempfile.mkdtemp())
    tarfile.open(fileobj=io.BytesIO(data)).extractall(folder)
    return folder / "jphantom"


def module_state(tree: ast.Module) -> list[tuple[str, str]]:
    """A module's mutable state: (name, kind) for each ContextVar made at module level, each name
    a function rebinds through ``global``, and each module-level list, dict or set a function
    mutates."""
    found: dict[str, str] = {}
    containers = set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        value = getattr(node, "value", None)
        for t in targets:
            if not isinstance(t, ast.Name):
                continue
            if (isinstance(value, ast.Call) and isinstance(value.func, (ast.Name, ast.Attribute))
                    and (getattr(value.func, "attr", None) or getattr(value.func, "id", None))
                    == "ContextVar"):
                found[t.id] = "ContextVar"
            elif isinstance(value, (ast.List, ast.Dict, ast.Set)) or (
                    isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    and value.func.id in ("list", "dict", "set")):
                containers.add(t.id)
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                for name in node.names:
                    found.setdefault(name, "global")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in _MUTATORS and isinstance(node.func.value, ast.Name)
                  and node.func.value.id in containers):
                found.setdefault(node.func.value.id, "mutated container")
            elif (isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete))):
                for t in getattr(node, "targets", None) or [getattr(node, "target", None)]:
                    if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                            and t.value.id in containers):
                        found.setdefault(t.value.id, "mutated container")
    return sorted(found.items())


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
    trees = {str(p.relative_to(root)): ast.parse(p.read_text()) for p in files}
    lines = {str(p.relative_to(root)): p.read_text().splitlines() for p in files}

    families: dict[str, int] = {}
    keyed, keyed_compared = {}, {}
    builds: dict[str, int] = {}
    for key, body in lines.items():
        own = key.startswith("models/") or key in ("families.py", "registry/families.py")
        for line in body:
            code = line.split("#", 1)[0]
            if not own and FAMILY_COMPARISON.search(code) and not NOT_FAMILIES.search(code):
                families[key] = families.get(key, 0) + 1
            reads = len(KEYED_READ.findall(code))
            if reads:
                keyed[key] = keyed.get(key, 0) + reads
                if COMPARED.search(code):
                    keyed_compared[key] = keyed_compared.get(key, 0) + reads
            if BUILD_CALL.search(code) or (key.startswith("config/") and "self.build()" in code):
                builds[key] = builds.get(key, 0) + 1

    state = {f"{key}::{name}": kind for key, tree in trees.items()
             for name, kind in module_state(tree)}
    step_state = {k: v for k, v in state.items() if k.startswith(STEP_MODULES)}

    classes: dict[str, list[str]] = {}
    defined: dict[str, list[str]] = {name: [] for name in DEFINED_ONCE}
    for key, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(key)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in defined:
                defined[node.name].append(key)
    shared = {name: sorted(set(where)) for name, where in sorted(classes.items())
              if len(set(where)) > 1}
    peaks = sorted([key for key, body in lines.items()
                    if any(re.search(r"\b989\.\d", line.split("#", 1)[0]) for line in body)]
                   + [str(p.relative_to(root)) for p in root.rglob("*.toml")
                      if re.search(r"^bf16 = \{ value = 989\.", p.read_text(), re.M)])
    root_modules = sorted(p.name for p in root.glob("*.py")
                          if p.name not in ("__init__.py", "__main__.py"))
    test_files = sorted(root.parent.joinpath("tests").rglob("test_*.py"))
    flat_tests = [p for p in test_files if p.parent == root.parent / "tests"]

    return {"revision": revision,
            "longest_functions": [[n, name] for n, name in sizes[:10]],
            "functions_over_80_lines": sum(1 for n, _ in sizes if n > 80),
            "strategy_name_comparisons": sum(where.values()),
            "files_comparing_strategy_names": dict(sorted(where.items())),
            "family_name_comparisons": sum(families.values()),
            "files_comparing_family_names": dict(sorted(families.items())),
            "strategy_or_family_keyed_reads": sum(keyed.values()),
            "strategy_or_family_keyed_reads_compared": sum(keyed_compared.values()),
            "files_reading_strategy_or_family_keys": dict(sorted(keyed.items())),
            "root_modules": len(root_modules),
            "root_module_names": root_modules,
            "test_files": len(test_files),
            "test_files_flat_in_tests": len(flat_tests),
            "module_state": len(state),
            "module_state_carrying_step_data": len(step_state),
            "module_state_names": state,
            "config_build_call_sites": sum(builds.values()),
            "files_calling_config_build": dict(sorted(builds.items())),
            "classes_sharing_a_name": len(shared),
            "shared_class_names": shared,
            "defined_more_than_once": {n: w for n, w in defined.items()},
            "files_with_an_h100_peak": peaks,
            "rule_messages": {rule: len(re.findall(rx, text)) for rule, rx in RULES.items()}}


def table(result: dict) -> list[str]:
    """The counts, a line each."""
    out = [f"== {result['revision']}",
           "longest functions: " + ", ".join(f"{n} {name}"
                                             for n, name in result["longest_functions"]),
           f"functions over 80 lines: {result['functions_over_80_lines']}",
           f"strategy-name comparisons: {result['strategy_name_comparisons']} in "
           f"{len(result['files_comparing_strategy_names'])} files "
           f"{result['files_comparing_strategy_names']}",
           f"family-name comparisons: {result['family_name_comparisons']} in "
           f"{len(result['files_comparing_family_names'])} files "
           f"{result['files_comparing_family_names']}",
           f"r['strategy']/r['family'] reads: {result['strategy_or_family_keyed_reads']} "
           f"({result['strategy_or_family_keyed_reads_compared']} compared) "
           f"{result['files_reading_strategy_or_family_keys']}",
           f"modules at the package root: {result['root_modules']}",
           f"test files flat in tests/: {result['test_files_flat_in_tests']} of "
           f"{result['test_files']}",
           f"module state: {result['module_state']}, carrying step data "
           f"{result['module_state_carrying_step_data']} {result['module_state_names']}",
           f"config.build() call sites: {result['config_build_call_sites']} "
           f"{result['files_calling_config_build']}",
           f"classes sharing a name: {result['classes_sharing_a_name']} "
           f"{result['shared_class_names']}",
           f"defined more than once: {result['defined_more_than_once']}",
           f"files with an H100 peak (989.x): {result['files_with_an_h100_peak']}"]
    out += [f"rule '{rule}': written in {n} place(s)" for rule, n in result["rule_messages"].items()]
    return out


def main(revisions: list[str]) -> None:
    from jphantom.analysis.machine import write_results

    OUT.mkdir(parents=True, exist_ok=True)
    for revision in revisions or ["HEAD"]:
        result = counts(revision)
        sha = subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
        lines = table(result)
        print("\n".join(lines))
        write_results(OUT, sha, result, lines)


if __name__ == "__main__":
    main(sys.argv[1:])
