"""The step without its reductions: a measurement, not a training step (Cheng et al.'s bottom-up
breakdown of a data-parallel step, Sec. 3.1, Eqs. 2-4).

``t_iter`` is the time of :class:`jphantom.TrainStep`; ``t_compute`` the time of the same step
with no gradient or loss reduction, this one; ``t_comm = t_iter - t_compute``
(:func:`jphantom.analysis.timing.breakdown` measures both side by side). Each rank's loss and
gradients are its own share, never summed, so the values are not the model's: only the time
means something. Collectives inside the layers (tensor parallelism over ``model``) stay.
"""

from __future__ import annotations

from jphantom.errors import ConfigError
from jphantom.step.reduce import NoReduction
from jphantom.step.train_step import TrainStep


def make_compute_only_step(model, mesh, optimizer, loss_fn, **options) -> TrainStep:
    """The step of :func:`jphantom.make_train_step` with the :class:`~jphantom.step.reduce.
    NoReduction` reducer: no gradient or loss reduction (measurement only; ``zero=0``,
    ``spmd="shard_map"``)."""
    if options.get("zero", 0) or options.get("spmd", "shard_map") != "shard_map":
        raise ConfigError("the compute-only step measures plain data parallelism of the "
                          "shard_map step: use zero=0")
    return TrainStep(model, mesh, optimizer, loss_fn, reducer=NoReduction, **options)
