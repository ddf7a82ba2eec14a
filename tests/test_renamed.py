"""Renamed modules keep their old import paths for one release, each with a DeprecationWarning:
the planner (``jphantom.plan`` -> :mod:`jphantom.planner`, its ``Plan`` -> ``Ranking``) and the
expert modules (``jphantom.nn.expert`` -> :mod:`jphantom.nn.expert_parallel`,
``jphantom.nn.experts`` -> :mod:`jphantom.nn.moe`); the library itself imports none of them.
Renamed names, so that no two classes share one and the zoo has one ``lm_loss``, keep theirs the
same way (a DeprecationWarning when read)."""

import subprocess
import sys
import warnings

import pytest


OLD_PATHS = [("jphantom.plan", "jphantom.planner", "plan"),
             ("jphantom.plan.search", "jphantom.planner.search", "plan"),
             ("jphantom.nn.expert", "jphantom.nn.expert_parallel", "ExpertParallelMoE"),
             ("jphantom.nn.experts", "jphantom.nn.moe", "Experts")]
LIBRARY = ("jphantom.cli", "jphantom.loop.trainer", "jphantom.plans", "jphantom.nn",
           "jphantom.models.llama", "jphantom.models.gpt2", "jphantom.costs.aot")
# In one fresh process: the library imports, then each old path as if first imported (a module
# warns as it runs: it and its old parents leave sys.modules first); per import, the
# DeprecationWarnings it raised, one JSON line.
IMPORTS = """
import importlib, json, sys, warnings
OLD = set(sys.argv[1].split(","))
for name in sys.argv[2:]:
    for loaded in [m for m in sys.modules if m in OLD and (name + ".").startswith(m + ".")]:
        del sys.modules[loaded]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        importlib.import_module(name)
    print(json.dumps([str(w.message) for w in caught
                      if issubclass(w.category, DeprecationWarning)]))
"""


@pytest.mark.parametrize("old, new, name", OLD_PATHS)
def test_an_old_path_names_the_same_object(old, new, name):
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        found = getattr(importlib.import_module(old), name)
    assert found is getattr(importlib.import_module(new), name)


def test_the_library_imports_no_old_path_and_each_old_path_warns():
    import json

    olds = [old for old, _, _ in OLD_PATHS]
    run = subprocess.run([sys.executable, "-c", IMPORTS, ",".join(olds), *LIBRARY, *olds],
                         capture_output=True, text=True, check=True)
    warned = dict(zip([*LIBRARY, *olds], map(json.loads, run.stdout.splitlines())))
    assert not any(warned[name] for name in LIBRARY), warned
    for old in olds:
        assert any("next release" in message for message in warned[old]), (old, warned[old])


def test_the_old_ranking_name():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jphantom.plan import Plan
    from jphantom.planner import Ranking

    assert Plan is Ranking


@pytest.mark.parametrize("module, old, new", [
    ("jphantom.step.token_mean", "lm_loss", "lm_loss_terms"),
    ("jphantom.analysis.hlo", "Collective", "HloCollective"),
    ("jphantom.perf.axonn_model", "Precision", "PrecisionBytes"),
    ("jphantom.perf.axonn_model", "Layer", "LayerShape"),
    ("jphantom.predict", "Placement", "GroupPlacement"),
    ("jphantom.models.gpt2", "Attention", "GPT2Attention"),
    ("jphantom.models.gpt2", "Block", "GPT2Block"),
    ("jphantom.models.gpt2", "MLP", "GPT2MLP"),
    ("jphantom.models.llama", "Attention", "LlamaAttention"),
    ("jphantom.models.llama", "Block", "LlamaBlock"),
    ("jphantom.models.llama", "MLP", "LlamaMLP"),
])
def test_an_old_name_is_the_renamed_object_and_warns(module, old, new):
    import importlib

    found = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match="next release"):
        assert getattr(found, old) is getattr(found, new)


def test_the_zoo_has_one_lm_loss():
    import jphantom.models
    import jphantom.models.llama
    import jphantom.registry.program

    assert jphantom.models.llama.lm_loss is jphantom.registry.program.lm_loss is jphantom.models.lm_loss


def _moved():
    import jphantom

    return sorted(jphantom._MOVED.items())


@pytest.mark.parametrize("old, new", _moved())
def test_a_module_moved_into_a_package_keeps_its_old_path_for_one_release(old, new):
    """``import jphantom.<old>`` gives the moved module itself (no copy: one set of globals),
    with a DeprecationWarning the first time only."""
    import importlib

    sys.modules.pop(f"jphantom.{old}", None)  # imported earlier in this process (by a test)
    warning = rf"jphantom\.{old} is now jphantom\.{new}; .* next release"
    with pytest.warns(DeprecationWarning, match=warning):
        found = importlib.import_module(f"jphantom.{old}")
    assert found is importlib.import_module(f"jphantom.{new}")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert importlib.import_module(f"jphantom.{old}") is found  # warned once


def test_the_old_from_import_of_a_moved_module_and_a_clean_root():
    """``from jphantom import mesh`` (the old spelling) is the moved module; the package root
    holds only the public face (``__init__``, ``__main__``, ``errors``)."""
    import pathlib

    import jphantom
    import jphantom.runtime.mesh

    sys.modules.pop("jphantom.mesh", None)  # imported earlier in this process (by a test)
    vars(jphantom).pop("mesh", None)
    with pytest.warns(DeprecationWarning, match="jphantom.runtime.mesh"):
        from jphantom import mesh
    assert mesh is jphantom.runtime.mesh
    root = pathlib.Path(jphantom.__file__).parent
    assert sorted(p.stem for p in root.glob("*.py")) == ["__init__", "__main__", "errors"]
