"""Conversations without a session key, through real Envoy on fake replicas (issue 42).

A chat workload whose conversations share one long system prompt (1,500 words) and open with
short distinct questions, run twice on fresh gateways: with ``x-session-id`` (keyed) and without
(keyless, recognised by the router from the conversation's own messages). Reported per run: the
share of follow-up turns answered by their conversation's first replica, requests per replica
(the busiest over the mean and over the least busy), client TTFT p50/p99
(:mod:`extproc_lab.bench.keyless`). Results: benchmarks/keyless_conversations.md.

    .venv/bin/python benchmarks/keyless_conversations.py [--replicas 4 --sessions 32 --turns 6 --concurrency 8]
"""

from __future__ import annotations

import argparse

from extproc_lab.bench.keyless import KeylessSettings, compare, table


def main() -> None:
    """Run the comparison and print its table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = KeylessSettings()
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--system-words", type=int, default=d.system_words)
    p.add_argument("--time-scale", type=float, default=d.time_scale)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--modes", default="keyed,keyless,keyless_off", help="comma-separated: keyed, keyless, keyless_off")
    p.add_argument(
        "--session-tokens",
        type=int,
        default=None,
        help="the default profile with prefill_cost.session_tokens=N (default: the default profile as it is)",
    )
    args = p.parse_args()
    settings = KeylessSettings(
        args.replicas,
        args.sessions,
        args.turns,
        args.concurrency,
        args.system_words,
        args.time_scale,
        args.seed,
        args.session_tokens,
    )
    results = compare(settings, tuple(args.modes.split(",")))
    print(table(results, settings.replicas))


if __name__ == "__main__":
    main()
