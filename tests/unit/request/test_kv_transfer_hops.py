"""The two hops' bodies (extproc.request.kv_transfer), the exchange they drive between two fake
replicas, and the fake of llm-d's sidecar driving it from the router's header."""

from __future__ import annotations

from typing import Any

from aiohttp import test_utils

from extproc.request.kv_transfer import PARAMS_FIELD, answer_params, decode_body, prefill_body, prefiller_header
from extproc_lab.replica import ReplicaEngine, build_app, get_profile
from extproc_lab.replica.sidecar import Sidecar, build_sidecar_app

MODEL = "demo-model"
PROMPT = "".join(f"{i:04d}" + "y" * 60 for i in range(30))


def client_body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **extra}


def test_the_prefill_hop_generates_one_token_and_asks_for_remote_decode() -> None:
    body = client_body(stream=True, stream_options={"include_usage": True}, max_completion_tokens=50, min_tokens=5)
    hop = prefill_body(body)
    assert hop["max_tokens"] == 1 and "max_completion_tokens" not in hop and hop["stream"] is False
    assert "min_tokens" not in hop and "stream_options" not in hop
    assert hop[PARAMS_FIELD]["do_remote_decode"] is True
    assert body["stream"] is True and body["min_tokens"] == 5  # the client's body is untouched


def test_answer_params_only_when_they_name_remote_blocks() -> None:
    params = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_host": "h", "remote_port": 1}
    assert answer_params({PARAMS_FIELD: params}) == params
    assert answer_params(b'{"kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": []}}') is not None
    assert answer_params(b"not json") is None
    assert answer_params(b"[]") is None
    assert answer_params({"error": {"message": "x"}}) is None
    assert answer_params({PARAMS_FIELD: {**params, "remote_block_ids": None}}) is None


def test_the_decode_hop_is_the_clients_body_with_the_params_or_without() -> None:
    body = client_body(stream=True, max_tokens=9)
    hop = decode_body(body, {"do_remote_prefill": True})
    assert hop[PARAMS_FIELD] == {"do_remote_prefill": True} and hop["stream"] is True and hop["max_tokens"] == 9
    assert PARAMS_FIELD not in decode_body({**body, PARAMS_FIELD: {"x": 1}}, None)
    assert prefiller_header("10.0.0.1:8000") == ("x-prefiller-host-port", "10.0.0.1:8000")


async def test_the_exchange_between_two_fake_replicas() -> None:
    profile = get_profile("demo", 0.01)
    p_server = test_utils.TestServer(build_app(ReplicaEngine(profile), "prefill-0", MODEL), host="127.0.0.1")
    d_server = test_utils.TestServer(build_app(ReplicaEngine(profile), "decode-0", MODEL), host="127.0.0.1")
    async with test_utils.TestClient(p_server) as p, test_utils.TestClient(d_server) as d:
        body = client_body(max_tokens=5)
        answer = await (await p.post("/v1/chat/completions", json=prefill_body(body))).read()
        params = answer_params(answer)
        assert params is not None
        decoded = await (await d.post("/v1/chat/completions", json=decode_body(body, params))).json()
        usage = decoded["usage"]
        assert usage["completion_tokens"] == 5
        assert usage["prompt_tokens_details"]["cached_tokens"] == 16 * len(params["remote_block_ids"])
        # A failed prefill hop: the decode hop goes as the client sent it, computed there.
        await p.post("/kv_transfer/faults", json={"prefill": "fail"})
        failed = await p.post("/v1/chat/completions", json=prefill_body(client_body(max_tokens=5, seed=1)))
        assert failed.status == 500 and answer_params(await failed.read()) is None
        other = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT.replace("y", "z")}], "max_tokens": 2}
        plain = await (await d.post("/v1/chat/completions", json=decode_body(other, None))).json()
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_the_sidecar_makes_the_hop_the_header_names_and_passes_other_requests_through() -> None:
    profile = get_profile("demo", 0.01)
    p_server = test_utils.TestServer(build_app(ReplicaEngine(profile), "prefill-0", MODEL), host="127.0.0.1")
    d_server = test_utils.TestServer(build_app(ReplicaEngine(profile), "decode-0", MODEL), host="127.0.0.1")
    async with test_utils.TestClient(p_server) as p, test_utils.TestClient(d_server) as d:
        sidecar = Sidecar(f"http://127.0.0.1:{d.server.port}", prefill_timeout_s=0.5)
        s_server = test_utils.TestServer(build_sidecar_app(sidecar), host="127.0.0.1")
        async with test_utils.TestClient(s_server) as s:
            header = dict([prefiller_header(f"127.0.0.1:{p.server.port}")])
            hopped = await s.post("/v1/chat/completions", json=client_body(max_tokens=3, stream=True), headers=header)
            assert hopped.status == 200 and hopped.headers["x-replica-name"] == "decode-0"
            assert b"[DONE]" in await hopped.read()
            assert (await (await p.get("/kv_transfer")).json())["exported_blocks"] > 0
            assert (await (await d.get("/kv_transfer")).json())["fetched_blocks"] > 0
            plain = await (
                await s.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            ).json()
            assert plain["usage"]["completion_tokens"] == 2 and sidecar.hops == 1
            await p.post("/kv_transfer/faults", json={"prefill": "hang"})
            other = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT.upper()}], "max_tokens": 2}
            late = await (await s.post("/v1/chat/completions", json=other, headers=header)).json()
            assert late["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert sidecar.failed_hops == 1


async def test_the_sidecar_passes_other_paths_to_its_replica_and_counts_the_prefillers_named() -> None:
    profile = get_profile("demo", 0.01)
    d_server = test_utils.TestServer(build_app(ReplicaEngine(profile), "decode-0", MODEL), host="127.0.0.1")
    async with test_utils.TestClient(d_server) as d:
        sidecar = Sidecar(f"http://127.0.0.1:{d.server.port}", prefill_timeout_s=0.5)
        s_server = test_utils.TestServer(build_sidecar_app(sidecar), host="127.0.0.1")
        async with test_utils.TestClient(s_server) as s:
            metrics = await s.get("/metrics")  # the router scrapes the replica through its sidecar
            assert metrics.status == 200 and "vllm:num_requests_running" in await metrics.text()
            assert (await s.get("/health")).status == 200
            faults = await s.post("/kv_transfer/faults", json={"fetch": "fail"})
            assert faults.status == 200 and (await (await d.get("/kv_transfer")).json())["faults"]["fetch"] == "fail"
            gone = dict([prefiller_header("127.0.0.1:9")])  # nothing listens: the hop fails, the decode runs
            answer = await s.post("/v1/chat/completions", json=client_body(max_tokens=2), headers=gone)
            assert answer.status == 200
            stats = await (await s.get("/sidecar")).json()
            assert stats == {"hops": 1, "failed_hops": 1, "prefillers": {"127.0.0.1:9": 1}}
