"""``extproc admin``: the admin API from a shell, a table by default, ``--json`` for scripts.

extproc admin [--server HOST:PORT] [--token-file F] explain --body FILE [--header K:V ...]
extproc admin replicas | hot-keys | session KEY [--model M] | forget KEY [--model M]
extproc admin cordon NAME | uncordon NAME | drain NAME | watch [--count N] [--sample-rate R]
extproc admin usage [--json | --csv]
extproc admin hit-ratio
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from extproc.cache.reuse import ReuseRow

DEFAULT_SERVER = "127.0.0.1:9002"  # the ext_proc port's default: the admin API is served there unless moved


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``admin`` sub-command and its own sub-commands."""
    p = sub.add_parser("admin", help="talk to a running router's admin API (explain, replicas, cordon, drain, ...)")
    p.add_argument(
        "--server",
        default=DEFAULT_SERVER,
        help=f"the router's --listen address, or its --admin-listen if it has one (default {DEFAULT_SERVER})",
    )
    p.add_argument("--token-file", metavar="F", help="file with the bearer token mutating calls need")
    p.add_argument("--ca", metavar="FILE", help="TLS: CA of the server's certificate")
    p.add_argument("--cert", metavar="FILE", help="mTLS: client certificate")
    p.add_argument("--key", metavar="FILE", help="mTLS: key of --cert")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    calls = p.add_subparsers(dest="call", required=True)
    e = calls.add_parser("explain", help="why a request would go where it goes (no side effects)")
    e.add_argument("--body", required=True, metavar="FILE", help="the JSON request body ('-' for stdin)")
    e.add_argument("--header", action="append", default=[], metavar="K:V", help="a request header (repeatable)")
    e.add_argument("--path", default="/v1/chat/completions", help="the request path (default chat completions)")
    calls.add_parser("replicas", help="every replica: health, rotation, cordon, load, sessions")
    calls.add_parser("hot-keys", help="the prefixes found hot (hot_keys:), by fingerprint")
    for name, text in (("session", "where a session is pinned"), ("forget", "unpin a session")):
        s = calls.add_parser(name, help=text)
        s.add_argument("key", help="the session key (as the router reads it from the request)")
        s.add_argument("--model", default="", help="the model the session is pinned for")
    for name, text in (
        ("cordon", "no new sessions or prefixes to a replica; pinned sessions stay"),
        ("uncordon", "undo cordon or drain"),
        ("drain", "move a replica's sessions to their next replica, then send it nothing"),
    ):
        c = calls.add_parser(name, help=text)
        c.add_argument("name", help="the replica's name")
    u = calls.add_parser("usage", help="tokens by tenant and model since start, and the token budgets left")
    shape = u.add_mutually_exclusive_group()
    # SUPPRESS: absent here, ``admin --json usage`` keeps the value the parent parser set.
    shape.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    shape.add_argument("--csv", action="store_true", help="print the usage as CSV, one row per tenant and model")
    calls.add_parser(
        "hit-ratio", help="where the hit ratio goes, per pool and replica: reuse offered, captured, delivered"
    )
    w = calls.add_parser("watch", help="a sampled stream of decisions")
    w.add_argument("--count", type=int, default=0, help="stop after this many (default: until interrupted)")
    w.add_argument("--sample-rate", type=float, default=0.0, help="share of decisions, in (0, 1] (default: server's)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run one admin call; exit 1 with the server's message when it refuses."""
    try:
        metadata: tuple[tuple[str, str], ...] = ()
        if args.token_file:
            token = Path(args.token_file).read_text(encoding="utf-8").strip()
            metadata = (("authorization", f"Bearer {token}"),)
        body = b""
        if args.call == "explain":
            body = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    except OSError as exc:
        print(f"extproc admin: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_run(args, metadata, body, sys.stdout))


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _channel(args: argparse.Namespace) -> Any:
    import grpc

    if not (args.ca or args.cert):
        return grpc.aio.insecure_channel(args.server)
    creds = grpc.ssl_channel_credentials(_read(args.ca), _read(args.key), _read(args.cert))
    return grpc.aio.secure_channel(args.server, creds)


async def _run(args: argparse.Namespace, metadata: tuple[tuple[str, str], ...], body: bytes, out: TextIO) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from extproc._proto.admin.v1 import admin_pb2 as pb
    from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc

    async with _channel(args) as channel:
        stub = pb_grpc.AdminStub(channel)
        kw: dict[str, Any] = {"metadata": metadata, "timeout": args.timeout}
        try:
            if args.call == "watch":
                return await _watch(stub, pb.WatchRequest(sample_rate=args.sample_rate), args, metadata, out)
            reply: Any
            if args.call == "explain":
                headers = [pb.Header(key=":path", value=args.path)]
                for spec in args.header:
                    key, sep, value = spec.partition(":")
                    if not sep:
                        print(f"extproc admin: --header {spec!r}: expected K:V", file=sys.stderr)
                        return 2
                    headers.append(pb.Header(key=key.strip().lower(), value=value.strip()))
                reply = await stub.Explain(pb.ExplainRequest(headers=headers, body=body), **kw)
            elif args.call == "replicas":
                reply = await stub.ListReplicas(pb.ListReplicasRequest(), **kw)
            elif args.call == "hot-keys":
                reply = await stub.ListHotKeys(pb.ListHotKeysRequest(), **kw)
            elif args.call == "usage":
                reply = await stub.GetUsage(pb.UsageRequest(), **kw)
            elif args.call == "hit-ratio":
                reply = await stub.GetHitRatio(pb.HitRatioRequest(), **kw)
            elif args.call in ("session", "forget"):
                call = stub.GetSession if args.call == "session" else stub.ForgetSession
                reply = await call(pb.SessionRequest(session_key=args.key, model=args.model), **kw)
            else:
                method = {"cordon": stub.Cordon, "uncordon": stub.Uncordon, "drain": stub.Drain}[args.call]
                reply = await method(pb.ReplicaRequest(replica=args.name), **kw)
        except grpc.aio.AioRpcError as exc:
            print(f"extproc admin: {exc.code().name}: {exc.details()}", file=sys.stderr)
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                print(
                    f"extproc admin: no admin API on {args.server}: off there (a listener off loopback without "
                    "admin.token_file), or on a port of its own (admin.listen); see docs/ports.md",
                    file=sys.stderr,
                )
            return 1
    if args.call == "usage" and (args.json or args.csv):
        out.write(json.dumps(usage_dict(reply), indent=2) + "\n" if args.json else usage_csv(reply))
    elif args.json:
        out.write(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2) + "\n")
    else:
        out.write(render(args.call, reply))
    return 0


async def _watch(stub: Any, request: Any, args: argparse.Namespace, metadata: Any, out: TextIO) -> int:
    from google.protobuf.json_format import MessageToDict

    seen = 0
    if not args.json:
        out.write(_table(["TIME", "REPLICA", "REASON", "MODEL", "MATCHED", "MS", "SKIPPED", "PREFILL"], []))
    async for event in stub.WatchDecisions(request, metadata=metadata):
        if args.json:
            out.write(json.dumps(MessageToDict(event, preserving_proto_field_name=True)) + "\n")
        else:
            import time

            stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
            matched = f"{event.matched_blocks}/{event.total_blocks}"
            row = [stamp, event.replica or "-", event.reason, event.model or "-", matched, f"{event.decision_ms:.2f}"]
            # The pair, in a disaggregated fleet: "replica-0 (disaggregated)", or "- (short)".
            pair = f"{event.prefill or '-'} ({event.pair_reason})" if event.pair_reason else "-"
            out.write("  ".join([*row, str(event.skipped), pair]) + "\n")
        out.flush()
        seen += 1
        if args.count and seen >= args.count:
            break
    return 0


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(header)] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n" for r in cells)


def _predicted(ttft_ms: float, tpot_ms: float) -> str:
    ttft = f"{ttft_ms:.0f}" if ttft_ms >= 0 else "-"
    tpot = f"{tpot_ms:.1f}" if tpot_ms >= 0 else "-"
    return "-" if ttft == tpot == "-" else f"{ttft}/{tpot}"


USAGE_COLUMNS = (
    "tenant",
    "model",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "total_tokens",
    "estimated_tokens",
)
"""``estimated_tokens``: of the total, those the router estimated; the rest the replicas reported."""


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).isoformat(timespec="seconds")


def _usage_rows(reply: Any) -> list[dict[str, Any]]:
    rows = []
    for u in reply.usage:
        total = u.input_tokens + u.cached_input_tokens + u.output_tokens
        values = (u.tenant, u.model, u.input_tokens, u.cached_input_tokens, u.output_tokens, total, u.estimated_tokens)
        rows.append(dict(zip(USAGE_COLUMNS, values, strict=True)))
    return rows


def usage_dict(reply: Any) -> dict[str, Any]:
    """A GetUsage reply as plain JSON values (token counts as numbers, every field present)."""
    return {
        "enabled": reply.enabled,
        "since": _iso(reply.since) if reply.enabled else None,
        "usage": _usage_rows(reply),
        "budgets": [
            {
                "kind": b.kind,
                "name": b.name,
                "windows": [
                    {
                        "window": w.window,
                        "limit": w.limit,
                        "used": w.used,
                        "remaining": w.remaining,
                        "reset_s": w.reset_s,
                    }
                    for w in b.windows
                ],
            }
            for b in reply.budgets
        ],
    }


def usage_csv(reply: Any) -> str:
    """A GetUsage reply's tokens as CSV: one row per tenant and model, with when counting began."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[*USAGE_COLUMNS, "since"], lineterminator="\n")
    writer.writeheader()
    since = _iso(reply.since) if reply.enabled else ""
    for row in _usage_rows(reply):
        writer.writerow({**row, "since": since})
    return buffer.getvalue()


def _render_usage(reply: Any) -> str:
    if not reply.enabled:
        return "metering is off (budgets.enabled)\n"
    rows = [list(r.values()) for r in _usage_rows(reply)]
    out = f"tokens since {_iso(reply.since)}\n" + _table(
        ["TENANT", "MODEL", "INPUT", "CACHED", "OUTPUT", "TOTAL", "ESTIMATED"], rows
    )
    budgets = [
        [b.kind, b.name, w.window, f"{w.limit:.0f}", f"{w.used:.0f}", f"{w.remaining:.0f}", f"{w.reset_s:.0f}s"]
        for b in reply.budgets
        for w in b.windows
    ]
    if budgets:
        out += "\n" + _table(["BUDGET", "NAME", "WINDOW", "LIMIT", "USED", "REMAINING", "RESETS IN"], budgets)
    return out


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def reuse_rows(reply: Any) -> list[ReuseRow]:
    """A GetHitRatio reply's rows as :class:`extproc.cache.reuse.ReuseRow` values."""
    from extproc.cache.reuse import ReuseRow

    return [
        ReuseRow(
            r.pool,
            r.replica,
            r.prompt_blocks,
            r.offered_blocks,
            r.captured_blocks,
            r.engine_queries_tokens,
            r.engine_hits_tokens,
        )
        for r in reply.rows
    ]


def render_hit_ratio(reply: Any) -> str:
    """A GetHitRatio reply: each replica, each pool and the fleet, with the three shares."""
    from extproc.cache.reuse import shares

    rows = reuse_rows(reply)
    pools = sorted({r.pool for r in rows})
    groups = [(r.pool, r.replica, [r]) for r in rows]
    groups += [(pool, "(pool)", [r for r in rows if r.pool == pool]) for pool in pools]
    groups.append(("(all)", "(all)", rows))
    table = []
    for pool, replica, members in groups:
        s = shares(members)
        reporting = [r for r in members if r.engine_queries_tokens >= 0]
        engine = (
            f"{sum(r.engine_hits_tokens for r in reporting):.0f}/{sum(r.engine_queries_tokens for r in reporting):.0f}"
            if reporting
            else "-"
        )
        table.append(
            [
                pool,
                replica,
                sum(r.prompt_blocks for r in members),
                sum(r.offered_blocks for r in members),
                sum(r.captured_blocks for r in members),
                engine,
                _share(s.offered),
                _share(s.captured),
                _share(s.delivered),
                _share(s.engine_hit_ratio),
            ]
        )
    header = ["POOL", "REPLICA", "BLOCKS", "OFFERED", "CAPTURED", "ENGINE HITS/QUERIES", "OFFERED%", "CAPTURED%"]
    head = f"since {_iso(reply.since)}\n"
    legend = (
        "OFFERED% offered/blocks: the reuse the workload offered; CAPTURED% captured/offered: the routing's share; "
        "DELIVERED% the engine's hit ratio over captured/blocks: the engine's share; HIT% the engine's hits/queries\n"
    )
    return head + _table([*header, "DELIVERED%", "HIT%"], table) + legend


def render(call: str, reply: Any) -> str:
    """A reply as a table for a terminal."""
    if call == "hit-ratio":
        return render_hit_ratio(reply)
    if call == "explain":
        head = (
            f"replica {reply.replica or '-'}  reason {reply.reason}  matched {reply.matched_blocks}/"
            f"{reply.total_blocks} blocks  ~{reply.predicted_uncached_tokens} uncached tokens  "
            f"pinned {reply.pinned or '-'}  key {reply.key_source}  profile {reply.profile}\n"
        )
        if reply.body_error:
            head += f"body: {reply.body_error}\n"
        if reply.conversation:
            head += f"conversation {reply.conversation} (no session key; known by its messages): {reply.session}\n"
        if reply.pair_reason:
            hop = f"prefill on {reply.prefill}, {reply.transfer_blocks} blocks cross" if reply.prefill else "no hop"
            head += f"pair {reply.pair_reason}: decode on {reply.replica or '-'}, {hop}\n"
        if reply.moved_by:
            head += f"moved off {reply.pinned} by {reply.moved_by}\n"
        elif reply.pin_lost:
            head += f"pin kept, its cache judged lost ({reply.pin_lost})\n"
        if reply.objective_predicted:
            asked = [f"TTFT {reply.objective_ttft_ms:g} ms"] if reply.objective_ttft_ms else []
            asked += [f"TPOT {reply.objective_tpot_ms:g} ms"] if reply.objective_tpot_ms else []
            action = f", on_miss {reply.on_miss}" if reply.on_miss else ""
            head += (
                f"objectives {', '.join(asked)}: predicted {reply.objective_predicted}{action}: {reply.objective_why}\n"
            )
        rows = []
        for r in sorted(reply.replicas, key=lambda r: (r.rank < 0, r.rank, r.replica)):
            parts = " ".join(f"{p.scorer}={p.contribution:.2f}" for p in r.scores if p.contribution)
            if r.price_s >= 0:
                # A priced candidate: its seconds and their parts say more than the scorers' tie-breaks.
                priced = " ".join(f"{p.part}={p.seconds * 1000:.1f}" for p in r.price_parts if p.seconds)
                parts = f"price {r.price_s * 1000:.1f} ms (ttft {r.price_ttft_s * 1000:.1f}; {priced}; {r.price_rates})"
            removed = f"{r.removed_by}: {r.removed_why}" if r.removed_by else ""
            age = f"{r.cache_evidence_age_s:.0f}s" if r.cache_evidence_age_s >= 0 else "never"
            cache = f"trust {r.cache_trust:.2f} ({age})" + (f" kv {r.kv_events}" if r.kv_events else "")
            rows.append(
                [
                    r.replica,
                    r.rank if r.rank >= 0 else "-",
                    f"{r.total:.3f}" if r.candidate else "-",
                    f"{r.matched_blocks} ({r.match_source})",
                    r.predicted_uncached_tokens,
                    cache,
                    _predicted(r.predicted_ttft_ms, r.predicted_tpot_ms),
                    removed or parts,
                ]
            )
        header = ["REPLICA", "RANK", "TOTAL", "MATCHED", "UNCACHED", "CACHE", "TTFT/TPOT MS", "SCORES / REMOVED"]
        table = _table(header, rows)
        return head + table + f"order {' > '.join(reply.order)}  fallbacks {', '.join(reply.fallbacks) or '-'}\n"
    if call == "replicas":
        rows = [
            [
                r.name,
                r.address,
                f"{r.health:.2f}",
                r.rotation_state,
                r.cordon or "-",
                r.inflight,
                r.queue,
                f"{r.kv_usage:.2f}",
                r.sessions_pinned,
                f"{r.cache_trust:.2f}",
                r.role or "both",
            ]
            for r in reply.replicas
        ]
        header = [
            "NAME",
            "ADDRESS",
            "HEALTH",
            "ROTATION",
            "CORDON",
            "INFLIGHT",
            "QUEUE",
            "KV",
            "SESSIONS",
            "TRUST",
            "ROLE",
        ]
        return _table(header, rows)
    if call == "usage":
        return _render_usage(reply)
    if call == "hot-keys":
        if not reply.enabled:
            return "hot keys are off (hot_keys.enabled)\n"
        rows = [
            [h.key, f"{h.requests_per_second:.1f}", f"{h.mean_prompt_tokens:.0f}", h.replicas, f"{h.hot_for_s:.0f}s"]
            for h in reply.hot_keys
        ]
        table = _table(["KEY", "REQ/S", "TOKENS", "REPLICAS", "HOT FOR"], rows)
        return table + f"{len(reply.hot_keys)} hot, {reply.cooling} cooling\n"
    if call in ("session", "forget"):
        if call == "forget":
            return f"{'forgotten' if reply.forgotten else 'was not pinned'}\n"
        return f"{reply.replica or 'not pinned'}\n"
    moved = f"  (moved {reply.sessions_moved} sessions)" if call == "drain" else ""
    return f"{reply.replica}: {reply.cordon or 'uncordoned'}{moved}\n"
