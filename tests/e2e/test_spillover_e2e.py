"""A replica that reports overload spills its sessions over, through real Envoy, the processor and
fake replicas (one whose /metrics page is switched at run time); once it recovers, the default
profile brings its sessions back, the price (opt-in) leaves each spilled session where its history
now is and sends new conversations to the replica again."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest

from extproc_lab.demo.fault_matrix import FAST_HEALTH, FaultyGateway
from tests.conftest import require_binary
from tests.helpers import PRICE_CONFIG, turn

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
VICTIM = "replica-0"
SPILLOVER = re.compile(r'^extproc_decisions_total\{[^}]*reason="spillover"[^}]*\} (\S+)$', re.M)


async def spillovers(http: aiohttp.ClientSession, metrics_url: str) -> float:
    async with http.get(metrics_url) as resp:
        return sum(float(v) for v in SPILLOVER.findall(await resp.text()))


def history(name: str) -> str:
    """A conversation's opening: long enough that recomputing it elsewhere costs."""
    return f"conversation {name} " + "background text " * 100


@pytest.mark.parametrize("profile", ["default", "price"])
async def test_overloaded_replica_spills_over_then_recovers(tmp_path: Path, profile: str) -> None:
    require_binary("envoy")
    gw = FaultyGateway(replicas=3, time_scale=0.05, faulty=(VICTIM,), log_dir=tmp_path)
    (tmp_path / "router.yaml").write_text(FAST_HEALTH + (PRICE_CONFIG.read_text() if profile == "price" else ""))
    gw.processor_args = ("--config", str(tmp_path / "router.yaml"))
    loop = asyncio.get_running_loop()
    histories = {f"s{i}": history(f"{i}") for i in range(12)}
    errors: list[tuple[str, int]] = []

    async def round_of_turns(http: aiohttp.ClientSession, tag: str) -> dict[str, str]:
        async def one(session: str) -> tuple[str, str]:
            histories[session] += f" turn {tag} question and answer"
            status, replica, _ = await turn(http, gw.url, session, histories[session])
            if status != 200:
                errors.append((session, status))
            return session, replica

        return dict(await asyncio.gather(*(one(s) for s in histories)))

    async def until(
        http: aiohttp.ClientSession, what: str, done: Callable[[dict[str, str]], bool], timeout_s: float = 8.0
    ) -> float:
        """Play rounds of turns until ``done(placement)``; the seconds it took."""
        start = loop.time()
        n = 0
        while loop.time() - start < timeout_s:
            n += 1
            if done(await round_of_turns(http, f"{what}{n}")):
                return loop.time() - start
            await asyncio.sleep(0.1)  # real time: rounds of turns against real processes
        raise AssertionError(f"{what}: not within {timeout_s}s")

    with gw:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            first = await round_of_turns(http, "pin")
            while sum(r == VICTIM for r in first.values()) < 2 and len(histories) < 40:
                # Placement follows the ring and the load: add sessions until the victim holds some.
                new = f"s{len(histories)}"
                histories[new] = history(new)
                status, first[new], _ = await turn(http, gw.url, new, histories[new])
                assert status == 200
            for _ in range(2):
                placement = await round_of_turns(http, "warm")
            assert placement == first  # sticky
            mine = {s for s, r in first.items() if r == VICTIM}
            assert mine, first  # some sessions are pinned to the faulty replica
            others = {s: r for s, r in first.items() if r != VICTIM}
            before = await spillovers(http, gw.metrics_url)

            gw.set_metrics_fault(VICTIM, "overloaded")
            away_s = await until(http, "over", lambda p: all(p[s] != VICTIM for s in mine))
            assert await spillovers(http, gw.metrics_url) > before  # decided as spillovers
            placement = await round_of_turns(http, "still")
            assert all(placement[s] != VICTIM for s in histories)  # nothing new lands there either
            assert all(placement[s] == r for s, r in others.items())  # the others stay put

            gw.set_metrics_fault(VICTIM, "ok")
            if profile == "default":
                # A spill does not re-pin: the sessions return to their pinned replica.
                back_s = await until(http, "back", lambda p: all(p[s] == VICTIM for s in mine))
                placement = await round_of_turns(http, "after")
                assert placement == first, Counter(placement.values())  # every session on its pinned replica
            else:
                # The price re-pins a spilled session where its history now is (going back would
                # recompute it): it stays there, and the recovered replica takes new conversations.
                for tag in ("after1", "after2"):
                    assert await round_of_turns(http, tag) == placement
                start = loop.time()
                while True:
                    new = f"s{len(histories)}"
                    histories[new] = history(new)
                    status, replica, _ = await turn(http, gw.url, new, histories[new])
                    assert status == 200
                    if replica == VICTIM:
                        break
                    assert len(histories) < 60, "no new conversation went to the recovered replica"
                back_s = loop.time() - start
            assert errors == []  # no client saw any of it
            assert away_s < 5 and back_s < 5, (away_s, back_s)
            print(f"{len(mine)} of {len(histories)} sessions moved away in {away_s:.2f}s, back in {back_s:.2f}s")
