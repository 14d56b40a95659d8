"""What several test files share: a settable clock, polling for a condition, reading metrics (in
process or from a /metrics page), requests through the demo gateway or one ext_proc stream, a
router fed by KV events, and expectations two files assert alike. Test files import from here and
from ``conftest``, never from each other (tests/project/test_layers.py checks), so any of them can move."""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import re
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from extproc.adapters.server.stream import RequestStream
from extproc.app.plan import Planner
from extproc.app.router import Router
from extproc.fleet.kvevents.cache_state import EventCacheState
from extproc.fleet.kvevents.hashing import EngineChain, HashAlgo
from extproc.fleet.kvevents.settings import KvEventSettings
from extproc.fleet.kvevents.wire import BlockStored, Message, encode_batch
from extproc.observe.metrics.kv_events import KvEventMetrics
from extproc.request.tenant import api_key_digest
from extproc.request.tokenizer import PromptTokenizer, TokenizerRegistry
from extproc_lab.demo import fault_matrix as fm
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.load import read_metrics
from extproc_lab.demo.processes import wait_for_port
from extproc_lab.demo.workload import Conversation
from extproc_lab.replica.tokenizer_dir import sample_text
from tests.conftest import ROOT, make_config, require_binary

CHAT = "/v1/chat/completions"
HOST = "127.0.0.1"


class Clock:
    """A clock the test sets: ``clock.now += 5`` is five seconds later."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def wait_for(
    check: Callable[[], bool | Awaitable[bool]],
    what: str = "the condition",
    within_s: float = 5.0,
    step_s: float = 0.01,
) -> float:
    """Poll ``check`` (plain or async) until it holds; the seconds it took. Fails after ``within_s``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return loop.time() - start
        if loop.time() - start > within_s:
            raise AssertionError(f"{what}: not within {within_s}s")
        await asyncio.sleep(step_s)  # real time: polls a condition that real processes or threads bring about


# -- metrics ------------------------------------------------------------------------------------


def tenant_key(tenant: str) -> str:
    """The test API key of ``tenant``: a tenant is who a mapped key says, never a client's header."""
    return f"sk-test-{tenant}"


def tenant_api_keys(*tenants: str) -> dict[str, str]:
    """``tenants.api_keys`` for :func:`tenant_key` of each of ``tenants``."""
    return {api_key_digest(tenant_key(t)): t for t in tenants}


def as_tenant(tenant: str) -> dict[str, str]:
    """The headers of a request by ``tenant``: its API key."""
    return {"authorization": f"Bearer {tenant_key(tenant)}"}


def charged_tokens(samples: dict[str, float], tenant: str) -> float:
    """Every token ``extproc_tokens_total`` holds for ``tenant`` (of a :func:`read_metrics` page)."""
    found = 0.0
    for key, value in samples.items():
        name, _, labels = key.partition("{")
        pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split(",") if p)
        if name == "extproc_tokens_total" and pairs.get("tenant") == tenant:
            found += value
    return found


async def engine_tokens(http: aiohttp.ClientSession, gw: LocalGateway) -> tuple[float, float]:
    """(prompt, generation) tokens the gateway's engines say they computed, summed over them
    (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``)."""
    prompt = generation = 0.0
    for member in gw.members:
        samples = await read_metrics(http, f"http://{member.address}/metrics")
        for key, value in samples.items():
            name = key.partition("{")[0]
            if name == "vllm:prompt_tokens_total":
                prompt += value
            elif name == "vllm:generation_tokens_total":
                generation += value
    return prompt, generation


async def abandon_after_first_chunk(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> bytes:
    """Send a streamed request, read its first chunk, and go away (the connection closed)."""
    async with http.post(url, json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        first = await resp.content.readany()
        resp.close()
        return first


async def settled(read: Callable[[], Awaitable[float]], quiet_s: float = 1.0, within_s: float = 30.0) -> float:
    """A count once it has not moved for ``quiet_s`` (charges of streams that ended land a moment
    after the client went away)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    last, since = await read(), loop.time()
    while loop.time() < deadline:
        await asyncio.sleep(0.1)  # real time: charges land from real processes a moment later
        now = await read()
        if now != last:
            last, since = now, loop.time()
        elif loop.time() - since >= quiet_s:
            return now
    raise AssertionError(f"the count kept moving for {within_s} s (last {last})")


def metric_value(metric: MetricWrapperBase) -> float:
    """The value of a counter or gauge without labels, or of one labelled child (``m.labels(...)``),
    read through its public ``collect()``: whichever registry it is on."""
    (family,) = metric.collect()
    (found,) = [s.value for s in family.samples if s.name in (family.name, family.name + "_total")]
    return found


def scrape(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of ``name`` on a /metrics page whose labels include ``labels``; None
    when the page has no such sample."""
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


def scrape_total(text: str, name: str, **labels: str) -> float:
    """Like :func:`scrape`, with 0 for a page that has no such sample."""
    return scrape(text, name, **labels) or 0.0


async def metrics_page(http: aiohttp.ClientSession, url: str) -> str:
    """The text of a /metrics page."""
    async with http.get(url) as resp:
        return await resp.text()


async def page_shows(http: aiohttp.ClientSession, url: str, line: str) -> bool:
    """Whether the /metrics page at ``url`` has ``line`` (a sample as the page renders it)."""
    return line in await metrics_page(http, url)


async def decisions(http: aiohttp.ClientSession, metrics_urls: Iterable[str]) -> list[Counter[str]]:
    """Routing decisions by reason, summed over models, one counter per processor."""
    out = []
    for url in metrics_urls:
        counts: Counter[str] = Counter()
        for key, count in (await read_metrics(http, url)).items():
            if key.startswith("extproc_decisions_total{"):
                counts[key.split("reason=")[1].split(",")[0].rstrip("}")] += int(count)
        out.append(counts)
    return out


# -- requests -----------------------------------------------------------------------------------


def chat(text: Any, model: str = "demo-model", max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    """A one-message chat completion for the demo gateway (``text`` may be a list of content parts)."""
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **extra}


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, str, dict[str, Any] | None]:
    """POST a chat completion through the gateway: status, the replica that answered, the JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(
        url + CHAT, data=data, headers={"content-type": "application/json", **(headers or {})}
    ) as resp:
        text = await resp.read()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = None
        return resp.status, resp.headers.get("x-replica-name", ""), payload


async def turn(
    http: aiohttp.ClientSession, url: str, session: str, text: str, model: str = "demo-model"
) -> tuple[int, str, int]:
    """One turn of a session through the gateway: the status, the replica that answered and the
    prompt tokens it had cached (0 for an error)."""
    status, replica, payload = await post(http, url, chat(text, model=model), {"x-session-id": session})
    usage = (payload or {}).get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return status, replica, int(cached) if status == 200 else 0


async def send_turn(
    http: aiohttp.ClientSession, url: str, conv: Conversation, turn: int, model: str = "demo-model"
) -> tuple[int, str]:
    """Send turn ``turn`` of a workload conversation, keep the answer in it; status and replica."""
    body = {"model": model, "messages": conv.next_messages(turn), "max_tokens": 2}
    async with http.post(url + CHAT, data=json.dumps(body), headers={"x-session-id": conv.session_id}) as resp:
        payload: Any = await resp.read()
        if resp.status == 200:
            conv.add_answer(json.loads(payload)["choices"][0]["message"]["content"])
        return resp.status, resp.headers.get("x-replica-name", "")


async def deciding(http: aiohttp.ClientSession, gw: LocalGateway, within_s: float = 15.0) -> None:
    """Send probe requests until the processor has decided one: the open port of a processor just
    (re)started does not mean that Envoy has reconnected to it."""
    probes = 0

    async def decided() -> bool:
        nonlocal probes
        probes += 1
        await post(http, gw.url, chat(f"probe {probes}"), {"x-session-id": f"probe-{probes}"})
        return scrape_total(await metrics_page(http, gw.metrics_url), "extproc_decisions_total") > 0

    await wait_for(decided, "a decision by the processor", within_s=within_s, step_s=0.1)


async def run(router: Router, messages: Iterable[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    """Play one ext_proc stream of ``messages`` through the router; its responses."""

    async def source() -> AsyncIterator[pb.ProcessingRequest]:
        for m in messages:
            yield m

    return [r async for r in RequestStream(Planner(router)).run(source())]


def validate(path: Path) -> None:
    """``envoy --mode validate`` must accept the file."""
    envoy = require_binary("envoy")
    result = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# -- shared expectations -------------------------------------------------------------------

# The request classes the tenant tests route by (in process and through Envoy).
SEED_CLASSES = [
    {"name": "batch", "match": {"headers": {"x-request-class": "batch"}}, "pool": {"pool": "batch"}},
    {"name": "multimodal", "match": {"media": True}, "pool": {"pool": "multimodal"}},
    {"name": "long-context", "match": {"min_tokens": 2049, "stream": True}, "pool": {"pool": "long"}},
    {"name": "short", "match": {"max_tokens": 512, "stream": False}, "pool": {"pool": "short"}},
]

# Slack for a loaded 2-core machine on a timeout-bound latency; still far below a route timeout.
SLACK_S = 3.0


PRICE_CONFIG = Path(__file__).resolve().parents[1] / "benchmarks" / "routing" / "price.yaml"
"""The price profile written out as a config (opt-in), for the cases that check what it does."""


def assert_every_shape_answered_within_its_budget(
    row: fm.CaseResult, scale: fm.Scale, tried_first: bool = True
) -> None:
    """Every request of every shape answered 200 by another replica, within its try's budget plus
    the retry and some slack, and (``tried_first``: each went to the hung replica first) after it."""
    assert row.requests > 0 and row.lost == 0, row
    per_shape = row.facts["per_shape"]
    assert len(per_shape) == 12, per_shape
    for name, facts in per_shape.items():
        budget = facts["budget_s"]
        assert budget <= max(scale.first_byte_s, scale.unary_max_s), (name, facts)
        assert facts["from_victim"] == 0, (name, facts)
        assert len(facts["latency_s"]) == scale.shape_requests, (name, facts)
        floor = 0.9 * budget if tried_first else 0.0
        assert all(floor <= t < budget + SLACK_S for t in facts["latency_s"]), (name, facts)


# -- a router fed by KV events (model "m", the lab's tokenizer) ----------------------------------

BS = 16  # tokens a block, as the test replicas publish them


def kv_router(tokenizer_dir: Path, clock: Clock, **settings: object) -> tuple[Router, EventCacheState]:
    """A router whose cache view comes from KV events, tokenizing model ``m`` with ``tokenizer_dir``."""
    kv = EventCacheState(
        KvEventSettings(tokenizers={"m": str(tokenizer_dir)}, **settings),  # type: ignore[arg-type]
        clock=clock,
        metrics=KvEventMetrics(),
        tokenizers=TokenizerRegistry({"m": str(tokenizer_dir)}),
    )
    return Router(make_config(), clock=clock, kv_events=kv), kv


def conversation(turns: int, seed: int = 0) -> list[dict[str, str]]:
    """A system prompt and ``turns`` user turns with the assistant's answers between them."""
    msgs = [{"role": "system", "content": sample_text(120, seed)}]
    for t in range(turns):
        msgs.append({"role": "user", "content": sample_text(40, seed * 100 + t)})
        if t < turns - 1:
            msgs.append({"role": "assistant", "content": sample_text(20, seed * 1000 + t)})
    return msgs


def chat_request(messages: list[dict[str, str]], session: str | None = None) -> tuple[dict[str, str], bytes]:
    """Headers and body of a chat completion for model ``m``, as :meth:`Router.route` takes them."""
    headers = {":path": CHAT, ":method": "POST"}
    if session:
        headers["x-session-id"] = session
    return headers, json.dumps({"model": "m", "messages": messages}).encode()


def stored_event(tok: PromptTokenizer, messages: list[dict[str, str]], algo: HashAlgo = HashAlgo.SHA256) -> BlockStored:
    """What vLLM would publish after prefilling ``messages``: its full blocks, hashed its way."""
    ids = tok.chat_ids(messages).ids
    n = len(ids) // BS
    hashes = EngineChain(algo).hashes(ids, BS) if algo is not HashAlgo.CONTENT else list(range(500, 500 + n))
    return BlockStored(tuple(hashes), None, list(ids[: n * BS]), BS)


async def feed(kv: EventCacheState, replica: str, seq: int, *events: object) -> None:
    """Deliver one batch of ``events`` from ``replica`` with sequence number ``seq``."""
    await kv.source.receive(Message(f"kv@{replica}@m", seq, encode_batch(1.0, events)), replica)  # type: ignore[arg-type]


# -- processes ----------------------------------------------------------------------------------


def serve_argv(port: int, metrics_port: int, *extra: str) -> list[str]:
    """``extproc serve`` as two gateways on one host run it: no admin flag (the default)."""
    return [
        sys.executable,
        "-m",
        "extproc",
        "serve",
        "--listen",
        f"{HOST}:{port}",
        "--metrics-listen",
        f"{HOST}:{metrics_port}",
        "--replica",
        "r0=127.0.0.1:9",
        *extra,
    ]


@contextmanager
def serving(argv: list[str], port: int) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` (an ``extproc serve``) until the block ends, once ``port`` accepts."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_port(HOST, port, proc=proc)
        yield proc
    finally:
        proc.terminate()  # this test's own child, by its handle
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One span an OTLP exporter sent, with the ``service.name`` of its resource; ids in hex."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """A real OTLP/gRPC trace collector (opentelemetry-proto's service): keeps every span sent."""

    def __init__(self) -> None:
        self.address = ""
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        """Keep the request's spans."""
        for resource in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope in resource.scope_spans:
                with self._lock:
                    self._spans.extend(self._received(service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    @staticmethod
    def _received(service: str, span: trace_pb2.Span) -> ReceivedSpan:
        return ReceivedSpan(
            service,
            span.name,
            span.trace_id.hex(),
            span.span_id.hex(),
            span.parent_span_id.hex(),
            {a.key: _value(a.value) for a in span.attributes},
        )

    @property
    def spans(self) -> list[ReceivedSpan]:
        """The spans received so far, in the order they came."""
        with self._lock:
            return list(self._spans)


@contextmanager
def otlp_receiver() -> Iterator[SpanReceiver]:
    """A :class:`SpanReceiver` on a free loopback port (``receiver.address``) for the block, on
    threads of its own: an exporter in the test's process or another one reaches it alike."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    receiver = SpanReceiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port(f"{HOST}:0")
    receiver.address = f"{HOST}:{port}"
    server.start()
    try:
        yield receiver
    finally:
        server.stop(None)


def apply_istio_patches(bootstrap: dict[str, Any], envoy_filter: dict[str, Any]) -> None:
    """Apply an EnvoyFilter's patches to a bootstrap as Istio does for the kinds we use."""
    listeners = bootstrap["static_resources"]["listeners"]
    clusters = bootstrap["static_resources"]["clusters"]
    for patch in envoy_filter["spec"]["configPatches"]:
        value, operation = patch["patch"]["value"], patch["patch"]["operation"]
        if patch["applyTo"] == "HTTP_FILTER":
            assert operation in ("INSERT_BEFORE", "INSERT_FIRST")
            for listener in listeners:
                filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
                if operation == "INSERT_FIRST":
                    filters.insert(0, copy.deepcopy(value))
                    continue
                wanted = patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
                filters.insert([f["name"] for f in filters].index(wanted), copy.deepcopy(value))
        elif patch["applyTo"] == "CLUSTER":
            assert operation == "MERGE"
            match = patch["match"]["cluster"]
            name = f"outbound|{match['portNumber']}||{match['service']}"
            next(c for c in clusters if c["name"] == name).update(copy.deepcopy(value))
        elif patch["applyTo"] == "LISTENER":
            assert operation == "MERGE"
            for listener in listeners:
                listener.update(copy.deepcopy(value))
        else:  # pragma: no cover - a patch kind this test does not know yet
            raise AssertionError(f"unexpected patch {patch['applyTo']}")


def trusted_headers() -> set[str]:
    """The request headers docs/security.md's table says Envoy's first filter strips (the table
    ``tests/project/test_headers_table.py`` holds to the code): the ones a client may not set."""
    text = (ROOT / "docs" / "security.md").read_text()
    section = text[text.index("## Headers the router reads") :]
    names: set[str] = set()
    for line in section[: section.index("\n## ", 1)].splitlines():
        cells = line.split("|")
        if line.startswith("| ") and len(cells) > 4 and cells[4].strip().startswith("Envoy's first filter"):
            names |= {n for n in re.findall(r"`([^`]+)`", cells[1]) if re.fullmatch(r"x-[a-z0-9-]+", n)}
    return names
