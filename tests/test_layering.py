"""The library's layers import downwards only (no import circle): errors and mesh, then the per-rank
operations, the parallel layers, the models, the plans, the step, the program, the run and its
analysis, the command line. Every import counts, module-level or inside a function, except the
top-level package's lazy names (``jphantom.parallelize`` and friends)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jphantom"

LAYERS = [
    ("base", ["errors", "mesh", "comm", "targets"]),
    ("operations", ["remat", "precision", "fp8", "sharding", "pipeline", "pipeline.schedule", "data",
                    "analysis.hlo", "perf.comm_model", "perf.axonn_model", "energy",
                    "coordinator", "distributed", "gpu_defaults", "token_mean"]),
    ("layers", ["nn"]),
    ("models", ["models"]),
    ("plans", ["plans"]),
    ("step", ["pipeline.runner", "pipeline.split", "train_step", "samo", "checkpoint", "exactness"]),
    ("program", ["program"]),
    ("run", ["config", "run", "resilience", "metrics", "analysis", "compare", "plan", "perf", "launch", "aot"]),
    ("cli", ["cli", "__main__"]),
]


def _layer_of(module: str) -> int:
    """The layer of ``jphantom.<module>``: the longest prefix listed wins."""
    best, rank = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    if rank is None:
        raise AssertionError(f"jphantom.{module} is in no layer: add it to LAYERS")
    return rank


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts == ("__init__",):
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "jphantom":
                for alias in node.names:
                    yield alias.name, node.lineno
            elif node.module.startswith("jphantom."):
                yield node.module[len("jphantom."):], node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jphantom."):
                    yield alias.name[len("jphantom."):], node.lineno


def test_every_import_goes_downwards():
    violations = []
    for name, path in _modules():
        own = _layer_of(name)
        for target, line in _imports(path):
            if target in ("errors",):
                continue
            if _layer_of(target) > own:
                violations.append(f"jphantom/{path.relative_to(ROOT)}:{line}: {name} "
                                  f"({LAYERS[own][0]}) imports {target} "
                                  f"({LAYERS[_layer_of(target)][0]})")
    assert not violations, "upward imports:\n" + "\n".join(violations)


@pytest.mark.parametrize("removed", ["strategies", "step", "train", "sharding.dense",
                                     "sharding.tensor", "sharding.phantom_transformer"])
def test_the_old_program_path_is_gone(removed):
    """One of each thing: the functional programs and their step builder were replaced by the NNX
    modules, jphantom.program and the one TrainStep."""
    assert not (ROOT / (removed.replace(".", "/") + ".py")).exists()
