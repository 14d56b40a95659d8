"""Prove envoy/cluster-mode/envoy.yaml against real Envoy, the processor and fake replicas.

Checks: conversations stick to one replica (the processor names its cluster in
``x-target-cluster``, the route's ``cluster_header`` follows it); routing headers a client forges
are stripped; with the processor killed every request is still served (``failure_mode_allow``
and the round-robin default route), and routing resumes when it is back.

Run: .venv/bin/python envoy/cluster-mode/verify.py   (exit 0: every check passed)
"""

from __future__ import annotations

from pathlib import Path

from extproc_lab.demo.scenario import Checks, ScenarioGateway, probe_fails_open, probe_forged_headers, probe_sticky

HERE = Path(__file__).resolve().parent


def main() -> int:
    """Start the scenario on free loopback ports, run the checks, stop everything."""
    checks = Checks(HERE.name)
    with ScenarioGateway(config_path=HERE / "envoy.yaml", mode="cluster", time_scale=0.02) as gw:
        checks.run("sessions stick to one replica", lambda: probe_sticky(gw.url, "sticky"))
        checks.run("forged routing headers are ignored", lambda: probe_forged_headers(gw.url, gw.members))
        checks.run("a dead processor degrades to round robin", lambda: probe_fails_open(gw))
    return checks.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
