"""The units of AxoNN's communication model (Singh's thesis ch. 5: bandwidths in GB/s = 1e9
bytes/s, memory in GiB) and the checks of the counts and positive numbers it is given."""

from __future__ import annotations

import math
from typing import Any

from jphantom.errors import ConfigError


GB = 1e9
"""Bytes in one GB (bandwidths are GB/s = 1e9 bytes per second)."""
GIB = 2**30


def check_count(name: str, value: Any, minimum: int = 1, fix: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}"
                          + (f": {fix}" if fix else ""))
    return value


def check_positive(name: str, value: Any, fix: str, *, zero_ok: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r} must be a number: {fix}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        raise ConfigError(f"{name}={value!r} must be finite and {'>= 0' if zero_ok else '> 0'}: "
                          f"{fix}")
    return number
