"""Deprecated: the planner is :mod:`jphantom.planner` (renamed so that it no longer reads like
:mod:`jphantom.plans`, the parallel plans), and its ranking class is
:class:`jphantom.planner.Ranking` (``Plan`` here). This alias, and ``jphantom.plan.search`` and
the planner's other modules under their old names, go in the next release."""

import sys
import warnings

from jphantom import planner
from jphantom.planner import (DEFAULT_DEVICE_TFLOPS, LAYOUTS, PIPELINES, PlanRow, Ranking,
                              add_parser, command, compiled, format_plan, plan, pricing, report,
                              result, search)

Plan = Ranking

for _name in ("command", "compiled", "pricing", "report", "result", "search"):
    sys.modules[f"{__name__}.{_name}"] = getattr(planner, _name)

warnings.warn("jphantom.plan is now jphantom.planner (its Plan is Ranking); the old name goes "
              "in the next release", DeprecationWarning, stacklevel=2)

__all__ = ["plan", "Plan", "PlanRow", "Ranking", "format_plan", "add_parser", "LAYOUTS",
           "PIPELINES", "DEFAULT_DEVICE_TFLOPS"]
