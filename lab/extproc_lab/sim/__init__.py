"""Simulation: workloads (traces and generators), the discrete-event simulator that drives the
router's own pipeline against replica models on a virtual clock, and hit-ratio ceilings.

No sockets and no grpc here: the simulator calls :class:`~extproc.router.Router` directly.
"""

from extproc_lab.sim.ceilings import Ceiling, ceiling, ceilings
from extproc_lab.sim.simulator import Outcome, SimCacheProbe, SimRun, Simulation, VirtualClock, simulate
from extproc_lab.sim.workload import SimRequest, Workload, text_request

__all__ = [
    "Ceiling",
    "Outcome",
    "SimCacheProbe",
    "SimRequest",
    "SimRun",
    "Simulation",
    "VirtualClock",
    "Workload",
    "ceiling",
    "ceilings",
    "simulate",
    "text_request",
]
