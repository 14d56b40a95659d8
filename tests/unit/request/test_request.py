"""Request understanding: bodies, session keys, tenants, prefix hashes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.request import (
    BodyError,
    FeatureSettings,
    SessionSource,
    block_hashes,
    extract_features,
    model_seed,
    parse_request_body,
    session_key,
)

CHAT = "/v1/chat/completions"


def chat(messages: list[dict[str, object]], **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def test_chat_content_as_string_and_parts_render_the_same() -> None:
    as_string = parse_request_body(CHAT, chat([{"role": "user", "content": "hello world"}]))
    as_parts = parse_request_body(
        CHAT,
        chat([{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]),
    )
    assert as_string.prompt == as_parts.prompt
    assert "hello world" in as_string.prompt


def test_chat_renders_messages_in_order_and_tools_first() -> None:
    req = parse_request_body(
        CHAT,
        chat(
            [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
            stream=True,
            user="alice",
        ),
    )
    assert req.prompt.index("tools") < req.prompt.index("S") < req.prompt.index("U")
    assert req.stream is True and req.user == "alice" and req.model == "m"


def test_media_parts_are_flagged_and_hashed_by_reference() -> None:
    req = parse_request_body(
        CHAT, chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])
    )
    assert req.has_media and "http://x/a.png" in req.prompt


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("abc", "abc"), (["ab", "c"], "abc"), ([1, 2, 3], "[1,2,3]")],
)
def test_completion_prompts(prompt: object, expected: str) -> None:
    req = parse_request_body("/v1/completions", json.dumps({"model": "m", "prompt": prompt}).encode())
    assert req.prompt == expected


@pytest.mark.parametrize(
    "raw", [b"", b"not json", b"[1,2]", b'{"model": "m"}', b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000]
)
def test_bad_chat_bodies_raise_body_error(raw: bytes) -> None:
    with pytest.raises(BodyError):
        parse_request_body(CHAT, raw)


def test_session_key_sources_in_priority_order() -> None:
    sources = (
        SessionSource.parse("header:X-Session-Id"),
        SessionSource.parse("cookie:sid"),
        SessionSource.parse("body:metadata.session_id"),
        SessionSource.parse("body:user"),
    )
    body = {"user": "u1", "metadata": {"session_id": "m1"}}
    assert session_key(sources, {"x-session-id": "h1", "cookie": "a=b; sid=c1"}, body) == "h1"
    assert session_key(sources, {"cookie": "a=b; sid=c1"}, body) == "c1"
    assert session_key(sources, {}, body) == "m1"
    assert session_key(sources, {}, {"user": "u1"}) == "u1"
    assert session_key(sources, {}, {}) is None


@pytest.mark.parametrize("spec", ["header", "x:y", "header:", "query:a"])
def test_bad_session_source_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="session source"):
        SessionSource.parse(spec)


def test_tenants_get_their_own_session_space() -> None:
    settings = FeatureSettings(tenant_header="x-tenant-id")
    body = chat([{"role": "user", "content": "hi"}])
    a = extract_features({":path": CHAT, "x-session-id": "s", "x-tenant-id": "a"}, body, settings)
    b = extract_features({":path": CHAT, "x-session-id": "s", "x-tenant-id": "b"}, body, settings)
    assert a.session_key != b.session_key


def test_latency_objectives_are_read_from_our_headers_or_llm_ds() -> None:
    settings = FeatureSettings()
    body = chat([{"role": "user", "content": "hi"}])
    f = extract_features({":path": CHAT, "x-slo-ttft-ms": "250", "x-slo-tpot-ms": " 40.5 "}, body, settings)
    assert (f.slo_ttft_ms, f.slo_tpot_ms) == (250.0, 40.5)
    f = extract_features({":path": CHAT, "x-llm-d-slo-ttft-ms": "300", "x-llm-d-slo-tpot-ms": "20"}, body, settings)
    assert (f.slo_ttft_ms, f.slo_tpot_ms) == (300.0, 20.0)
    # Ours wins over llm-d's; a bad value of ours leaves llm-d's.
    f = extract_features({":path": CHAT, "x-slo-ttft-ms": "100", "x-llm-d-slo-ttft-ms": "300"}, body, settings)
    assert f.slo_ttft_ms == 100.0
    f = extract_features({":path": CHAT, "x-slo-ttft-ms": "soon", "x-llm-d-slo-ttft-ms": "300"}, body, settings)
    assert f.slo_ttft_ms == 300.0
    for bad in ("", "abc", "-5", "0", "nan", "inf", "1e400"):
        f = extract_features({":path": CHAT, "x-slo-ttft-ms": bad, "x-slo-tpot-ms": bad}, body, settings)
        assert (f.slo_ttft_ms, f.slo_tpot_ms) == (None, None), bad
    # Without a usable body too.
    assert extract_features({":path": CHAT, "x-slo-tpot-ms": "25"}, None, settings).slo_tpot_ms == 25.0
    assert extract_features({":path": CHAT}, body, settings).slo_ttft_ms is None


def test_shared_prefix_shares_leading_hashes_only() -> None:
    seed = model_seed("m")
    base = "x" * 640
    one = block_hashes(base + "a" * 128, seed, 64, 100)
    two = block_hashes(base + "b" * 128, seed, 64, 100)
    assert one[:10] == two[:10]
    assert one[10] != two[10]
    assert len(one) == 12


def test_hashes_are_seeded_by_model_and_capped() -> None:
    text = "y" * 64 * 50
    assert block_hashes(text, model_seed("a"), 64, 100)[0] != block_hashes(text, model_seed("b"), 64, 100)[0]
    assert len(block_hashes(text, model_seed("a"), 64, 8)) == 8
    assert block_hashes("short", model_seed("a"), 64, 8) == ()


def test_features_of_unusable_bodies_carry_the_error() -> None:
    settings = FeatureSettings(max_body_bytes=100)
    huge = chat([{"role": "user", "content": "z" * 1000}])
    f = extract_features({":path": CHAT, "x-session-id": "s"}, huge, settings)
    assert f.body_error and "limit" in f.body_error and f.session_key == "s" and not f.prefix_hashes
    f = extract_features({":path": CHAT}, b"{", settings)
    assert f.body_error and "JSON" in f.body_error


@given(st.binary(max_size=2000))
def test_any_bytes_give_features_never_an_exception(raw: bytes) -> None:
    for path in (CHAT, "/v1/completions", "/other"):
        f = extract_features({":path": path, "cookie": raw.decode("latin-1")}, raw, FeatureSettings())
        assert f.path == path


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c)
    )
)
def test_any_json_gives_features_never_an_exception(value: object) -> None:
    raw = json.dumps({"model": "m", "messages": value, "prompt": value, "user": value, "metadata": value}).encode()
    for path in (CHAT, "/v1/completions"):
        extract_features({":path": path}, raw, FeatureSettings())


def test_bodies_orjson_refuses_are_still_parsed_as_python_json_would() -> None:
    """The fast parser declines NaN, integers beyond 64 bits and lone surrogate escapes; a
    replica's server takes them, so the router parses them the slow way instead of failing."""
    from extproc.request.openai_body import parse_request_body

    raw = b'{"model": "m", "temperature": NaN, "seed": 123456789012345678901234567890,'
    raw += b' "messages": [{"role": "user", "content": "caf\\ud800 au lait"}]}'
    parsed = parse_request_body("/v1/chat/completions", raw)
    assert parsed.model == "m"
    assert "caf" in parsed.prompt and "au lait" in parsed.prompt
