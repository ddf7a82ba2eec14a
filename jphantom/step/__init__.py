"""The training step's parts, which :class:`jphantom.train_step.TrainStep` composes:
:mod:`jphantom.step.layout` (the parameter layout, the batch's axes and the checks before
tracing) and :mod:`jphantom.step.pipeline` (the ``stage`` axis: the cut at ``Stacked`` and the
schedule executors' glue)."""
