"""Canary splits with model rewrites, through real Envoy, the processor and fake replicas (which
answer with the model they served, as vLLM does)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from extproc_lab.demo.gateway import LocalGateway
from tests.conftest import require_binary
from tests.helpers import chat, scrape_total

pytestmark = pytest.mark.e2e

SPLITS = [
    {
        "name": "support-canary",
        "match": {"model": "support*"},
        "targets": [{"model": "support-v1", "weight": 90}, {"model": "support-v2", "weight": 10}],
    }
]


def support(text: str) -> dict[str, Any]:
    """A one-token chat for the model the split rule matches."""
    return chat(text, model="support", max_tokens=1)


async def served(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]) -> str:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        text = await resp.text()
        assert resp.status == 200, text
        model: str = json.loads(text)["model"]
        return model


@pytest.mark.parametrize("full_duplex", [False, True], ids=["buffered", "full-duplex"])
async def test_a_90_10_split_by_session_rewrites_the_model(tmp_path: Path, full_duplex: bool) -> None:
    require_binary("envoy")
    (tmp_path / "router.yaml").write_text(yaml.safe_dump({"splits": SPLITS}))
    args = ("--config", str(tmp_path / "router.yaml"))
    with LocalGateway(replicas=2, processor_args=args, full_duplex=full_duplex, time_scale=0.001) as gw:
        connector = aiohttp.TCPConnector(limit=32)
        async with aiohttp.ClientSession(connector=connector) as http:
            sessions = 2000 if not full_duplex else 400
            gate = asyncio.Semaphore(32)

            async def first_turn(i: int) -> str:
                async with gate:
                    return await served(http, gw.url, support(f"hello {i}"), {"x-session-id": f"s{i}"})

            arms = await asyncio.gather(*(first_turn(i) for i in range(sessions)))
            assert set(arms) <= {"support-v1", "support-v2"}  # every answer came from a rewritten body
            share = arms.count("support-v2") / sessions
            if not full_duplex:
                assert abs(share - 0.10) <= 0.02, share
            else:
                assert 0.05 <= share <= 0.15, share  # 400 sessions: the exact figure is the buffered case's

            # Every later turn of a session stays in its arm; a longer history (several blocks) too.
            async def later_turns(i: int) -> set[str]:
                seen = set()
                history = f"hello {i} " + "and more context " * 30
                for t in range(3):
                    history += f" turn {t}"
                    async with gate:
                        seen.add(await served(http, gw.url, support(history), {"x-session-id": f"s{i}"}))
                return seen

            sample = range(0, sessions, sessions // 40)
            later = await asyncio.gather(*(later_turns(i) for i in sample))
            assert all(seen == {arms[i]} for i, seen in zip(sample, later, strict=True))

            # A header naming a target pins that arm, whatever the hash says.
            v1_session = arms.index("support-v1")
            pinned = await served(
                http, gw.url, support("pinned"), {"x-session-id": f"s{v1_session}", "x-canary": "support-v2"}
            )
            assert pinned == "support-v2"
            # A model no rule matches goes unchanged; a body not JSON still gets an answer.
            assert await served(http, gw.url, chat("other", max_tokens=1), {}) == "demo-model"
            async with http.post(f"{gw.url}/v1/chat/completions", data=b"{not json", headers={}) as resp:
                assert resp.status == 400

            async with http.get(gw.metrics_url) as resp:
                page = await resp.text()
            v2 = scrape_total(page, "extproc_split_requests_total", rule="support-canary", arm="support-v2")
            v1 = scrape_total(page, "extproc_split_requests_total", rule="support-canary", arm="support-v1")
            assert v1 + v2 >= sessions and v2 >= arms.count("support-v2")
            ttft = scrape_total(page, "extproc_split_ttft_seconds_count", rule="support-canary", arm="support-v2")
            assert ttft >= arms.count("support-v2")


async def test_a_large_body_is_rewritten_whole_in_full_duplex(tmp_path: Path) -> None:
    """A body of several streamed chunks is replaced by the rewritten one, its length fixed."""
    require_binary("envoy")
    splits = [{"match": {"model": "support"}, "targets": [{"model": "support-v2-with-a-longer-name"}]}]
    (tmp_path / "router.yaml").write_text(yaml.safe_dump({"splits": splits}))
    args = ("--config", str(tmp_path / "router.yaml"))
    with LocalGateway(replicas=1, processor_args=args, full_duplex=True, time_scale=0.001) as gw:
        async with aiohttp.ClientSession() as http:
            body = support("x" * 200_000)
            async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                payload = json.loads(await resp.read())
                assert resp.status == 200, payload
            assert payload["model"] == "support-v2-with-a-longer-name"
            assert payload["usage"]["prompt_tokens"] >= 200_000 // 4


@pytest.mark.parametrize(
    ("splits", "field"),
    [
        ([{"match": {"model": "m"}}], "splits[0].targets"),
        ([{"targets": [{"model": "a", "weight": -1}]}], "splits[0].targets[0].weight"),
        ([{"targets": [{"model": "a", "wieght": 1}]}], "splits[0].targets[0].wieght"),
        ([{"targets": [{"model": "a", "weight": 0}]}], "splits[0].targets"),
        ([{"match": {"modle": "m"}, "targets": [{"model": "a"}]}], "splits[0].match.modle"),
    ],
)
def test_a_malformed_rule_set_is_refused_at_start_naming_the_field(
    tmp_path: Path, splits: list[dict[str, Any]], field: str
) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"splits": splits}))
    done = subprocess.run(
        [sys.executable, "-m", "extproc", "serve", "--config", str(path), "--replica", "a=127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode != 0
    assert field in done.stderr, done.stderr
