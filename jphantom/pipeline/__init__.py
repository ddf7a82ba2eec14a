"""Pipeline parallelism (seed 003 Sec. 2.2, seed 004 ch. 3): schedules as data
(:mod:`.schedule`) and their SPMD executor (:mod:`.runner`)."""

from jphantom.pipeline.schedule import (SCHEDULES, Lockstep, Simulation, Task, Tick, TimedTask, build,
                                        lockstep, simulate)

__all__ = ["SCHEDULES", "Lockstep", "Simulation", "Task", "Tick", "TimedTask", "build", "lockstep",
           "simulate"]
