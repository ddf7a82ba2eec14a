"""What ran an experiment (host, jax, device and load, recorded next to every measured number), and
where a benchmark or experiment script writes its results."""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from pathlib import Path

import jax


def machine_info() -> dict:
    """CPU count, OS, Python and jax versions, device kind and count, and the 1-minute load average
    (other work on a shared machine shows up in every timing)."""
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def output_folder(out, default, *, quick: bool, name: str) -> Path:
    """The folder a script writes its results into: ``out`` when given (``--out``); otherwise
    ``default`` (the committed results, ``benchmarks/results/<name>`` or
    ``experiments/results/<name>``), except for a ``--quick`` smoke run, which gets a fresh
    scratch folder under the system's temporary directory so that it never overwrites the
    committed results."""
    if out is not None:
        return Path(out)
    if quick:
        return Path(tempfile.mkdtemp(prefix=f"jphantom-{name}-quick-"))
    return Path(default)


def write_results(out: Path, name: str, result: dict, table: list[str]) -> None:
    """A script's results: ``<out>/<name>.json`` (``result``) and ``<out>/<name>.txt`` (``table``,
    a line a row), and a line on standard output saying where."""
    import json

    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.txt").write_text("\n".join(table) + "\n")
    print(f"wrote {out}/{name}.json and {name}.txt")


def source_revision(root) -> str:
    """The short git revision of the checkout at ``root`` ("" outside a git checkout)."""
    return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
