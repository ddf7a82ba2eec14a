"""Pipeline-parallel schedules as data (issue 8): task tables and a discrete-event simulator."""

from jphantom.pipeline.schedule import SCHEDULES, Simulation, Task, TimedTask, build, simulate

__all__ = ["SCHEDULES", "Simulation", "Task", "TimedTask", "build", "simulate"]
