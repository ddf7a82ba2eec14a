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
                            "import jphantom.cli, jphantom.run, jphantom.plans, jphantom.nn, "
                            "jphantom.models.llama, jphantom.models.gpt2, jphantom.aot"],
                           capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr


@pytest.mark.parametrize("module, old, new", [
    ("jphantom.token_mean", "lm_loss", "lm_loss_terms"),
    ("jphantom.analysis.hlo", "Collective", "HloCollective"),
    ("jphantom.perf.axonn_model", "Precision", "PrecisionBytes"),
    ("jphantom.perf.axonn_model", "Layer", "LayerShape"),
    ("jphantom.predict", "Placement", "GroupPlacement"),
])
def test_an_old_name_is_the_renamed_object_and_warns(module, old, new):
    import importlib

    found = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match="next release"):
        assert getattr(found, old) is getattr(found, new)


def test_the_zoo_has_one_lm_loss():
    import jphantom.models
    import jphantom.models.llama
    import jphantom.program

    assert jphantom.models.llama.lm_loss is jphantom.program.lm_loss is jphantom.models.lm_loss
