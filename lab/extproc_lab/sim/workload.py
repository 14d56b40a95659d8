"""What the simulator replays: requests with their prompts described as prefix keys, and when
they arrive.

A request either arrives at an absolute time (open loop: traces, Poisson generators) or follows
another one (closed loop: the next turn of a conversation is sent ``arrival_s`` seconds after
the previous turn's answer is complete). Its prompt is described twice, once per consumer:

- for the **router**, as :class:`~extproc.api.RequestFeatures`, the very features
  ``extract_features`` would compute from the request's headers and body (prefix hashes over
  64-character blocks of the rendered prompt, capped at ``max_blocks``);
- for the **replica model**, as the keys of its full KV blocks (:class:`extproc_lab.replica.Seq`):
  the same 16-token block hashes for text workloads (so the simulator agrees with the HTTP
  replica), or coarser keys for traces that only give block ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from extproc.api import CHAT_PATH, COMPLETIONS_PATH, FeatureSettings, RequestFeatures, render_chat
from extproc.api.sim import block_hashes, conversation_chain, model_seed
from extproc_lab.replica.cache import count_tokens

DEFAULT_MODEL = "demo-model"
BLOCK_TOKENS = 16
"""vLLM's block size: text workloads key their prompts by 16-token (64-character) blocks."""


@dataclass(slots=True)
class SimRequest:
    """One request of a workload.

    ``keys`` are the replica-side prefix keys of the prompt's full blocks: key ``i`` covers
    ``key_span`` tokens, the last one ``tail_span`` (multiples of 16). ``messages`` (chat) or
    ``prompt`` (completions) hold the text when the workload has real text; otherwise
    ``router_hashes`` gives the router's block hashes directly.
    """

    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    keys: tuple[int, ...]
    key_span: int = BLOCK_TOKENS
    tail_span: int = BLOCK_TOKENS
    session: str | None = None
    tenant: str = ""
    after: int = -1
    model: str = DEFAULT_MODEL
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    router_hashes: Callable[[int], tuple[int, ...]] | None = None
    synth_text: Callable[[], str] | None = None
    slo_class: str = ""
    slo_ttft_ms: float | None = None
    """The request's objectives (:mod:`extproc_lab.sim.objectives`), sent as ``x-slo-ttft-ms`` and
    ``x-slo-tpot-ms``; None: none."""
    slo_tpot_ms: float | None = None

    @property
    def request_id(self) -> str:
        """The id the router sees (``x-request-id``)."""
        return f"r{self.index}"

    def text(self) -> str:
        """The prompt as the replica renders it (chat messages in order, or the completion prompt)."""
        if self.messages is not None:
            return render_chat(self.messages)[0]
        if self.prompt is None and self.synth_text is not None:
            return self.synth_text()
        return self.prompt or ""

    def headers(self) -> dict[str, str]:
        """The request headers a client would send."""
        out = {
            ":path": CHAT_PATH if self.messages is not None else COMPLETIONS_PATH,
            "x-request-id": self.request_id,
        }
        if self.session:
            out["x-session-id"] = self.session
        if self.tenant:
            out["x-tenant-id"] = self.tenant
        if self.slo_ttft_ms is not None:
            out["x-slo-ttft-ms"] = f"{self.slo_ttft_ms:g}"
        if self.slo_tpot_ms is not None:
            out["x-slo-tpot-ms"] = f"{self.slo_tpot_ms:g}"
        return out

    def body(self) -> dict[str, Any]:
        """The OpenAI request body: exactly ``output_tokens`` tokens come back from the fake
        replica (``ignore_eos`` with ``max_tokens``), so every run sees the same conversation."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.output_tokens, "ignore_eos": True}
        if self.messages is not None:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.text()
        return body

    def features(self, settings: FeatureSettings, objectives: bool = True) -> RequestFeatures:
        """What ``extract_features`` computes for this request's headers and body, without the
        JSON round trip (a test checks the two agree); without ``objectives`` as if the client
        sent none."""
        hashes: tuple[int, ...]
        if self.router_hashes is not None:
            hashes = self.router_hashes(settings.max_blocks)
            prompt_chars = self.prompt_tokens * 4
        else:
            text = self.text()
            prompt_chars = len(text)
            if settings.block_chars == BLOCK_TOKENS * 4 and self.key_span == BLOCK_TOKENS:
                # The replica keys are these very hashes: no need to hash the text again.
                hashes = self.keys[: settings.max_blocks]
            else:
                hashes = block_hashes(text, model_seed(self.model), settings.block_chars, settings.max_blocks)
        key = self.session
        if key is not None:
            key = key[:256]
            if self.tenant:
                # Tenants live in their own key space, as extract_features keys them.
                key = f"{self.tenant[:128]}\x1f{key}"
        chain = None
        if key is None and self.messages is not None and settings.conversations:
            # As extract_features: a keyless chat request is known by its messages' chain.
            chain = conversation_chain(self.messages, None, model_seed(self.model))
        return RequestFeatures(
            path=CHAT_PATH if self.messages is not None else COMPLETIONS_PATH,
            model=self.model,
            session_key=key,
            tenant=self.tenant[:128],
            prompt_chars=prompt_chars,
            prefix_hashes=hashes,
            request_id=self.request_id,
            max_output_tokens=self.output_tokens,
            slo_ttft_ms=self.slo_ttft_ms if objectives else None,
            slo_tpot_ms=self.slo_tpot_ms if objectives else None,
            conversation=chain,
        )


def text_request(
    index: int,
    arrival_s: float,
    output_tokens: int,
    *,
    messages: list[dict[str, str]] | None = None,
    prompt: str | None = None,
    session: str | None = None,
    tenant: str = "",
    after: int = -1,
    model: str = DEFAULT_MODEL,
) -> SimRequest:
    """A request with real text: its keys are the 16-token block hashes the HTTP replica computes."""
    req = SimRequest(
        index=index,
        arrival_s=arrival_s,
        prompt_tokens=0,
        output_tokens=max(1, output_tokens),
        keys=(),
        session=session,
        tenant=tenant,
        after=after,
        model=model,
        messages=messages,
        prompt=prompt,
    )
    text = req.text()
    req.prompt_tokens = count_tokens(text)
    req.keys = block_hashes(text, model_seed(model), BLOCK_TOKENS * 4, 1 << 30)
    return req


@dataclass
class Workload:
    """A named list of requests, in index order; ``info`` describes it for reports."""

    name: str
    requests: list[SimRequest]
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def followers(self) -> dict[int, list[int]]:
        """For each request, the requests that follow it (closed loop)."""
        out: dict[int, list[int]] = {}
        for r in self.requests:
            if r.after >= 0:
                out.setdefault(r.after, []).append(r.index)
        return out

    def nominal_order(self) -> list[SimRequest]:
        """Requests in the order they would arrive if every answer were instant: open-loop
        arrivals in time order, follow-ups after their predecessors' think time. The ceilings are
        computed on this stream, the same for every policy."""
        when: dict[int, float] = {}
        for r in self.requests:
            when[r.index] = r.arrival_s if r.after < 0 else when[r.after] + r.arrival_s
        return sorted(self.requests, key=lambda r: (when[r.index], r.index))

    def summary(self) -> dict[str, Any]:
        """Size figures for the report."""
        reqs = self.requests
        prompt = sum(r.prompt_tokens for r in reqs)
        out = sum(r.output_tokens for r in reqs)
        sessions = {r.session for r in reqs if r.session}
        return {
            "name": self.name,
            "requests": len(reqs),
            "sessions": len(sessions),
            "prompt_tokens": prompt,
            "output_tokens": out,
            "mean_prompt_tokens": round(prompt / len(reqs), 1) if reqs else 0.0,
            "mean_output_tokens": round(out / len(reqs), 1) if reqs else 0.0,
            **self.info,
        }


def check_order(requests: Sequence[SimRequest]) -> None:
    """Indices must be 0..n-1 in order and a follow-up must come after what it follows."""
    for i, r in enumerate(requests):
        if r.index != i:
            raise ValueError(f"request {i} has index {r.index}")
        if r.after >= i:
            raise ValueError(f"request {i} follows request {r.after}, which is not before it")
