"""Rebalancing: moving sessions when replicas join, leave or run hot, and pre-warming them."""

from extproc.rebalance.ledger import LedgerEntry, SessionLedger
from extproc.rebalance.planner import Move, plan_join, plan_leave, plan_shed
from extproc.rebalance.prewarm import Prewarm, Prewarmer, PrewarmQueue, PrewarmSettings, prefill_only
from extproc.rebalance.rebalancer import Rebalancer, RebalanceSettings

__all__ = [
    "LedgerEntry",
    "Move",
    "Prewarm",
    "PrewarmQueue",
    "PrewarmSettings",
    "Prewarmer",
    "RebalanceSettings",
    "Rebalancer",
    "SessionLedger",
    "plan_join",
    "plan_leave",
    "plan_shed",
    "prefill_only",
]
