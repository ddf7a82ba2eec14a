"""Seal et al.'s synthetic regression task: a fixed standard-Gaussian teacher W (n x n, seeded),
inputs x ~ N(0, I), targets y = ReLU(W ReLU(x)).

Samples are generated on demand from (seed, split, sample index), so the data set is never held in
memory and every batch is reproducible: sample i of the training split is the same array in every run,
whatever the batch size or mesh. Batches can be produced directly with a sharding (features sharded
over the model axis), so each device only materialises its own slice of x.

The paper does not give N, the split or the scale of W beyond "standard Gaussian". We keep W standard
Gaussian and scale the targets by ``1/sqrt(n)`` by default (``target_scale``), so that the MSE of the
zero predictor is O(1) at every width and one learning rate serves all widths; set
``target_scale=1.0`` for the paper's raw scale.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp

from jphantom.errors import ConfigError

SPLITS = {"train": 0, "eval": 1}


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    width: int
    train_size: int = 1 << 16
    eval_size: int = 2048
    seed: int = 0
    target_scale: float | None = None  # None: 1/sqrt(width)

    def __post_init__(self):
        for name in ("width", "train_size", "eval_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.target_scale is not None and not self.target_scale > 0:
            raise ConfigError(f"target_scale={self.target_scale} must be > 0 (or None for 1/sqrt(n))")

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.width) if self.target_scale is None else self.target_scale


class Teacher:
    """On-demand batches of the teacher task. ``weight`` is the fixed teacher matrix W."""

    def __init__(self, config: TeacherConfig, dtype=jnp.float32):
        self.config, self.dtype = config, jnp.dtype(dtype)
        weight_key, self._data_key = jax.random.split(jax.random.PRNGKey(config.seed))
        self.weight = jax.random.normal(weight_key, (config.width, config.width), self.dtype)

    def _size(self, split: str) -> int:
        if split not in SPLITS:
            raise ConfigError(f"split={split!r}; use one of {tuple(SPLITS)}")
        return self.config.train_size if split == "train" else self.config.eval_size

    @partial(jax.jit, static_argnums=(0, 2, 3))
    def _generate(self, indices, split_id, sharding):
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(self._data_key, split_id), i))(indices)
        x = jax.vmap(lambda k: jax.random.normal(k, (self.config.width,), self.dtype))(keys)
        y = jax.nn.relu(jax.nn.relu(x) @ self.weight.T) * self.config.scale
        if sharding is not None:
            x = jax.lax.with_sharding_constraint(x, sharding)
            y = jax.lax.with_sharding_constraint(y, sharding)
        return x, y

    def batch(self, split: str, start: int, size: int, sharding=None):
        """Samples ``start .. start+size-1`` (mod the split's size) of ``split``: (x, y) [size, n]."""
        count = self._size(split)
        if size < 1:
            raise ConfigError(f"batch size {size} must be >= 1")
        indices = (start + jnp.arange(size)) % count
        return self._generate(indices, SPLITS[split], sharding)

    def train_batch(self, step: int, size: int, sharding=None):
        """The step-th training batch: consecutive samples, wrapping around the training split."""
        return self.batch("train", step * size, size, sharding)

    def eval_batches(self, size: int, sharding=None):
        """The whole held-out split in batches of ``size`` (the last one may wrap around)."""
        count = self._size("eval")
        for start in range(0, count, size):
            yield self.batch("eval", start, min(size, count - start), sharding)

    def __hash__(self):  # static argument of the jitted generator
        return id(self)

    def __eq__(self, other):
        return self is other
