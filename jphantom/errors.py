"""Error and warning types shared by every jphantom module.

Every validation failure raises :class:`ConfigError`, whose message names the offending value, the
constraint it breaks and how to fix it. Soft violations of a paper's recommendation (for example a
ghost width above Seal et al.'s Eq. 8 bound) emit :class:`JPhantomWarning` instead.
"""

from __future__ import annotations

import math
from numbers import Integral, Real


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which value, why, and the fix."""


class JPhantomWarning(UserWarning):
    """A legal but unwise setting (e.g. a ghost width that makes phantom larger than dense)."""


class TrainingDiverged(FloatingPointError):
    """Training produced a NaN or infinite loss; the message names the step."""


def check_int(name: str, value, minimum: int = 1, fix: str = "") -> int:
    """``value`` (an integer, numpy's included, never a bool) >= ``minimum`` as an ``int``, else a
    ConfigError naming it (and ``fix``). The one integer validator of the library."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}"
                          + (f"; {fix}" if fix else ""))
    return int(value)


def check_real(name: str, value, *, low: float = 0.0, high: float | None = None,
               low_inclusive: bool = True, fix: str = "") -> float:
    """``value`` (a real number, never a bool or a string) finite, >= ``low`` (> ``low`` unless
    ``low_inclusive``) and <= ``high``, as a ``float``; else a ConfigError naming it (and
    ``fix``). The one real-number validator of the library."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        number = float(value)
        ok = (number >= low if low_inclusive else number > low) and (high is None or
                                                                     number <= high)
    if not ok:
        bound = f"{'>=' if low_inclusive else '>'} {low:g}" + (f" and <= {high:g}"
                                                              if high is not None else "")
        raise ConfigError(f"{name}={value!r} must be a finite number {bound}"
                          + (f"; {fix}" if fix else ""))
    return float(value)
