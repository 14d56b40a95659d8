"""Priority and fair queueing: requests held while every candidate replica is saturated."""

from extproc.queueing.admission import Admission, Refusal, Waiter
from extproc.queueing.fair_queue import FairQueue, Ticket
from extproc.queueing.levels import PriorityLevels
from extproc.queueing.saturation import saturated
from extproc.queueing.settings import QueueClass, QueueSettings

__all__ = [
    "Admission",
    "FairQueue",
    "PriorityLevels",
    "QueueClass",
    "QueueSettings",
    "Refusal",
    "Ticket",
    "Waiter",
    "saturated",
]
