"""``extproc calibrate``: measure an OpenAI-compatible engine's speeds and write its pool's prior.

What the router prices a choice with (:mod:`extproc.base.engine_rates`) is learnt online from the
answers it times, starting from each pool's prior (``health.engine_rates``). This measures that
prior on a running engine, from the client's side as the router sees it (the first streamed
event, the usage the engine reports), one request at a time on an engine nothing else uses:

- **cached prefill**: each prompt below sent again at once, so the engine holds it: its time to
  first token, less what the few tokens the engine did not find cached
  (``prompt_tokens_details.cached_tokens``, where the engine reports them) cost, is the fixed
  overhead of a request (``overhead_s``: HTTP, template, tokenizing, scheduling);
- **cold prefill**: prompts of several lengths, each new to the engine's prefix cache (a fresh
  start), one output token, after one untimed pass over the lengths; the throughput is the
  least-squares slope of their time to first token (each length's fastest repeat), less that
  overhead, over their tokens (a line through the overhead: on vLLM's CPU engine
  the cold time grows faster than linearly with the prompt, and a free intercept then comes out
  negative, no overhead at all);
- **decode**: one stream of ``decode_tokens`` tokens alone (``ignore_eos``), the mean gap between
  its first and last token; then ``batch`` such streams at once, whose slower decode gives what
  each further sequence adds to a step (from each stream's whole time, not the gaps between its
  events: an engine whose server falls behind its engine core sends a busy stream's tokens in
  bursts).

The result is YAML for the router's config, the measurements as comments.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import yaml

from extproc.fleet.health.settings import RatePrior

CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Timed:
    """One streamed answer as the client saw it."""

    ttft_s: float
    """Seconds from sending to the first event with a choice (the engine's first output)."""
    last_s: float
    """Seconds from sending to the last event with a choice (its last token)."""
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds between two output tokens (None for fewer than two)."""
        if self.output_tokens < 2:
            return None
        return (self.last_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Engine:
    """An OpenAI-compatible engine at ``url`` serving ``model``."""

    url: str
    model: str
    timeout_s: float = 120.0

    def stream(self, prompt: str, max_tokens: int, *, ignore_eos: bool = False) -> Timed:
        """Send one streamed chat request and time it."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if ignore_eos:
            body["ignore_eos"] = True
        req = urllib.request.Request(
            self.url + CHAT, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
        started = time.perf_counter()
        first = last = None
        usage: dict[str, Any] = {}
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                now = time.perf_counter() - started
                # As the router times a stream (extproc.request.token_clock): vLLM writes its first event,
                # the role-only chunk of a chat, with the engine's first output; the last event
                # with a choice is the last token (a random-weight model's text may be empty).
                if event.get("choices"):
                    first = now if first is None else first
                    last = now
                usage = event.get("usage") or usage
        if first is None or last is None or not usage:
            raise RuntimeError(f"{self.url}: a stream without choices or usage (is it an OpenAI-compatible engine?)")
        details = usage.get("prompt_tokens_details") or {}
        return Timed(
            first,
            last,
            int(usage["prompt_tokens"]),
            int(details.get("cached_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
        )


def served_model(url: str, timeout_s: float = 10.0) -> tuple[str, int | None]:
    """The first model ``url`` serves, and its context length where the engine says (vLLM does)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=timeout_s) as resp:
        models = json.loads(resp.read())["data"]
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model")
    first = models[0]
    length = first.get("max_model_len")
    return str(first["id"]), int(length) if isinstance(length, int) else None


def prompt(words: int) -> str:
    """A prompt of ``words`` short words, its start new to any cache."""
    nonce = uuid.uuid4().hex
    return f"{nonce}: " + " ".join(f"w{nonce[i % 32]}{i}" for i in range(words))


@dataclass(frozen=True, slots=True)
class Line:
    """A least-squares line ``y = intercept + slope * x``."""

    intercept: float
    slope: float


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """The least-squares line through ``points`` (at least two distinct x)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0.0:
        raise ValueError("the prompts must differ in length for a slope")
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return Line(my - slope * mx, slope)


@dataclass
class Calibration:
    """What was measured, and the prior it gives."""

    model: str
    cold: list[Timed] = field(default_factory=list)
    cached: list[Timed] = field(default_factory=list)
    alone: list[Timed] = field(default_factory=list)
    batched: list[Timed] = field(default_factory=list)
    batch: int = 1

    def overhead_s(self) -> float:
        """The fixed part of a time to first token: a cached prompt's, less its uncached tokens'
        prefill at the rate the cold prompts give with a free intercept (a first estimate)."""
        per_token = max(0.0, fit_line(self.cold_points()).slope)
        return max(
            0.0, statistics.median(t.ttft_s - (t.prompt_tokens - t.cached_tokens) * per_token for t in self.cached)
        )

    def cold_points(self) -> list[tuple[float, float]]:
        """(prompt tokens, TTFT) of the cold prompts, the least of each length's repeats: what
        else runs on the host only ever adds to a request's time (seen on a 2-core host: one
        repeat of ~820 tokens at 197 ms beside two at 74 and 93 ms), and the price adds the
        queue and the batch itself, so the line is the engine's uncontended rate."""
        groups: list[list[Timed]] = []
        for t in sorted(self.cold, key=lambda t: t.prompt_tokens):
            if groups and t.prompt_tokens <= groups[-1][0].prompt_tokens * 1.05:
                groups[-1].append(t)
            else:
                groups.append([t])
        return [(statistics.median(t.prompt_tokens for t in g), min(t.ttft_s for t in g)) for g in groups]

    def prefill_line(self) -> Line:
        """Cold TTFT over prompt tokens: the overhead, and the slope of the rest through it."""
        overhead = self.overhead_s()
        points = self.cold_points()
        xx = sum(x * x for x, _ in points)
        if xx <= 0:
            raise ValueError("no cold prompt timed")
        return Line(overhead, sum(x * (y - overhead) for x, y in points) / xx)

    def decode_step_s(self) -> float:
        """The median gap between two tokens of a stream decoding alone."""
        return statistics.median(t.tpot_s for t in self.alone if t.tpot_s is not None)

    def batched_step_s(self) -> float:
        """The median step of ``batch`` streams decoding together: each stream's whole time less
        a short prompt's time to first token alone, over its tokens after the first."""
        first = statistics.median(t.ttft_s for t in self.alone)
        return statistics.median(
            (t.last_s - first) / (t.output_tokens - 1) for t in self.batched if t.output_tokens > 1
        )

    def prior(self, labels: dict[str, str]) -> RatePrior:
        """The pool's prior: a slope that is not positive (a noisy engine, prompts too alike) is
        refused, not written."""
        line = self.prefill_line()
        if line.slope <= 0.0:
            raise RuntimeError(f"cold TTFT does not grow with the prompt (slope {line.slope:.3g} s/token): re-run")
        if not self.alone:
            raise RuntimeError("no decode stream timed")
        step = self.decode_step_s()
        per_seq = (self.batched_step_s() - step) / (self.batch - 1) if self.batch > 1 and self.batched else 0.0
        return RatePrior(
            labels=labels,
            prefill_tokens_per_s=round(1.0 / line.slope, 1),
            decode_step_s=round(step, 6),
            decode_per_seq_s=round(max(0.0, per_seq), 6),
            overhead_s=round(line.intercept, 6),
        )


def calibrate(
    engine: Engine,
    prompt_tokens: Sequence[int],
    *,
    repeats: int = 3,
    decode_tokens: int = 32,
    batch: int = 4,
    log: TextIO | None = None,
) -> Calibration:
    """Measure ``engine`` (see the module docstring): ``prompt_tokens`` are the lengths aimed at
    (each ``repeats`` times, cold then cached), reached from the engine's own count of a probe."""
    out = Calibration(engine.model, batch=batch)
    engine.stream(prompt(8), 2)  # the first request pays for the engine's warm-up, not its rate
    probe = engine.stream(prompt(200), 1)
    per_word = max(0.5, (probe.prompt_tokens - engine.stream(prompt(8), 1).prompt_tokens) / 192)
    # A fresh engine's first prompt of each length is slower than its later ones (seen on vLLM's
    # CPU build: 150-165 ms for ~1,000 tokens first, 75-115 ms after), so one pass is not timed.
    for tokens in prompt_tokens:
        engine.stream(prompt(max(1, round(tokens / per_word))), 1)
    for _ in range(repeats):
        for tokens in prompt_tokens:
            text = prompt(max(1, round(tokens / per_word)))
            cold = engine.stream(text, 1)
            cached = engine.stream(text, 1)
            out.cold.append(cold)
            out.cached.append(cached)
            if log is not None:
                print(
                    f"prompt {cold.prompt_tokens} tokens: cold TTFT {cold.ttft_s * 1000:.1f} ms, "
                    f"cached {cached.ttft_s * 1000:.1f} ms ({cached.cached_tokens} cached)",
                    file=log,
                )
    short = prompt(16)
    out.alone = [engine.stream(short + str(i), decode_tokens, ignore_eos=True) for i in range(3)]
    if batch > 1:
        results: list[Timed] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            timed = engine.stream(prompt(16), decode_tokens, ignore_eos=True)
            with lock:
                results.append(timed)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out.batched = results
    if log is not None:
        print(f"decode alone {out.decode_step_s() * 1000:.2f} ms a token", file=log)
    return out


def prior_yaml(cal: Calibration, prior: RatePrior, command: str) -> str:
    """The prior as a ``health.engine_rates`` entry for the router's config, the figures as comments."""
    cached = cal.cached
    cached_ttft = statistics.median(t.ttft_s for t in cached)
    cached_share = sum(t.cached_tokens for t in cached) / max(1, sum(t.prompt_tokens for t in cached))
    cold_ttft = statistics.median(t.ttft_s for t in cal.cold)
    tokens = sorted({t.prompt_tokens for t in cal.cold})
    lines = [
        f"# {command}",
        f"# model {cal.model}; {len(cal.cold)} cold prompts of {tokens[0]}-{tokens[-1]} tokens, one at a time:",
        f"#   cold TTFT median {cold_ttft * 1000:.1f} ms, {prior.prefill_tokens_per_s:.0f} prompt tokens/s"
        f" + {prior.overhead_s * 1000:.1f} ms",
        f"#   the same prompts again (cached): TTFT median {cached_ttft * 1000:.1f} ms,"
        f" {cached_share:.0%} of their tokens reported cached,"
        f" {statistics.median(t.prompt_tokens / t.ttft_s for t in cached):.0f} prompt tokens/s with the cache",
        f"#   decode alone {prior.decode_step_s * 1000:.2f} ms a token; {cal.batch} streams at once"
        f" {cal.batched_step_s() * 1000 if cal.batched else 0.0:.2f} ms",
    ]
    entry = prior.model_dump()
    body = yaml.safe_dump({"health": {"engine_rates": [entry]}}, sort_keys=False)
    return "\n".join(lines) + "\n" + body


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``calibrate``."""
    p = sub.add_parser(
        "calibrate",
        help="measure an engine's prefill (cold, cached) and decode rates; print its pool's prior as config YAML",
        description="Send timed requests, one at a time, to an OpenAI-compatible engine nothing else is using, "
        "and print a health.engine_rates entry (the prior the rate learner and the price read) for its pool.",
    )
    p.add_argument("--url", required=True, help="the engine's base URL, e.g. http://10.0.0.5:8000")
    p.add_argument("--pool", help="the pool's name: its replicas carry the label pool=NAME")
    p.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="another label the pool's replicas carry"
    )
    p.add_argument("--model", help="the model to ask for (default: the first the engine lists)")
    p.add_argument(
        "--prompt-tokens",
        default=None,
        metavar="N,N,...",
        help="prompt lengths to time (default: 5 from 128 to half the engine's context, at most 4,096)",
    )
    p.add_argument("--repeats", type=int, default=3, help="each length this many times (default 3; the least counts)")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens of each decode stream (default 32)")
    p.add_argument(
        "--batch", type=int, default=4, help="streams decoding at once for the per-sequence cost (default 4)"
    )
    p.add_argument("--out", help="write the YAML here (default: standard output)")


def lengths(spec: str | None, context: int | None) -> list[int]:
    """The prompt lengths to time: given, or five from 128 up to half the context (at most 4,096)."""
    if spec:
        return [int(v) for v in spec.split(",") if v.strip()]
    top = min(4096, (context or 2048) // 2)
    return [round(128 + (top - 128) * i / 4) for i in range(5)]


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """``extproc calibrate``."""
    labels = {}
    if args.pool:
        labels["pool"] = args.pool
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"extproc calibrate: --label {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        labels[key] = value
    url = args.url.rstrip("/")
    model, context = served_model(url)
    engine = Engine(url, args.model or model)
    if args.batch < 1 or args.repeats < 1 or args.decode_tokens < 2:
        print("extproc calibrate: --batch and --repeats at least 1, --decode-tokens at least 2", file=sys.stderr)
        return 2
    cal = calibrate(
        engine,
        lengths(args.prompt_tokens, context),
        repeats=args.repeats,
        decode_tokens=args.decode_tokens,
        batch=args.batch,
        log=sys.stderr,
    )
    given = [f"--url {url}"] + [f"--pool {args.pool}"] * bool(args.pool) + [f"--label {v}" for v in args.label]
    if args.model:
        given.append(f"--model {args.model}")
    if args.prompt_tokens:
        given.append(f"--prompt-tokens {args.prompt_tokens}")
    given += [f"--repeats {args.repeats} --decode-tokens {args.decode_tokens} --batch {args.batch}"]
    command = "extproc calibrate " + " ".join(given)
    text = prior_yaml(cal, cal.prior(labels), command)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        out.write(text)
    return 0
