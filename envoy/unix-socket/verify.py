"""Prove envoy/unix-socket/envoy.yaml against real Envoy, the processor and fake replicas.

Cluster mode with the processor on a unix socket (``extproc serve --listen unix:/path``), as a
sidecar sharing a volume with Envoy: no TCP port for the ext_proc stream. Checks: the processor
is reached over the socket and decides (its decision counter grows, and conversations stick,
which round robin would not do); forged routing headers are stripped; a dead processor degrades
to round robin and routing resumes when it is back on the same socket.

Run: .venv/bin/python envoy/unix-socket/verify.py   (exit 0: every check passed)
"""

from __future__ import annotations

from pathlib import Path

from extproc_lab.demo.scenario import (
    Checks,
    ScenarioGateway,
    probe_fails_open,
    probe_forged_headers,
    probe_sticky,
    processor_decisions,
)

HERE = Path(__file__).resolve().parent


def main() -> int:
    """Start the scenario on free loopback ports, run the checks, stop everything."""
    checks = Checks(HERE.name)
    with ScenarioGateway(config_path=HERE / "envoy.yaml", mode="cluster", time_scale=0.02, unix_socket=True) as gw:

        def decides_over_the_socket() -> tuple[bool, str]:
            before = processor_decisions(gw)
            passed, detail = probe_sticky(gw.url, "sticky")
            made = processor_decisions(gw) - before
            return passed and made >= 24, f"{made:g} decisions over {gw.processor_address}; {detail}"

        checks.run("the processor on the unix socket routes, sessions stick", decides_over_the_socket)
        checks.run("forged routing headers are ignored", lambda: probe_forged_headers(gw.url, gw.members))
        checks.run("a dead processor degrades to round robin", lambda: probe_fails_open(gw))
    return checks.exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
