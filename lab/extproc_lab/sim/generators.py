"""Synthetic workloads in the shapes peer benchmarks publish (their parameters in ``data/workloads``).

- :func:`multi_turn`: vLLM's multi-turn benchmark (``vllm_multi_turn.json``): a prefix common to
  every conversation, a long per-conversation document in the first turn, follow-ups that resend
  the growing conversation with the previous answers. Closed loop: a turn is sent a think time
  after the previous answer is complete.
- :func:`shared_prefix`: the GIE / llm-d prefix-cache benchmark (inference-perf ``shared_prefix``):
  150 groups x 5 prompts, a 6,000-token system prompt per group, a 1,200-token question, 1,000
  output tokens, Poisson arrivals ramping from 3 to 60 requests/s.
- :func:`sglang_shared_prefix`: SGLang's generated-shared-prefix dataset: 64 groups x 16 prompts,
  2,048-token system prompts, 128-token questions, 256 output tokens, shuffled.
- :func:`tenant_mix`: three tenants on one fleet: chat (multi-turn), RAG (shared prefixes) and
  batch (unique prompts with Azure-like lengths).

Text is made of words from a fixed vocabulary drawn with a seeded generator (about four
characters a token): the same seed gives the same requests, byte for byte. ``rate`` scales every
arrival rate (and divides think times), so 2.0 is twice the load.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from extproc_lab.replica.engine import filler_text
from extproc_lab.sim.workload import DEFAULT_MODEL, SimRequest, Workload, check_order, text_request

_VOCAB = (
    "the of and to in is that for it as with was on be by this are from or at an which have not "
    "cache replica token prefix session model request latency block memory route gateway envoy "
    "queue batch decode prefill attention layer weight tensor kernel shard stream cluster pool "
    "river mountain garden window letter market harbor engine signal winter summer autumn spring"
).split()

WORKLOADS_DIR = Path(__file__).resolve().parent / "data" / "workloads"
"""Peer benchmarks' workload parameters, shipped with the package (licences beside them)."""


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of filler text (four characters a token)."""
    out: list[str] = []
    size = 0
    target = tokens * 4
    while size < target:
        w = rng.choice(_VOCAB)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def sample(rng: random.Random, spec: Mapping[str, Any]) -> int:
    """One integer draw from a distribution of vLLM's multi-turn config format."""
    kind = spec.get("distribution")
    if kind == "constant":
        value = float(spec["value"])
    elif kind == "uniform":
        value = rng.uniform(float(spec["min"]), float(spec["max"]))
    elif kind == "lognormal":
        value = rng.lognormvariate(float(spec["mean"]), float(spec["sigma"]))
    elif kind == "zipf":
        # Not used by the shipped config; a bounded draw keeps it usable.
        value = float(min(int(spec.get("max", 1000)), int(1 / max(1e-9, rng.random()) ** (1 / float(spec["alpha"])))))
    else:
        raise ValueError(f"unknown distribution {kind!r}")
    if "max" in spec:
        value = min(value, float(spec["max"]))
    if "min" in spec and kind != "uniform":
        value = max(value, float(spec["min"]))
    return max(0, round(value))


def load_multi_turn_spec(path: str | Path | None = None) -> dict[str, Any]:
    """vLLM's multi-turn config: ``path``, else the packaged ``vllm_multi_turn.json``."""
    loaded: dict[str, Any] = json.loads(Path(path or WORKLOADS_DIR / "vllm_multi_turn.json").read_text())
    return loaded


def _poisson_times(rng: random.Random, count: int, rate: float) -> list[float]:
    t = 0.0
    out = []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def multi_turn(
    conversations: int = 1500,
    *,
    seed: int = 7,
    rate: float = 1.0,
    conversations_per_s: float = 12.0,
    think_s: float = 10.0,
    spec: Mapping[str, Any] | None = None,
    model: str = DEFAULT_MODEL,
    tenant: str = "",
    session_prefix: str = "conv",
) -> Workload:
    """Multi-turn chat in the shape of vLLM's benchmark (``spec``, default its shipped config).

    ``spec`` counts turns as messages (a user prompt and its answer are two), rounded up to even,
    as vLLM's generator does. Conversations start as a Poisson process of
    ``conversations_per_s * rate``; each later turn is sent an exponential think time (mean
    ``think_s / rate``) after the previous answer is complete. The first turn carries the common
    prefix and the conversation's document; each answer is the text the fake replica writes.

    vLLM's config has 24 conversations for one server; the defaults here (1,500 conversations,
    12 new ones a second, 10 s of thought between turns: ~40 requests/s, ~1,000 conversations
    active at once) load 8 replicas of the ``llama-8b-h100`` profile so that round robin queues
    while a cache-aware router does not.
    """
    spec = spec or load_multi_turn_spec()
    inp = spec["prompt_input"]
    outp = spec["prompt_output"]
    rng = random.Random(seed)
    common_tokens = sample(rng, inp.get("common_prefix_num_tokens", {"distribution": "constant", "value": 0}))
    common = ("Shared instructions: " + words(rng, common_tokens) + "\n") if common_tokens else ""
    starts = _poisson_times(rng, conversations, conversations_per_s * rate)
    reqs: list[SimRequest] = []
    for c in range(conversations):
        messages_total = max(2, sample(rng, inp["num_turns"]))
        turns = (messages_total + messages_total % 2) // 2
        doc_tokens = sample(rng, inp["prefix_num_tokens"])
        messages: list[dict[str, str]] = []
        prev = -1
        for t in range(turns):
            question = f"{c} is a nice number... question {t}: " + words(rng, sample(rng, inp["num_tokens"]))
            if t == 0:
                question = common + f"Document {c}: " + words(rng, doc_tokens) + "\n" + question
            messages = [*messages, {"role": "user", "content": question}]
            out_tokens = max(1, sample(rng, outp["num_tokens"]))
            arrival = starts[c] if t == 0 else rng.expovariate(1.0) * think_s / rate
            req = text_request(
                len(reqs),
                arrival,
                out_tokens,
                messages=messages,
                session=f"{session_prefix}-{c}",
                tenant=tenant,
                after=prev,
                model=model,
            )
            reqs.append(req)
            prev = req.index
            messages = [*messages, {"role": "assistant", "content": filler_text(out_tokens)}]
    check_order(reqs)
    info = {
        "shape": "vLLM multi-turn benchmark (vllm_multi_turn.json)",
        "conversations": conversations,
        "conversations_per_s": conversations_per_s * rate,
        "think_s": think_s / rate,
        "seed": seed,
    }
    return Workload("multi-turn", reqs, info)


def _grouped(
    rng: random.Random,
    groups: int,
    per_group: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    arrivals: list[float],
    model: str,
    tenant: str = "",
    range_ratio: float = 1.0,
) -> list[SimRequest]:
    """Requests of ``groups`` x ``per_group`` prompts sharing a system prompt per group, shuffled."""
    systems = [f"System prompt of group {g}: " + words(rng, system_tokens) for g in range(groups)]
    pairs = [(g, p) for g in range(groups) for p in range(per_group)]
    rng.shuffle(pairs)
    reqs = []
    for i, (g, p) in enumerate(pairs):
        q_tokens = (
            question_tokens if range_ratio >= 1 else rng.randint(int(range_ratio * question_tokens), question_tokens)
        )
        messages = [
            {"role": "system", "content": systems[g]},
            {"role": "user", "content": f"Question {p} for group {g}: " + words(rng, q_tokens)},
        ]
        reqs.append(text_request(i, arrivals[i], output_tokens, messages=messages, tenant=tenant, model=model))
    return reqs


def shared_prefix(
    groups: int = 150,
    prompts_per_group: int = 5,
    *,
    seed: int = 7,
    rate: float = 1.0,
    system_tokens: int = 6000,
    question_tokens: int = 1200,
    output_tokens: int = 1000,
    start_qps: float = 3.0,
    end_qps: float = 60.0,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """The GIE / llm-d shared-prefix benchmark: Poisson arrivals whose rate ramps linearly from
    ``start_qps`` to ``end_qps`` (times ``rate``) over the run."""
    rng = random.Random(seed)
    n = groups * prompts_per_group
    t = 0.0
    arrivals = []
    for i in range(n):
        arrivals.append(t)
        qps = (start_qps + (end_qps - start_qps) * i / max(1, n - 1)) * rate
        t += rng.expovariate(qps)
    reqs = _grouped(rng, groups, prompts_per_group, system_tokens, question_tokens, output_tokens, arrivals, model)
    info = {
        "shape": "GIE / llm-d shared_prefix (inference-perf)",
        "groups": groups,
        "prompts_per_group": prompts_per_group,
        "qps": f"{start_qps * rate:g} -> {end_qps * rate:g}",
        "seed": seed,
    }
    return Workload("shared-prefix", reqs, info)


def sglang_shared_prefix(
    groups: int = 64,
    prompts_per_group: int = 16,
    *,
    seed: int = 7,
    rate: float = 1.0,
    qps: float = 24.0,
    system_tokens: int = 2048,
    question_tokens: int = 128,
    output_tokens: int = 256,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """SGLang's generated-shared-prefix dataset with its defaults, shuffled, sent as a Poisson
    process of ``qps * rate`` (SGLang's bench sends all at once by default; a rate keeps the
    comparison about routing rather than about one burst)."""
    rng = random.Random(seed)
    arrivals = _poisson_times(rng, groups * prompts_per_group, qps * rate)
    reqs = _grouped(rng, groups, prompts_per_group, system_tokens, question_tokens, output_tokens, arrivals, model)
    info = {"shape": "SGLang generated-shared-prefix defaults", "groups": groups, "qps": qps * rate, "seed": seed}
    return Workload("sglang-shared-prefix", reqs, info)


def unique_prompts(
    count: int,
    *,
    seed: int = 7,
    qps: float = 4.0,
    mean_prompt_tokens: int = 1000,
    mean_output_tokens: int = 250,
    tenant: str = "",
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Prompts that share nothing (batch jobs), lognormal lengths of the given means (the Azure
    conversation trace's shape), Poisson arrivals."""
    rng = random.Random(seed)
    arrivals = _poisson_times(rng, count, qps)
    reqs = []
    sigma = 0.8
    for i in range(count):
        p = max(16, round(rng.lognormvariate(math.log(mean_prompt_tokens) - sigma**2 / 2, sigma)))
        o = max(1, round(rng.lognormvariate(math.log(mean_output_tokens) - sigma**2 / 2, sigma)))
        prompt = f"Batch job {tenant} {i}: " + words(rng, p)
        reqs.append(text_request(i, arrivals[i], o, prompt=prompt, tenant=tenant, model=model))
    return Workload("unique", reqs, {"seed": seed})


def merge(name: str, parts: list[Workload], info: Mapping[str, Any] | None = None) -> Workload:
    """One workload of several (their requests renumbered, follow-ups kept)."""
    reqs: list[SimRequest] = []
    for part in parts:
        offset = len(reqs)
        for r in part.requests:
            r.index += offset
            if r.after >= 0:
                r.after += offset
            reqs.append(r)
    check_order(reqs)
    return Workload(name, reqs, dict(info or {}))


def tenant_mix(*, seed: int = 7, rate: float = 1.0, model: str = DEFAULT_MODEL) -> Workload:
    """Three tenants on one fleet for about five minutes: ``chat`` (multi-turn conversations),
    ``rag`` (32 shared system prompts, SGLang-like) and ``batch`` (unique prompts). Sessions are
    keyed per tenant, as the router keys them."""
    chat = multi_turn(120, seed=seed, rate=rate, conversations_per_s=0.4, model=model, tenant="chat")
    rng = random.Random(seed + 1)
    n_rag = 32 * 24
    rag_arrivals = _poisson_times(rng, n_rag, 2.5 * rate)
    rag = Workload(
        "rag",
        _grouped(rng, 32, 24, 3000, 200, 200, rag_arrivals, model, tenant="rag"),
    )
    batch = unique_prompts(600, seed=seed + 2, qps=2.0 * rate, tenant="batch", model=model)
    info = {
        "shape": "chat (multi-turn, 120 conversations) + rag (32 groups x 24) + batch (600 unique prompts)",
        "seed": seed,
        "rate": rate,
    }
    return merge("tenant-mix", [chat, rag, batch], info)


def hot_prefix(
    *,
    seed: int = 7,
    rate: float = 1.0,
    prompts: int = 64,
    zipf_s: float = 1.7,
    qps: float = 40.0,
    duration_s: float = 240.0,
    system_tokens: int = 2000,
    question_tokens: int = 150,
    output_tokens: int = 150,
    replicas_before: int = 8,
    replicas_after: int = 10,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """One system prompt carries about half the traffic: ``prompts`` system prompts drawn by a Zipf
    law of exponent ``zipf_s`` (64 at 1.7: the top one about 50%), each request a unique question
    after it, Poisson arrivals at ``qps * rate`` for ``duration_s``. At 40 requests/s the top prompt
    arrives at about 20/s, over twice what one replica prefills of whole prompts (20,000 tokens/s
    over 2,150 tokens on the default replica profile). ``info["changes"]`` asks for a scale-up
    from ``replicas_before`` to ``replicas_after`` halfway through (the bench replays it with
    :class:`~extproc_lab.sim.dynamic.DynamicSimulation`)."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf_s for i in range(prompts)]
    top_share = weights[0] / sum(weights)
    systems = [f"System prompt {g}: " + words(rng, system_tokens) for g in range(prompts)]
    arrivals = []
    t = rng.expovariate(qps * rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(qps * rate)
    reqs = []
    for i, at in enumerate(arrivals):
        g = rng.choices(range(prompts), weights)[0]
        messages = [
            {"role": "system", "content": systems[g]},
            {"role": "user", "content": f"Question {i}: " + words(rng, question_tokens)},
        ]
        reqs.append(text_request(i, at, output_tokens, messages=messages, model=model))
    info = {
        "shape": f"{prompts} system prompts, Zipf {zipf_s:g} (top {top_share:.0%}), unique questions",
        "qps": qps * rate,
        "top_share": round(top_share, 3),
        "changes": ((duration_s / 2, replicas_after),),
        "replicas_before": replicas_before,
        "seed": seed,
    }
    return Workload("hot-prefix", reqs, info)


def shared_system_chat(
    conversations: int = 48,
    turns: int = 6,
    *,
    seed: int = 7,
    rate: float = 1.0,
    live: int = 30,
    stagger_s: float = 0.1,
    system_tokens: int = 400,
    document_tokens: int = 1500,
    followup_tokens: int = 140,
    max_tokens: int = 16,
    model: str = DEFAULT_MODEL,
    keyed: bool = True,
) -> Workload:
    """``extproc bench realstack``'s workload in the simulator: conversations sharing one system
    prompt (the same text, :func:`extproc_lab.demo.workload.multi_turn`), each turn sent as soon as
    the previous answer is complete, at most ``live`` conversations at once. The first ``live``
    start ``stagger_s / rate`` apart; conversation ``i`` after them starts when conversation
    ``i - live`` ends (a fixed slot, where the real client takes whichever slot frees first).
    Without ``keyed`` the requests carry no session key, as a chat client's without a session
    header (the router knows them by their messages)."""
    from extproc_lab.demo.workload import multi_turn as conversations_of

    reqs: list[SimRequest] = []
    last: list[int] = []
    for i, convo in enumerate(
        conversations_of(conversations, turns, seed, system_tokens, document_tokens, followup_tokens, run_id="chat")
    ):
        prev = last[i - live] if i >= live else -1
        for t in range(turns):
            arrival = i * stagger_s / rate if t == 0 and prev < 0 else 0.0
            req = text_request(
                len(reqs),
                arrival,
                max_tokens,
                messages=convo.next_messages(t),
                session=convo.session_id if keyed else None,
                after=prev,
                model=model,
            )
            reqs.append(req)
            prev = req.index
            convo.add_answer(filler_text(max_tokens))
        last.append(prev)
    check_order(reqs)
    info = {
        "shape": f"{conversations} conversations x {turns} turns, one {system_tokens}-token system prompt, {live} live",
        "seed": seed,
    }
    return Workload("shared-system-chat", reqs, info)


def agents(
    count: int = 48,
    *,
    seed: int = 7,
    rate: float = 1.0,
    agents_per_s: float = 0.5,
    harness_tokens: int = 1500,
    task_tokens: int = 500,
    turns: tuple[int, int] = (8, 16),
    tool_result_tokens: tuple[int, int] = (100, 500),
    call_tokens: tuple[int, int] = (30, 90),
    tool_pause_s: float = 2.0,
    fork_share: float = 0.25,
    fork_turns: tuple[int, int] = (3, 6),
    keyless_share: float = 0.3,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Coding agents: each a long growing context over many turns, paused for tool calls between
    them, some forking sub-agents that share their prefix, some without a session header.

    Every agent opens with the same harness (a system prompt with its tool definitions,
    ``harness_tokens``) and its own task (``task_tokens``); each turn's answer is a tool call
    (``call_tokens``), and the next turn follows a tool pause (exponential, mean ``tool_pause_s /
    rate``) carrying the call and the tool's result (``tool_result_tokens``): the context grows by
    a few hundred tokens a turn. With probability ``fork_share`` an agent forks a sub-agent after a
    random turn: its messages so far and a sub-task, for ``fork_turns`` turns of its own (its own
    session), started as its parent's next turn is. A ``keyless_share`` of agents (with their
    sub-agents) send no session header. Agents start as a Poisson process of ``agents_per_s * rate``.
    """
    rng = random.Random(seed)
    harness = "Agent harness. Tools: read_file, grep, edit_file, run_tests. " + words(rng, harness_tokens) + "\n"
    starts = _poisson_times(rng, count, agents_per_s * rate)
    reqs: list[SimRequest] = []
    forks = 0

    def run(messages: list[dict[str, str]], n: int, session: str | None, first_after: int, arrival: float) -> None:
        nonlocal forks
        prev = first_after
        for t in range(n):
            out_tokens = rng.randint(*call_tokens)
            pause = arrival if t == 0 else rng.expovariate(1.0) * tool_pause_s / rate
            req = text_request(
                len(reqs), pause, out_tokens, messages=messages, session=session, after=prev, model=model
            )
            reqs.append(req)
            prev = req.index
            call = "call " + filler_text(out_tokens)
            result = f"result of tool step {t}: " + words(rng, rng.randint(*tool_result_tokens))
            messages = [*messages, {"role": "assistant", "content": call}, {"role": "user", "content": result}]
            if session is not None and "." not in session and t < n - 1 and rng.random() < fork_share / n:
                forks += 1
                sub = [*messages, {"role": "user", "content": f"sub-task {forks}: " + words(rng, 40)}]
                run(sub, rng.randint(*fork_turns), f"{session}.fork{forks}", prev, 0.0)
            elif session is None and t < n - 1 and rng.random() < fork_share / n:
                forks += 1
                sub = [*messages, {"role": "user", "content": f"sub-task {forks}: " + words(rng, 40)}]
                run(sub, rng.randint(*fork_turns), None, prev, 0.0)

    for a in range(count):
        keyless = rng.random() < keyless_share
        task = [
            {"role": "system", "content": harness},
            {"role": "user", "content": f"Task {a}: " + words(rng, task_tokens)},
        ]
        run(task, rng.randint(*turns), None if keyless else f"agent-{a}", -1, starts[a])
    reqs.sort(key=lambda r: r.index)
    check_order(reqs)
    info = {
        "shape": (
            f"{count} agents, {turns[0]}-{turns[1]} turns, a {harness_tokens}-token shared harness, "
            f"tool pauses of {tool_pause_s / rate:g} s mean, {forks} forks, {keyless_share:.0%} keyless"
        ),
        "seed": seed,
        "forks": forks,
    }
    return Workload("agents", reqs, info)
