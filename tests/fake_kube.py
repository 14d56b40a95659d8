"""A fake Kubernetes API server for list+watch over several collections, with equality label
selectors and ``metadata.name`` field selectors, as the real one serves them: a watch with a
selector is sent ``DELETED`` for an object that stops matching and ``ADDED`` for one that starts.

Just enough for InferencePools and Pods (tests/unit/fleet/discovery, tests/e2e/test_picker_e2e.py):
objects are JSON mappings, every change bumps one resourceVersion, history can be compacted
(watches from before are told ``410 Gone``), and requests can be made to fail.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools"
PODS = "/api/v1/namespaces/{namespace}/pods"


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    labels: Mapping[str, str] = obj.get("metadata", {}).get("labels") or {}
    return labels


def matches(obj: Mapping[str, Any], label_selector: str, field_selector: str) -> bool:
    """Whether ``obj`` is selected (equality selectors only, as the picker sends)."""
    for term in filter(None, label_selector.split(",")):
        key, _, value = term.partition("=")
        if _labels(obj).get(key) != value:
            return False
    for term in filter(None, field_selector.split(",")):
        key, _, value = term.partition("=")
        if key != "metadata.name":
            raise ValueError(f"field selector {key} not supported here")
        if obj["metadata"]["name"] != value:
            return False
    return True


class _Watch:
    def __init__(self, collection: str, namespace: str, labels: str, fields: str) -> None:
        self.collection, self.namespace, self.labels, self.fields = collection, namespace, labels, fields
        self.queue: asyncio.Queue[tuple[str, dict[str, Any]] | None] = asyncio.Queue()


class FakeKube:
    """Collections ``pools`` and ``pods`` of namespaced objects, served over HTTP on 127.0.0.1."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (collection, namespace, name)
        self.version = 100
        self.history: list[tuple[int, str, dict[str, Any], dict[str, Any] | None]] = []
        self.deletions: set[int] = set()  # versions of the history that were deletions
        self.compacted = 0
        self.fail_next = 0
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._watches: set[_Watch] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> FakeKube:
        app = web.Application()
        app.router.add_get(POOLS, lambda r: self._handle(r, "pools"))
        app.router.add_get(PODS, lambda r: self._handle(r, "pods"))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        self.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def watches(self, collection: str) -> int:
        return sum(1 for w in self._watches if w.collection == collection)

    # -- changes --------------------------------------------------------------------------------
    def put(self, collection: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (collection, meta["namespace"], meta["name"])
        before = self.objects.get(key)
        self.version += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.objects[key] = obj
        self.history.append((self.version, collection, obj, before))
        for watch in self._watches:
            self._notify(watch, collection, obj, before)

    def delete(self, collection: str, namespace: str, name: str) -> None:
        obj = self.objects.pop((collection, namespace, name))
        self.version += 1
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = str(self.version)
        self.history.append((self.version, collection, gone, obj))
        self.deletions.add(self.version)
        for watch in self._watches:
            if watch.collection == collection and self._selected(watch, obj):
                watch.queue.put_nowait(("DELETED", gone))

    def expire(self) -> None:
        """Compact the history: open watches are told 410 Gone, and must list again."""
        self.version += 1
        self.compacted = self.version
        gone = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410, "message": "too old"}
        for watch in self._watches:
            watch.queue.put_nowait(("ERROR", gone))

    def close_watches(self) -> None:
        for watch in self._watches:
            watch.queue.put_nowait(None)

    # -- serving --------------------------------------------------------------------------------
    def _selected(self, watch: _Watch, obj: Mapping[str, Any]) -> bool:
        return obj["metadata"]["namespace"] == watch.namespace and matches(obj, watch.labels, watch.fields)

    def _event(
        self, watch: _Watch, obj: dict[str, Any], before: Mapping[str, Any] | None
    ) -> tuple[str, dict[str, Any]] | None:
        now, was = self._selected(watch, obj), before is not None and self._selected(watch, before)
        if now:
            return ("MODIFIED" if was else "ADDED", obj)
        return ("DELETED", obj) if was else None

    def _was_deletion(self, version: int) -> bool:
        return version in self.deletions

    def _deleted(self, watch: _Watch, obj: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        return ("DELETED", obj) if self._selected(watch, obj) else None

    def _notify(self, watch: _Watch, collection: str, obj: dict[str, Any], before: Mapping[str, Any] | None) -> None:
        if watch.collection == collection:
            event = self._event(watch, obj, before)
            if event is not None:
                watch.queue.put_nowait(event)

    async def _handle(self, request: web.Request, collection: str) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append((collection, query))
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.json_response({"kind": "Status", "code": 500, "message": "etcd is sad"}, status=500)
        namespace = request.match_info["namespace"]
        watch = _Watch(collection, namespace, query.get("labelSelector", ""), query.get("fieldSelector", ""))
        if query.get("watch") != "true":
            items = [o for (c, _, _), o in sorted(self.objects.items()) if c == collection and self._selected(watch, o)]
            return web.json_response(
                {"kind": "List", "metadata": {"resourceVersion": str(self.version)}, "items": items}
            )
        since = int(query.get("resourceVersion") or 0)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)

        async def send(kind: str, obj: Mapping[str, Any]) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        if since < self.compacted:
            await send("ERROR", {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"})
            return response
        self._watches.add(watch)
        try:
            for version, c, obj, before in self.history:
                if version > since and c == collection:
                    event = (
                        self._deleted(watch, obj) if self._was_deletion(version) else self._event(watch, obj, before)
                    )
                    if event is not None:
                        await send(*event)
            timeout = float(query.get("timeoutSeconds", "60"))
            while True:
                try:
                    item = await asyncio.wait_for(watch.queue.get(), timeout)
                except TimeoutError:
                    break
                if item is None:
                    break
                await send(*item)
                if item[0] == "ERROR":
                    break
        except ConnectionResetError:
            pass
        finally:
            self._watches.discard(watch)
        return response


def pool(name: str, namespace: str, selector: Mapping[str, str], ports: tuple[int, ...] = (8000,)) -> dict[str, Any]:
    """An InferencePool v1 object."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "extproc", "port": {"number": 9002}},
        },
    }


def pod(
    name: str,
    namespace: str,
    ip: str,
    labels: Mapping[str, str],
    *,
    ready: bool = True,
    phase: str = "Running",
    deleting: bool = False,
    node: str = "node-a",
) -> dict[str, Any]:
    """A Pod object as the picker reads it."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"nodeName": node},
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }
