"""``extproc admin hit-ratio``: the table of a GetHitRatio reply, each replica, each pool and the
fleet with the three shares; a router's ledger as the admin API reads it."""

from __future__ import annotations

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc.adapters.admin.tables import render
from extproc.adapters.telemetry import reuse_rows
from extproc.app.router import Router
from tests.conftest import chat_body, make_config


def test_the_table_has_each_replica_each_pool_and_the_fleet() -> None:
    reply = pb.HitRatioResponse(
        since=0,
        rows=[
            pb.HitRatioRow(pool="a", replica="r0", prompt_blocks=100, offered_blocks=80, captured_blocks=40,
                           engine_queries_tokens=1600, engine_hits_tokens=320),
            pb.HitRatioRow(pool="a", replica="r1", prompt_blocks=100, offered_blocks=80, captured_blocks=80,
                           engine_queries_tokens=1600, engine_hits_tokens=1280),
            pb.HitRatioRow(pool="b", replica="r2", prompt_blocks=50, engine_queries_tokens=-1),
        ],
    )  # fmt: skip
    lines = render("hit-ratio", reply).splitlines()
    cells = {tuple(line.split()[:2]): line.split()[2:] for line in lines[2:-1]}
    # r0: offered 80%, captured 50%; the engine found 20% where the router believed 40%: delivered 50%.
    assert cells[("a", "r0")] == ["100", "80", "40", "320/1600", "80%", "50%", "50%", "20%"]
    assert cells[("a", "(pool)")] == ["200", "160", "120", "1600/3200", "80%", "75%", "83%", "50%"]
    assert cells[("b", "r2")] == ["50", "0", "0", "-", "0%", "-", "-", "-"]  # an engine without counters
    assert cells[("(all)", "(all)")][:3] == ["250", "160", "120"]


async def test_a_routers_ledger_as_the_admin_api_reads_it() -> None:
    router = Router(make_config())
    chat = {":path": "/v1/chat/completions", "x-session-id": "s"}
    body = chat_body("a long shared document " * 30)
    for _ in range(2):
        router.release(await router.route(chat, body))
    rows = reuse_rows(router)
    assert {r.replica for r in rows} == {"r0", "r1", "r2"}
    (used,) = [r for r in rows if r.prompt_blocks]
    # The second turn found the first's blocks on the replica it was pinned to.
    assert used.offered_blocks == used.captured_blocks == used.prompt_blocks // 2 > 0
    assert used.engine_queries_tokens == -1  # nothing scraped
