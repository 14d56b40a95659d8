"""The pure decision's cost in process: ``decide`` on 8 replicas, a session, a 64-block prompt.

Run: ``.venv/bin/python benchmarks/decision_cost.py`` (results in benchmarks/decision_cost.md).
Compares the request path (no trace) with the traced decision Explain computes, and with a cordon
in force. The best of ``ROUNDS`` rounds of ``N`` decisions each (environment variables), to keep
other load on a shared machine out. With ``PYTHONPATH`` pointing at an older checkout it measures
that one's ``decide`` (the cases it lacks are skipped).
"""

from __future__ import annotations

import inspect
import os
import time

from extproc.api import (
    AffinityView,
    DecisionInputs,
    Replica,
    ReplicaState,
    RequestFeatures,
    Snapshot,
    build_profile,
    decide,
)

ROUNDS, N = int(os.environ.get("ROUNDS", "5")), int(os.environ.get("N", "20000"))


def main() -> None:
    states = [
        ReplicaState(Replica(f"r{i}", f"127.0.0.1:{9000 + i}"), inflight=i % 3, kv_usage=0.1 * i) for i in range(8)
    ]
    snap = Snapshot(tuple(states))
    features = RequestFeatures(
        path="/v1/chat/completions", model="m", session_key="s1", prompt_chars=4096, prefix_hashes=tuple(range(64))
    )
    view = AffinityView(pinned="r2", prefix_matches={"r2": 40, "r5": 10})
    profile = build_profile()
    params = inspect.signature(decide).parameters
    cases = {"request path": {}}
    if "trace" in params:
        from extproc.api import DecisionTrace

        cases["cordon in force"] = {"cordons": {"r5": "cordoned"}}
        cases["traced (Explain)"] = {"trace": None}
    for label, kwargs in cases.items():
        best = float("inf")
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for _ in range(N):
                extra = dict(kwargs)
                if "trace" in extra:
                    extra["trace"] = DecisionTrace()
                decide(DecisionInputs.of(features, snap, view, 0.0, profile, **extra))  # type: ignore[arg-type]
            best = min(best, time.perf_counter() - start)
        print(f"{label:18s} {best / N * 1e6:6.2f} us per decision")


if __name__ == "__main__":
    main()
