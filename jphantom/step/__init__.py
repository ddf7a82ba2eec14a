"""The training step's parts, which :class:`jphantom.step.train_step.TrainStep` composes, one idea each:

- :mod:`jphantom.step.layout`: the parameter layout and shardings, the batch's axes, the checks
  before tracing;
- :mod:`jphantom.step.grads`: each rank's loss share and gradient, the weighted loss,
  accumulation over micro-batches, the MoE whole-batch balance;
- :mod:`jphantom.step.reduce`: the axes each gradient is summed over, ZeRO's gathers and
  reduce-scatters;
- :mod:`jphantom.step.pipeline`: the ``stage`` axis (the cut at ``Stacked``, the schedule
  executors' glue, GSPMD's tick loop);
- :mod:`jphantom.step.gspmd`: the GSPMD baseline (annotations, ``jax.jit``'s collectives);
- :mod:`jphantom.step.finite`: the ``on_nonfinite`` policy (warn once, skip or stop on a
  non-finite loss or update).
"""
