"""The FFN's shape: :class:`FFNConfig` (Seal et al.'s width n and depth L, phantom's ghost
width k, the dtype), validated without jax (a run's configuration builds it as it validates)."""

from __future__ import annotations

import dataclasses

from jphantom.errors import ConfigError, check_int
from jphantom.registry.dtypes import DTYPES, check_dtype, check_float64  # noqa: F401



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
        check_dtype(self.dtype)
        check_float64(self.dtype)
