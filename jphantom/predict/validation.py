"""A prediction's measured error: the band ``benchmarks/predict_validation.py`` found for the same
device, read from its record (``benchmarks/results/predict/predict_validation.json``) so that a
prediction prints the error of its own device beside its figures (SimAI's and Lumos's habit: a
number with its error).

Two kinds of row are on record: ``gpu_step`` (our step on a lent GPU, its step time predicted
against the measured one: a signed error) and ``published`` (a peer framework's published run,
jphantom's equivalent layout predicted: predicted over published tokens/s per GPU, a ratio). Only
rows of the same device description count; a device with none says it is unvalidated."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

RECORD = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "predict" / \
    "predict_validation.json"
"""The validation record in a source checkout (an installed package has none)."""


def error_band(device: str, precision: str | None = None, record: Path | None = None) -> str:
    """One line: the measured error of predictions on ``device`` (a description's name) at
    ``precision`` (``bf16``, ``fp8``; rows of every precision where it has none), or that
    none is on record."""
    record = RECORD if record is None else Path(record)
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return (f"measured error: no validation record here ({record.name}; "
                "benchmarks/predict_validation.py writes it): the figures above are unchecked")
    parts = []
    step = data.get("gpu_step") or {}
    if step.get("device") == device:
        rows = _of_precision(step.get("rows", []), precision)
        if rows:
            errors = ", ".join(f"{r['error_step']:+.1%} ({r['precision']})" for r in rows)
            parts.append(f"step time {errors} against {step.get('measured_on', device)}'s "
                         "measured step")
    published = [r for r in (data.get("published") or {}).get("rows", [])
                 if r.get("gpu") == device and r.get("ratio") is not None]
    rows = _of_precision(published, precision)
    if rows:
        ratios = [r["ratio"] for r in rows]
        which = "/".join(sorted({r["precision"] for r in rows}))
        parts.append(f"predicted / published tokens/s per GPU {min(ratios):.2f}-{max(ratios):.2f}"
                     f" (median {statistics.median(ratios):.2f}) over {len(rows)} published "
                     f"{which} run{'s' if len(rows) > 1 else ''}")
    if not parts:
        return (f"measured error: none on record for {device} ({record.name} holds no run on "
                "it): the figures above are unvalidated")
    return f"measured error on {device} ({record.name}): " + "; ".join(parts)


def _of_precision(rows: list, precision: str | None) -> list:
    same = [r for r in rows if precision is not None and r.get("precision") == precision]
    return same or list(rows)


__all__ = ["RECORD", "error_band"]
