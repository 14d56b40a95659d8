"""Plain prompts (completions) that open alike reuse a recent prompt's tokens, and get exactly the
ids of encoding them whole: on byte-level BPE (the lab's tokenizer), Llama 3's split pattern with a
normalizer, SentencePiece's metaspace, with adversarial openings, and when the check is not enough."""

from __future__ import annotations

import logging
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from extproc.request import plain_reuse
from extproc.request.plain_reuse import MIN_CHARS, PlainReuse
from extproc.request.tokenizer import PromptTokenizer
from extproc_lab.replica.tokenizer_dir import sample_text


def whole(tok: Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tok.encode(text, add_special_tokens=True).ids)


def test_completions_sharing_an_opening_reuse_it_and_equal_encoding_whole(tokenizer_dir: Path) -> None:
    tok = PromptTokenizer(tokenizer_dir)
    opening = sample_text(700, 1)
    assert len(opening) > 2 * MIN_CHARS
    reused = []
    for i in range(6):
        prompt = opening + sample_text(40, 100 + i)
        got = tok.completion_ids(prompt)
        assert got.ids == whole(tok.tokenizer, prompt)
        reused.append(got.reused)
    # The first is encoded whole; each later one keeps most of the opening's tokens.
    assert reused[0] == 0
    assert all(r > 0.8 * len(whole(tok.tokenizer, opening)) for r in reused[1:]), reused
    # Short prompts and prompts unlike any seen are encoded whole, and right.
    for prompt in (opening[:500], sample_text(600, 7)):
        got = tok.completion_ids(prompt)
        assert got.reused == 0 and got.ids == whole(tok.tokenizer, prompt)


_TRICKY = st.lists(
    st.sampled_from([*string.ascii_letters[:6], " ", "  ", "\n", "\t", ".", ",", "'s", "7", "é", "\u0301", "日", "🙂"]),
    max_size=60,
).map("".join)


# Llama 3's split pattern (tokens never cross its matches; digits in threes).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _trained(pre_tokenizer: pre_tokenizers.PreTokenizer, normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=["<unk>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tricky = " 12345 67890 (word) [x]\n\n  e\u0301 日本 🙂"
    tok.train_from_iterator([sample_text(3000, s) + tricky for s in range(3)], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


@pytest.fixture(scope="module")
def tokenizers(tokenizer_dir: Path) -> dict[str, Tokenizer]:
    """The lab's byte-level BPE, Llama 3's split pattern with NFC, and SentencePiece's metaspace."""
    llama3 = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return {
        "byte_level": Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")),
        "llama3_nfc": _trained(llama3, normalizers.NFC()),
        "metaspace": _trained(pre_tokenizers.Metaspace()),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["byte_level", "llama3_nfc", "metaspace"]),
    seed=st.integers(0, 10_000),
    cut=st.integers(0, 400),
    a=_TRICKY,
    b=_TRICKY,
    pad=_TRICKY,
)
def test_any_two_prompts_sharing_an_opening_get_the_ids_of_encoding_whole(
    tokenizers: dict[str, Tokenizer], kind: str, seed: int, cut: int, a: str, b: str, pad: str
) -> None:
    """Where the two texts part (mid-word, in a run of spaces or digits, a combining accent, an
    emoji), and whatever follows: a reuse the check lets through gives what encoding whole gives."""
    tok = tokenizers[kind]
    reuse = PlainReuse(tok)
    opening = sample_text(500, seed)
    opening = opening[: len(opening) - cut] + pad + sample_text(10, seed + 1)
    first, second = opening + a, opening + b
    assert len(first) >= MIN_CHARS  # long enough to be kept
    assert reuse.encode(first) == (whole(tok, first), 0)
    assert reuse.leading is not None
    got = reuse._reuse(reuse._store[first[: plain_reuse.HEAD_CHARS]], second, reuse.leading)
    if got is not None:
        assert got[0].ids == whole(tok, second)
        assert got[0].ends == tuple(e for _, e in tok.encode(second, add_special_tokens=True).offsets)
    assert reuse.encode(second)[0] == whole(tok, second)


def test_the_check_lets_most_reuse_through_on_byte_level_and_llama3_tokenizers(
    tokenizers: dict[str, Tokenizer],
) -> None:
    opening = sample_text(500, 9) + " 1234567 (x) "
    for kind in ("byte_level", "llama3_nfc"):
        reuse = PlainReuse(tokenizers[kind])
        reuse.encode(opening + sample_text(20, 1))
        ids, reused = reuse.encode(opening + sample_text(20, 2))
        assert ids == whole(tokenizers[kind], opening + sample_text(20, 2))
        assert reused > 0.8 * len(whole(tokenizers[kind], opening)), (kind, reused)


def test_a_tokenizer_that_adds_tokens_after_a_prompt_never_reuses() -> None:
    tok = _trained(pre_tokenizers.Metaspace())
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A <unk>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("<unk>", tok.token_to_id("<unk>"))]
    )
    reuse = PlainReuse(tok)
    assert not reuse.enabled
    opening = sample_text(600, 4)
    for i in range(3):
        prompt = opening + sample_text(30, i)
        assert reuse.encode(prompt) == (whole(tok, prompt), 0)


def test_a_reuse_that_differs_from_encoding_whole_turns_reuse_off(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sampled comparison is the net under the check: a tokenizer where the check passes and
    the ids still differ (simulated here) is found out and encoded whole from then on."""
    tok = PromptTokenizer(tokenizer_dir)
    opening = sample_text(600, 5)
    tok.completion_ids(opening + "first")
    real = PlainReuse._reuse

    def off_by_one(self: PlainReuse, previous: object, text: str, lead: int) -> object:
        got = real(self, previous, text, lead)  # type: ignore[arg-type]
        assert got is not None
        encoded, n = got
        return plain_reuse._Encoded(encoded.text, (*encoded.ids[:-1], encoded.ids[-1] + 1), encoded.ends), n

    monkeypatch.setattr(PlainReuse, "_reuse", off_by_one)
    with caplog.at_level(logging.WARNING, logger="extproc.request.plain_reuse"):
        got = tok.completion_ids(opening + "second")
    assert got.ids == whole(tok.tokenizer, opening + "second") and got.reused == 0
    assert not tok.plain.enabled
    assert "encoded whole from now on" in caplog.text


def test_the_store_stays_within_its_characters(tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    reuse = PlainReuse(tok, store_chars=10_000)
    for seed in range(30):
        prompt = sample_text(400, seed)
        assert reuse.encode(prompt)[0] == whole(tok, prompt)
    assert 0 < reuse._store_chars <= 10_000
    assert sum(len(e.text) for e in reuse._store.values()) == reuse._store_chars
