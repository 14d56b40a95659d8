"""``extproc admin``: the admin API from a shell, a table by default, ``--json`` for scripts.

extproc admin [--server HOST:PORT] [--token-file F] explain --body FILE [--header K:V ...]
extproc admin replicas | hot-keys | session KEY [--model M] | forget KEY [--model M]
extproc admin cordon NAME | uncordon NAME | drain NAME | watch [--count N] [--sample-rate R]
extproc admin usage [--json | --csv]
extproc admin hit-ratio

The tables it prints are :mod:`extproc.adapters.admin.tables`'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from extproc.adapters.admin.tables import render, text_table, usage_csv, usage_dict

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
        out.write(text_table(["TIME", "REPLICA", "REASON", "MODEL", "MATCHED", "MS", "SKIPPED", "PREFILL"], []))
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
