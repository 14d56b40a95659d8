"""Prove envoy/failover/envoy.yaml against real Envoy, the processor and fake replicas.

Cluster mode plus Envoy's own active health checks. A replica is killed while it holds the most
conversations: no client sees an error (each replica's cluster lists the others at priority 1,
and Envoy both retries on them and, within a second, marks the dead host failed by its health
check); the processor ejects it and re-pins its conversations, which are sticky again. Brought
back, the replica passes Envoy's health check again and takes new conversations.

Run: .venv/bin/python envoy/failover/verify.py   (exit 0: every check passed)
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from extproc_lab.demo.scenario import (
    Answer,
    Checks,
    ScenarioGateway,
    chat,
    envoy_health_flags,
    in_rotation,
    probe_replica_death,
    probe_sticky,
    wait_until,
)

HERE = Path(__file__).resolve().parent
# A replica that comes back is readmitted after 1 s instead of the default cooldown.
ROUTER_CONFIG = "health:\n  cooldown_s: 1.0\n"


def main() -> int:
    """Start the scenario on free loopback ports, run the checks, stop everything."""
    checks = Checks(HERE.name)
    gateway = ScenarioGateway(
        config_path=HERE / "envoy.yaml", mode="cluster", time_scale=0.02, router_config=ROUTER_CONFIG
    )
    with gateway as gw:
        checks.run("sessions stick to one replica", lambda: probe_sticky(gw.url, "sticky"))
        checks.run("a replica killed mid-conversation costs no error", lambda: probe_replica_death(gw))
        victim = next(r for r in gw.members if r.name not in gw.procs.procs)

        def failed_health_check() -> tuple[bool, str]:
            # Within one check interval of the cluster's next check (1 s with traffic; clusters
            # that have had none check every 5 s, the no_traffic_interval).
            failed = wait_until(lambda: "/failed_active_hc" in envoy_health_flags(gw, victim.name, victim.address))
            return failed, f"{victim.name} in its own cluster: {envoy_health_flags(gw, victim.name, victim.address)}"

        def comes_back() -> tuple[bool, str]:
            gw.start_replica(victim)
            healthy = wait_until(lambda: envoy_health_flags(gw, victim.name, victim.address) == "healthy")
            readmitted = wait_until(lambda: in_rotation(gw, victim.name) is True, timeout_s=15)
            answers: list[Answer] = []

            def taken() -> bool:
                # New conversations, a few at a time, until one lands on the replica that came back.
                start = len(answers)
                answers.extend(
                    chat(gw.url, f"fresh topic {i} " * 40, session=f"fresh-{i}") for i in range(start, start + 6)
                )
                return any(a.replica == victim.name for a in answers)

            reached = wait_until(taken, timeout_s=10)
            passed = healthy and readmitted and reached and all(a.status == 200 for a in answers)
            spread = dict(Counter(a.replica for a in answers))
            return passed, f"Envoy healthy: {healthy}, processor readmitted: {readmitted}, new conversations: {spread}"

        checks.run("Envoy's health check marks the dead replica failed", failed_health_check)
        checks.run("the replica back is health-checked in and takes new conversations", comes_back)
    return checks.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
