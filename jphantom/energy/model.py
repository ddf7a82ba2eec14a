"""Seal et al.'s energy model: Eq. 1 (joules of one iteration from the seconds it computes and
communicates, and a GPU's busy and idle power) and Eq. 2 (joules to a target loss), and the
record of an estimate, modelled or measured.

    (1)  e = A · α + B · β        joules per iteration
    (2)  E_λ = ν_λ · e            joules to reach loss λ in ν_λ iterations
"""

from __future__ import annotations

import dataclasses
import math

from jphantom.errors import ConfigError, check_real

SOURCES = ("measured", "modelled")


@dataclasses.dataclass(frozen=True)
class PowerModel:
    """Per-device power of Eq. 1: A = ``busy_watts`` computing, B = ``idle_watts`` communicating.

    Defaults are Seal et al.'s Frontier values (Sec. II-A): A ≈ 560 W, B ≈ 90 W per MI250X GCD.
    """

    busy_watts: float = 560.0
    idle_watts: float = 90.0
    name: str = "frontier-mi250x"

    def __post_init__(self):
        busy = check_real("PowerModel.busy_watts", self.busy_watts, low_inclusive=False)
        idle = check_real("PowerModel.idle_watts", self.idle_watts, low_inclusive=False)
        if busy < idle:
            raise ConfigError(
                f"PowerModel.busy_watts={self.busy_watts!r} < idle_watts={self.idle_watts!r}: Eq. 1 needs "
                "A (computing) >= B (waiting on communication); swap them"
            )
        object.__setattr__(self, "busy_watts", busy)
        object.__setattr__(self, "idle_watts", idle)


def energy_per_iteration(
    alpha_s: float, beta_s: float, power: PowerModel = PowerModel(), devices: int = 1
) -> float:
    """Eq. 1, joules of one iteration on ``devices`` devices: devices · (A · α + B · β).

    ``alpha_s`` (α) and ``beta_s`` (β) are *per-device* seconds of one iteration, spent computing and
    spent communicating; in an SPMD step every device has the same α and β, and the paper's energy
    sums over the GPUs, hence the factor ``devices``. Eq. 1 treats the two as disjoint: time in which
    communication overlaps compute belongs in α only.
    """
    alpha = check_real("alpha_s", alpha_s)
    beta = check_real("beta_s", beta_s)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"devices={devices!r} must be a whole number >= 1 (the GPUs Eq. 1 sums over)")
    if not isinstance(power, PowerModel):
        raise ConfigError(f"power={power!r} must be a PowerModel")
    return devices * (power.busy_watts * alpha + power.idle_watts * beta)


def energy_to_target(per_iteration_j: float, iterations: float) -> float:
    """Eq. 2, joules to reach the target loss: E_λ = ν_λ · e (``iterations`` ν_λ, often epochs)."""
    return check_real("per_iteration_j", per_iteration_j) * check_real("iterations", iterations)


@dataclasses.dataclass(frozen=True)
class EnergyEstimate:
    """Energy of a training run to a target, Eqs. 1-2, either ``"modelled"`` or ``"measured"``.

    ``compute_seconds`` (α) and ``comm_seconds`` (β) are per device per iteration, None where a
    measurement did not split them. ``total_joules`` = ``joules_per_iteration`` · ``iterations``.
    """

    compute_seconds: float | None
    comm_seconds: float | None
    joules_per_iteration: float
    iterations: float
    total_joules: float
    source: str
    note: str = ""

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ConfigError(f"EnergyEstimate.source={self.source!r} must be one of {SOURCES}")
        for name in ("compute_seconds", "comm_seconds"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_real(f"EnergyEstimate.{name}", getattr(self, name)))
        for name in ("joules_per_iteration", "iterations", "total_joules"):
            object.__setattr__(self, name, check_real(f"EnergyEstimate.{name}", getattr(self, name)))
        eq2 = self.joules_per_iteration * self.iterations
        if not math.isclose(self.total_joules, eq2, rel_tol=1e-9, abs_tol=1e-9):
            raise ConfigError(
                f"EnergyEstimate.total_joules={self.total_joules!r} differs from joules_per_iteration x "
                f"iterations = {eq2!r} (Eq. 2); build it with estimate_energy or measured_energy"
            )


def estimate_energy(
    alpha_s: float,
    beta_s: float,
    iterations: float,
    power: PowerModel = PowerModel(),
    devices: int = 1,
    note: str = "",
) -> EnergyEstimate:
    """A modelled ``EnergyEstimate``: Eq. 1 per iteration on ``devices`` devices, then Eq. 2."""
    per_iteration = energy_per_iteration(alpha_s, beta_s, power, devices)
    detail = f"Eq. 1, {power.name}: A={power.busy_watts:g} W, B={power.idle_watts:g} W, x {devices} devices"
    return EnergyEstimate(
        compute_seconds=float(alpha_s),
        comm_seconds=float(beta_s),
        joules_per_iteration=per_iteration,
        iterations=float(iterations),
        total_joules=energy_to_target(per_iteration, iterations),
        source="modelled",
        note=f"{detail}; {note}" if note else detail,
    )


def measured_energy(
    total_joules: float,
    iterations: float,
    compute_seconds: float | None = None,
    comm_seconds: float | None = None,
    note: str = "",
) -> EnergyEstimate:
    """A measured ``EnergyEstimate``: metered joules (e.g. an ``NvmlPowerMeter``) over ``iterations`` > 0."""
    total = check_real("total_joules", total_joules)
    count = check_real("iterations", iterations, low_inclusive=False)
    return EnergyEstimate(compute_seconds, comm_seconds, total / count, count, total, "measured", note)
