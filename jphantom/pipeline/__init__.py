"""Pipeline parallelism (the Day 66 notes Sec. 2.2, Singh's thesis ch. 3): schedules as data
(:mod:`.schedule`), their SPMD executor (:mod:`.runner`) and the zero-bubble executor that splits
each backward into B and W (:mod:`.split`)."""

from jphantom.pipeline.schedule import (ALL_SCHEDULES, SCHEDULES, SPLIT_SCHEDULES, Lockstep,
                                        Simulation, Task, Tick, TimedTask, build, lockstep,
                                        simulate)

__all__ = ["ALL_SCHEDULES", "SCHEDULES", "SPLIT_SCHEDULES", "Lockstep", "Simulation", "Task",
           "Tick", "TimedTask", "build", "lockstep", "simulate"]
