"""Experimental steps, built from :class:`jphantom.TrainStep`'s parts (its gradient provider
``step.gradients``, its reducer ``step.reducer`` and the axes each gradient is summed over
``step.reducer.vary``, its ``shard_map`` ``over_mesh``, ``init_state``, ``build``):

- :mod:`jphantom.experimental.samo`: SAMO, a magnitude-pruned model with compressed master
  weights, optimizer state and gradient all-reduce (Singh's thesis ch. 4);
- :mod:`jphantom.experimental.compute_only`: the step without its reductions, for Cheng et al.'s
  compute/communication breakdown (measurement only).

They train (SAMO) or measure (compute-only) but are not options of the main step: each has its
own constructor, and what they refuse they refuse by name.
"""
