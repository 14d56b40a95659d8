"""Prove envoy/endpoint-mode/envoy.yaml against real Envoy, the processor and fake replicas.

The processor speaks the Gateway API Inference Extension's endpoint-picker protocol: the pod's
``ip:port`` in ``x-gateway-destination-endpoint`` and, with fallbacks, in the ``envoy.lb``
metadata; the ``override_host`` load-balancing policy sends the request there. Checks:
conversations stick; forged routing headers are stripped; a dead processor degrades to round
robin; a replica killed mid-conversation costs no client error (retries go to another host).

Run: .venv/bin/python envoy/endpoint-mode/verify.py   (exit 0: every check passed)
"""

from __future__ import annotations

from pathlib import Path

from extproc_lab.demo.scenario import (
    Checks,
    ScenarioGateway,
    probe_fails_open,
    probe_forged_headers,
    probe_replica_death,
    probe_sticky,
)

HERE = Path(__file__).resolve().parent


def main() -> int:
    """Start the scenario on free loopback ports, run the checks, stop everything."""
    checks = Checks(HERE.name)
    with ScenarioGateway(config_path=HERE / "envoy.yaml", mode="endpoint", time_scale=0.02) as gw:
        checks.run("sessions stick to one replica", lambda: probe_sticky(gw.url, "sticky"))
        checks.run("forged routing headers are ignored", lambda: probe_forged_headers(gw.url, gw.members))
        checks.run("a dead processor degrades to round robin", lambda: probe_fails_open(gw))
        checks.run("a replica killed mid-conversation costs no error", lambda: probe_replica_death(gw))
    return checks.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
