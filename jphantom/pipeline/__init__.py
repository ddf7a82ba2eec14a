"""Pipeline parallelism (Narayanan et al. 2021, Sec. 2.2, Singh's thesis ch. 3): schedules as data
(:mod:`.schedule`), the settings (:mod:`.config`), a schedule compiled to a table of F, BW, B and
W tasks (:mod:`.table`), the one SPMD executor that runs every schedule's table (:mod:`.runner`,
its buffers in :mod:`.buffers`) and a stage's backward split into B and W (:mod:`.split`)."""

from jphantom.pipeline.schedule import (ALL_SCHEDULES, SCHEDULES, SPLIT_SCHEDULES, Lockstep,
                                        Simulation, Task, TimedTask, build, lockstep,
                                        simulate)

__all__ = ["ALL_SCHEDULES", "SCHEDULES", "SPLIT_SCHEDULES", "Lockstep", "Simulation", "Task",
           "TimedTask", "build", "lockstep", "simulate"]
