"""Latency objectives in the simulator: classes of requests with a TTFT and a TPOT objective, and
goodput, the output tokens per second of the requests that met theirs.

A workload's conversations are drawn into classes (``chat:0.7:300:40`` is 70% of the
conversations, each turn asking its first token within 300 ms and its next ones 40 ms apart);
every turn of a conversation keeps its class. A request meets its objectives when its time to
first token and its time per output token after the first are both within them (an objective
left out is always met).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from extproc_lab.sim.simulator import Outcome
from extproc_lab.sim.workload import SimRequest, Workload


@dataclass(frozen=True, slots=True)
class ObjectiveClass:
    """A share of the conversations and the objectives their requests carry (None: none)."""

    name: str
    share: float
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __str__(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:g}"

        return f"{self.name}:{self.share:g}:{ms(self.ttft_ms)}:{ms(self.tpot_ms)}"


def parse_mix(text: str) -> tuple[ObjectiveClass, ...]:
    """``NAME:SHARE:TTFT_MS:TPOT_MS`` classes, comma-separated (``-`` for no objective); the
    shares are relative (they need not add up to 1). ``ValueError`` says what is wrong."""
    out = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) != 4 or not parts[0]:
            raise ValueError(f"objective class {item!r}: expected NAME:SHARE:TTFT_MS:TPOT_MS")
        try:
            share = float(parts[1])
            ttft, tpot = (None if p in ("", "-") else float(p) for p in parts[2:])
        except ValueError:
            raise ValueError(f"objective class {item!r}: share and objectives must be numbers (or -)") from None
        if share <= 0 or any(v is not None and v <= 0 for v in (ttft, tpot)):
            raise ValueError(f"objective class {item!r}: share and objectives must be positive")
        out.append(ObjectiveClass(parts[0], share, ttft, tpot))
    if not out:
        raise ValueError("no objective class given")
    return tuple(out)


def uniform(ttft_ms: float | None, tpot_ms: float | None) -> tuple[ObjectiveClass, ...]:
    """One class for every request (nothing when neither objective is given)."""
    if ttft_ms is None and tpot_ms is None:
        return ()
    return (ObjectiveClass("all", 1.0, ttft_ms, tpot_ms),)


def draw(mix: Sequence[ObjectiveClass], key: str, seed: int) -> ObjectiveClass:
    """The class of conversation (or request) ``key``: a draw seeded by ``seed`` and ``key`` alone,
    so it is the same whatever else the workload holds."""
    total = sum(c.share for c in mix)
    x = random.Random(f"{seed}\x1f{key}").random() * total
    for c in mix:
        x -= c.share
        if x < 0:
            return c
    return mix[-1]


def assign(workload: Workload, mix: Sequence[ObjectiveClass], seed: int) -> Workload:
    """``workload`` with every request's objectives (and class) drawn from ``mix``, per
    conversation; the requests are changed in place."""
    if not mix:
        return workload
    for r in workload.requests:
        c = draw(mix, f"{r.tenant}\x1f{r.session}" if r.session else f"#{r.index}", seed)
        r.slo_class, r.slo_ttft_ms, r.slo_tpot_ms = c.name, c.ttft_ms, c.tpot_ms
    workload.info["objectives"] = ",".join(str(c) for c in mix)
    return workload


def met(req: SimRequest, arrival: float, first_token: float, finish: float, output_tokens: int) -> bool:
    """Whether a request's latencies met its objectives."""
    if req.slo_ttft_ms is not None and (first_token - arrival) * 1000.0 > req.slo_ttft_ms:
        return False
    if req.slo_tpot_ms is not None and output_tokens > 1:
        tpot_ms = (finish - first_token) * 1000.0 / (output_tokens - 1)
        if tpot_ms > req.slo_tpot_ms:
            return False
    return True


def goodput_figures(outcomes: Iterable[Outcome], requests: Sequence[SimRequest]) -> dict[str, Any]:
    """The share of requests that met their objectives (``slo_met``), the output tokens per second
    of those (``goodput_tokens_per_s``, over the run's makespan), and both per class."""
    done = list(outcomes)
    if not done:
        return {"slo_met": 0.0, "goodput_tokens_per_s": 0.0, "slo_classes": {}}
    start = min(o.arrival for o in done)
    makespan = max(o.finish for o in done) - start
    per: dict[str, list[int]] = {}  # class -> [requests, met, tokens of met]
    for o in done:
        req = requests[o.index]
        tally = per.setdefault(req.slo_class, [0, 0, 0])
        tally[0] += 1
        if met(req, o.arrival, o.first_token, o.finish, o.output_tokens):
            tally[1] += 1
            tally[2] += o.output_tokens

    def rate(tokens: int) -> float:
        return round(tokens / makespan, 1) if makespan > 0 else 0.0

    n, ok, tokens = (sum(t[i] for t in per.values()) for i in range(3))
    return {
        "slo_met": round(ok / n, 4),
        "goodput_tokens_per_s": rate(tokens),
        "slo_classes": {
            name: {"requests": t[0], "slo_met": round(t[1] / t[0], 4), "goodput_tokens_per_s": rate(t[2])}
            for name, t in sorted(per.items())
        },
    }
