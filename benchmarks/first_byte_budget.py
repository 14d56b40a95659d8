"""Where the default first-byte timeout comes from: a 10,000-token prefill on a slow replica.

The replica timing model (``lab/extproc_lab/replica/timing.py``, profile ``llama-8b-h100``) prices one
engine step; this walks a 10,000-token prompt through chunked prefill, step by step, on an idle
replica and on replicas whose running batch is already decoding (each step's token budget is
shared with one token per running sequence, and every step pays for their context). The slowest
case is the "slow replica" the defaults of ``upstream:`` are chosen from (docs/operations.md, "Hung
replicas"). It also prices one decode step there, the per-output-token budget of a non-streaming
request, whose first byte comes only after its last token.

    .venv/bin/python benchmarks/first_byte_budget.py
"""

from __future__ import annotations

from extproc_lab.replica.timing import LLAMA_8B_H100, ReplicaProfile

PROMPT_TOKENS = 10_000


def prefill_s(profile: ReplicaProfile, prompt: int, running: int, context: int) -> float:
    """Seconds until the first token of a ``prompt``-token request that arrives while ``running``
    sequences of ``context`` tokens each are decoding (chunked prefill, vLLM V1)."""
    done, total = 0, 0.0
    kv = running * context
    while done < prompt:
        chunk = min(prompt - done, max(1, profile.max_num_batched_tokens - running))
        # New-by-earlier attention pairs of this chunk: over the part already prefilled and itself.
        pairs = chunk * done + chunk * chunk / 2
        total += profile.step_seconds(chunk, pairs, True, running, kv)
        done += chunk
    return total


def decode_step_s(profile: ReplicaProfile, running: int, context: int) -> float:
    """Seconds of one decode step with ``running`` sequences of ``context`` tokens."""
    return profile.step_seconds(0, 0.0, False, running, running * context)


def main() -> None:
    profile = LLAMA_8B_H100
    print(f"profile {profile.name}: 10,000-token prompt, chunked prefill of {profile.max_num_batched_tokens} tokens")
    print("| running sequences | context each | prompts queued ahead | time to first token s | decode step s |")
    print("|---|---|---|---|---|")
    for running, context, queued in ((0, 0, 0), (64, 2_000, 0), (256, 4_000, 0), (512, 8_000, 0), (512, 8_000, 4)):
        # Prompts queued ahead (10,000 tokens each) are prefilled first, one after the other.
        ttft = (queued + 1) * prefill_s(profile, PROMPT_TOKENS, running, context)
        step = decode_step_s(profile, running, context) if running else profile.decode_s_per_token
        print(f"| {running} | {context} | {queued} | {ttft:.2f} | {step:.3f} |")


if __name__ == "__main__":
    main()
