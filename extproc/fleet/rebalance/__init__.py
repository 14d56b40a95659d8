"""Rebalancing: moving sessions when replicas join, leave or run hot, and pre-warming them."""

from extproc.fleet.rebalance.ledger import LedgerEntry, SessionLedger
from extproc.fleet.rebalance.observer import NullRebalanceObserver, RebalanceObserver
from extproc.fleet.rebalance.planner import Move, plan_join, plan_leave, plan_shed
from extproc.fleet.rebalance.prewarm import Prewarm, Prewarmer, PrewarmQueue, PrewarmSettings, prefill_only
from extproc.fleet.rebalance.rebalancer import Rebalancer, RebalanceSettings

__all__ = [
    "LedgerEntry",
    "Move",
    "NullRebalanceObserver",
    "Prewarm",
    "PrewarmQueue",
    "PrewarmSettings",
    "Prewarmer",
    "RebalanceObserver",
    "RebalanceSettings",
    "Rebalancer",
    "SessionLedger",
    "plan_join",
    "plan_leave",
    "plan_shed",
    "prefill_only",
]
