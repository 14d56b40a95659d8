"""Kubernetes discovery: list, then watch, the EndpointSlices of one Service.

The protocol is the API server's list+watch, as client-go's reflector does it:

1. **List** the slices labelled ``kubernetes.io/service-name=<service>``; the list's
   ``resourceVersion`` says how fresh it is.
2. **Watch** from that version: a stream of ``ADDED``/``MODIFIED``/``DELETED`` events (each
   carrying its object and new ``resourceVersion``), ``BOOKMARK`` events (a newer version, no
   change), and ``ERROR`` events (a ``Status``).
3. The server ends a watch after ``timeoutSeconds``, and proxies cut idle streams: resume the
   watch from the last version seen, without listing again.
4. ``410 Gone`` (as an ``ERROR`` event or as the response status) means that version has been
   compacted away: list again, which also resynchronises anything missed.
5. Any other failure (connection refused, HTTP 5xx, a broken stream) is retried with exponential
   backoff and jitter; the last known replicas stay members meanwhile. Unlike DNS, an empty list
   from the API server is the truth (scaled to zero) and is passed on.

**Why the client's asyncio flavour.** ``kubernetes.client`` blocks, so it would have to run in a
thread (``asyncio.to_thread``). A watch is a request that lasts minutes: it would pin a thread of
the loop's default executor for good, and cancelling it on shutdown cannot interrupt a thread
blocked in ``recv``, so ``asyncio.run`` would wait up to the watch timeout to exit.
``kubernetes.aio`` (same package, same API, same config loaders, on aiohttp) reads the stream on
the event loop itself: cancellation is immediate and no thread is involved. The JSON is read raw
(``*_without_preload_content``) rather than turned into model objects: the few fields used are
read by :mod:`extproc.fleet.discovery.endpoint_slices`, and a field the models do not know yet cannot
make deserialisation fail.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from extproc.base.world import REAL_WORLD, World
from extproc.fleet.discovery.endpoint_slices import SERVICE_NAME_LABEL, PortChoice, SliceSet, resource_version
from extproc.fleet.discovery.settings import WATCH_TIMEOUT_S, AddressType
from extproc.routing.model import Replica

log = logging.getLogger("extproc.fleet.discovery")

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LIST_TIMEOUT_S = 30.0
# A watch that ends sooner than this without an event is a failure in disguise (a proxy that
# closes at once, say): back off instead of reconnecting in a tight loop.
MIN_QUIET_WATCH_S = 1.0


class ApiError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class Gone(Exception):
    """410: the resourceVersion is too old; list again."""


class Backoff:
    """Exponential backoff with jitter: ``initial_s``, doubling up to ``max_s``, each delay drawn
    in [d/2, d] so that many routers restarted together do not hit the API server in step."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.rng = rng
        self.failures = 0

    def next(self) -> float:
        """The delay before the next attempt."""
        delay = min(self.max_s, self.initial_s * 2.0**self.failures)
        self.failures += 1
        return delay * (0.5 + 0.5 * self.rng.random())

    def reset(self) -> None:
        """Something worked: start from ``initial_s`` again."""
        self.failures = 0


async def watch_events(resp: Any) -> AsyncGenerator[tuple[str, Mapping[str, Any]], None]:
    """A watch response's events as (type, object), released at the end; a 410 (the version is
    too old: list again) raises :class:`Gone`, another error status or ERROR event
    :class:`ApiError`, a malformed line ValueError."""
    try:
        if resp.status == 410:
            raise Gone()
        if resp.status != 200:
            raise ApiError(resp.status, (await resp.text())[:200])
        while line := await resp.content.readline():
            if not line.strip():
                continue
            event = json.loads(line)
            kind = event.get("type") if isinstance(event, Mapping) else None
            obj = event.get("object") if isinstance(event, Mapping) else None
            if not isinstance(obj, Mapping):
                raise ValueError(f"malformed watch event: {line[:200]!r}")
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Gone()
                raise ApiError(int(obj.get("code") or 0), str(obj.get("message") or obj))
            yield str(kind), obj
    finally:
        resp.release()


async def api_configuration(given: Any, kubeconfig: str | None, context: str | None) -> Any:
    """The API client's configuration: ``given`` if any; else in-cluster (the service account)
    when no ``kubeconfig`` is named and the pod runs in a cluster; else from the kubeconfig file
    (default ``~/.kube/config``) and ``context``."""
    if given is not None:
        return given
    from kubernetes.aio import client, config

    cfg = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        await config.load_kube_config(
            config_file=kubeconfig, context=context, client_configuration=cfg, persist_config=False
        )
    return cfg


def own_namespace() -> str:
    """The pod's namespace (from its service account), else ``default``."""
    try:
        return NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


class KubernetesDiscovery:
    """Yields the ready endpoints of one Service, from its EndpointSlices.

    ``configuration`` is a ``kubernetes.aio.client.Configuration``; when None it is loaded when
    :meth:`updates` starts: in-cluster (service account) when running in a pod and no
    ``kubeconfig`` is given, else from ``kubeconfig`` (default ``~/.kube/config``) and ``context``.
    Tests pass ``Configuration(host="http://127.0.0.1:PORT")``.
    """

    def __init__(
        self,
        service: str,
        namespace: str | None = None,
        port: int | None = None,
        port_name: str | None = None,
        address_type: AddressType = "IPv4",
        configuration: Any = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        rng: random.Random | None = None,
        *,
        world: World = REAL_WORLD,
    ) -> None:
        self.service = service
        self.world = world  # backoffs are slept on its time, jittered by its random source
        self.namespace = namespace
        self.choice = PortChoice(port, port_name, address_type)
        self.configuration = configuration
        self.kubeconfig = os.path.expanduser(kubeconfig) if kubeconfig else None
        self.context = context
        self.watch_timeout_s = watch_timeout_s
        self.backoff = Backoff(backoff_initial_s, backoff_max_s, rng or world.random)

    def __repr__(self) -> str:
        return f"kubernetes({self.namespace or '<own namespace>'}/{self.service})"

    @property
    def label_selector(self) -> str:
        """The selector of the Service's slices."""
        return f"{SERVICE_NAME_LABEL}={self.service}"

    async def _configuration(self) -> Any:
        return await api_configuration(self.configuration, self.kubeconfig, self.context)

    async def updates(self) -> AsyncGenerator[Sequence[Replica], None]:
        """List, then watch, until cancelled; yields the replicas after the list and after each
        change. Errors are retried here, never raised (a bad kubeconfig is, at start)."""
        from kubernetes.aio import client

        api_client = client.ApiClient(await self._configuration())
        api = client.DiscoveryV1Api(api_client)
        namespace = self.namespace or own_namespace()
        slices = SliceSet(self.choice)
        version: str | None = None
        try:
            while True:
                try:
                    if version is None:
                        version = await self._list(api, namespace, slices)
                        self.backoff.reset()
                        log.info("discovery %r: listed %d slices, %d ready", self, len(slices), len(slices.replicas()))
                        yield slices.replicas()
                    started = self.world.monotonic()
                    events = 0
                    async with contextlib.aclosing(self._watch(api, namespace, version, slices)) as watch:
                        async for resume_from, changed in watch:
                            version = resume_from
                            events += 1
                            self.backoff.reset()
                            if changed:
                                yield slices.replicas()
                    if events == 0 and self.world.monotonic() - started < MIN_QUIET_WATCH_S:
                        await self.world.sleep(self.backoff.next())
                    # Otherwise the server ended the watch (its timeout): resume from ``version``.
                except Gone:
                    log.info("discovery %r: resourceVersion %s expired, listing again", self, version)
                    version = None
                except (ApiError, aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    delay = self.backoff.next()
                    log.warning(
                        "discovery %r: %s: %s; keeping %d replicas, retrying in %.1fs",
                        self,
                        type(exc).__name__,
                        exc,
                        len(slices.replicas()),
                        delay,
                    )
                    await self.world.sleep(delay)
        finally:
            await api_client.close()

    async def _list(self, api: Any, namespace: str, slices: SliceSet) -> str:
        resp = await api.list_namespaced_endpoint_slice_without_preload_content(
            namespace, label_selector=self.label_selector, _request_timeout=LIST_TIMEOUT_S
        )
        try:
            if resp.status != 200:
                raise ApiError(resp.status, (await resp.text())[:200])
            body = await resp.json(content_type=None)
        finally:
            resp.release()
        if not isinstance(body, Mapping) or not isinstance(body.get("items", []), list):
            raise ValueError("the list response is not an EndpointSliceList")
        slices.reset(item for item in body.get("items") or () if isinstance(item, Mapping))
        return resource_version(body) or ""

    async def _watch(
        self, api: Any, namespace: str, version: str, slices: SliceSet
    ) -> AsyncGenerator[tuple[str, bool], None]:
        """Apply watch events to ``slices``; after each event yields the version to resume from
        and whether the slices changed (a bookmark only moves the version on)."""
        resp = await api.list_namespaced_endpoint_slice_without_preload_content(
            namespace,
            label_selector=self.label_selector,
            watch=True,
            resource_version=version or None,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            # The whole request's limit: a connection that goes silent without closing ends too.
            _request_timeout=float(self.watch_timeout_s + 30),
        )
        async for kind, obj in watch_events(resp):
            version = resource_version(obj) or version
            if kind in ("ADDED", "MODIFIED"):
                slices.put(obj)
            elif kind == "DELETED":
                slices.remove(obj)
            yield version, kind in ("ADDED", "MODIFIED", "DELETED")
