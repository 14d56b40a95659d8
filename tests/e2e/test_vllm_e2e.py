"""End to end with real engines: real Envoy -> our processor -> two vLLM CPU engines (0.32), on 127.0.0.1.

The router is configured as a user would for that fleet: the model's own directory as its
tokenizer, each engine's KV-event publisher, ``kv_events.block_size`` the engines' 32 (see
:class:`~extproc_lab.demo.gateway.LocalGateway` with ``engine="vllm"``). What the router believes
is compared with what the engines themselves report: ``usage.prompt_tokens_details.cached_tokens``
in each answer, their ``/metrics`` counters, their KV events.

The engines (vLLM's venv and a locally built model, under ~/.cache/extproc; ``make engines``) are
two of the session's shared fleet (tests/e2e/conftest.py: started once, handed over with empty
caches); a missing venv is built first (about 2 minutes), and failing to build
it fails under CI and skips elsewhere. Which engine answered a request is read from the engines'
own ``vllm:request_success_total`` (requests here are sent one at a time).
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc._proto.admin.v1 import admin_pb2 as pb
from extproc._proto.admin.v1 import admin_pb2_grpc as pb_grpc
from extproc.fleet.health.vllm_metrics import ReplicaMetrics, parse_vllm_metrics
from extproc.routing.filters import OverloadFilter
from extproc.routing.model import Replica, ReplicaState
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.workload import Conversation, multi_turn, words
from extproc_lab.replica import PROFILES, ReplicaModel, Seq
from tests.conftest import require_binary
from tests.e2e.conftest import TINY_BLOCKS, TinyEngines
from tests.helpers import scrape_total

pytestmark = pytest.mark.e2e
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MODEL = "demo-model"
BLOCK = 32
# Small enough to fill (512 blocks of 32 tokens: 16,384 tokens), above one full-length request.
BLOCKS = TINY_BLOCKS
_DONE = "vllm:request_success_total"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, tiny_engines: TinyEngines) -> Iterator[LocalGateway]:
    require_binary("envoy")
    config = tmp_path_factory.mktemp("vllm-config") / "router.yaml"
    config.write_text("health:\n  scrape_timeout_s: 1.0\n")
    gateway = LocalGateway(
        replicas=2,
        engines=tiny_engines.fresh(),
        log_dir=tmp_path_factory.mktemp("vllm-gw"),
        # Every answer read for its cached tokens: the sampled prediction check sees them all.
        # A CPU engine busy on both cores can take longer than the default 0.2 s to serve its
        # /metrics (a timed-out scrape leaves the router without load figures, as a CI run saw).
        processor_args=("--kv-check-sample-rate", "1", "--config", str(config)),
    )
    with gateway:
        yield gateway


@pytest.fixture(scope="module")
def admin(gw: LocalGateway) -> Iterator[pb_grpc.AdminStub]:
    with grpc.insecure_channel(gw.admin_addresses[0]) as channel:
        yield pb_grpc.AdminStub(channel)


# -- helpers ------------------------------------------------------------------------------------


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _post(url: str, body: dict[str, Any], session: str | None = None, timeout_s: float = 60) -> dict[str, Any]:
    headers = {"content-type": "application/json", **({"x-session-id": session} if session else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return dict(json.loads(resp.read()))


def done_counts(gw: LocalGateway) -> dict[str, float]:
    """Requests each engine has finished, from its own /metrics (-1 for one that is down)."""
    out = {}
    for r in gw.members:
        try:
            out[r.name] = scrape_total(_get(gw.replica_url(r.name) + "/metrics"), _DONE)
        except OSError:
            out[r.name] = -1.0
    return out


def chat_body(messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


class Sent:
    """One request through Envoy: the router's prediction just before, what the engine reported."""

    def __init__(self, gw: LocalGateway, admin: pb_grpc.AdminStub, path: str, body: dict[str, Any], session: str):
        headers = [pb.Header(key=":path", value=path), pb.Header(key="x-session-id", value=session)]
        self.explained = admin.Explain(pb.ExplainRequest(headers=headers, body=json.dumps(body).encode()))
        chosen = [r for r in self.explained.replicas if r.replica == self.explained.replica]
        self.predicted = chosen[0].matched_blocks * BLOCK if chosen else -1
        self.source = chosen[0].match_source if chosen else ""
        before = done_counts(gw)
        self.answer = _post(gw.url + path, body, session)
        self.engine = _which(gw, before)
        assert self.answer["system_fingerprint"] == self.engine  # the engine's name (fleet.py)
        usage = self.answer["usage"]
        self.prompt_tokens = int(usage["prompt_tokens"])
        self.cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        # The engine's events for this request reach the index within milliseconds; a little time
        # so that the next prediction is made on them.
        time.sleep(0.15)

    def text(self) -> str:
        choice = self.answer["choices"][0]
        return str(choice["message"]["content"] if "message" in choice else choice["text"])

    def __repr__(self) -> str:
        return (
            f"Sent(explained {self.explained.replica} {self.explained.reason} predicted {self.predicted} "
            f"({self.source}), engine {self.engine} prompt {self.prompt_tokens} cached {self.cached})"
        )


def _which(gw: LocalGateway, before: dict[str, float]) -> str:
    """The engine whose finished-request counter moved (the request was the only one in flight)."""
    deadline = time.monotonic() + 5
    while True:
        after = done_counts(gw)
        moved = [name for name in after if after[name] > before[name]]
        if len(moved) == 1:
            return moved[0]
        assert time.monotonic() < deadline, f"no single engine counted the request: {before} -> {after}"
        time.sleep(0.05)  # real time: the engines' counters, read over HTTP


def converse(gw: LocalGateway, admin: pb_grpc.AdminStub, convo: Conversation, turn: int, **extra: Any) -> Sent:
    sent = Sent(gw, admin, CHAT, chat_body(convo.next_messages(turn), **extra), convo.session_id)
    convo.add_answer(sent.text())
    return sent


def checks(gw: LocalGateway) -> Counter[str]:
    """The sampled prediction check's outcomes so far, over both engines."""
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(_get(gw.metrics_url)):
        for sample in family.samples:
            if sample.name == "extproc_kv_prediction_checks_total":
                out[sample.labels["outcome"]] += int(sample.value)
    return out


def replicas(admin: pb_grpc.AdminStub) -> dict[str, pb.ReplicaInfo]:
    return {r.name: r for r in admin.ListReplicas(pb.ListReplicasRequest()).replicas}


def wait_until(what: Any, cond: Any, timeout_s: float = 30.0, every_s: float = 0.2) -> Any:
    """Poll ``cond`` until truthy; ``what`` (or what it returns, if callable) names it on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(every_s)  # real time: polls real processes


# -- tests --------------------------------------------------------------------------------------


def test_predicted_cached_tokens_equal_the_engines_on_chat_completions(
    gw: LocalGateway, admin: pb_grpc.AdminStub
) -> None:
    before = checks(gw)
    convos = multi_turn(3, 3, seed=21, system_tokens=200, document_tokens=500, followup_tokens=60, run_id="chat")
    sent = [converse(gw, admin, c, turn) for turn in range(3) for c in convos]
    for s in sent:
        assert s.predicted == s.cached, s
        assert s.engine == s.explained.replica, s
    followups = sent[len(convos) :]
    assert all(s.source == "kv_events" and s.cached >= 5 * BLOCK for s in followups), followups
    # The sampled check (every answer here) saw the same: each prediction within a block.
    after = checks(gw) - before
    assert after["agree"] >= len(followups) and not after["over"] and not after["under"], after


def test_predicted_cached_tokens_equal_the_engines_on_completions(gw: LocalGateway, admin: pb_grpc.AdminStub) -> None:
    rng = random.Random(22)
    for i in range(2):
        prompt = f"Document {i}. " + words(rng, 500)
        session = f"completions-{i}"
        for turn in range(3):
            s = Sent(gw, admin, COMPLETIONS, {"model": MODEL, "prompt": prompt, "max_tokens": 4}, session)
            assert s.predicted == s.cached, (turn, s)
            if turn:
                assert s.source == "kv_events" and s.cached >= 5 * BLOCK, (turn, s)
            prompt += s.text() + f"\nMore {turn}: " + words(rng, 60)


def test_a_cache_salt_is_hashed_as_the_engine_hashes_it(gw: LocalGateway, admin: pb_grpc.AdminStub) -> None:
    plain, salted, other = multi_turn(3, 2, seed=23, system_tokens=200, document_tokens=400, run_id="salt")
    salted.user_turns = other.user_turns = list(plain.user_turns)
    for turn in range(2):
        p = converse(gw, admin, plain, turn)
        s = converse(gw, admin, salted, turn, cache_salt="tenant-a")
        o = converse(gw, admin, other, turn, cache_salt="tenant-b")
        for x in (p, s, o):
            assert x.predicted == x.cached, (turn, x)
        if turn == 0:
            # The same prompt under another salt shares nothing (vLLM salts the first block).
            assert s.cached == 0 and o.cached == 0, (s, o)
        else:
            assert s.cached > 0 and o.cached > 0, (s, o)


def test_sessions_stay_on_their_engine(gw: LocalGateway, admin: pb_grpc.AdminStub) -> None:
    # Each with a system prompt of its own: new sessions spread (a shared one draws them together).
    convos = [
        multi_turn(1, 4, seed=240 + i, system_tokens=100, document_tokens=200, followup_tokens=40, run_id=f"sticky{i}")[
            0
        ]
        for i in range(6)
    ]
    where: dict[str, set[str]] = {c.session_id: set() for c in convos}
    for turn in range(4):
        for c in convos:
            s = converse(gw, admin, c, turn)
            where[c.session_id].add(s.engine)
            assert s.predicted == s.cached, s
    assert all(len(engines) == 1 for engines in where.values()), where
    assert {e for engines in where.values() for e in engines} == {r.name for r in gw.members}, where


def test_a_real_metrics_page_feeds_the_health_score(gw: LocalGateway, admin: pb_grpc.AdminStub) -> None:
    loaded, idle = (r.name for r in gw.members)
    for _ in range(2):  # a prompt seen twice: the prefix-cache counters have hits
        _post(gw.replica_url(loaded) + COMPLETIONS, {"model": MODEL, "prompt": "hello " * 100, "max_tokens": 1})
    page = parse_vllm_metrics(_get(gw.replica_url(loaded) + "/metrics"))
    assert (page.block_size, page.num_gpu_blocks) == (BLOCK, BLOCKS)
    assert page.models == (MODEL,)
    assert page.prefix_queries > 0 and 0 < page.prefix_hits <= page.prefix_queries
    assert page.running == page.waiting == 0 and page.kv_usage == 0.0
    wait_until("both engines healthy", lambda: all(r.health > 0.9 for r in replicas(admin).values()))

    # Load one engine directly (not through the router): more long generations than its cache holds
    # (each about 2,000 tokens with its output: twice the cache's worth of them).
    rng = random.Random(25)
    bodies = [
        {"model": MODEL, "prompt": words(rng, 1400), "max_tokens": 300, "ignore_eos": True}
        for _ in range(2 * BLOCKS * BLOCK // 2000 + 1)
    ]
    seen: dict[str, Any] = {}
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(_post, gw.replica_url(loaded) + COMPLETIONS, b, None, 120) for b in bodies]

        # The engine's page and the router's view (a scrape behind it) each have to show the burst,
        # not necessarily in the same poll: under load the burst can drain within one scrape.
        def moved() -> bool:
            page = parse_vllm_metrics(_get(gw.replica_url(loaded) + "/metrics"))
            info = replicas(admin)
            failed = scrape_total(_get(gw.metrics_url), "extproc_replica_scrape_errors_total", replica=loaded)
            seen.update(page=page, info={n: (r.health, r.queue, r.kv_usage) for n, r in info.items()}, failed=failed)
            if page.running > 0 and page.waiting > 0 and page.kv_usage > 0.5:
                seen["engine_loaded"] = True
            r = info[loaded]
            seen["router_max"] = max(seen.get("router_max", (0, 0.0)), (r.queue, r.kv_usage))
            seen["router_min_health"] = min(seen.get("router_min_health", 1.0), r.health)
            # Lower by what the page's queue and KV usage cost (the KV penalty starts at 0.85 of
            # the cache: how far past it a scrape lands is luck, so no margin is asked of it).
            if r.queue > 0 and r.kv_usage > 0.5 and r.health < info[idle].health - 0.01:
                seen["router_saw_it"] = True
            return bool(seen.get("engine_loaded") and seen.get("router_saw_it"))

        try:
            wait_until(lambda: f"{loaded}'s health below {idle}'s: {seen}", moved, timeout_s=60, every_s=0.2)
        finally:
            done = [f.result() for f in futures]
    assert all(d["usage"]["completion_tokens"] == 300 for d in done)
    wait_until(f"{loaded} healthy again", lambda: replicas(admin)[loaded].health > 0.9, timeout_s=30)


def _fake_full_and_queued(blocks: int, prompt_blocks: int, output: int, running: int) -> tuple[float, float]:
    """The fake replica's model on the scenario below: its KV usage with ``running`` prompts all
    admitted and nothing waiting, then with one more waiting (each reading asserted to be that)."""
    profile = dataclasses.replace(
        PROFILES["demo"], block_size=BLOCK, num_gpu_blocks=blocks, max_running=256, max_num_batched_tokens=2048
    )
    model = ReplicaModel(profile)

    def prompt(i: int) -> Seq:
        keys = tuple(range(1000 * (i + 1), 1000 * (i + 1) + prompt_blocks))
        return Seq(f"r{i}", prompt_blocks * BLOCK, output, keys, BLOCK, BLOCK)

    for i in range(running):
        model.submit(prompt(i), 0.0)
    now = 0.0
    while model.waiting or any(s.prefilling for s in model.running):
        now += model.begin_step(now) or 0.0
        model.end_step()
    assert (model.num_running, model.num_waiting) == (running, 0)
    full = model.kv_cache_usage_perc
    model.submit(prompt(running), now)
    model.begin_step(now)
    model.end_step()
    assert (model.num_running, model.num_waiting) == (running, 1)
    return full, model.kv_cache_usage_perc


def test_a_full_engine_with_nothing_waiting_takes_new_work_and_a_queued_one_does_not(gw: LocalGateway) -> None:
    # What the overload filter's rule rests on, read from a real engine: vLLM's KV usage counts the
    # blocks its running requests reference, so a cache full of running requests reads near 1 while
    # nothing waits; a request waits only when its blocks do not fit. 8 distinct prompts of 58
    # blocks with 160 tokens to decode each (at most 63 blocks each, 504 of the 511 usable: vLLM
    # keeps one of the 512 as its null block) fill the cache without a queue; a ninth waits.
    engine = gw.members[0].name
    url = gw.replica_url(engine)
    prompt_blocks, output, running = 58, 160, 8
    flt = OverloadFilter(waiting_threshold=0)  # any request waiting: the signal, read from the engine

    def page() -> ReplicaMetrics:
        return parse_vllm_metrics(_get(url + "/metrics"))

    def as_state(p: ReplicaMetrics) -> ReplicaState:
        return ReplicaState(
            Replica(engine, url),
            queue=p.waiting,
            running=p.running,
            kv_usage=p.kv_usage,
            kv_capacity_tokens=BLOCKS * BLOCK,
        )

    wait_until(f"{engine} idle", lambda: (p := page()).running == p.waiting == 0)
    rng = random.Random(31)
    # Token ids, so that each prompt is exactly its blocks (ids above the tokenizer's specials, within
    # its vocabulary of 817: an id beyond it is refused with a 400).
    bodies = [
        {
            "model": MODEL,
            "prompt": [rng.randrange(10, 250) for _ in range(prompt_blocks * BLOCK)],
            "max_tokens": output,
            "ignore_eos": True,
        }
        for _ in range(running + 1)
    ]
    seen: dict[str, ReplicaMetrics] = {}
    states: list[tuple[int, int, float]] = []  # (running, waiting, KV usage) as polled, for a failure's message

    def poll() -> ReplicaMetrics:
        p = seen["last"] = page()
        states.append((p.running, p.waiting, round(p.kv_usage, 3)))
        return p

    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(_post, url + COMPLETIONS, b, None, 120) for b in bodies[:running]]

        def full() -> bool:
            if ended := [f.exception() or "answered" for f in futures if f.done()]:
                raise AssertionError(f"requests ended before the cache was seen full: {ended[:2]}, {states[-20:]}")
            p = poll()
            return p.running == running and p.waiting == 0 and p.kv_usage > 0.9

        wait_until(lambda: f"{engine} full with nothing waiting: {states[-20:]}", full, timeout_s=60, every_s=0.05)
        seen["full"] = seen["last"]
        futures.append(pool.submit(_post, url + COMPLETIONS, bodies[running], None, 120))

        def queued() -> bool:
            p = poll()
            return p.waiting == 1 and p.kv_usage > 0.9

        try:
            wait_until(lambda: f"{engine} full with one waiting: {states[-20:]}", queued, timeout_s=30, every_s=0.05)
            seen["queued"] = seen["last"]
        finally:
            done = [f.result() for f in futures]
    assert all(d["usage"]["completion_tokens"] == output for d in done)
    wait_until(f"{engine} idle again", lambda: (p := page()).running == p.waiting == 0 and p.kv_usage == 0.0)
    # The filter: full with nothing waiting takes new work, full with a queue does not.
    assert not flt.overloaded(as_state(seen["full"])), seen
    assert flt.overloaded(as_state(seen["queued"])), seen
    # The fake replica's model reads the same on the same scenario (both phases reached, both above
    # the threshold; its cache has no null block, so it reads at most 1/512 lower).
    fake_full, fake_queued = _fake_full_and_queued(BLOCKS, prompt_blocks, output, running)
    assert fake_full > 0.9 and fake_queued > 0.9, (fake_full, fake_queued)
    # The engine was read while its 8 requests went on decoding: between the fake's reading when the
    # ninth arrives and the 8 at their full length (63 blocks each of the 511 usable).
    longest = running * (prompt_blocks + -(-output // BLOCK)) / (BLOCKS - 1)
    assert fake_queued - 0.01 <= seen["queued"].kv_usage <= longest + 0.01, (fake_queued, longest, seen["queued"])


def test_evicted_blocks_leave_the_index(gw: LocalGateway, admin: pb_grpc.AdminStub) -> None:
    (convo,) = multi_turn(1, 3, seed=26, system_tokens=300, document_tokens=900, run_id="evict")
    first = converse(gw, admin, convo, 0)
    engine = first.engine
    second = converse(gw, admin, convo, 1)
    assert second.engine == engine and second.predicted == second.cached >= 10 * BLOCK, second
    removed_before = scrape_total(_get(gw.metrics_url), "extproc_kv_event_blocks_total", op="removed", replica=engine)

    # Fill that engine's cache past its capacity with other prompts, sent to it directly.
    rng = random.Random(27)

    def removed_since() -> float:
        page = _get(gw.metrics_url)
        return scrape_total(page, "extproc_kv_event_blocks_total", op="removed", replica=engine) - removed_before

    sent = 0
    while sent <= BLOCKS * BLOCK:  # more than the whole cache: the conversation's blocks are the oldest
        body = {"model": MODEL, "prompt": words(rng, 1500), "max_tokens": 1}
        sent += int(_post(gw.replica_url(engine) + COMPLETIONS, body)["usage"]["prompt_tokens"])
    removed = wait_until("BlockRemoved events in the index", removed_since)
    assert removed >= 10, removed
    index_blocks = scrape_total(_get(gw.metrics_url), "extproc_kv_index_blocks", replica=engine)
    assert index_blocks <= BLOCKS, index_blocks

    third = converse(gw, admin, convo, 2)
    # What the index now claims for the conversation on its engine is what the engine still holds.
    assert third.predicted == third.cached, third
    assert third.cached < second.cached, (second, third)


def test_a_killed_engine_is_dropped_fails_over_and_comes_back(gw: LocalGateway, admin: pb_grpc.AdminStub) -> None:
    convos = multi_turn(6, 5, seed=28, system_tokens=100, document_tokens=300, followup_tokens=40, run_id="kill")
    home = {c.session_id: converse(gw, admin, c, 0).engine for c in convos}
    victim = Counter(home.values()).most_common(1)[0][0]
    survivor = next(r.name for r in gw.members if r.name != victim)
    on_victim = [c for c in convos if home[c.session_id] == victim]
    assert on_victim
    restarts_before = scrape_total(_get(gw.metrics_url), "extproc_kv_event_restarts_total", replica=victim)

    assert gw.fleet is not None
    gw.fleet.kill(victim)
    # Every request sent after the kill is answered, by the survivor.
    for c in on_victim:
        s = converse(gw, admin, c, 1)
        assert s.engine == survivor, s
    wait_until(f"{victim} out of rotation", lambda: not replicas(admin)[victim].in_rotation)

    fill_before = scrape_total(_get(gw.metrics_url), "extproc_replica_cache_fill_ratio", replica=victim)
    assert fill_before > 0.0
    gw.fleet.restart(victim)  # the same HTTP and KV-event ports, an empty cache
    wait_until(f"{victim} back in rotation", lambda: replicas(admin)[victim].in_rotation, timeout_s=60)
    # Its index was dropped: nothing claimed there before it serves again.
    page = _get(gw.metrics_url)
    assert scrape_total(page, "extproc_kv_index_blocks", replica=victim) == 0
    assert scrape_total(page, "extproc_kv_event_restarts_total", replica=victim) >= restarts_before

    # Nor is its cache believed full of what the old engine held: its counters went back, and
    # the fill is what the new one reports computing (nothing, before it serves).
    def fills() -> tuple[float, float]:
        engine = parse_vllm_metrics(_get(gw.replica_url(victim) + "/metrics"))
        assert engine.prefix_queries is not None and engine.prefix_hits is not None
        computed = (engine.prefix_queries - engine.prefix_hits) / (BLOCKS * BLOCK)
        return computed, scrape_total(_get(gw.metrics_url), "extproc_replica_cache_fill_ratio", replica=victim)

    def agreed() -> tuple[float, float] | None:
        engine, router = fills()
        return (engine, router) if abs(engine - router) < 1e-9 else None

    restarted, _ = wait_until(lambda: f"the router's fill of {victim} at its engine's: {fills()}", agreed)
    assert restarted < fill_before, (restarted, fill_before)

    # The moved sessions stay where they moved (their cache is there now), the others at home,
    # predictions exact on both; the engine back takes new sessions again.
    for turn in (2, 3):
        for c in convos:
            s = converse(gw, admin, c, turn)
            assert s.predicted == s.cached, s
            assert s.engine == (survivor if c in on_victim else home[c.session_id]), s
    fresh = [
        multi_turn(1, 2, seed=280 + i, system_tokens=100, document_tokens=300, run_id=f"kill-new{i}")[0]
        for i in range(6)
    ]
    landed: Counter[str] = Counter()
    for c in fresh:
        first = converse(gw, admin, c, 0)
        again = converse(gw, admin, c, 1)
        assert first.engine == again.engine and again.predicted == again.cached > 0, (first, again)
        landed[first.engine] += 1
    assert landed[victim] > 0, landed
