"""What ``extproc admin`` prints of a reply: a table per call, the usage as JSON or CSV, and where
the hit ratio goes (``hit-ratio``)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from extproc.fleet.cache.reuse import ReuseRow


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``rows`` under ``header`` in columns as wide as their widest cell."""
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
    out = f"tokens since {_iso(reply.since)}\n" + text_table(
        ["TENANT", "MODEL", "INPUT", "CACHED", "OUTPUT", "TOTAL", "ESTIMATED"], rows
    )
    budgets = [
        [b.kind, b.name, w.window, f"{w.limit:.0f}", f"{w.used:.0f}", f"{w.remaining:.0f}", f"{w.reset_s:.0f}s"]
        for b in reply.budgets
        for w in b.windows
    ]
    if budgets:
        out += "\n" + text_table(["BUDGET", "NAME", "WINDOW", "LIMIT", "USED", "REMAINING", "RESETS IN"], budgets)
    return out


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def reuse_rows(reply: Any) -> list[ReuseRow]:
    """A GetHitRatio reply's rows as :class:`extproc.fleet.cache.reuse.ReuseRow` values."""
    from extproc.fleet.cache.reuse import ReuseRow

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
    from extproc.fleet.cache.reuse import shares

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
    return head + text_table([*header, "DELIVERED%", "HIT%"], table) + legend


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
        table = text_table(header, rows)
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
        return text_table(header, rows)
    if call == "usage":
        return _render_usage(reply)
    if call == "hot-keys":
        if not reply.enabled:
            return "hot keys are off (hot_keys.enabled)\n"
        rows = [
            [h.key, f"{h.requests_per_second:.1f}", f"{h.mean_prompt_tokens:.0f}", h.replicas, f"{h.hot_for_s:.0f}s"]
            for h in reply.hot_keys
        ]
        table = text_table(["KEY", "REQ/S", "TOKENS", "REPLICAS", "HOT FOR"], rows)
        return table + f"{len(reply.hot_keys)} hot, {reply.cooling} cooling\n"
    if call in ("session", "forget"):
        if call == "forget":
            return f"{'forgotten' if reply.forgotten else 'was not pinned'}\n"
        return f"{reply.replica or 'not pinned'}\n"
    moved = f"  (moved {reply.sessions_moved} sessions)" if call == "drain" else ""
    return f"{reply.replica}: {reply.cordon or 'uncordoned'}{moved}\n"
