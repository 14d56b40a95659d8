"""The fault matrix at full size: every case of :mod:`extproc_lab.demo.fault_matrix` against real
Envoy, the processor, fake replicas and Redis on 127.0.0.1, bigger than the test suite runs them
(16 concurrent conversations, 5 s faults, 10,000 sessions, a burst of 800). Prints the table and
writes it, with each case's measured facts, to a markdown file.

    .venv/bin/python benchmarks/fault_matrix.py [--out benchmarks/fault_matrix.md] [--small]
        [--only CASE,CASE...]   (the cases: processor, redis, replica-killed, replica-killed-streams,
                                 replica-hung, replica-hung-shapes, replica-hung-shapes-endpoint,
                                 replica-hung-shapes-defaults, metrics, big-bodies, sessions, burst,
                                 burst-shared-prompt-200, burst-shared-prompt)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from extproc_lab.demo import fault_matrix as fm

CASES: dict[str, Callable[[fm.Scale], Awaitable[fm.CaseResult | list[fm.CaseResult]]]] = {
    "processor": fm.processor_restart,
    "redis": fm.redis_outage,
    "replica-killed": fm.replica_killed,
    "replica-killed-streams": fm.streams_on_a_killed_replica,
    "replica-hung": fm.replica_hung,
    "replica-hung-shapes": fm.replica_hung_every_shape,
    "replica-hung-shapes-endpoint": lambda scale: fm.replica_hung_every_shape(
        scale, mode="endpoint", health_check_path=None
    ),
    # At the shipped timeouts (first_byte_s 8 s, unary_max_s 60 s), whatever the scale: a minute.
    "replica-hung-shapes-defaults": lambda _scale: fm.replica_hung_every_shape(fm.DEFAULTS),
    "metrics": fm.metrics_faults,
    "big-bodies": fm.big_bodies,
    "sessions": fm.many_sessions,
    "burst": fm.session_burst,
    "burst-shared-prompt-200": lambda scale: fm.session_burst(replace(scale, burst=200), shared_system_prompt=True),
    "burst-shared-prompt": lambda scale: fm.session_burst(scale, shared_system_prompt=True),
}


NOTES = """## Reading the table

- **Processor killed**: Envoy's `failure_mode_allow` sends every request down the default route
  (Envoy's round robin) while nothing listens, so nothing is lost but sessions scatter. The
  restarted processor's memory store starts empty: sessions are pinned afresh on their next turn
  (with `--store redis://...` they would keep their replica).
- **Redis hung or killed**: the store pays its 50 ms timeout once, routes from its local mirror
  (no session changed replica) and a probe with backoff finds Redis again; the empty restarted
  Redis is written again by the following decisions.
- **Replica killed**: requests that had not started streaming are retried by Envoy on another
  replica (connect failures and resets). Found by this matrix and fixed: Envoy's default retry
  circuit breaker allows 3 concurrent retries per cluster, so when a replica holding more
  requests died, the others got a 503 (`upstream_rq_retry_overflow`); the replica clusters now
  allow 1,024. Streams already flowing from the killed replica cannot be retried: they end with
  an error the client sees (aiohttp's `ClientPayloadError`) about a second after the kill
  (Envoy's delayed-close timeout), and their next turn goes elsewhere.
- **Replica hung** (SIGSTOP: it accepts connections and never answers), with streams flowing
  from it when it stops: every try that had nothing back from it meets the first-byte timeout
  (`upstream.first_byte_s`, 0.5 s in this run and the tests, 8 s by default) and Envoy retries it
  on another replica, so no request that had not started streaming is lost; the processor ejects
  the replica from those failed tries (`x-envoy-attempt-count` on the response) and its scrapes
  timing out. The streams that already had their headers cannot be retried: Envoy's idle timeout
  (`upstream.stream_idle_s`, 1.6 s here, 25 s by default; it must outlast three first-byte tries,
  as the timer also runs before the headers) ends them, and the client sees the error about a
  second later (Envoy's delayed close). Before this, every request sent to it waited for the route
  timeout (300 s in the rendered configs) and got a 504. The demo replica runs in real time in
  this case, so the streams are still flowing when it stops.
- **Replica hung, every request shape** (the user's check: the rendered failover scenario, 24
  sessions pinned over three replicas, then the one holding most stops and requests of twelve
  shapes follow on its sessions at once, before the processor has noticed): chat and
  completions, streamed and not, without `max_tokens`, with 2 and with 1,000,000. Each try has a
  budget (`docs/timeouts.md`): a stream's is `first_byte_s`, a non-streaming request's
  `min(first_byte_s + max_tokens x unary_s_per_output_token, unary_max_s)`, and `unary_max_s`
  without `max_tokens`. When it passes, a stream's try is reset and retried; a non-streaming
  one is hedged (another replica is asked too, the first try keeps running), as a replica still
  generating is as silent as a hung one. Before `unary_max_s`, the non-streaming requests without
  `max_tokens` or with a huge one waited for the route timeout (300 s by default) and got a 504:
  Envoy's health check marked the host failed within seconds, but that does not end requests in
  flight to it (`close_connections_on_host_health_failure`, tried on Envoy 1.40, did not either).
  The rows run at the matrix's small timeouts (`first_byte_s` 0.5 s, `unary_max_s` 1 s) in the
  failover scenario and in endpoint mode without health checks, and at the shipped ones
  (8 s, 60 s).
- **/metrics broken**: a page that hangs or is not a Prometheus exposition fails the scrape, and
  the replica is ejected within about a second (its own requests still succeed: it serves, it
  just cannot be judged); an impossible load (queue 10^12) keeps it out of new work through the
  overload filter without an ejection. Found by this matrix and fixed: negative counts made the
  replica look emptier than idle, and it drew every new session (100% instead of a third); they
  are now clamped at zero.
- **8 MB bodies** are parsed (under the 8 MiB limit), decided well within Envoy's 1 s message
  timeout and kept on one replica; the processor adds a few tens of milliseconds to each.
- **Many sessions**: the session map holds them all up to its bound (`sessions.max_sessions`,
  100,000 by default; the suite checks a bound of 1,000 is held under 2,000 sessions), and
  revisited sessions stay where they were.
- **Burst of new sessions**: they spread, since in-flight work is counted at decision time, also
  when every prompt opens with the same long system prompt that the first decision put on one
  replica. That variant herded when this matrix first ran (200 of 200 on one replica: the prefix
  scorer, weight 3 for about 0.9 of the prompt matched, outweighed at most 3 x 0.8 of load); the
  default profile has since weighed prefix and queued work in one unit (the `prefill_cost`
  scorer), and the suite asserts it
  (`tests/e2e/test_fault_matrix.py::test_a_burst_of_new_sessions_sharing_a_system_prompt_spreads`).
  The 200-session row is the suite's size: a burst that ends before the next scrape; a bigger one
  also builds a queue the scraper sees, and the overload filter spills over.
"""


async def run(names: list[str], scale: fm.Scale) -> list[fm.CaseResult]:
    """Run the named cases one after the other (each starts and stops its own gateway)."""
    rows: list[fm.CaseResult] = []
    for name in names:
        started = time.monotonic()
        result = await CASES[name](scale)
        got = result if isinstance(result, list) else [result]
        for row in got:
            print(f"{row.case}: {row.requests} requests, {row.lost} lost, recover {row.recover_s}", flush=True)
        print(f"  ({name}: {time.monotonic() - started:.1f} s)", flush=True)
        rows.extend(got)
    return rows


def report(rows: list[fm.CaseResult], command: str, seconds: float) -> str:
    """The markdown file: how it was run, the table, then each case's facts."""
    load = os.getloadavg()
    lines = [
        "# Fault matrix",
        "",
        f"`{command}` ({seconds / 60:.1f} minutes), {platform.node() or 'this machine'}: "
        f"{os.cpu_count()} cores shared by Envoy (one worker), the processor, the fake replicas "
        f"(demo profile at 50x speed unless noted), Redis and the load generator; load average "
        f"{load[0]:.1f} at the end. Every case runs its own gateway on 127.0.0.1 and stops every "
        'process it started by PID. "Lost" is any request that did not get a 200.',
        "",
        fm.markdown_table(rows),
        NOTES,
        "## Facts per case",
        "",
    ]
    for row in rows:
        lines.append(f"- **{row.case}**: `{json.dumps(row.facts, default=str)}`")
    return "\n".join(lines) + "\n"


def main() -> int:
    """Run the matrix, print the table, write the report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/fault_matrix.md")
    parser.add_argument("--small", action="store_true", help="the test suite's scale (a quick look)")
    parser.add_argument("--only", help=f"comma-separated cases among {', '.join(CASES)}")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    started = time.monotonic()
    rows = asyncio.run(run(names, fm.SMALL if args.small else fm.LARGE))
    command = "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    text = report(rows, command, time.monotonic() - started)
    print()
    print(fm.markdown_table(rows))
    Path(args.out).write_text(text)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
