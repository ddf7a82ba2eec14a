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


@pytest.mark.parametrize("old, new, name", [
    ("jphantom.plan", "jphantom.planner", "plan"),
    ("jphantom.plan.search", "jphantom.planner.search", "plan"),
    ("jphantom.nn.expert", "jphantom.nn.expert_parallel", "ExpertParallelMoE"),
    ("jphantom.nn.experts", "jphantom.nn.moe", "Experts"),
])
def test_an_old_path_names_the_same_object_and_warns(old, new, name):
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        found = getattr(importlib.import_module(old), name)
    assert found is getattr(importlib.import_module(new), name)
    warned = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                             f"import {old}"], capture_output=True, text=True)
    assert warned.returncode != 0 and "next release" in warned.stderr


def test_the_old_ranking_name_and_a_clean_library():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jphantom.plan import Plan
    from jphantom.planner import Ranking

    assert Plan is Ranking
    clean = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                            "import jphantom.cli, jphantom.loop.trainer, jphantom.plans, jphantom.nn, "
                            "jphantom.models.llama, jphantom.models.gpt2, jphantom.costs.aot"],
                           capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr


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
