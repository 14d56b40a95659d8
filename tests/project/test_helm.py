"""The Helm chart (charts/extproc): linted and rendered by Helm's own engine (``helm-python-sdk``
binds Helm v4's Go SDK; no helm binary), every rendered object validated (core objects against the
Kubernetes schemas, strictly; custom resources against tests/project/test_k8s.py's structural
schemas), the router config it writes loaded by the router's own loader, and the TLS certificate it
makes loaded by the server's TLS code."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from helm_python import Chart, HelmError, HelmValuesError, lint

from extproc.adapters.server.tls import server_credentials
from extproc.config import ListenerTls, config_from_mapping
from extproc.fleet.discovery import InferencePoolSource, KubernetesSource
from tests.conftest import ROOT
from tests.helpers import validate
from tests.k8s_schemas import CORE_GROUPS, CRD_SCHEMAS, EXT_PROC_SERVICE, K8S_VERSIONS

CHART = ROOT / "charts" / "extproc"
WARNING = 2  # helm lint's severities: 1 info, 2 warning, 3 error


MODEL_SERVERS = {"inferencePool": {"modelServers": {"matchLabels": {"app": "vllm"}}}}
"""The one value the chart requires (with inferencePool.create, its default)."""


def _with_model_servers(values: dict[str, Any]) -> dict[str, Any]:
    pool = values.get("inferencePool", {})
    if "modelServers" in pool:
        return values
    return {**values, "inferencePool": {**pool, **MODEL_SERVERS["inferencePool"]}}


def render(
    values: dict[str, Any] | None = None, name: str = "picker", namespace: str = "team-a"
) -> list[dict[str, Any]]:
    """The chart's objects for ``values`` (the model servers' labels added), as Helm renders them
    for an install."""
    with Chart.load(CHART) as chart:
        manifests = chart.render(_with_model_servers(values or {}), name=name, namespace=namespace, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{kind}: {len(found)}"
    return found[0]


def router_config(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap" and "router.yaml" in o.get("data", {})]
    data: dict[str, Any] = yaml.safe_load(config_map["data"]["router.yaml"])
    return data


SIDECAR = {
    "layout": "sidecar",
    "sidecar": {"modelServers": {"service": "vllm-qwen", "namespace": "models", "port": 8001}},
}
"""The sidecar layout: Envoy beside the router, the model servers through their Service."""


EVERYTHING = {
    "serviceMonitor": {"enabled": True},
    "podDisruptionBudget": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "dashboards": {"enabled": True},
    "replicaCount": 2,
}


def test_helm_lints_the_chart_without_a_warning() -> None:
    for given in (
        {},
        EVERYTHING,
        {"tls": {"enabled": False}, "inferencePool": {"create": False}},
        SIDECAR,
        {**EVERYTHING, **SIDECAR},
    ):
        values = _with_model_servers(given)
        report = lint(CHART, values, strict=True, namespace="team-a", kube_version="v1.29.0")
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= WARNING] == [], report


@pytest.mark.parametrize(
    "values",
    [{}, EVERYTHING, {"tls": {"enabled": False}}, SIDECAR, {**EVERYTHING, **SIDECAR}],
    ids=["default", "all", "no-tls", "sidecar", "sidecar-all"],
)
def test_every_rendered_object_is_valid(values: dict[str, Any]) -> None:
    objects = render(values)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    assert ("InferencePool" in kinds) == (values.get("layout") != "sidecar")
    for obj in objects:
        if obj["apiVersion"] in CORE_GROUPS:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
        else:
            assert obj["kind"] in CRD_SCHEMAS, f"no schema for {obj['apiVersion']} {obj['kind']}"
            jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
    if values is EVERYTHING:
        assert {"ServiceMonitor", "PodDisruptionBudget", "PrometheusRule"} <= kinds


def test_the_values_schema_refuses_bad_values_and_the_pool_needs_its_model_servers() -> None:
    for bad in ({"inferencePool": {"failureMode": "Sometimes"}}, {"ports": {"grpc": 0}}, {"surprise": 1}):
        with pytest.raises(HelmValuesError):
            render(bad)
    with Chart.load(CHART) as chart, pytest.raises(HelmError, match=r"modelServers\.matchLabels"):
        chart.render({}, name="picker", namespace="team-a")


def test_the_picker_follows_the_pool_it_creates_and_is_the_pools_picker() -> None:
    objects = render()
    cfg = config_from_mapping(router_config(objects))
    pool = one(objects, "InferencePool")
    service = one(objects, "Service")
    assert isinstance(cfg.discovery, InferencePoolSource)
    assert (cfg.discovery.name, cfg.discovery.namespace) == (pool["metadata"]["name"], pool["metadata"]["namespace"])
    assert cfg.mode == "endpoint" and cfg.listen == "0.0.0.0:9002"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"] and ref["port"]["number"] == 9002
    assert ref["failureMode"] == "FailClose"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 9002, "metrics": 9090}
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    # RBAC: the picker's account reads the pool and its pods, in the pool's namespace.
    role, binding = one(objects, "Role"), one(objects, "RoleBinding")
    assert {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]} == {
        ("inference.networking.k8s.io", "inferencepools"),
        ("", "pods"),
    }
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in role["rules"])
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["spec"]["serviceAccountName"], "namespace": "team-a"}
    ]


def test_tls_by_default_with_a_certificate_the_server_loads(tmp_path: Path) -> None:
    objects = render()
    cfg = config_from_mapping(router_config(objects))
    assert cfg.grpc.tls is not None and cfg.grpc.health_listen == "0.0.0.0:9003"
    secret = one(objects, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    deployment = one(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == secret["metadata"]["name"]
    assert Path(cfg.grpc.tls.cert_file).parent == Path(mounts["tls"])
    # The Secret's files, where the config says, are what the server serves.
    files = {}
    for key in ("tls.crt", "tls.key"):
        files[key] = tmp_path / key
        files[key].write_bytes(base64.b64decode(secret["data"][key]))
    _, loaded = server_credentials(ListenerTls(cert_file=str(files["tls.crt"]), key_file=str(files["tls.key"])))
    assert loaded.configuration is not None
    # Probes go to the plaintext health port: kubelet's gRPC probes do not speak TLS.
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": EXT_PROC_SERVICE}
    assert container["livenessProbe"]["grpc"]["port"] == container["startupProbe"]["grpc"]["port"] == 9003
    # A Secret of one's own: none made, that one mounted; mutual TLS with a client CA.
    own = render({"tls": {"existingSecret": "picker-cert", "clientCaSecret": "gateway-ca"}})
    assert [o for o in own if o["kind"] == "Secret"] == []
    volumes = {v["name"]: v for v in one(own, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "picker-cert"
    assert volumes["client-ca"]["secret"]["secretName"] == "gateway-ca"
    assert config_from_mapping(router_config(own)).grpc.tls.mutual  # type: ignore[union-attr]
    plain = render({"tls": {"enabled": False}})
    assert config_from_mapping(router_config(plain)).grpc.tls is None
    assert [o for o in plain if o["kind"] == "Secret"] == []


def test_names_namespaces_and_labels_come_from_the_values() -> None:
    values = {
        "fullnameOverride": "qwen-picker",
        "commonLabels": {"team": "inference"},
        "inferencePool": {
            "name": "qwen",
            "namespace": "models",
            "modelServers": {"matchLabels": {"model": "qwen3"}},
            "targetPorts": [{"number": 8080}, {"number": 8081}],
            "failureMode": "FailOpen",
        },
        "ports": {"grpc": 9443},
        "router": {"store": "redis://redis.team-a:6379/0", "config": {"sessions": {"ttl_s": 600}}},
    }
    objects = render(values, name="gw", namespace="team-a")
    text = yaml.safe_dump_all(objects)
    assert "llm" not in text.split() and "vllm" not in text  # nothing of the defaults is left
    for obj in objects:
        assert obj["metadata"]["labels"]["team"] == "inference", obj["kind"]
        where = "models" if obj["kind"] in ("InferencePool", "Role", "RoleBinding") else "team-a"
        assert obj["metadata"]["namespace"] == where, obj["kind"]
    pool = one(objects, "InferencePool")
    assert pool["metadata"]["name"] == "qwen" and pool["spec"]["selector"]["matchLabels"] == {"model": "qwen3"}
    assert pool["spec"]["targetPorts"] == [{"number": 8080}, {"number": 8081}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "qwen-picker",
        "port": {"number": 9443},
        "failureMode": "FailOpen",
    }
    cfg = config_from_mapping(router_config(objects))
    assert isinstance(cfg.discovery, InferencePoolSource)
    assert (cfg.discovery.name, cfg.discovery.namespace, cfg.listen) == ("qwen", "models", "0.0.0.0:9443")
    assert cfg.store == "redis://redis.team-a:6379/0" and cfg.sessions.ttl_s == 600
    # A pool managed elsewhere: not created, still followed.
    elsewhere = render({"inferencePool": {"create": False, "name": "shared"}})
    assert [o for o in elsewhere if o["kind"] == "InferencePool"] == []
    assert config_from_mapping(router_config(elsewhere)).discovery.name == "shared"  # type: ignore[union-attr]


def test_the_image_is_the_routers_version_and_values_reach_the_environment() -> None:
    with Chart.load(CHART) as chart:
        version = chart.metadata["appVersion"]
    container = one(
        render({"extraEnv": [{"name": "EXTPROC_HEALTH__RESPONSE_SAMPLE_RATE", "value": "0.5"}]}), "Deployment"
    )["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"extproc-router:{version}"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {
        "EXTPROC_LOG_LEVEL": "info",
        "EXTPROC_LOG_FORMAT": "json",
        "EXTPROC_HEALTH__RESPONSE_SAMPLE_RATE": "0.5",
    }
    from extproc.config.keys import config_keys

    assert "EXTPROC_HEALTH__RESPONSE_SAMPLE_RATE" in {k.env for k in config_keys()}


def test_the_rules_and_the_dashboard_are_the_observability_folders() -> None:
    observability = ROOT / "k8s" / "observability"
    for copy, original in (
        ("alerts.rules.yaml", observability / "alerts.rules.yaml"),
        ("extproc-overview.json", observability / "dashboards" / "extproc-overview.json"),
    ):
        assert (CHART / "files" / copy).read_text() == original.read_text(), f"charts/extproc/files/{copy} drifted"
    objects = render(EVERYTHING)
    rules = one(objects, "PrometheusRule")
    assert rules["spec"]["groups"] == yaml.safe_load((observability / "alerts.rules.yaml").read_text())["groups"]
    assert "{{ $labels.replica }}" in yaml.safe_dump(rules)  # the rules' own templates left alone
    dashboards = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboards")]
    assert len(dashboards) == 1 and dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    original = json.loads((observability / "dashboards" / "extproc-overview.json").read_text())
    assert json.loads(dashboards[0]["data"]["extproc-overview.json"]) == original


def test_the_sidecar_layout_is_envoy_beside_the_router_with_the_bootstrap_the_renderer_makes(tmp_path: Path) -> None:
    import runpy

    values = {**SIDECAR, "ports": {"grpc": 9102}, "sidecar": {**SIDECAR["sidecar"], "envoy": {"port": 8088}}}
    objects = render(values, name="gw", namespace="team-a")
    assert not {o["kind"] for o in objects} & {"InferencePool", "Secret"}
    cfg = config_from_mapping(router_config(objects))
    source = cfg.discovery
    assert isinstance(source, KubernetesSource)
    assert (source.service, source.namespace, source.port) == ("vllm-qwen", "models", 8001)
    assert cfg.mode == "endpoint" and cfg.listen == "0.0.0.0:9102"
    assert cfg.grpc.tls is None and cfg.grpc.secure_serving is False  # Envoy dials it on loopback
    pod = one(objects, "Deployment")["spec"]["template"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert set(containers) == {"envoy", "extproc"}
    assert containers["envoy"]["image"] == "envoyproxy/envoy:v1.40.0"
    assert {p["name"]: p["containerPort"] for p in containers["envoy"]["ports"]}["http"] == 8088
    # The bootstrap is what `extproc envoy-config --scenario kubernetes` renders for this config.
    (envoy_map,) = [o for o in objects if o["kind"] == "ConfigMap" and "envoy.yaml" in o["data"]]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["envoy-config"]["configMap"]["name"] == envoy_map["metadata"]["name"]
    render_envoy = runpy.run_path(str(ROOT / "scripts" / "chart_envoy.py"))["render_envoy"]
    bootstrap = envoy_map["data"]["envoy.yaml"]
    assert bootstrap == render_envoy("vllm-qwen", "models", 8001, 9102, 8088)
    clusters = {c["name"]: c for c in yaml.safe_load(bootstrap)["static_resources"]["clusters"]}
    processor = clusters["extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert processor["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 9102}
    path = tmp_path / "envoy.yaml"
    path.write_text(bootstrap)
    validate(path)  # by Envoy itself
    # The gateway's Service: its http port to Envoy's listener; RBAC: the EndpointSlices, there.
    service = one(objects, "Service")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "http": (80, "http"),
        "metrics": (9090, "metrics"),
    }
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "gateway"
    role = one(objects, "Role")
    assert role["metadata"]["namespace"] == "models"
    assert [(r["apiGroups"], r["resources"]) for r in role["rules"]] == [(["discovery.k8s.io"], ["endpointslices"])]
    with Chart.load(CHART) as chart, pytest.raises(HelmError, match=r"sidecar\.modelServers\.service"):
        chart.render({"layout": "sidecar"}, name="gw", namespace="team-a")


def test_the_charts_envoy_bootstrap_file_is_the_renderers() -> None:
    import runpy

    generate = runpy.run_path(str(ROOT / "scripts" / "chart_envoy.py"))["generate"]
    assert (CHART / "files" / "envoy-sidecar.yaml").read_text() == generate(), "stale: make chart-envoy"


def _value_paths(values: dict[str, Any], prefix: str = "") -> list[str]:
    """Every settable value of values.yaml, dotted (a mapping that is empty or of free keys, and a
    list, is one value)."""
    out = []
    for name, value in values.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict) and value and name not in ("resources", "matchLabels", "labels"):
            out += _value_paths(value, f"{path}.")
        else:
            out.append(path)
    return out


def test_every_value_is_documented_in_the_values_table() -> None:
    page = (ROOT / "docs" / "helm.md").read_text()
    table = page[page.index("## Values") :].split("\n\n")[1]
    documented: set[str] = set()
    for row in table.splitlines()[2:]:
        last = ""
        for name in re.findall(r"`([\w.*]+)`", row.split("|")[1]):
            # `.namespace` after `sidecar.modelServers.service` is sidecar.modelServers.namespace.
            full = last.rpartition(".")[0] + name if name.startswith(".") else name
            documented.add(full)
            last = full
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def covered(path: str) -> bool:
        parts = path.split(".")
        return path in documented or any(".".join(parts[:i]) + ".*" in documented for i in range(1, len(parts)))

    missing = [p for p in _value_paths(values) if not covered(p)]
    assert not missing, f"docs/helm.md's values table lacks {missing}"
