"""The FFN's shape: :class:`FFNConfig` (Seal et al.'s width n and depth L, phantom's ghost
width k, the dtype), validated without jax (a run's configuration builds it as it validates)."""

from __future__ import annotations

import dataclasses

from jphantom.errors import ConfigError, check_int

DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class FFNConfig:
    """The FFN's shape. ``ghost_width`` (k of Seal et al.) is used by phantom strategies only."""

    width: int
    depth: int = 2
    ghost_width: int | None = None
    dtype: str = "float32"
    model_name = "ffn"

    def __post_init__(self):
        for name in ("width", "depth"):
            check_int(name, getattr(self, name))
        k = self.ghost_width
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"ghost_width={k!r} must be an integer >= 1 (k ghost neurons per "
                              "rank, Seal et al.), e.g. 16")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {DTYPES}")
        if self.dtype == "float64":
            import jax  # 64-bit mode is jax's setting: only a float64 shape asks for it

            if not jax.config.jax_enable_x64:
                raise ConfigError("dtype='float64' needs 64-bit mode: call "
                                  "jax.config.update('jax_enable_x64', True) first, or use "
                                  "float32")
