"""Prove envoy/endpoint-original-dst/envoy.yaml against real Envoy, the processor and fake replicas.

The endpoint-picker protocol into an ``ORIGINAL_DST`` cluster that connects to whatever
``ip:port`` the processor names in ``x-gateway-destination-endpoint``. Checks: conversations
stick; forged routing headers are stripped (Envoy would otherwise connect wherever a client
says); a dead processor degrades to round robin; and a replica Envoy's config never names, known
only to the processor, is reached.

Run: .venv/bin/python envoy/endpoint-original-dst/verify.py   (exit 0: every check passed)
"""

from __future__ import annotations

from pathlib import Path

from extproc_lab.demo.scenario import (
    Checks,
    ScenarioGateway,
    probe_fails_open,
    probe_forged_headers,
    probe_sticky,
    probe_unknown_replicas_reached,
)

HERE = Path(__file__).resolve().parent


def main() -> int:
    """Start the scenario on free loopback ports, run the checks, stop everything."""
    checks = Checks(HERE.name)
    with ScenarioGateway(config_path=HERE / "envoy.yaml", mode="endpoint", time_scale=0.02, extra_replicas=1) as gw:
        checks.run("sessions stick to one replica", lambda: probe_sticky(gw.url, "sticky"))
        checks.run("forged routing headers are ignored", lambda: probe_forged_headers(gw.url, gw.members))
        checks.run("a replica unknown to Envoy is reached", lambda: probe_unknown_replicas_reached(gw))
        checks.run("a dead processor degrades to round robin", lambda: probe_fails_open(gw))
    return checks.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
