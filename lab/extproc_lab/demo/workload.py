"""A multi-turn chat workload in the shape of vLLM's multi-turn benchmark
(lab/extproc_lab/sim/data/workloads/vllm_multi_turn.json): a system prompt shared by every conversation, a long
document in the first turn, then follow-ups that resend the growing conversation.

Text is made of words drawn from a fixed vocabulary with a seeded generator: the same seed gives
the same conversations, byte for byte.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from extproc.api import CHARS_PER_TOKEN

_VOCAB = (
    "the of and to in is that for it as with was on be by this are from or at an which have not "
    "cache replica token prefix session model request latency block memory route gateway envoy "
    "queue batch decode prefill attention layer weight tensor kernel shard stream cluster pool "
    "river mountain garden window letter market harbor engine signal winter summer autumn spring"
).split()


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of filler text (four characters a token)."""
    out: list[str] = []
    size = 0
    target = tokens * CHARS_PER_TOKEN
    while size < target:
        w = rng.choice(_VOCAB)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


@dataclass
class Conversation:
    """One session: its id, the system prompt, and the user turns to send in order."""

    session_id: str
    system: str
    user_turns: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)

    def next_messages(self, turn: int) -> list[dict[str, str]]:
        """The messages to send for ``turn`` (the conversation so far plus the next user turn)."""
        if turn == 0:
            self.messages = [{"role": "system", "content": self.system}]
        self.messages.append({"role": "user", "content": self.user_turns[turn]})
        return list(self.messages)

    def add_answer(self, text: str) -> None:
        """Append the assistant's answer, as a chat client would before the next turn."""
        self.messages.append({"role": "assistant", "content": text})


def multi_turn(
    sessions: int,
    turns: int,
    seed: int = 7,
    system_tokens: int = 500,
    document_tokens: int = 1500,
    followup_tokens: int = 140,
    run_id: str = "demo",
) -> list[Conversation]:
    """``sessions`` conversations of ``turns`` turns each."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + words(rng, system_tokens)
    out = []
    for i in range(sessions):
        first = "Please read this document and answer questions about it.\n" + words(rng, document_tokens)
        follow = [f"Question {t}: " + words(rng, followup_tokens) for t in range(1, turns)]
        out.append(Conversation(f"{run_id}-{i}", system, [first, *follow]))
    return out


def shared_prompt_chat(
    sessions: int,
    turns: int,
    seed: int = 11,
    system_words: int = 1500,
    question_words: int = 12,
    run_id: str = "chat",
) -> list[Conversation]:
    """``sessions`` conversations of ``turns`` turns that share one long system prompt
    (``system_words`` words) and open with short, distinct questions: the shape of a chat product
    behind one assistant persona, where only the system prompt is common to every conversation."""
    rng = random.Random(seed)
    system = "You are the assistant of a support desk. " + " ".join(rng.choice(_VOCAB) for _ in range(system_words))
    out = []
    for i in range(sessions):
        asks = [
            f"Conversation {i}, question {t}: " + " ".join(rng.choice(_VOCAB) for _ in range(question_words)) + "?"
            for t in range(turns)
        ]
        out.append(Conversation(f"{run_id}-{i}", system, asks))
    return out
