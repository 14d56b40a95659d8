"""Cache tiers end to end: real Envoy, one processor, three fake vLLM replicas with CPU memory
behind a small GPU cache (``--cpu-offload-blocks``, vLLM's offloading connector: events with
``medium: "CPU"``), all on this machine.

A session's blocks are pushed out of its replica's GPU by other prompts sent to that replica
directly (bypassing Envoy: only the events tell the processor). CPU memory still holds them, so
the pin holds (Explain: no ``pin_lost``; the processor weighs a CPU block 0.3 here, under
``unpin_below``'s half, so a judgement on the weighed match would have lost it), the next turn
goes to the same replica, is answered with the blocks loaded from CPU memory among its cached
tokens, and the processor's prediction of those tokens agrees with what the replica reported.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import aiohttp
import grpc
import pytest

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.replica.tokenizer_dir import build_tokenizer_dir, sample_text
from tests.conftest import require_binary
from tests.helpers import metrics_page, scrape, scrape_total, wait_for

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
MODEL = "demo-model"
REPLICAS = ("replica-0", "replica-1", "replica-2")
SESSION = "tiered"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGateway]:
    require_binary("envoy")
    tok = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    sockets = tmp_path_factory.mktemp("kv")
    config = tmp_path_factory.mktemp("cfg") / "router.yaml"
    config.write_text("kv_events:\n  cpu_weight: 0.3\n")
    labels, replica_args = {}, {}
    for name in REPLICAS:
        pub, replay = f"ipc://{sockets}/{name}.pub", f"ipc://{sockets}/{name}.replay"
        labels[name] = {"kv_events": pub, "kv_replay": replay}
        replica_args[name] = ("--tokenizer", str(tok), "--kv-events", pub, "--kv-replay", replay,
                              "--kv-blocks", "64", "--cpu-offload-blocks", "4096")  # fmt: skip
    gw = LocalGateway(
        replicas=len(REPLICAS),
        time_scale=0.02,
        labels=labels,
        replica_args=replica_args,
        processor_args=("--config", str(config), "--tokenizer", f"{MODEL}={tok}", "--kv-check-sample-rate", "1"),
    )
    with gw:
        yield gw


def conversation(seed: int, turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": sample_text(80, seed)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": sample_text(25, seed * 100 + t)})
        msgs.append({"role": "assistant", "content": sample_text(10, seed * 1000 + t)})
    return msgs[:-1]


async def post(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], **headers: str
) -> tuple[str, dict[str, int]]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    async with http.post(url + CHAT, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return resp.headers.get("x-replica-name", ""), {"prompt": usage["prompt_tokens"], "cached": cached}


async def synced(http: aiohttp.ClientSession, gw: LocalGateway) -> None:
    """Wait until the processor applied every batch each replica published."""
    wanted = {}
    for name in REPLICAS:
        async with http.get(gw.replica_url(name) + "/kv_events") as resp:
            wanted[name] = (await resp.json())["next_seq"] - 1

    async def check() -> bool:
        page = await metrics_page(http, gw.metrics_url)
        return all(
            scrape(page, "extproc_kv_feed_last_seq", replica=n) == seq
            and scrape(page, "extproc_kv_feed_live", replica=n) == 1
            for n, seq in wanted.items()
        )

    await wait_for(check, within_s=10.0)


async def checks(http: aiohttp.ClientSession, gw: LocalGateway, replica: str, outcome: str) -> float:
    page = await metrics_page(http, gw.metrics_url)
    return scrape_total(page, "extproc_kv_prediction_checks_total", replica=replica, outcome=outcome)


async def test_a_session_whose_blocks_moved_to_cpu_memory_stays_and_hits_there(gateway: LocalGateway) -> None:
    async with aiohttp.ClientSession() as http:
        for name in REPLICAS:  # every feed heard from, so the index answers for all of them
            await post(http, gateway.replica_url(name), conversation(90 + REPLICAS.index(name), 1))
        await synced(http, gateway)
        first_turn = conversation(1, 1)
        pinned, first = await post(http, gateway.url, first_turn, **{"x-session-id": SESSION})
        blocks = first["prompt"] // 16
        for seed in range(10, 30):  # 64 GPU blocks: these push the session's out of the GPU
            assert (await post(http, gateway.replica_url(pinned), conversation(seed, 1)))[0] == pinned
        await synced(http, gateway)

        second_turn = conversation(1, 2)
        body = json.dumps({"model": MODEL, "messages": second_turn, "max_tokens": 2}).encode()
        async with grpc.aio.insecure_channel(gateway.admin_addresses[0]) as channel:
            stub = pb_grpc.AdminStub(channel)
            headers = [pb.Header(key=":path", value=CHAT), pb.Header(key="x-session-id", value=SESSION)]
            explained = await stub.Explain(pb.ExplainRequest(headers=headers, body=body))
        assert explained.pinned == pinned and explained.pin_lost == "", explained
        held = next(r for r in explained.replicas if r.replica == pinned)
        # Weighed 0.3 a block: out of the GPU (else it would be all of them), still in CPU memory.
        assert held.match_source == "kv_events" and 0 < held.matched_blocks < blocks, held

        agree, under = await checks(http, gateway, pinned, "agree"), await checks(http, gateway, pinned, "under")
        replica, second = await post(http, gateway.url, second_turn, **{"x-session-id": SESSION})
        assert replica == pinned
        assert second["cached"] >= (blocks - 1) * 16, (second, blocks)  # loaded from CPU memory
        await wait_for(lambda: _grew(http, gateway, pinned, agree), within_s=5.0)
        assert await checks(http, gateway, pinned, "under") == under


async def _grew(http: aiohttp.ClientSession, gw: LocalGateway, replica: str, before: float) -> bool:
    return await checks(http, gw, replica, "agree") > before
