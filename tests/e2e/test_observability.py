"""Observability: the metrics page, alert rules (promtool), dashboards, and a real Prometheus
scraping the processor and the fake replicas while a workload runs through Envoy."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client import generate_latest

from extproc.adapters.telemetry import export
from extproc.app.router import Router
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.processes import ProcessGroup, free_port, wait_for_http
from tests.conftest import ROOT, chat_body, make_config, require_binary

OBS = ROOT / "k8s" / "observability"
DASHBOARD = OBS / "dashboards" / "extproc-overview.json"
RULES = OBS / "alerts.rules.yaml"


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


# --- the metrics page ---------------------------------------------------------------------------


async def test_metrics_page_for_a_known_sequence_of_decisions() -> None:
    router = Router(make_config(), clock=lambda: 100.0)  # a still clock: every decision takes 0 s
    chat = {":path": "/v1/chat/completions"}
    body = chat_body("shared document " * 40, user="alice@example.com")  # 640 chars of prompt: 10 blocks
    for headers, payload in [
        ({**chat, "x-session-id": "conv-7f3a"}, body),  # new_session
        ({**chat, "x-session-id": "conv-7f3a"}, body),  # sticky, 10 of 10 blocks matched
        ({**chat, "x-request-id": "r1"}, b"{not json"),  # fallback
    ]:
        router.release(await router.route(headers, payload))
    export(router)()
    text = generate_latest(router.metrics.registry).decode()
    expected = [
        'extproc_decisions_total{model="m",reason="new_session"} 1.0',
        'extproc_decisions_total{model="m",reason="sticky"} 1.0',
        'extproc_decisions_total{model="none",reason="fallback"} 1.0',
        'extproc_decisions_total{model="m",reason="spillover"} 0.0',
        "extproc_prefix_blocks_total 20.0",
        "extproc_prefix_blocks_matched_total 10.0",
        "extproc_request_body_errors_total 1.0",
        'extproc_decision_duration_seconds_bucket{le="0.0001"} 3.0',
        "extproc_decision_duration_seconds_count 3.0",
        "extproc_sessions 1.0",
        'extproc_stream_errors_total{kind="answer"} 0.0',
        'extproc_replica_in_rotation{replica="r0"} 1.0',
        'extproc_replica_inflight_requests{replica="r0"} 0.0',
        'extproc_replica_scrape_errors_total{replica="r1"} 0.0',
    ]
    missing = [line for line in expected if line not in text.splitlines()]
    assert missing == []
    # 10 matched blocks on one of 3 replicas: a random replica would have held 10/3 of them.
    assert re.search(r"^extproc_prefix_blocks_expected_round_robin_total 3\.33", text, re.MULTILINE)
    for personal in ("conv-7f3a", "alice", "shared document"):
        assert personal not in text  # never a session, user or prompt in a label


def test_model_labels_are_bounded() -> None:
    from extproc.observe.metrics import BoundedLabel

    label = BoundedLabel(2)
    assert [label(m) for m in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


# --- rules and dashboards -------------------------------------------------------------------------


def test_promtool_checks_and_unit_tests_the_rules() -> None:
    promtool = require_binary("promtool")
    for argv in ([promtool, "check", "rules", str(RULES)], [promtool, "test", "rules", str(OBS / "alerts.test.yaml")]):
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    tests = yaml.safe_load((OBS / "alerts.test.yaml").read_text())["tests"]
    fired = {c["alertname"] for t in tests for c in t.get("alert_rule_test", []) if c["exp_alerts"]}
    assert fired == {r["alert"] for r in rules() if "alert" in r}


def test_prometheus_rule_carries_the_same_groups() -> None:
    rule = yaml.safe_load((OBS / "prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_dashboard_uses_a_datasource_variable_everywhere() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert [v["name"] for v in dash["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
    titles = [p["title"] for p in dash["panels"]]
    for needed in ("hit ratio", "Decisions by reason", "load", "Spillovers", "latency", "Sessions", "Redis"):
        assert any(needed.lower() in t.lower() for t in titles), needed
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" and t["expr"] for t in p["targets"])


def test_dashboard_configmap_renders_with_kustomize() -> None:
    kubectl = require_binary("kubectl")
    for target in (OBS, ROOT / "k8s" / "base"):
        out = subprocess.run(
            [kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=60, check=True
        )
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "extproc-dashboards")
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cm["data"]["extproc-overview.json"])["uid"] == "extproc-overview"
        # In Grafana's namespace (its sidecar reads its own by default), not the router's, also
        # where the base puts everything else in llm.
        assert cm["metadata"]["namespace"] == "monitoring"
        others = {d["metadata"].get("namespace") for d in docs if d is not cm and d["kind"] != "Namespace"}
        assert others == ({"llm"} if target != OBS else {None})


# --- what on-call reads: variables, selectors, aggregation, runbooks, severities -----------------

VARIABLES = ("cluster", "namespace", "instance")
SELECTOR = 'cluster=~"$cluster", namespace=~"$namespace", instance=~"$instance"'
METRIC = re.compile(r"\b(extproc_[a-z0-9_]+|vllm:[a-z0-9_:]+)(\{[^}]*\})?")
AGGREGATION = re.compile(r"\b(?:sum|max|min|avg|count|topk|bottomk)\s+by\s*\(([^)]*)\)")


def test_dashboard_has_the_on_call_variables_and_every_query_uses_them() -> None:
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert list(variables) == ["datasource", *VARIABLES]
    for name in VARIABLES:
        v = variables[name]
        assert v["type"] == "query" and v["datasource"]["uid"] == "${datasource}"
        assert v["includeAll"] and v["allValue"] == ".*" and v["multi"]
        asked = v["query"]["query"]
        assert asked.startswith("label_values(extproc_store_available") and f", {name})" in asked
    unfiltered = [
        (expr, m.group(0))
        for expr in dashboard_queries()
        for m in METRIC.finditer(expr)
        if not (m.group(2) or "").startswith("{" + SELECTOR)
    ]
    assert unfiltered == []


def test_dashboard_has_a_row_where_the_hit_ratio_goes() -> None:
    dash = json.loads(DASHBOARD.read_text())
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows] == ["Where the hit ratio goes: reuse offered, captured, delivered"]
    below = [p for p in dash["panels"] if p["gridPos"]["y"] == rows[0]["gridPos"]["y"] + 1]
    exprs = " ".join(t["expr"] for p in below for t in p["targets"])
    for kind in ("prompt", "offered", "captured"):
        assert f'extproc_reuse_blocks_total{{{SELECTOR}, kind="{kind}"}}' in exprs
    for kind in ("queries", "hits"):
        assert f'extproc_reuse_engine_tokens_total{{{SELECTOR}, kind="{kind}"}}' in exprs


def test_dashboard_has_a_time_to_first_token_panel_on_the_routers_histogram() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ttft = [p for p in dash["panels"] if "time to first token" in p["title"].lower()]
    assert len(ttft) == 1
    exprs = [t["expr"] for t in ttft[0]["targets"]]
    assert exprs and all("extproc_ttft_seconds_bucket" in e and "histogram_quantile" in e for e in exprs)
    assert ttft[0]["fieldConfig"]["defaults"]["unit"] == "s"


def test_dashboard_is_grafanas_schema() -> None:
    """Every field the dashboard sets survives a round trip through the types Grafana generates
    from its dashboard schema (grafana-foundation-sdk): a field the schema does not have is
    dropped there, and reported here. Then what the schema's types do not check: unique panel ids
    and refIds, integer grid positions within 24 columns, no two panels overlapping."""
    dash = json.loads(DASHBOARD.read_text())
    assert schema_dropped(dash) == []
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], int] = {}
    for p in dash["panels"]:
        pos = p["gridPos"]
        assert all(isinstance(pos[k], int) for k in ("x", "y", "w", "h")), p["title"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, (p["id"], cells.get((x, y)))
                cells[(x, y)] = p["id"]


def test_the_schema_check_reports_a_field_grafana_does_not_know() -> None:
    dash = json.loads(DASHBOARD.read_text())
    dash["panels"][0]["targets"][0]["exprr"] = "typo"
    dash["templating"]["list"][1]["allvalue"] = ".*"
    assert sorted(schema_dropped(dash)) == ["/panels[0]/targets[0]/exprr", "/templating/list[1]/allvalue"]


def schema_dropped(dash: dict[str, Any]) -> list[str]:
    """The paths of ``dash`` that do not come back from Grafana's dashboard types."""
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.cog.plugins import register_default_plugins
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_default_plugins()
    back = json.loads(json.dumps(Dashboard.from_json(dash), cls=JSONEncoder))

    def missing(given: Any, kept: Any, path: str) -> list[str]:
        if isinstance(given, dict):
            if not isinstance(kept, dict):
                return [path]
            out = []
            for key, value in given.items():
                out += [f"{path}/{key}"] if key not in kept else missing(value, kept[key], f"{path}/{key}")
            return out
        if isinstance(given, list):
            if not isinstance(kept, list) or len(kept) != len(given):
                return [path]
            return [m for i, (g, k) in enumerate(zip(given, kept, strict=True)) for m in missing(g, k, f"{path}[{i}]")]
        return [] if given == kept else [f"{path} ({given!r} came back as {kept!r})"]

    return missing(dash, back, "")


def test_rules_are_per_namespace_and_name_no_job() -> None:
    for rule in rules():
        expr = " ".join(rule["expr"].split())
        assert "job=" not in expr and 'job="' not in expr, rule
        for grouping in AGGREGATION.findall(expr):
            assert "namespace" in [g.strip() for g in grouping.split(",")], (rule.get("alert") or rule["record"], expr)
        if "alert" in rule:
            assert AGGREGATION.search(expr) or expr.startswith("extproc:"), rule["alert"]


def test_no_critical_alert_on_an_error_rate() -> None:
    for rule in rules():
        if rule.get("labels", {}).get("severity") == "critical":
            assert "error" not in rule["expr"], rule["alert"]
    severities = {r["alert"]: r["labels"]["severity"] for r in rules() if "alert" in r}
    assert set(severities.values()) <= {"critical", "warning", "info"}


# --- a real Prometheus ----------------------------------------------------------------------------


def left_operand(expr: str) -> str:
    """The signal an alert compares: the expression before its first top-level comparison."""
    depth = 0
    flat = " ".join(expr.split())
    for i, ch in enumerate(flat):
        depth += ch in "([{"
        depth -= ch in ")]}"
        comparison = flat[i : i + 2] in ("==", "<=", ">=") or (ch in "<>" and flat[i - 1] == " ")
        if depth == 0 and comparison:
            return flat[:i].strip()
    return flat


def query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        payload = json.loads(resp.read())
    assert payload["status"] == "success", (expr, payload)
    return list(payload["data"]["result"])


async def replay(url: str, sessions: int, turns: int, tag: str) -> None:
    async with aiohttp.ClientSession() as http:

        async def converse(i: int) -> None:
            history = f"{tag} conversation {i} " + "a long shared document " * 60
            for t in range(turns):
                history += f" question {t}"
                body = {"model": "demo-model", "messages": [{"role": "user", "content": history}], "max_tokens": 2}
                # An objective loose enough to be met: the attainment panel has data.
                headers = {"x-session-id": f"{tag}-{i}", "x-slo-ttft-ms": "10000"}
                async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status == 200
                    await r.read()

        await asyncio.gather(*(converse(i) for i in range(sessions)))


async def targets_up(port: int, expected: int, timeout_s: float = 30.0) -> None:
    """Wait until Prometheus scrapes every target (it applies new targets on a 5 s tick)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            async with http.get(f"http://127.0.0.1:{port}/api/v1/targets") as resp:
                active = (await resp.json())["data"]["activeTargets"]
            if len(active) == expected and all(t["health"] == "up" for t in active):
                await asyncio.sleep(2)  # a couple of samples before the workload starts
                return
            await asyncio.sleep(0.5)  # real time: Prometheus scraping its targets
    raise AssertionError(f"Prometheus targets not all up after {timeout_s}s")


SCRAPE_LABELS = {"cluster": "test", "namespace": "llm"}


def label_values(port: int, label: str, metric: str) -> list[str]:
    url = f"http://127.0.0.1:{port}/api/v1/label/{label}/values?" + urllib.parse.urlencode({"match[]": metric})
    with urllib.request.urlopen(url, timeout=10) as resp:
        return list(json.loads(resp.read())["data"])


def real_hit_ratio(port: int, window_s: int) -> float:
    expr = (
        f"sum(increase(vllm:prefix_cache_hits_total[{window_s}s]))"
        f" / sum(increase(vllm:prefix_cache_queries_total[{window_s}s]))"
    )
    result = query(port, expr)
    return float(result[0]["value"][1])


@pytest.mark.e2e
async def test_prometheus_answers_every_panel_and_alert_and_sees_the_hit_ratio_win(tmp_path: Path) -> None:
    prometheus = require_binary("prometheus")
    require_binary("envoy")
    # Budgets on (one tenant's, never reached): the metering and budget panels have data too.
    (tmp_path / "router.yaml").write_text(
        yaml.safe_dump({"budgets": {"enabled": True, "tenants": {"acme": {"per_day": 10**9}}}})
    )
    gateway = LocalGateway(replicas=4, time_scale=0.05, processor_args=("--config", str(tmp_path / "router.yaml")))
    with gateway as gw, ProcessGroup(tmp_path / "logs") as procs:
        port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                # Not called extproc: the rules must not depend on the job's name. The labels are
                # those a Kubernetes scrape adds, for the dashboard's variables to select.
                {
                    "job_name": "llm/extproc-gateway",
                    "static_configs": [{"targets": [f"127.0.0.1:{gw.metrics_port}"], "labels": SCRAPE_LABELS}],
                },
                {
                    "job_name": "vllm",
                    "static_configs": [{"targets": [r.address for r in gw.members], "labels": SCRAPE_LABELS}],
                },
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        procs.start(
            "prometheus",
            [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
        )
        wait_for_http(f"http://127.0.0.1:{port}/-/ready", timeout_s=30)
        await targets_up(port, expected=1 + len(gw.members))

        await replay(gw.url, sessions=8, turns=10, tag="ours")
        await asyncio.sleep(3)  # two more scrapes after the last request
        ours = real_hit_ratio(port, 20)
        started = time.monotonic()
        async with aiohttp.ClientSession() as http:
            for r in gw.members:  # a fair start for round robin: empty caches
                async with http.post(f"http://{r.address}/reset_prefix_cache") as resp:
                    assert resp.status == 200
        # Two scrapes before round robin starts: increase() counts from the first sample in its
        # window, so without one taken before the traffic the cold first turns (all misses) can
        # fall outside it (a CI run saw round robin at 0.81 that way).
        await asyncio.sleep(2)
        await replay(gw.round_robin_url, sessions=8, turns=10, tag="rr")
        await asyncio.sleep(3)  # real time: Prometheus scrapes after the traffic
        rr = real_hit_ratio(port, int(time.monotonic() - started) + 1)
        assert ours > rr + 0.2, (ours, rr)

        # The variables' queries, as Grafana runs label_values(): the labels of this scrape.
        instance = f"127.0.0.1:{gw.metrics_port}"
        for name, value in (*SCRAPE_LABELS.items(), ("instance", instance)):
            assert label_values(port, name, "extproc_store_available") == [value]
        chosen = {"$cluster": SCRAPE_LABELS["cluster"], "$namespace": SCRAPE_LABELS["namespace"], "$instance": instance}
        empty = []
        for panel_expr in dashboard_queries():
            expr = panel_expr
            for variable, value in (*chosen.items(), ("$__rate_interval", "30s")):
                expr = expr.replace(variable, value)
            if not query(port, expr):
                empty.append(expr)
        # Another namespace selects nothing: the variables do filter.
        decisions = "sum by (reason) (rate(extproc_decisions_total{" + SELECTOR + "}[$__rate_interval]))"
        assert decisions in dashboard_queries()
        for namespace, found in (("llm", True), ("elsewhere", False)):
            given = {**chosen, "$namespace": namespace, "$__rate_interval": "30s"}
            expr = decisions
            for variable, value in given.items():
                expr = expr.replace(variable, value)
            assert bool(query(port, expr)) is found, expr
        # A correctly configured Envoy shows the processor no configuration problem.
        problems = query(port, "extproc_config_problem")
        assert problems and all(float(r["value"][1]) == 0 for r in problems)
        # Every replica has its time-to-first-token and end-to-end series (the router's own histograms).
        # Their quantiles answer NaN until something observes them (RouterMetrics.first_token and
        # request_completed, called where the first streamed token is seen), as the store's latency
        # does here with a memory store: "non-empty" above is a series, not a number.
        for metric in ("extproc_ttft_seconds_count", "extproc_request_duration_seconds_count"):
            assert {r["metric"]["replica"] for r in query(port, metric)} == {r.name for r in gw.members}
        for rule in rules():
            expr = rule["expr"]
            query(port, expr)  # valid as a whole
            if not query(port, left_operand(expr)):
                empty.append(left_operand(expr))
        assert empty == []
