"""Pipeline parallelism (issue 8): schedules as data (:mod:`.schedule`) and their SPMD executor
(:mod:`.runner`)."""

from jphantom.pipeline.schedule import (SCHEDULES, Lockstep, Simulation, Task, Tick, TimedTask, build,
                                        lockstep, simulate)

__all__ = ["SCHEDULES", "Lockstep", "Simulation", "Task", "Tick", "TimedTask", "build", "lockstep",
           "simulate"]
