"""Prefill/decode with real engines: two vLLM CPU engines (0.32) exchange a prompt's KV through
vLLM's ``ExampleConnector`` (the example connector formerly named ``SharedStorageConnector``: each
layer's KV written to, and read from, a folder both engines share), the prefill hop made by the
lab's fake of llm-d's sidecar in front of the decode engine (docs/disaggregation.md, "Real vLLM
engines").

The decode engine's own account is the evidence: ``usage.prompt_tokens_details.cached_tokens`` of
a prompt it has never seen, and its connector's log line. Every test uses prompts of its own; the
engines (vLLM's venv and a locally built model under ~/.cache/extproc; ``make engines``) are
started once for the module, and a missing venv fails under CI and skips elsewhere.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from extproc.request.kv_transfer import PREFILLER_HEADER
from extproc_lab.demo.processes import free_port
from extproc_lab.engines.fleet import EngineSettings, VllmFleet
from extproc_lab.replica.sidecar import Sidecar, build_sidecar_app
from tests.conftest import require_engines
from tests.helpers import metrics_page, scrape_total

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]
COMPLETIONS = "/v1/completions"
BLOCK = 32
PREFILL, DECODE = "replica-0", "replica-1"
_DONE = "vllm:request_success_total"
_ids = itertools.count()


def connector(store: Path) -> dict[str, Any]:
    """Both engines save every prompt's KV to ``store`` and load what they find there."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    require_engines("tiny")
    store = tmp_path_factory.mktemp("kv-store")
    settings = EngineSettings(
        model="tiny",
        block_size=BLOCK,
        num_blocks=128,
        kv_events=False,
        extra_args=("--kv-transfer-config", json.dumps(connector(store))),
    )
    with VllmFleet(replicas=2, settings=settings, log_dir=tmp_path_factory.mktemp("engines")) as fleet:
        yield fleet


@pytest.fixture
async def sidecar(engines: VllmFleet) -> AsyncIterator[str]:
    """The fake sidecar in front of the decode engine, in this process; its base URL."""
    runner = web.AppRunner(build_sidecar_app(Sidecar(engines.url(DECODE), prefill_timeout_s=120)), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def prompt() -> str:
    """A prompt of its own (its first block differs from every other's), about 1,000 tokens."""
    return f"request {next(_ids)} " + " ".join(f"word{i}" for i in range(180))


async def complete(
    http: aiohttp.ClientSession, url: str, text: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    body = {"model": "demo-model", "prompt": text, "max_tokens": 8, "temperature": 0}
    async with http.post(url + COMPLETIONS, json=body, headers=headers or {}) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


def cached(answer: dict[str, Any]) -> int:
    return int(((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def done(http: aiohttp.ClientSession, engines: VllmFleet, name: str) -> float:
    """Requests the engine has finished (whatever the reason)."""
    return scrape_total(await metrics_page(http, engines.url(name) + "/metrics"), _DONE)


async def test_the_decode_engine_loads_the_prompt_the_prefill_engine_computed(engines: VllmFleet, sidecar: str) -> None:
    text = prompt()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        prefilled = await done(http, engines, PREFILL)
        answer = await complete(http, sidecar, text, {PREFILLER_HEADER: engines.member(PREFILL).address})
        async with http.get(sidecar + "/sidecar") as resp:
            stats = await resp.json()
        assert await done(http, engines, PREFILL) == prefilled + 1  # the prefill hop reached it
    prompt_tokens = answer["usage"]["prompt_tokens"]
    # Every full block of the prompt came from the store: the decode engine had never seen it.
    assert cached(answer) == (prompt_tokens - 1) // BLOCK * BLOCK > 0
    assert answer["system_fingerprint"] == DECODE
    assert stats["prefillers"] == {engines.member(PREFILL).address: 1}
    # The connector hands the blocks over through the folder, not through the answer: the prefill
    # answer carries no kv_transfer_params, which the sidecar counts as a hop without parameters.
    assert stats["hops"] == 1 and stats["failed_hops"] == 1
    assert "External Cache Hit" in engines.group.log_tail(DECODE, 200)


async def test_without_the_prefill_hop_the_decode_engine_computes_the_prompt(engines: VllmFleet, sidecar: str) -> None:
    text = prompt()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        prefilled = await done(http, engines, PREFILL)
        alone = await complete(http, sidecar, text)  # no header: no hop
        again = await complete(http, engines.url(DECODE), text)
        assert await done(http, engines, PREFILL) == prefilled
    assert cached(alone) == 0
    # The second time, the decode engine's own cache (or the store it saved to) holds the prompt.
    assert cached(again) == (again["usage"]["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert again["choices"][0]["text"] == alone["choices"][0]["text"]


async def test_the_loaded_kv_decodes_as_the_computed_kv_does(engines: VllmFleet, sidecar: str) -> None:
    """The same greedy answer whether the decode engine computed the prompt or loaded it."""
    text = prompt()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        computed = await complete(http, engines.url(PREFILL), text)  # and saved to the store
        loaded = await complete(http, sidecar, text, {PREFILLER_HEADER: engines.member(PREFILL).address})
    assert cached(computed) == 0 and cached(loaded) > 0
    assert loaded["choices"][0]["text"] == computed["choices"][0]["text"]
