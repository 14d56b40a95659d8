"""The Kubernetes manifests: rendered by ``kubectl kustomize``, core objects validated against the
Kubernetes schemas (``kubernetes-validate``, offline, with its bundled schemas), custom resources
checked against the structural schemas below (no schema ships for them), the embedded Envoy and
router configs validated by Envoy and by the router's own loader, and the EnvoyFilter's patches
applied to a bootstrap that Envoy must accept."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ExternalProcessor

from extproc.adapters.cli import main
from extproc.adapters.envoy_config import (
    GatewaySpec,
    IstioSpec,
    istio_envoy_filter,
    processor_cluster,
    render,
    to_dict,
)
from extproc.config import config_from_mapping
from extproc.fleet.discovery.settings import KubernetesSource
from tests.conftest import ROOT, require_binary
from tests.helpers import apply_istio_patches, validate
from tests.k8s_schemas import CORE_GROUPS, CRD_SCHEMAS, EXT_PROC_SERVICE, K8S_VERSIONS

K8S = ROOT / "k8s"
TARGETS = {
    "base": K8S / "base",
    "istio": K8S / "overlays" / "istio",
    "inference-pool": K8S / "overlays" / "inference-pool",
    "inference-pool-istio": K8S / "overlays" / "inference-pool-istio",
}
GATEWAY_CONTAINERS = {"envoy", "extproc"}


@cache
def rendered(target: str) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize`` of a target, as a tuple of objects (rendered once per run)."""
    kubectl = require_binary("kubectl")
    result = subprocess.run(
        [kubectl, "kustomize", str(TARGETS[target])], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def objects(target: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in rendered(target) if o["kind"] == kind]


def one(target: str, kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects(target, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name} in {target}: {len(found)}"
    return found[0]


def config_map_data(target: str, prefix: str) -> dict[str, str]:
    found = [o for o in objects(target, "ConfigMap") if o["metadata"]["name"].startswith(prefix)]
    assert len(found) == 1, [o["metadata"]["name"] for o in found]
    data: dict[str, str] = found[0]["data"]
    return data


def containers(target: str) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(deployment name, pod spec, container) for every container of every Deployment."""
    for deployment in objects(target, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        for container in pod["containers"]:
            yield deployment["metadata"]["name"], pod, container


# -- rendering and schemas


@pytest.mark.parametrize("target", TARGETS)
def test_kustomize_renders(target: str) -> None:
    kinds = {o["kind"] for o in rendered(target)}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    assert {"PodDisruptionBudget", "ServiceMonitor", "PrometheusRule"} <= kinds


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_core_object_validates_against_the_kubernetes_schemas(target: str, version: str) -> None:
    core = [o for o in rendered(target) if o["apiVersion"] in CORE_GROUPS]
    assert core
    for obj in core:
        # strict: a field the schema does not know is an error, not silently dropped.
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_is_either_core_or_checked_structurally(target: str) -> None:
    for obj in rendered(target):
        if obj["apiVersion"] in CORE_GROUPS:
            continue
        assert obj["kind"] in CRD_SCHEMAS, f"no schema for {obj['apiVersion']} {obj['kind']}"
        jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])


def test_the_structural_schemas_refuse_what_they_should() -> None:
    pool = copy.deepcopy(one("inference-pool", "InferencePool", "vllm"))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, CRD_SCHEMAS["InferencePool"])
    envoy_filter = copy.deepcopy(one("istio", "EnvoyFilter", "extproc-router"))
    envoy_filter["spec"]["configPatches"][0]["patch"]["operation"] = "REPLACE_ALL"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(envoy_filter, CRD_SCHEMAS["EnvoyFilter"])


def test_kubernetes_validate_catches_a_wrong_field() -> None:
    deployment = copy.deepcopy(one("base", "Deployment", "extproc"))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["runAsNonRot"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


# -- the gateway pod


def test_every_container_is_locked_down_and_sized() -> None:
    for target in TARGETS:
        for name, pod, container in containers(target):
            where = f"{target}: {name}/{container['name']}"
            security = container.get("securityContext", {})
            assert pod["securityContext"]["runAsNonRoot"] is True, where
            assert security.get("runAsNonRoot", True) is True, where
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), where
            assert "memory" in container["resources"]["limits"], where
            assert "readinessProbe" in container and "livenessProbe" in container, where


def test_base_gateway_pod_has_envoy_and_the_processor_probed_on_grpc_health() -> None:
    deployment = one("base", "Deployment", "extproc")
    pod = deployment["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    assert set(by_name) == GATEWAY_CONTAINERS
    extproc = by_name["extproc"]
    assert extproc["readinessProbe"]["grpc"] == {"port": 9002, "service": EXT_PROC_SERVICE}
    assert extproc["livenessProbe"]["grpc"]["port"] == 9002
    assert extproc["startupProbe"]["grpc"]["port"] == 9002
    assert by_name["envoy"]["readinessProbe"]["httpGet"]["path"] == "/ready"
    # The API token reaches the processor only.
    assert pod["automountServiceAccountToken"] is False
    mounts = {c["name"]: {m["mountPath"] for m in c.get("volumeMounts", [])} for c in pod["containers"]}
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts["extproc"]
    assert "/var/run/secrets/kubernetes.io/serviceaccount" not in mounts["envoy"]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert deployment["spec"]["replicas"] >= 2


def test_the_pdb_and_services_select_the_gateway_pods() -> None:
    for target in TARGETS:
        pod_labels = one(target, "Deployment", "extproc")["spec"]["template"]["metadata"]["labels"]
        pdb = one(target, "PodDisruptionBudget", "extproc")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        ports = {p["name"] for _, _, c in containers(target) for p in c.get("ports", [])}
        for service in objects(target, "Service"):
            selected = [
                d
                for d in objects(target, "Deployment")
                if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
            ]
            assert selected, f"{target}: Service {service['metadata']['name']} selects no pods"
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in ports, f"{target}: {service['metadata']['name']} {port}"


def test_the_service_monitor_scrapes_the_processor_as_job_extproc() -> None:
    monitor = one("base", "ServiceMonitor", "extproc")
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = {
        (s["metadata"]["name"], p["name"])
        for s in objects("base", "Service")
        if selector.items() <= s["metadata"]["labels"].items()
        for p in s["spec"]["ports"]
    }
    wanted = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert ("extproc", "metrics") in scraped  # the alert rules expect job="extproc"
    assert wanted <= {port for _, port in scraped}


def test_observability_is_included() -> None:
    assert objects("base", "PrometheusRule")
    assert any("dashboards" in o["metadata"]["name"] for o in objects("base", "ConfigMap"))


def test_rbac_lets_the_processor_watch_endpoint_slices() -> None:
    role = one("base", "Role", "extproc-discovery")
    rule = role["rules"][0]
    assert rule["apiGroups"] == ["discovery.k8s.io"] and rule["resources"] == ["endpointslices"]
    assert {"list", "watch"} <= set(rule["verbs"])
    binding = one("base", "RoleBinding", "extproc-discovery")
    assert binding["roleRef"]["name"] == "extproc-discovery"
    account = one("base", "Deployment", "extproc")["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "llm"}]


# -- the configs inside


def test_router_config_loads_with_the_real_loader_redis_and_endpoint_slices() -> None:
    cfg = config_from_mapping(yaml.safe_load(config_map_data("base", "extproc-router")["router.yaml"]))
    assert cfg.store.startswith("redis://extproc-redis:")
    assert cfg.mode == "endpoint"
    source = cfg.discovery
    assert isinstance(source, KubernetesSource)
    assert (source.namespace, source.service, source.port) == ("llm", "vllm", 8000)
    redis = one("base", "Service", "extproc-redis")
    assert redis["spec"]["ports"][0]["port"] == 6379
    assert main(["check-config", str(K8S / "base" / "router.yaml")]) == 0


def test_embedded_envoy_config_validates(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(config_map_data("base", "extproc-envoy")["envoy.yaml"])
    validate(path)


def test_embedded_envoy_config_is_rendered_from_the_router_config(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["envoy-config", "--config", str(K8S / "base" / "router.yaml"), "--scenario", "kubernetes"]
    assert main(argv) == 0
    assert capsys.readouterr().out == (K8S / "base" / "envoy.yaml").read_text()


def test_istio_envoy_filter_is_rendered_from_the_router_config(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["envoy-config", "--config", str(K8S / "base" / "router.yaml"), "--output", "istio-envoyfilter"]
    assert main([*argv, "--processor", "extproc.llm.svc.cluster.local:9002"]) == 0
    assert capsys.readouterr().out == (K8S / "overlays" / "istio" / "envoyfilter.yaml").read_text()


CORS = "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"


def test_istio_envoy_filter_patches_validate_in_a_gateway_bootstrap(tmp_path: Path) -> None:
    envoy_filter = one("istio", "EnvoyFilter", "extproc-router")
    spec = IstioSpec(processor_service="extproc.llm.svc.cluster.local:9002", replicas_service="", replicas_port=0)
    # A stand-in for Istio's ingress gateway: one HTTP listener with only the router filter, the
    # cluster Istio makes for our processor's Service, and the model servers' EDS cluster as Istio
    # configures it (LEAST_REQUEST), here static.
    gateway = render(GatewaySpec(replicas=(), mode="endpoint", replicas_dns="vllm.llm.svc.cluster.local:8000"))
    listener = gateway["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    # Istio's own filters (authentication among them) sit before the router: the strip goes first.
    hcm["http_filters"] = [
        {"name": "envoy.filters.http.cors", "typed_config": {"@type": CORS}},
        *(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"),
    ]
    hcm["route_config"]["virtual_hosts"][0]["routes"] = [
        {"match": {"prefix": "/"}, "route": {"cluster": "outbound|8000||vllm.llm.svc.cluster.local"}}
    ]
    del listener["per_connection_buffer_limit_bytes"]
    models = {
        "name": "outbound|8000||vllm.llm.svc.cluster.local",
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {
            "cluster_name": "outbound|8000||vllm.llm.svc.cluster.local",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": {"socket_address": {"address": "10.0.0.1", "port_value": 8000}}}}
                    ]
                }
            ],
        },
    }
    bootstrap = {
        "admin": gateway["admin"],
        "static_resources": {
            "listeners": [listener],
            "clusters": [to_dict(processor_cluster(spec.processor_cluster, ["127.0.0.1:9002"])), models],
        },
    }
    apply_istio_patches(bootstrap, envoy_filter)
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.cors",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    removed = {m["remove"] for m in hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]}
    assert {"x-tenant-id", "x-prefiller-host-port", "x-gateway-destination-endpoint"} <= removed
    # The ext_proc patch is an ExternalProcessor, field for field (the typed class refuses others).
    ext_proc = {k: v for k, v in hcm["http_filters"][2]["typed_config"].items() if k != "@type"}
    parsed = ExternalProcessor.from_dict(ext_proc)
    assert parsed.grpc_service is not None and parsed.grpc_service.envoy_grpc is not None
    assert parsed.grpc_service.envoy_grpc.cluster_name == "outbound|9002||extproc.llm.svc.cluster.local"
    assert parsed.failure_mode_allow is True
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    validate(path)


def test_the_header_strip_for_an_inference_gateway_is_rendered_from_the_router_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["envoy-config", "--config", str(K8S / "base" / "router.yaml"), "--output", "istio-header-strip"]
    assert main([*argv, "--istio-namespace", "llm", "--istio-gateway", "inference-gateway"]) == 0
    assert capsys.readouterr().out == (K8S / "components" / "istio-header-strip" / "envoyfilter.yaml").read_text()


def test_an_inference_pool_fails_open_only_where_envoy_strips_first(tmp_path: Path) -> None:
    """Issue 39: with the processor down a pool that fails open sends the client's request, headers
    and all, to a pod: a decode pod's sidecar would make its prefill hop wherever the client's
    x-prefiller-host-port says. The overlay for any GIE implementation fails closed; the one for
    Istio fails open behind a strip that runs first in the inference gateway's Envoy."""
    assert one("inference-pool", "InferencePool", "vllm")["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    assert not objects("inference-pool", "EnvoyFilter")
    pool = one("inference-pool-istio", "InferencePool", "vllm")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    strip = one("inference-pool-istio", "EnvoyFilter", "extproc-header-strip")
    gateway_pods = one("inference-pool-istio", "NetworkPolicy", "extproc")["spec"]["ingress"][1]["from"][0]
    assert strip["spec"]["workloadSelector"]["labels"] == gateway_pods["podSelector"]["matchLabels"]
    # Applied as Istio applies it to a GIE gateway's own chain (its ext_proc filter to the
    # endpoint picker, failing open, then the router): the strip comes first and Envoy takes it.
    gateway = render(GatewaySpec(replicas=(), mode="endpoint", replicas_dns="vllm.llm.svc.cluster.local:8000"))
    listener = gateway["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.header_mutation"]
    bootstrap = {"admin": gateway["admin"], "static_resources": gateway["static_resources"]}
    apply_istio_patches(bootstrap, strip)
    assert [f["name"] for f in hcm["http_filters"]] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.router",
    ]
    removed = {m["remove"] for m in hcm["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]}
    assert {"x-prefiller-host-port", "x-tenant-id", "x-gateway-destination-endpoint"} <= removed
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    validate(path)


def test_the_overlays_point_at_the_services_the_router_discovers() -> None:
    cfg = config_from_mapping(yaml.safe_load(config_map_data("istio", "extproc-router")["router.yaml"]))
    source = cfg.discovery
    assert isinstance(source, KubernetesSource)
    models = f"{source.service}.{source.namespace}.svc.cluster.local"
    processor = one("istio", "Service", "extproc")
    grpc = next(p for p in processor["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "grpc"  # Istio's cluster for it is then HTTP/2
    patches = one("istio", "EnvoyFilter", "extproc-router")["spec"]["configPatches"]
    ext_proc = next(p for p in patches if p["patch"]["value"].get("name") == "envoy.filters.http.ext_proc")
    cluster = ext_proc["patch"]["value"]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
    assert cluster == f"outbound|{grpc['port']}||extproc.{processor['metadata']['namespace']}.svc.cluster.local"
    merged = next(p for p in patches if p["applyTo"] == "CLUSTER")
    assert merged["match"]["cluster"] == {"service": models, "portNumber": source.port}
    virtual_service = one("istio", "VirtualService", "vllm")
    assert virtual_service["spec"]["http"][0]["route"][0]["destination"]["host"] == models
    pool = one("inference-pool", "InferencePool", "vllm")
    assert pool["spec"]["targetPorts"] == [{"number": source.port}]
    picker = pool["spec"]["endpointPickerRef"]
    service = one("inference-pool", "Service", picker["name"])
    assert picker["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    route = one("inference-pool", "HTTPRoute", "vllm")
    assert route["spec"]["rules"][0]["backendRefs"][0] == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": "vllm",
    }


@pytest.mark.parametrize("target", ["istio", "inference-pool", "inference-pool-istio"])
def test_overlays_run_the_processor_alone(target: str) -> None:
    pod = one(target, "Deployment", "extproc")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["extproc"]
    assert not [o for o in objects(target, "ConfigMap") if o["metadata"]["name"].startswith("extproc-envoy")]
    assert not [o for o in objects(target, "Service") if o["metadata"]["name"] == "extproc-gateway"]
    volumes = {v["name"] for v in pod["volumes"]}
    assert not volumes & {"envoy-config", "envoy-tmp"}


def test_istio_overlay_puts_the_processor_in_the_mesh() -> None:
    assert one("istio", "Namespace", "llm")["metadata"]["labels"]["istio-injection"] == "enabled"
    envoy_filter = one("istio", "EnvoyFilter", "extproc-router")
    assert envoy_filter["metadata"]["namespace"] == "istio-system"
    assert envoy_filter == istio_envoy_filter(
        IstioSpec(
            processor_service="extproc.llm.svc.cluster.local:9002",
            replicas_service="vllm.llm.svc.cluster.local",
            replicas_port=8000,
        )
    )


# -- the container image (no docker engine here: its definition is checked, and its build step,
# the wheel, is built and installed into a fresh venv whose `extproc` command must work)


def _final_stage(dockerfile: str) -> list[str]:
    lines = [line.strip() for line in dockerfile.splitlines() if line.strip() and not line.startswith("#")]
    starts = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    assert len(starts) >= 2, "a multi-stage build: the wheel is built apart from the image"
    return lines[starts[-1] :]


def test_dockerfile_installs_the_wheel_offline_as_the_user_the_pod_runs_as() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    final = _final_stage(dockerfile)
    assert final[0].startswith("FROM python:") and "-slim" in final[0]
    assert "pip wheel --wheel-dir /wheels ." in dockerfile
    install = " ".join(final)
    assert "pip install --no-index --find-links /wheels extproc-router" in install
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and users[-1] == "10001:10001"
    assert 'ENTRYPOINT ["extproc"]' in final
    pod_users = {
        c["securityContext"]["runAsUser"] for _, _, c in containers("base") if c["image"].startswith("extproc-router")
    }
    assert pod_users == {10001}
    ignored = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert ignored[0] == "*" and {"!pyproject.toml", "!README.md", "!extproc/"} <= set(ignored)


def _run(
    argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False, env=env, cwd=cwd)


def test_the_wheel_installs_the_extproc_command(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):  # what .dockerignore lets into the build
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "extproc", source / "extproc", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(source)])
    assert built.returncode == 0, built.stderr
    wheel = next(tmp_path.glob("extproc_router-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "extproc/py.typed" in names and "extproc/adapters/cli.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "envoy/", "k8s/"))]
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    installed = _run([*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", str(wheel)])
    assert installed.returncode == 0, installed.stderr
    # The dependencies come from this environment (the image gets them as wheels from the build stage).
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    # Run from elsewhere: from the repository, `import extproc` would find its source folder.
    where = _run([str(venv / "bin" / "python"), "-c", "import extproc; print(extproc.__file__)"], env, tmp_path)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    checked = _run([str(venv / "bin" / "extproc"), "check-config", str(K8S / "base" / "router.yaml")], env, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ok (mode endpoint" in checked.stdout


# --- NetworkPolicy around the gateway pods -----------------------------------------------------

GATEWAY_POD = {"app.kubernetes.io/name": "extproc", "app.kubernetes.io/component": "gateway"}
PROMETHEUS_POD = {"app.kubernetes.io/name": "prometheus"}
STRANGER = {"app": "curl"}


def _selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    # matchLabels only: the policies here use nothing else (asserted below).
    assert selector is None or set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in (selector or {}).get("matchLabels", {}).items())


def _peer_matches(peer: dict[str, Any], labels: dict[str, str], namespace: dict[str, str]) -> bool:
    if "ipBlock" in peer:
        return False  # pods are matched by selectors; ipBlocks are for the API server
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], namespace):
            return False
    elif namespace.get("kubernetes.io/metadata.name") != "llm":
        return False  # a podSelector alone means the policy's own namespace
    return _selects(peer.get("podSelector"), labels)


def _allows(rules: list[dict[str, Any]], key: str, labels: dict[str, str], port: int, namespace: str = "llm") -> bool:
    """Whether one of ``rules`` (ingress ``from`` or egress ``to``) admits a pod with ``labels`` in
    ``namespace`` on TCP ``port``."""
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    for rule in rules:
        ports = [p["port"] for p in rule.get("ports", []) if p.get("protocol", "TCP") == "TCP"]
        if ports and port not in ports:
            continue
        peers = rule.get(key)
        if not peers or any(_peer_matches(p, labels, ns_labels) for p in peers):
            return True
    return False


def _gateway_policy(target: str) -> dict[str, Any]:
    policy = one(target, "NetworkPolicy", "extproc")
    assert policy["spec"]["podSelector"]["matchLabels"] == GATEWAY_POD
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    return policy


@pytest.mark.parametrize("target", list(TARGETS))
def test_network_policy_selects_the_gateway_pods_and_admits_only_their_peers(target: str) -> None:
    spec = _gateway_policy(target)["spec"]
    ingress = spec["ingress"]
    # Prometheus, from any namespace, on the metrics ports; nobody else there.
    for port in (9190, 9902):
        assert _allows(ingress, "from", PROMETHEUS_POD, port, namespace="monitoring")
        assert not _allows(ingress, "from", STRANGER, port)
        assert not _allows(ingress, "from", GATEWAY_POD, port, namespace="other")
    # ext_proc: only the Envoy that calls it.
    assert not _allows(ingress, "from", STRANGER, 9002)
    assert not _allows(ingress, "from", PROMETHEUS_POD, 9002, namespace="monitoring")
    envoy = {
        "base": (GATEWAY_POD, "llm"),
        "istio": ({"istio": "ingressgateway"}, "istio-system"),
        "inference-pool": ({"gateway.networking.k8s.io/gateway-name": "inference-gateway"}, "llm"),
        "inference-pool-istio": ({"gateway.networking.k8s.io/gateway-name": "inference-gateway"}, "llm"),
    }[target]
    assert _allows(ingress, "from", envoy[0], 9002, namespace=envoy[1])
    # Client traffic reaches Envoy's listener; nothing else is open to everyone.
    assert _allows(ingress, "from", STRANGER, 8080)
    assert [r for r in ingress if not r.get("from")] == [{"ports": [{"port": 8080, "protocol": "TCP"}]}]


def test_network_policy_ports_are_the_ports_the_gateway_pod_serves() -> None:
    deployment = one("base", "Deployment", "extproc")
    served = {p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert deployment["spec"]["template"]["metadata"]["labels"].items() >= GATEWAY_POD.items()
    ingress_ports = {p["port"] for r in _gateway_policy("base")["spec"]["ingress"] for p in r["ports"]}
    assert ingress_ports == served


@pytest.mark.parametrize("target", list(TARGETS))
def test_network_policy_lets_the_processor_reach_only_replicas_redis_dns_and_the_api_server(target: str) -> None:
    egress = _gateway_policy("base" if target == "base" else target)["spec"]["egress"]
    router = config_from_mapping(yaml.safe_load(config_map_data("base", "extproc-router")["router.yaml"]))
    source = router.discovery
    assert isinstance(source, KubernetesSource) and source.port is not None
    pool = one("inference-pool", "InferencePool", "vllm")["spec"]["selector"]["matchLabels"]
    redis = one("base", "Service", "extproc-redis")["spec"]
    assert _allows(egress, "to", pool, source.port)
    assert _allows(egress, "to", redis["selector"], redis["ports"][0]["port"])
    assert not _allows(egress, "to", pool, redis["ports"][0]["port"])
    assert not _allows(egress, "to", redis["selector"], source.port)
    assert not _allows(egress, "to", STRANGER, source.port)
    dns = [r for r in egress if {p["port"] for p in r["ports"]} == {53}]
    assert len(dns) == 1 and {p["protocol"] for p in dns[0]["ports"]} == {"UDP", "TCP"}
    assert _allows(egress, "to", {"k8s-app": "kube-dns"}, 53, namespace="kube-system")
    api = [r for r in egress if any("ipBlock" in peer for peer in r["to"])]
    assert len(api) == 1 and {p["port"] for p in api[0]["ports"]} == {443, 6443}
    extra = {"istio": 1}.get(target, 0)  # the mesh's sidecar also talks to istiod
    assert len(egress) == 4 + extra
