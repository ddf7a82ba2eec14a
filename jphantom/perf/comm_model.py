"""Collective cost model of Seal et al.: Eq. 26, with Table III's Frontier constants as a preset.

    (26)  t(m, p) = c1 · log2 p + c2 · m + c3                                  [microseconds]

p is the number of ranks taking part and m the message size in floats (4-byte words). Other dtypes
convert by bytes, m = bytes / 4: the model prices bytes on the wire, so a bf16 buffer of N elements
counts as N/2 floats. c1 is the latency term, c2 the inverse bandwidth in μs per float, c3 a constant
that the paper found to be ~0 and dropped (its reduce-scatter fit gave c3 = 2.62e-58).

Collective kinds are named as in HLO ("all-gather", "reduce-scatter", "all-reduce"; see
``jphantom.analysis.hlo``) plus "broadcast", which Table III also fits.

What "message size" means per kind. Table II gives m per rank: all-gather and reduce-scatter move
(n/p)·B or k·B, the *contribution of one rank*; all-reduce and broadcast move n·B, the whole buffer.
HLO reports the per-device *result* buffer of R bytes instead, so (``message_floats``):

    all-gather      result holds all p contributions    m = R / (4 p)
    reduce-scatter  result is this rank's 1/p share     m = R / 4
    all-reduce      result is the whole buffer          m = R / 4
    broadcast       result is the whole buffer          m = R / 4

(collective-permute and all-to-all, outside Table III, take m = R / 4: the buffer each rank sends.)
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jphantom.errors import ConfigError

BYTES_PER_FLOAT = 4

# How many ranks' contributions one per-device result buffer holds (see the module docstring).
_CONTRIBUTIONS_IN_RESULT = {
    "all-gather": "p",
    "reduce-scatter": 1,
    "all-reduce": 1,
    "broadcast": 1,
    "collective-permute": 1,
    "all-to-all": 1,
}


def _check_ranks(p: Any) -> float:
    """p must be a whole number of ranks >= 1; returns it as a float."""
    try:
        value = float(p)
    except (TypeError, ValueError):
        raise ConfigError(f"ranks p={p!r} is not a number: pass the collective's group size") from None
    if isinstance(p, bool) or not math.isfinite(value) or value < 1 or not value.is_integer():
        raise ConfigError(f"ranks p={p!r} must be a whole number >= 1: pass the collective's group size")
    return value


def _check_message(m: Any) -> float:
    try:
        value = float(m)
    except (TypeError, ValueError):
        raise ConfigError(f"message size m={m!r} is not a number of floats") from None
    if isinstance(m, bool) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"message size m={m!r} must be a finite number of floats >= 0 (m = bytes / 4)")
    return value


def message_floats(kind: str, result_bytes: float, p: int) -> float:
    """Eq. 26's m (floats, Table II's per-rank message) for an HLO collective of ``result_bytes``.

    ``result_bytes`` is the per-device result buffer that ``jphantom.analysis.hlo`` reports. An
    all-gather's result holds all p contributions, so m = R / (4 p); reduce-scatter, all-reduce and
    broadcast take m = R / 4. Example (TP, width n, batch B, f32): all-gather result [B, n] gives
    m = n·B/p, Table II's (n/p) × batch_size.
    """
    if kind not in _CONTRIBUTIONS_IN_RESULT:
        known = ", ".join(sorted(_CONTRIBUTIONS_IN_RESULT))
        raise ConfigError(f"collective kind {kind!r} has no message-size rule; known kinds: {known}")
    ranks = _check_ranks(p)
    try:
        nbytes = float(result_bytes)
    except (TypeError, ValueError):
        raise ConfigError(f"result bytes {result_bytes!r} of {kind} is not a number") from None
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ConfigError(f"result bytes {result_bytes!r} of {kind} must be finite and >= 0")
    contributions = ranks if _CONTRIBUTIONS_IN_RESULT[kind] == "p" else 1.0
    return nbytes / (BYTES_PER_FLOAT * contributions)


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """Eq. 26's constants for one collective kind: t = c1·log2 p + c2·m + c3 in μs.

    Named with Table III's symbols: c1 is the latency term (μs per doubling of p), c2 the bandwidth
    term (μs per float of message), c3 a constant (μs). ``rmse_log2_us`` is the fit's root-mean-square
    error in log2(μs), as Table III reports it (None when unknown).
    """

    c1: float
    c2: float
    c3: float = 0.0
    rmse_log2_us: float | None = None

    def __post_init__(self):
        for name in ("c1", "c2", "c3"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
                raise ConfigError(f"CollectiveCost.{name}={value!r} must be a real number (μs, Eq. 26)")
            if not math.isfinite(value):
                raise ConfigError(f"CollectiveCost.{name}={value!r} must be finite (μs, Eq. 26)")
            object.__setattr__(self, name, float(value))
        rmse = self.rmse_log2_us
        if rmse is not None:
            is_real = isinstance(rmse, (int, float, np.floating, np.integer)) and not isinstance(rmse, bool)
            if not is_real or not rmse >= 0:
                raise ConfigError(f"CollectiveCost.rmse_log2_us={rmse!r} must be >= 0 (log2 μs) or None")
            object.__setattr__(self, "rmse_log2_us", float(rmse))

    def time_us(self, m: float, p: int) -> float:
        """Eq. 26: microseconds for a message of m floats (m = bytes/4) among p ranks."""
        return self.c1 * math.log2(_check_ranks(p)) + self.c2 * _check_message(m) + self.c3


@dataclasses.dataclass(frozen=True)
class CommModel:
    """Eq. 26 for each collective kind: ``costs`` maps an HLO kind name to its ``CollectiveCost``."""

    costs: Mapping[str, CollectiveCost]
    name: str = "unnamed"

    def __post_init__(self):
        if not isinstance(self.costs, Mapping) or not self.costs:
            raise ConfigError(
                f"CommModel.costs={self.costs!r} must be a non-empty mapping kind -> CollectiveCost"
            )
        for kind, cost in self.costs.items():
            if not isinstance(kind, str) or not kind:
                raise ConfigError(f"CommModel kind {kind!r} must be a non-empty string such as 'all-gather'")
            if not isinstance(cost, CollectiveCost):
                raise ConfigError(f"CommModel cost for {kind!r} is {cost!r}, expected a CollectiveCost")
        object.__setattr__(self, "costs", types.MappingProxyType(dict(self.costs)))

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.costs)

    def cost(self, kind: str) -> CollectiveCost:
        try:
            return self.costs[kind]
        except KeyError:
            known = ", ".join(self.costs)
            raise ConfigError(
                f"collective kind {kind!r} is not in comm model {self.name!r}; known kinds: {known}"
            ) from None

    def time_us(self, kind: str, m: float, p: int) -> float:
        """Eq. 26 for ``kind``: microseconds for m floats (Table II's per-rank message) among p ranks."""
        return self.cost(kind).time_us(m, p)

    def step_time_us(self, collectives: Iterable[Any], p: int) -> float:
        """Modelled μs of a step's collectives, all among the same p ranks, summed one after another.

        Each item is a ``jphantom.analysis.hlo.HloCollective`` or a mapping with "kind" and
        "bytes" (per-device result bytes) and optionally "count": the rows of ``hlo.summarize``
        carry the bytes of ``count`` collectives, which cost ``count`` latencies and one bandwidth
        term on the summed bytes (Eq. 26 is linear in m). An ``HloCollective`` runs ``count``
        times per step (loop trip counts; ``bytes`` is one execution's), so it costs ``count``
        latencies and the bandwidth term of its ``total_bytes``. Bytes become m through
        ``message_floats``. For collectives over groups of different sizes, call once per group
        size and add.
        """
        total = 0.0
        for item in collectives:
            if isinstance(item, Mapping):
                try:
                    kind, nbytes = item["kind"], item["bytes"]
                except KeyError as missing:
                    raise ConfigError(
                        f"collective {item!r} lacks key {missing}: need 'kind' and 'bytes'"
                    ) from None
                count = item.get("count", 1)
            else:
                kind, nbytes, count = item.kind, item.total_bytes, item.count
            if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
                raise ConfigError(f"collective count={count!r} of {kind!r} must be a whole number >= 1")
            cost = self.cost(kind)
            m = message_floats(kind, nbytes, p)
            total += count * (cost.c1 * math.log2(_check_ranks(p)) + cost.c3) + cost.c2 * m
        return total


FRONTIER = CommModel(
    costs={
        "broadcast": CollectiveCost(c1=35.5, c2=1.12e-3, c3=0.0, rmse_log2_us=3.20),
        "all-reduce": CollectiveCost(c1=33.4, c2=2.56e-3, c3=0.0, rmse_log2_us=2.58),
        "all-gather": CollectiveCost(c1=149.94, c2=2.07e-3, c3=0.0, rmse_log2_us=3.90),
        "reduce-scatter": CollectiveCost(c1=145.52, c2=2.40e-3, c3=0.0, rmse_log2_us=3.91),
    },
    name="frontier (Seal et al. Table III fit)",
)
"""The paper's Frontier fit (Seal et al. Table III): RCCL on MI250X GCDs, fitted over m = 2^2..2^26
floats and p = 2..256 ranks; c3 = 0 as the paper sets it."""


def _samples_array(samples: Iterable[Sequence[float]]) -> np.ndarray:
    rows = list(samples)
    if len(rows) < 3:
        raise ConfigError(
            f"fit needs at least 3 (m, p, time_us) samples for Eq. 26's three constants, got {len(rows)}"
        )
    table = np.empty((len(rows), 3), dtype=np.float64)
    for i, row in enumerate(rows):
        if len(row) != 3:
            raise ConfigError(f"sample {i} = {row!r} must be a triple (m floats, p ranks, time_us)")
        m, p, t = row
        table[i, 0] = _check_message(m)
        table[i, 1] = _check_ranks(p)
        try:
            t = float(t)
        except (TypeError, ValueError):
            raise ConfigError(f"sample {i} time_us={row[2]!r} is not a number") from None
        if not math.isfinite(t) or t <= 0:
            raise ConfigError(
                f"sample {i} time_us={row[2]!r} must be a positive time in μs (log2 needs t > 0)"
            )
        table[i, 2] = t
    return table


def rmse_log2_us(cost: CollectiveCost, samples: Iterable[Sequence[float]]) -> float:
    """Root-mean-square of log2(model μs) - log2(measured μs), Table III's error measure.

    ``math.inf`` when the model predicts a non-positive time for some sample (no logarithm).
    """
    table = _samples_array(samples)
    predicted = cost.c1 * np.log2(table[:, 1]) + cost.c2 * table[:, 0] + cost.c3
    if np.any(predicted <= 0):
        return math.inf
    return float(np.sqrt(np.mean((np.log2(predicted) - np.log2(table[:, 2])) ** 2)))


def fit(samples: Iterable[Sequence[float]], *, relative: bool = True) -> CollectiveCost:
    """Least-squares Eq. 26 constants (c1, c2, c3) from (m floats, p ranks, time μs) samples.

    Eq. 26 is linear in its constants, so this is one ``numpy.linalg.lstsq`` in linear time, not an
    iterative fit in log space. With ``relative=True`` (default) each residual is divided by the
    measured time, i.e. it minimises Σ((model - t)/t)², which to first order is the log-space error
    the paper reports, so a 4 μs latency and a 100 ms transfer weigh the same, as they do on the
    paper's range m = 2^2..2^26. ``relative=False`` minimises absolute μs. Either way the result
    carries the RMSE in log2(μs), as Table III does (``rmse_log2_us``). Noise-free samples of an
    Eq. 26 model give back its constants exactly (to rounding).

    The samples must vary both p (to separate c1 from c3) and m (for c2); at least 3.
    """
    table = _samples_array(samples)
    m, p, t = table[:, 0], table[:, 1], table[:, 2]
    design = np.stack([np.log2(p), m, np.ones_like(m)], axis=1)
    weights = 1.0 / t if relative else np.ones_like(t)
    # Scale columns so lstsq's rank test sees m ~ 1e7 and log2 p ~ 1 alike; undo after solving.
    scale = np.max(np.abs(design), axis=0)
    scale[scale == 0] = 1.0
    solution, _, rank, _ = np.linalg.lstsq(design * weights[:, None] / scale, t * weights, rcond=None)
    if rank < 3:
        raise ConfigError(
            f"samples cannot separate Eq. 26's constants (rank {rank} < 3): distinct p = "
            f"{sorted(set(p.tolist()))}, distinct m = {len(set(m.tolist()))}; "
            "measure at least two group sizes p and two message sizes m"
        )
    c1, c2, c3 = (solution / scale).tolist()
    cost = CollectiveCost(c1=c1, c2=c2, c3=c3)
    return dataclasses.replace(cost, rmse_log2_us=rmse_log2_us(cost, table))


def fit_model(
    samples_by_kind: Mapping[str, Iterable[Sequence[float]]], name: str = "fitted", *, relative: bool = True
) -> CommModel:
    """A ``CommModel`` with one ``fit`` per collective kind (HLO names, e.g. "all-gather")."""
    if not isinstance(samples_by_kind, Mapping) or not samples_by_kind:
        raise ConfigError(
            f"samples_by_kind={samples_by_kind!r} must map each kind to its (m, p, time_us) samples"
        )
    costs = {}
    for kind, samples in samples_by_kind.items():
        try:
            costs[kind] = fit(samples, relative=relative)
        except ConfigError as error:
            raise ConfigError(f"{kind}: {error}") from None
    return CommModel(costs=costs, name=name)
