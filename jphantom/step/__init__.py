"""The training step's parts (:class:`jphantom.train_step.TrainStep` composes them):
:mod:`jphantom.step.layout`, the parameter layout and the checks before tracing."""
