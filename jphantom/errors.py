"""Error and warning types shared by every jphantom module.

Every validation failure raises :class:`ConfigError`, whose message names the offending value, the
constraint it breaks and how to fix it. Soft violations of a paper's recommendation (for example a
ghost width above seed 000's Eq. 8 bound) emit :class:`JPhantomWarning` instead.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which value, why, and the fix."""


class JPhantomWarning(UserWarning):
    """A legal but unwise setting (e.g. a ghost width that makes phantom larger than dense)."""


class TrainingDiverged(FloatingPointError):
    """Training produced a NaN or infinite loss; the message names the step."""


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` if it is an integer (not a bool) >= ``minimum``, else ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
    return value
