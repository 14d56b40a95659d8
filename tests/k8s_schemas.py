"""What the Kubernetes manifest tests share (tests/project/test_k8s.py for k8s/, test_helm.py for
charts/): the Kubernetes releases the objects are validated against, the core API groups that
``kubernetes-validate`` has schemas for, and structural schemas of the custom resources (no schema
ships for them)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]

# The oldest release the manifests are meant for (gRPC probes, PDB unhealthyPodEvictionPolicy)
# and the newest whose schemas kubernetes-validate bundles.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CORE_GROUPS = {"v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1"}
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


# -- structural schemas of the custom resources (a subset of their CRDs: the fields we use,
# with their types and allowed values; unknown fields are refused where we know the whole level).

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 1}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}},
}
_PORT_NUMBER = {"type": "integer", "minimum": 1, "maximum": 65535}


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _META, "spec": spec},
    }


CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _resource(
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
        {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": _LABELS}, "required": ["matchLabels"]},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m)$"},
                        },
                    },
                },
            },
        },
    ),
    "PrometheusRule": _resource(
        "monitoring.coreos.com/v1",
        "PrometheusRule",
        {
            "type": "object",
            "required": ["groups"],
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string"},
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                    "properties": {"expr": {"type": ["string", "integer"]}, "for": {"type": "string"}},
                                },
                            },
                        },
                    },
                }
            },
        },
    ),
    "EnvoyFilter": _resource(
        "networking.istio.io/v1alpha3",
        "EnvoyFilter",
        {
            "type": "object",
            "required": ["configPatches"],
            "additionalProperties": False,
            "properties": {
                "workloadSelector": {"type": "object", "properties": {"labels": _LABELS}, "required": ["labels"]},
                "configPatches": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["applyTo", "patch"],
                        "additionalProperties": False,
                        "properties": {
                            "applyTo": {
                                "enum": ["LISTENER", "FILTER_CHAIN", "NETWORK_FILTER", "HTTP_FILTER", "CLUSTER"]
                            },
                            "match": {
                                "type": "object",
                                "properties": {
                                    "context": {"enum": ["ANY", "SIDECAR_INBOUND", "SIDECAR_OUTBOUND", "GATEWAY"]},
                                    "cluster": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {"service": {"type": "string"}, "portNumber": _PORT_NUMBER},
                                    },
                                },
                            },
                            "patch": {
                                "type": "object",
                                "required": ["operation", "value"],
                                "additionalProperties": False,
                                "properties": {
                                    "operation": {
                                        "enum": ["MERGE", "ADD", "INSERT_BEFORE", "INSERT_AFTER", "INSERT_FIRST"]
                                    },
                                    "value": {"type": "object"},
                                },
                            },
                        },
                    },
                },
            },
        },
    ),
    "InferencePool": _resource(
        "inference.networking.k8s.io/v1",
        "InferencePool",
        {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS},
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "items": {"type": "object", "required": ["number"], "properties": {"number": _PORT_NUMBER}},
                },
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name", "port"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"const": ""},
                        "kind": {"const": "Service"},
                        "name": {"type": "string"},
                        "port": {"type": "object", "required": ["number"], "properties": {"number": _PORT_NUMBER}},
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    ),
    "HTTPRoute": _resource(
        "gateway.networking.k8s.io/v1",
        "HTTPRoute",
        {
            "type": "object",
            "required": ["parentRefs", "rules"],
            "properties": {
                "parentRefs": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                "rules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "backendRefs": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["name"],
                                    "properties": {"group": {"type": "string"}, "kind": {"type": "string"}},
                                },
                            },
                            "timeouts": {"type": "object", "properties": {"request": {"type": "string"}}},
                        },
                    },
                },
            },
        },
    ),
    "Gateway": _resource(
        "networking.istio.io/v1",
        "Gateway",
        {
            "type": "object",
            "required": ["selector", "servers"],
            "properties": {"selector": _LABELS, "servers": {"type": "array", "minItems": 1}},
        },
    ),
    "VirtualService": _resource(
        "networking.istio.io/v1",
        "VirtualService",
        {
            "type": "object",
            "required": ["hosts", "http"],
            "properties": {"hosts": {"type": "array"}, "gateways": {"type": "array"}, "http": {"type": "array"}},
        },
    ),
}
