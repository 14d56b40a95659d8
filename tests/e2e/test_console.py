"""The console in a real browser (Debian's chromium, headless, driven by Playwright) while a
replay runs through real Envoy; and the canary: no prompt, session key or API key reaches the
console or WatchDecisions.

Set ``UPDATE_SCREENSHOT=1`` to write the screenshot docs/operations.md shows (docs/console.png); otherwise it
goes to the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.routing.roles import ROLE_LABEL
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.workload import Conversation, multi_turn
from tests.conftest import IN_CI, ROOT, require_binary

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
CANARY_PROMPT = "canary-prompt-7f3a9c"
CANARY_SESSION = "canary-session-51be02"
CANARY_KEY = "sk-canary-key-c0ffee42"


def _need_chromium() -> None:
    if not Path(CHROMIUM).exists():
        message = "Debian's chromium is not installed (apt-get install chromium; scripts/install-os-deps.sh)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        if IN_CI:
            pytest.fail("playwright is not installed (the dev extra)")
        pytest.skip("playwright is not installed (the dev extra)")


@pytest.fixture(scope="module")
def gateway() -> Iterator[LocalGateway]:
    require_binary("envoy")
    with LocalGateway(replicas=3, time_scale=0.02) as gw:
        yield gw


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


def console_base(gw: LocalGateway) -> str:
    return gw.metrics_url.removesuffix("/metrics")


async def replay(
    http: aiohttp.ClientSession, gw: LocalGateway, convs: list[Conversation], turns: int, prompt: str = ""
) -> list[int]:
    """Each conversation's turns in order, the conversations concurrently; the statuses seen.
    Every request carries an API key; with ``prompt``, a system message too."""
    statuses: list[int] = []

    async def converse(conv: Conversation) -> None:
        for t in range(turns):
            messages = conv.next_messages(t)
            if prompt:
                messages = [{"role": "system", "content": prompt}, *messages]
            body = {"model": "demo-model", "messages": messages, "max_tokens": 2}
            headers = {"x-session-id": conv.session_id, "authorization": f"Bearer {CANARY_KEY}"}
            async with http.post(gw.url + CHAT, data=json.dumps(body), headers=headers) as resp:
                payload = await resp.read()
                statuses.append(resp.status)
                if resp.status == 200:
                    conv.add_answer(json.loads(payload)["choices"][0]["message"]["content"])
            await asyncio.sleep(0.05)  # real time: a client's think time between turns

    await asyncio.gather(*(converse(c) for c in convs))
    return statuses


async def test_console_shows_every_replica_and_the_hit_ratio_curve_during_a_replay(
    gateway: LocalGateway, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    _need_chromium()
    from playwright.async_api import async_playwright

    convs = multi_turn(8, 10, seed=21, system_tokens=200, document_tokens=400, run_id="console")
    running = asyncio.create_task(replay(http, gateway, convs, 10))
    names = [r.name for r in gateway.members]
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            await page.goto(console_base(gateway) + "/console")
            # Every replica in the table with a number, and a curve with points (samples every 2 s).
            await page.wait_for_function(
                """(n) => document.querySelectorAll('#fleet tbody tr').length === n
                   && document.querySelectorAll('#hitratio circle.pt[data-series="estimated"]').length >= 3
                   && document.querySelectorAll('#reasons .bar').length >= 1""",
                arg=len(names),
                timeout=60_000,
            )
            rows = await page.eval_on_selector_all(
                "#fleet tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
            )
            assert [r[0] for r in rows] == names
            for row in rows:
                assert any(cell.replace(".", "").replace("%", "").isdigit() for cell in row[1:]), row
                assert row[1] == "both"  # no role labels: whole requests
                assert row[7].endswith("%")  # KV usage
            points = await page.eval_on_selector_all("#hitratio circle.pt", "c => c.map(x => x.dataset.series)")
            assert points.count("estimated") >= 3 and points.count("round_robin") >= 3
            assert await page.locator("#heatmap rect").count() >= len(names) * 2
            await running
            # The explain form: a decision with its table, nothing routed.
            await page.fill("#explain-session", "console-explain")
            await page.click("#explain-form button")
            await page.wait_for_selector("#explain-result table")
            assert "->" in (await page.inner_text("#explain-result"))
            await page.select_option("#heat-metric", "sessions")
            await page.wait_for_timeout(2500)  # one more poll after the replay: the final numbers
            shot = ROOT / "docs" / "console.png" if os.environ.get("UPDATE_SCREENSHOT") else tmp_path / "console.png"
            await page.screenshot(path=str(shot), full_page=False)
            assert shot.stat().st_size > 10_000
            page_text = await page.content()
        finally:
            await browser.close()
    assert set(running.result()) == {200}
    assert CANARY_KEY not in page_text


async def test_no_prompt_session_key_or_api_key_in_the_console_or_the_decision_feed(
    gateway: LocalGateway, http: aiohttp.ClientSession
) -> None:
    convs = multi_turn(3, 3, seed=22, system_tokens=50, document_tokens=50, run_id="canary")
    for i, conv in enumerate(convs):
        conv.session_id = f"{CANARY_SESSION}-{i}"
    events: list[bytes] = []
    async with grpc.aio.insecure_channel(gateway.admin_addresses[0]) as channel:
        watch = pb_grpc.AdminStub(channel).WatchDecisions(pb.WatchRequest(sample_rate=1.0))

        async def collect() -> None:
            async for event in watch:
                events.append(event.SerializeToString())

        collecting = asyncio.create_task(collect())
        # The watch is registered when its call reaches the server: wait for a first event.
        (warm,) = multi_turn(1, 20, seed=23, system_tokens=20, document_tokens=20, run_id="warm")
        for _ in range(20):
            await replay(http, gateway, [warm], 1)
            await asyncio.sleep(0.1)  # real time: the watch registering on the real server
            if events:
                break
        assert events, "WatchDecisions sent nothing"
        await asyncio.sleep(0.5)  # a warm-up decision still in transit
        before = len(events)
        statuses = await replay(http, gateway, convs, 3, prompt=CANARY_PROMPT)
        for _ in range(50):
            if len(events) - before >= 9:
                break
            await asyncio.sleep(0.1)  # real time: events streaming from the real server
        watch.cancel()
        collecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            await collecting
    assert set(statuses) == {200}
    assert len(events) - before == 9
    async with http.get(console_base(gateway) + "/console/data") as resp:
        console = await resp.read()
    for page in ("/console", "/console/static/console.js"):
        async with http.get(console_base(gateway) + page) as resp:
            console += await resp.read()
    for blob in (b"".join(events), console):
        for canary in (CANARY_PROMPT, CANARY_SESSION, CANARY_KEY):
            assert canary.encode() not in blob, canary
    assert b"replica-0" in console  # the data is there, only the secrets are not


async def test_the_replica_table_shows_each_replicas_role(http: aiohttp.ClientSession) -> None:
    """A disaggregated fleet (llm-d's role labels, one replica without): each row names its role,
    as ListReplicas does."""
    _need_chromium()
    require_binary("envoy")
    from playwright.async_api import async_playwright

    labels = {"replica-0": {ROLE_LABEL: "prefill"}, "replica-1": {ROLE_LABEL: "decode"}}
    with LocalGateway(replicas=3, time_scale=0.02, labels=labels) as gw:
        async with grpc.aio.insecure_channel(gw.admin_addresses[0]) as channel:
            listed = await pb_grpc.AdminStub(channel).ListReplicas(pb.ListReplicasRequest(), timeout=10)
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = await browser.new_page()
                await page.goto(console_base(gw) + "/console")
                await page.wait_for_function("() => document.querySelectorAll('#fleet tbody tr').length === 3")
                headers = await page.eval_on_selector_all("#fleet thead th", "hs => hs.map(h => h.textContent)")
                rows = await page.eval_on_selector_all(
                    "#fleet tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
                )
            finally:
                await browser.close()
    assert headers[:2] == ["replica", "role"]
    expected = {"replica-0": "prefill", "replica-1": "decode", "replica-2": "both"}
    assert {r[0]: r[1] for r in rows} == expected
    assert {r.name: r.role for r in listed.replicas} == expected


def test_the_console_ships_in_the_package() -> None:
    from importlib import resources

    static = resources.files("extproc.adapters.admin") / "static"
    assert all((static / name).is_file() for name in ("index.html", "console.js", "console.css"))
