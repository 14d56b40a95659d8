"""Default latency objectives per request class and per tenant (``classes[].objectives``,
``tenants.definitions.NAME.objectives``), filled where a request's headers give none."""

from __future__ import annotations

import pytest

from extproc.config import ConfigError, config_from_mapping
from extproc.request.features import read_request
from tests.conftest import chat_body

CONFIG = {
    "classes": [
        {"name": "premium", "match": {"headers": {"x-tier": "premium"}}, "objectives": {"ttft_ms": 300}},
        {"name": "batch", "match": {"headers": {"x-tier": "batch"}}},
    ],
    "tenants": {
        "trust_header": True,
        "definitions": {"acme": {"objectives": {"ttft_ms": 800, "tpot_ms": 40}}, "quiet": {}},
    },
}


def objectives(headers: dict[str, str]) -> tuple[float | None, float | None, str]:
    settings = config_from_mapping(CONFIG).features
    f = read_request({":path": "/v1/chat/completions", **headers}, chat_body("hi"), settings).features
    return f.slo_ttft_ms, f.slo_tpot_ms, f.request_class


def test_the_header_wins_then_the_class_then_the_tenant_each_objective_on_its_own() -> None:
    assert objectives({"x-tier": "premium", "x-tenant-id": "acme"}) == (300, 40, "premium")
    assert objectives({"x-tier": "premium", "x-tenant-id": "acme", "x-slo-ttft-ms": "120"}) == (120, 40, "premium")
    assert objectives({"x-tier": "batch", "x-tenant-id": "acme"}) == (800, 40, "batch")
    assert objectives({"x-tier": "premium"}) == (300, None, "premium")
    assert objectives({"x-tenant-id": "quiet"}) == (None, None, "default")
    assert objectives({"x-llm-d-slo-tpot-ms": "25", "x-tenant-id": "acme"}) == (800, 25, "default")


def test_a_request_without_a_body_gets_its_tenants_defaults_too() -> None:
    settings = config_from_mapping(CONFIG).features
    f = read_request({":path": "/v1/chat/completions", "x-tenant-id": "acme"}, None, settings).features
    assert (f.slo_ttft_ms, f.slo_tpot_ms) == (800, 40)


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({"classes": [{"name": "x", "objectives": {"ttft_ms": 0}}]}, "classes[0].objectives.ttft_ms"),
        ({"classes": [{"name": "x", "objectives": {"ttft": 100}}]}, "classes[0].objectives.ttft"),
        ({"tenants": {"definitions": {"a": {"objectives": {"tpot_ms": "fast"}}}}}, "tenants.definitions.a"),
    ],
)
def test_bad_objectives_name_their_field(raw: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError, match=path.replace("[", r"\[").replace("]", r"\]")):
        config_from_mapping(raw)


def test_a_client_can_only_tighten_its_class_s_objectives_unless_the_class_allows_loosening() -> None:
    config = {
        "classes": [
            {"name": "premium", "match": {"headers": {"x-tier": "premium"}}, "objectives": {"ttft_ms": 300}},
            {"name": "open", "match": {"headers": {"x-tier": "open"}}, "objectives": {"ttft_ms": 300, "loosen": True}},
        ],
        "tenants": {"trust_header": True, "definitions": {"acme": {"objectives": {"tpot_ms": 40}}}},
    }
    settings = config_from_mapping(config).features

    def objectives(headers: dict[str, str]) -> tuple[float | None, float | None]:
        f = read_request({":path": "/v1/chat/completions", **headers}, None, settings).features
        return f.slo_ttft_ms, f.slo_tpot_ms

    # Looser than the class: ignored, the class's holds (a class that sheds stays shed).
    assert objectives({"x-tier": "premium", "x-slo-ttft-ms": "60000"}) == (300, None)
    assert objectives({"x-tier": "premium", "x-slo-ttft-ms": "120"}) == (120, None)  # stricter counts
    # The tenant's default is held the same way; llm-d's header names too.
    assert objectives({"x-tenant-id": "acme", "x-llm-d-slo-tpot-ms": "900"}) == (None, 40)
    assert objectives({"x-tenant-id": "acme", "x-slo-tpot-ms": "25"}) == (None, 25)
    # A class that allows it takes the client's looser objective; no default: the client's own.
    assert objectives({"x-tier": "open", "x-slo-ttft-ms": "60000"}) == (60000, None)
    assert objectives({"x-slo-ttft-ms": "60000"}) == (60000, None)
