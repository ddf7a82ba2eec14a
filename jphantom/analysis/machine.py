"""What ran an experiment: host, jax, device and load, recorded next to every measured number."""

from __future__ import annotations

import os
import platform

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
