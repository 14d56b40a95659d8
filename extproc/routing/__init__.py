"""The routing decision: a pure pipeline of filters, weighted scorers and a picker."""

from extproc.routing.model import AffinityView, Decision, Reason, Replica, ReplicaState, Snapshot
from extproc.routing.pipeline import DecisionInputs, decide
from extproc.routing.profile import Profile
from extproc.routing.registry import DEFAULT_PROFILE, PRICE_PROFILE, SCORES_PROFILE, ProfileError, build_profile
from extproc.routing.ring import HashRing

__all__ = [
    "DEFAULT_PROFILE",
    "PRICE_PROFILE",
    "SCORES_PROFILE",
    "AffinityView",
    "Decision",
    "DecisionInputs",
    "HashRing",
    "Profile",
    "ProfileError",
    "Reason",
    "Replica",
    "ReplicaState",
    "Snapshot",
    "build_profile",
    "decide",
]
