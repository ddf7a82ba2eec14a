"""The parameter dtypes a model configuration may name, and their checks (no jax unless a
configuration asks for float64, whose 64-bit mode is jax's setting)."""

from __future__ import annotations

from jphantom.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_dtype(dtype: str) -> None:
    """``dtype`` is one of :data:`DTYPES`."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}; use one of {DTYPES}")


def check_float64(dtype: str) -> None:
    """A float64 model needs jax's 64-bit mode on (only a float64 configuration imports jax)."""
    if dtype == "float64":
        import jax

        if not jax.config.jax_enable_x64:
            raise ConfigError("dtype='float64' needs 64-bit mode: call "
                              "jax.config.update('jax_enable_x64', True) first, or use float32")
