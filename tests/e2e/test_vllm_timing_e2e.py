"""What the router learns of a real engine's timing, through real Envoy, against vLLM's own CPU engine
(0.32, the ``small`` model: a cold prompt of ~1,500 tokens takes well over 50 ms to its first token).

vLLM sends a stream's response headers before its engine has even queued it (a Starlette
``StreamingResponse``), so the router times a stream's first token from its first streamed event,
and a non-streamed answer's from its headers (which come with its last token) less the engine's
own decode time (``vllm:inter_token_latency_seconds`` deltas). Both are compared here with what
the client and the engine saw: the stream's first ``data:`` line at the client, and the engine's
own ``vllm:time_to_first_token_seconds``. Requests go one at a time, each prompt new to the cache,
so each metric's delta is that one request's.

Two engines are started for the module: the timing tests route to the first alone; ``extproc
calibrate`` measures the second, and a gateway over both, configured with that prior and the price
profile, is loaded with concurrent streams while Explain's predicted time to first token of each
request's chosen engine is compared with the client's.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import statistics
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from extproc.adapters.calibrate import Engine
from extproc.adapters.cli import main as cli_main
from extproc.config import config_from_mapping
from extproc_lab.bench.price_accuracy import cold_prompt, measure_cold_prompts, render, summarize
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.engines.fleet import EngineSettings, VllmFleet
from tests.conftest import ROOT, require_binary, require_engines
from tests.helpers import scrape_total

# Timings against real engines: `make test` runs this module after the others, the host to itself
# (under the other xdist worker's load the queued and the lone requests took the same time).
pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.alone]
CHAT = "/v1/chat/completions"
MODEL = "demo-model"
TTFT = "extproc_ttft_seconds"
ENGINE_TTFT = "vllm:time_to_first_token_seconds"
# Well above the prompts' prefill here (a few hundred ms), well below the idle timeout that alone
# would end a stream stalled after its headers.
FIRST_BYTE_S = 2.0
STREAM_IDLE_S = 8.0


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmFleet]:
    require_engines("small")
    settings = EngineSettings(model="small", block_size=32, num_blocks=256, max_model_len=2048)
    with VllmFleet(replicas=2, settings=settings, log_dir=tmp_path_factory.mktemp("vllm-timing-engines")) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, engines: VllmFleet) -> Iterator[LocalGateway]:
    require_binary("envoy")
    config = tmp_path_factory.mktemp("vllm-timing") / "router.yaml"
    # Learn from every answer from the start (no request here states an objective).
    config.write_text(
        "health:\n  scrape_timeout_s: 1.0\n  latency_models: always\n"
        f"upstream:\n  first_byte_s: {FIRST_BYTE_S}\n  stream_idle_s: {STREAM_IDLE_S}\n"
    )
    gateway = LocalGateway(
        replicas=1,
        engines=engines,
        log_dir=tmp_path_factory.mktemp("vllm-timing-gw"),
        processor_args=("--config", str(config)),
        envoy_options={"first_byte_timeout_s": FIRST_BYTE_S, "stream_idle_timeout_s": STREAM_IDLE_S},
    )
    with gateway:
        yield gateway


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def post(gw: LocalGateway, body: dict[str, Any]) -> tuple[float, float, float | None, bytes]:
    """Send ``body``; seconds to the response headers, to the end, to the first ``data:`` line."""
    req = urllib.request.Request(
        gw.url + CHAT, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    started = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=60) as resp:
        headers = time.perf_counter() - started
        out = b""
        for line in resp:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - started
            out += line
    return headers, time.perf_counter() - started, first, out


def totals(gw: LocalGateway) -> tuple[float, float, float, float]:
    """The router's learned TTFT (sum, count) and the engine's own (sum, count), so far."""
    ours = _get(gw.metrics_url)
    engine = _get(gw.replica_url(gw.members[0].name) + "/metrics")
    return (
        scrape_total(ours, f"{TTFT}_sum"),
        scrape_total(ours, f"{TTFT}_count"),
        scrape_total(engine, f"{ENGINE_TTFT}_sum"),
        scrape_total(engine, f"{ENGINE_TTFT}_count"),
    )


def learned(gw: LocalGateway, before: tuple[float, float, float, float]) -> tuple[float, float]:
    """The one request's TTFT since ``before``: as the router learnt it, as the engine measured it."""
    deadline = time.monotonic() + 5.0
    while True:
        now = totals(gw)
        if now[1] == before[1] + 1 and now[3] == before[3] + 1:
            return now[0] - before[0], now[2] - before[2]
        assert time.monotonic() < deadline, (before, now)
        time.sleep(0.05)  # real time: the engine's counters, read over HTTP


def test_a_streams_learned_ttft_is_the_clients_first_token_not_its_headers(gw: LocalGateway) -> None:
    post(gw, {"model": MODEL, "messages": cold_prompt(-1), "max_tokens": 2, "stream": True})  # warm the server
    rows = []
    for i in range(6):
        before = totals(gw)
        body = {"model": MODEL, "messages": cold_prompt(i), "max_tokens": 8, "stream": True}
        headers_s, _, first_s, out = post(gw, body)
        assert first_s is not None and b"[DONE]" in out
        ours, engine = learned(gw, before)
        rows.append((headers_s, first_s, ours, engine))
    print("stream (headers_s, client first token s, router's TTFT s, engine's TTFT s):", rows)
    # The prompts are long enough: the engine's own TTFT is over 50 ms.
    assert all(engine >= 0.05 for *_, engine in rows), rows
    # What the router learnt is the client's first token, within 20%; and it is not the headers'
    # time, which vLLM sends before the engine has the request (a router timing them learns that).
    # (At the median: on a loaded host one stream's event may wait in the processor's loop.)
    errors = [abs(ours - first_s) / first_s for _, first_s, ours, _ in rows]
    assert statistics.median(errors) <= 0.2 and max(errors) <= 0.5, rows
    assert all(headers_s < 0.5 * first_s for headers_s, first_s, *_ in rows), rows
    # No usage chunk reached a client that did not ask for one (the router asked for it to count).
    assert b'"usage"' not in out.replace(b'"usage":null', b"")


def test_a_non_streamed_answers_ttft_is_learned_from_what_the_engine_reports(gw: LocalGateway) -> None:
    # Streams first: the engine's inter-token gaps the router reads from its /metrics.
    post(gw, {"model": MODEL, "messages": cold_prompt(100), "max_tokens": 32, "ignore_eos": True, "stream": True})
    time.sleep(1.0)  # a scrape after it
    errors = []
    for i, tokens in enumerate((1, 1, 16, 16, 16)):
        before = totals(gw)
        body = {"model": MODEL, "messages": cold_prompt(200 + i), "max_tokens": tokens, "ignore_eos": True}
        _, total_s, _, out = post(gw, body)
        assert json.loads(out)["usage"]["completion_tokens"] == tokens
        ours, engine = learned(gw, before)
        # Not the whole answer's time: its decode is taken off.
        if tokens > 1:
            assert ours < total_s - 0.5 * (total_s - engine), (ours, engine, total_s)
        errors.append(abs(ours - engine) / engine)
        time.sleep(0.5)  # the scrapes keep up with the engine's gaps
    print("non-streamed, relative error against the engine's TTFT:", [round(e, 3) for e in errors])
    # One token: the headers' time is the first token's (less the hops); more: its decode is estimated.
    assert statistics.median(errors) <= 0.2, errors


def test_the_output_tokens_the_router_learns_from_are_what_the_engine_generated(gw: LocalGateway) -> None:
    # Streams that asked for no usage (the router asks for it itself) and non-streamed answers, of
    # several lengths: the router's count of each answer's output tokens (which the price learns
    # a model's answer length from) against the engine's own count of the tokens it generated.
    def counts() -> tuple[float, float, float]:
        ours = _get(gw.metrics_url)
        engine = _get(gw.replica_url(gw.members[0].name) + "/metrics")
        return (
            scrape_total(ours, "extproc_observed_output_tokens_sum"),
            scrape_total(ours, "extproc_observed_output_tokens_count"),
            scrape_total(engine, "vllm:generation_tokens_total"),
        )

    sent = [(3, True), (7, True), (12, False), (5, False), (9, True)]
    before = counts()
    for i, (tokens, stream) in enumerate(sent):
        body = {"model": MODEL, "messages": cold_prompt(300 + i), "max_tokens": tokens, "ignore_eos": True}
        if stream:
            body |= {"stream": True}
        out = post(gw, body)[3]
        if not stream:
            assert json.loads(out)["usage"]["completion_tokens"] == tokens
    expected = sum(t for t, _ in sent)  # ignore_eos: every answer decodes its max_tokens
    deadline = time.monotonic() + 5.0
    while (after := counts())[1] < before[1] + len(sent) or after[2] < before[2] + expected:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)  # real time: the processor sees a body's end after the client does
    ours, answers, engine = (a - b for a, b in zip(after, before, strict=True))
    assert answers == len(sent)
    assert ours == engine == expected, (ours, engine)


def test_an_engine_stuck_after_its_headers_costs_the_first_byte_budget_not_the_idle_timeout(gw: LocalGateway) -> None:
    """The engine process stopped as soon as a stream's headers are out (vLLM sends them before its
    first token): Envoy's first-byte timeout never sees it, the processor's does."""
    assert gw.fleet is not None
    engine = gw.fleet.group.procs[gw.members[0].name]
    host, port = gw.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "messages": cold_prompt(300), "max_tokens": 8, "stream": True})
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    before = scrape_total(_get(gw.metrics_url), "extproc_first_token_timeouts_total")
    started = time.monotonic()
    try:
        conn.request("POST", CHAT, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        os.kill(engine.pid, signal.SIGSTOP)  # stuck: headers out, no token
        headers_s = time.monotonic() - started
        assert resp.status == 200
        try:
            got = resp.read()
        except (http.client.IncompleteRead, ConnectionError) as exc:
            got = getattr(exc, "partial", b"")
        ended_s = time.monotonic() - started
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        conn.close()
    print(f"stalled after its headers: headers {headers_s:.3f} s, ended {ended_s:.3f} s")
    assert headers_s < 1.0, headers_s
    assert b"[DONE]" not in got and b'"content"' not in got, got
    # Ended at the first-byte budget from the decision, not at the idle timeout.
    assert FIRST_BYTE_S * 0.9 <= ended_s < FIRST_BYTE_S + 1.5, ended_s
    after = scrape_total(_get(gw.metrics_url), "extproc_first_token_timeouts_total")
    assert after == before + 1


# -- calibration and the price's predicted TTFT ------------------------------------------------

POOL = "cpu"
# Concurrent clients over the two engines, three to an engine, so that requests often find a
# prefill running on both, the load the prediction's queue part is for. With four, the price
# mostly found one engine without a queue: 1 of 24 and 4 of 23 requests queued in two runs.
CLIENTS = 6
ROUNDS = 6
WARM_ROUNDS = 2
"""Each client's first rounds are not counted: the engines' rates are learnt on from the prior,
calibrated on one engine alone on the host, to what two busy engines sharing its two cores do."""


@pytest.fixture(scope="module")
def calibrated(engines: VllmFleet, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``extproc calibrate`` on the second engine (idle): the config it writes, parsed."""
    out = tmp_path_factory.mktemp("calibrate") / "prior.yaml"
    url = engines.url(engines.members[1].name)
    assert cli_main(["calibrate", "--url", url, "--pool", POOL, "--out", str(out)]) == 0
    text = out.read_text()
    print(text)
    return dict(yaml.safe_load(text))


def test_calibrate_measures_a_real_engine_and_its_prior_predicts_a_cold_prompt(
    engines: VllmFleet, calibrated: dict[str, Any]
) -> None:
    cfg = config_from_mapping(calibrated)
    (prior,) = cfg.health.engine_rates
    assert prior.labels == {"pool": POOL}
    # vLLM's CPU engine on this model: thousands of prompt tokens a second, a decode step of ms.
    assert 500 < prior.prefill_tokens_per_s < 200_000, prior
    assert 0.0005 < prior.decode_step_s < 0.5, prior
    # What it predicts of a fresh prompt alone is what the engine then takes uncontended, within a
    # factor of 1.5: the fastest of five, the statistic calibrate fits (each length's fastest
    # repeat), since whatever else runs on a 2-core host only adds to a request. The bound is the
    # sum of two errors CI showed: the fit is a line through five lengths (one run predicted 88 ms
    # where the fastest repeat at that length had taken 77), and the same prompt's fastest of five
    # moves by a quarter between runs (65 ms in that run; another took 88-105 ms for a prompt whose
    # calibration repeats had taken 89-99). A prior in the wrong units or without the engine's
    # fixed overhead is off by more.
    engine = Engine(engines.url(engines.members[1].name), MODEL)
    timings = [engine.stream(cold_prompt(i, 150)[0]["content"], 1) for i in range(5)]
    for timed in timings:
        predicted = prior.pool().rates.prefill_s(timed.prompt_tokens)
        print(f"{timed.prompt_tokens} tokens: predicted {predicted:.3f} s, took {timed.ttft_s:.3f} s")
    fastest = min(timings, key=lambda t: t.ttft_s)
    predicted = prior.pool().rates.prefill_s(fastest.prompt_tokens)
    assert 1 / 1.5 <= predicted / fastest.ttft_s <= 1.5, (predicted, [t.ttft_s for t in timings])


@pytest.fixture(scope="module")
def priced(
    tmp_path_factory: pytest.TempPathFactory, engines: VllmFleet, calibrated: dict[str, Any]
) -> Iterator[LocalGateway]:
    """Both engines, labelled ``pool=cpu``, behind the price profile with the calibrated prior."""
    require_binary("envoy")
    tmp = tmp_path_factory.mktemp("vllm-priced")
    config = {
        "profile": yaml.safe_load((ROOT / "benchmarks" / "routing" / "price.yaml").read_text())["profile"],
        "health": {**calibrated["health"], "scrape_timeout_s": 1.0, "latency_models": "always"},
    }
    (tmp / "router.yaml").write_text(yaml.safe_dump(config))
    gateway = LocalGateway(
        replicas=2,
        engines=engines,
        labels={r.name: {"pool": POOL} for r in engines.members},
        log_dir=tmp,
        processor_args=("--config", str(tmp / "router.yaml")),
    )
    with gateway:
        yield gateway


def test_under_load_the_price_predicts_the_chosen_engines_first_token(priced: LocalGateway) -> None:
    """Concurrent clients (:func:`extproc_lab.bench.price_accuracy.measure`): Explain's predicted
    time to first token of each request's chosen engine against the client's first token.

    The aim, 30% at the median, is measured by ``benchmarks/price_accuracy.py`` over several runs
    (benchmarks/price.md). Here, on a host whose two engines share two cores with Envoy, the
    router and the clients (so one engine's prefill slows the other's, which no per-replica model
    sees), the bound is one a working price holds there run after run (15% on a quiet host, 38% in
    one CI run): well under the header-timed router's 87%, and a queue part that predicts a wait
    the clients then have."""
    rows, decisions = measure_cold_prompts(
        priced.url, priced.admin_addresses[0], MODEL, clients=CLIENTS, rounds=ROUNDS, warm_rounds=WARM_ROUNDS
    )
    print(render(rows))
    summary = summarize(rows)
    print(summary)
    assert len(rows) == CLIENTS * (ROUNDS - WARM_ROUNDS) and decisions == CLIENTS * ROUNDS, (rows, decisions)
    assert summary.agreed >= 0.8 * len(rows), rows
    # Prompts whose cold first token takes tens of ms (one alone took 49 ms in a run, so the median).
    assert statistics.median(r.first_token_s for r in rows) >= 0.05, rows
    # Under load: some predictions have a queue in them, and those requests did wait longer. How
    # many depends on how the clients' requests interleave, so the floor is a count that makes
    # comparing the means worth it.
    assert summary.queued >= 3, rows
    assert summary.mean_first_token_queued_s is not None and summary.mean_first_token_alone_s is not None
    assert summary.mean_first_token_queued_s > summary.mean_first_token_alone_s, summary
    assert summary.median_error <= 0.5, summary
