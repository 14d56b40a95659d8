"""Bounded fuzzing in the suite: hypothesis over the parser and the stream handler, and short
coverage-guided atheris runs of the harnesses in fuzz/ (longer runs: ``make fuzz``)."""

from __future__ import annotations

import json
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.harness import check_features, check_stream, new_router
from tests.conftest import ROOT

ROUTER = new_router()
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_features_from_any_bytes(data: bytes) -> None:
    check_features(data)


@settings(max_examples=200)
@given(json_values, st.sampled_from(["utf-8", "utf-16", "latin-1"]), st.integers(0, 400))
def test_features_from_odd_json(value: object, encoding: str, cut: int) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": value}], "prompt": value})
    raw = body.encode(encoding, "replace")
    check_features(b"\n" * 3 + raw)  # whole, in an odd encoding
    check_features(b"\n" * 3 + raw[:cut])  # truncated


def test_deeply_nested_and_enormous_bodies() -> None:
    for raw in (b"[" * 200_000, b'{"a":' * 50_000, b'{"model":"m","prompt":"' + b"x" * 3_000_000 + b'"}'):
        check_features(b"/v1/completions\n" + raw)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_stream_handler_answers_any_message_sequence(data: bytes) -> None:
    check_stream(ROUTER, data)


def test_atheris_harnesses_run_clean() -> None:
    for harness, runs in (("fuzz_request.py", 2000), ("fuzz_stream.py", 800)):
        result = subprocess.run(
            [sys.executable, str(ROOT / "fuzz" / harness), f"-runs={runs}", "-max_len=8192", "-seed=1"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"Done {runs} runs" in result.stderr


def test_kv_event_decoder_harness_runs_clean() -> None:
    from fuzz.harness import check_kv_events

    check_kv_events(b"")
    result = subprocess.run(
        [sys.executable, str(ROOT / "fuzz" / "fuzz_kvevents.py"), "-runs=3000", "-max_len=4096", "-seed=1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Done 3000 runs" in result.stderr
