"""An InferencePool and its pods to replicas: pure functions over the API's JSON, no client, no I/O.

The Gateway API Inference Extension's ``InferencePool`` (``inference.networking.k8s.io/v1``) names
the model server pods with ``spec.selector.matchLabels`` and the ports they serve on with
``spec.targetPorts`` (one to eight ``{number}``); its endpoint picker follows both. Semantics
followed here:

- A pod is a member when the selector matches its labels, it has an IP, it is ``Running``, its
  ``Ready`` condition is ``True`` and it is not being deleted (``deletionTimestamp``): a pod being
  deleted may finish its requests, but new work must not go there.
- Each target port of a member is a replica at ``podIP:port``: named after the pod with one port,
  ``POD-rank-I`` with several (data-parallel ranks served on their own ports).
- The pod's labels become the replica's: ``llm-d.ai/role`` (prefill/decode, see
  :mod:`extproc.routing.roles`), and whatever request classes select on; its node is ``node``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.fleet.discovery.source import canonical, host_port
from extproc.routing.model import Replica

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def object_name(obj: Mapping[str, Any]) -> str:
    """``metadata.name`` ('' when missing)."""
    return str(_mapping(obj.get("metadata")).get("name") or "")


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the picker needs of a pool: its selector and its target ports."""

    selector: tuple[tuple[str, str], ...]
    ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        """The selector as the API's ``labelSelector`` query (``a=b,c=d``)."""
        return ",".join(f"{k}={v}" for k, v in self.selector)

    def selects(self, labels: Mapping[str, str]) -> bool:
        """Whether a pod with ``labels`` is in the pool."""
        return all(labels.get(k) == v for k, v in self.selector)


def pool_spec(obj: Mapping[str, Any]) -> PoolSpec:
    """The spec of an InferencePool; ValueError naming the field when it cannot be followed (an
    empty selector would select every pod of the namespace: refused, as the API's schema does)."""
    spec = _mapping(obj.get("spec"))
    selector = _mapping(spec.get("selector"))
    labels = _mapping(selector.get("matchLabels"))
    if not labels or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValueError(f"InferencePool {object_name(obj)}: spec.selector.matchLabels: expected labels, got {labels}")
    ports = []
    for entry in spec.get("targetPorts") or ():
        number = _mapping(entry).get("number")
        if isinstance(number, int) and not isinstance(number, bool) and 1 <= number <= 65535:
            ports.append(number)
        else:
            raise ValueError(f"InferencePool {object_name(obj)}: spec.targetPorts: not a port number: {entry}")
    if not ports:
        raise ValueError(f"InferencePool {object_name(obj)}: spec.targetPorts: none given")
    return PoolSpec(tuple(sorted((str(k), str(v)) for k, v in labels.items())), tuple(ports))


def is_member(pod: Mapping[str, Any]) -> bool:
    """Running, ready, with an IP, and not being deleted."""
    meta, status = _mapping(pod.get("metadata")), _mapping(pod.get("status"))
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    conditions = [c for c in status.get("conditions") or () if isinstance(c, Mapping)]
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def replicas_of_pod(pod: Mapping[str, Any], spec: PoolSpec) -> tuple[Replica, ...]:
    """The replicas a pod makes in the pool (none when it is not a member, or not selected)."""
    meta = _mapping(pod.get("metadata"))
    labels = {str(k): str(v) for k, v in _mapping(meta.get("labels")).items()}
    if not spec.selects(labels) or not is_member(pod):
        return ()
    name = object_name(pod)
    node = _mapping(pod.get("spec")).get("nodeName")
    if node:
        labels.setdefault("node", str(node))
    try:
        addresses = [host_port(str(_mapping(pod.get("status"))["podIP"]), port) for port in spec.ports]
    except ValueError:  # not an IP: the API server validates this, a fake or a proxy might not
        return ()
    if len(addresses) == 1:
        return (Replica(name, addresses[0], 1.0, labels),)
    return tuple(Replica(f"{name}-rank-{i}", a, 1.0, labels) for i, a in enumerate(addresses))


class PodSet:
    """The pods of one pool as last seen, and the replicas they make."""

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self._pods: dict[str, tuple[Replica, ...]] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def reset(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """Replace everything with a fresh list (after a list call)."""
        self._pods = {}
        for pod in pods:
            self.put(pod)

    def put(self, pod: Mapping[str, Any]) -> None:
        """A pod was added or modified (or started to match the selector)."""
        self._pods[object_name(pod)] = replicas_of_pod(pod, self.spec)

    def remove(self, pod: Mapping[str, Any]) -> None:
        """A pod was deleted (or stopped matching the selector)."""
        self._pods.pop(object_name(pod), None)

    def replicas(self) -> tuple[Replica, ...]:
        """Every member's replicas, sorted by name."""
        return canonical(r for name in sorted(self._pods) for r in self._pods[name])
