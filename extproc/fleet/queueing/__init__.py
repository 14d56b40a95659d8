"""Priority and fair queueing: requests held while every candidate replica is saturated."""

from extproc.fleet.queueing.admission import Admission, Refusal, Waiter
from extproc.fleet.queueing.fair_queue import FairQueue, Ticket
from extproc.fleet.queueing.levels import PriorityLevels
from extproc.fleet.queueing.observer import NullQueueObserver, QueueObserver
from extproc.fleet.queueing.saturation import saturated
from extproc.fleet.queueing.settings import QueueClass, QueueSettings

__all__ = [
    "Admission",
    "FairQueue",
    "NullQueueObserver",
    "PriorityLevels",
    "QueueClass",
    "QueueObserver",
    "QueueSettings",
    "Refusal",
    "Ticket",
    "Waiter",
    "saturated",
]
