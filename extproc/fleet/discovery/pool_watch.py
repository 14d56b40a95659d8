"""InferencePool discovery: the processor as a Gateway API Inference Extension endpoint picker
follows its pool (``inference.networking.k8s.io/v1``) and the pods the pool selects.

Two collections are listed and watched at once, each by a :class:`~extproc.fleet.discovery.reflector.Reflector`
(so with the same restart, ``410 Gone`` and backoff discipline as the EndpointSlice source):

1. the pool, by name (``fieldSelector=metadata.name=NAME``): its selector and target ports;
2. the pods its selector matches (``labelSelector``), in the pool's namespace.

When the pool's selector or ports change, the pod watch is started again with the new selector
(its events from before are dropped); when the pool is deleted, the fleet is empty until it comes
back (the API server's word, as with a Service scaled to zero). A pool whose spec cannot be
followed (no selector, no port) is logged and the previous spec kept. A pod that stops matching
the selector leaves at once: the API server sends its watchers a ``DELETED`` event for it.

RBAC: ``get``, ``list``, ``watch`` on ``inferencepools`` (group ``inference.networking.k8s.io``)
and on ``pods``, in the pool's namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from extproc.base.world import REAL_WORLD, World
from extproc.fleet.discovery.inference_pool import GROUP, PLURAL, VERSION, PodSet, PoolSpec, pool_spec
from extproc.fleet.discovery.kubernetes_watch import Backoff, api_configuration, own_namespace
from extproc.fleet.discovery.reflector import Change, Reflector
from extproc.fleet.discovery.settings import WATCH_TIMEOUT_S
from extproc.routing.model import Replica

log = logging.getLogger("extproc.fleet.discovery")


class InferencePoolDiscovery:
    """Yields the ready pods of one InferencePool as replicas, one per target port.

    ``configuration`` as :class:`~extproc.fleet.discovery.kubernetes_watch.KubernetesDiscovery` takes it
    (None: in-cluster, else ``kubeconfig``/``context``).
    """

    def __init__(
        self,
        name: str,
        namespace: str | None = None,
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
        self.name = name
        self.namespace = namespace
        self.configuration = configuration
        self.kubeconfig = os.path.expanduser(kubeconfig) if kubeconfig else None
        self.context = context
        self.watch_timeout_s = watch_timeout_s
        self._backoff = (backoff_initial_s, backoff_max_s)
        self.world = world  # its reflectors' backoffs sleep on its time
        self.rng = rng or world.random
        self.spec: PoolSpec | None = None
        """The pool's spec as last followed (None before it is seen, or once it is deleted)."""
        self.pod_watches = 0
        """How many pod watches were started (one more each time the selector or ports change)."""

    def __repr__(self) -> str:
        return f"inferencepool({self.namespace or '<own namespace>'}/{self.name})"

    def _new_backoff(self) -> Backoff:
        return Backoff(*self._backoff, self.rng)

    async def _configuration(self) -> Any:
        return await api_configuration(self.configuration, self.kubeconfig, self.context)

    def _followed(self, change: Change) -> tuple[bool, PoolSpec | None]:
        """What a change of the pool collection says: (whether it says anything, the spec)."""
        if change.kind == "delete":
            return True, None
        items = change.items if change.kind == "reset" else (change.item,) if change.item is not None else ()
        if not items:
            return True, None
        try:
            return True, pool_spec(items[0])
        except ValueError as exc:
            log.warning("discovery %r: %s; keeping the pool as last followed", self, exc)
            return False, None

    async def updates(self) -> AsyncGenerator[Sequence[Replica], None]:
        """Follow the pool and its pods until cancelled; yields the replicas after each change of
        either. Errors are retried in the reflectors, never raised (a bad kubeconfig is, at start)."""
        from kubernetes.aio import client

        api_client = client.ApiClient(await self._configuration())
        namespace = self.namespace or own_namespace()
        custom, core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
        # (generation, change): pod changes of a watch started for an older spec are dropped.
        queue: asyncio.Queue[tuple[int, Change]] = asyncio.Queue()
        pool_call = functools.partial(
            custom.list_namespaced_custom_object_without_preload_content,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            field_selector=f"metadata.name={self.name}",
        )
        pools = Reflector(pool_call, f"{self!r}: the pool", self._new_backoff(), self.watch_timeout_s, self.world)

        async def pump(generation: int, reflector: Reflector) -> None:
            async with contextlib.aclosing(reflector.changes()) as changes:
                async for change in changes:
                    await queue.put((generation, change))

        tasks = {0: asyncio.create_task(pump(0, pools), name="inferencepool")}
        generation = 0
        pods: PodSet | None = None
        started = False
        try:
            while True:
                source, change = await queue.get()
                if source == 0:
                    says, spec = self._followed(change)
                    if not says or (started and spec == self.spec):
                        continue  # a pool's status changed, or a relist found it as it was
                    started, self.spec = True, spec
                    if generation in tasks and generation != 0:
                        tasks.pop(generation).cancel()
                    if spec is None:
                        pods = None
                        log.warning("discovery %r: no such InferencePool (yet): no members", self)
                        yield ()
                        continue
                    generation += 1
                    pods = PodSet(spec)
                    self.pod_watches += 1
                    pod_call = functools.partial(
                        core.list_namespaced_pod_without_preload_content, namespace, label_selector=spec.label_selector
                    )
                    what = f"{self!r}: pods {spec.label_selector} on {','.join(map(str, spec.ports))}"
                    pod_reflector = Reflector(pod_call, what, self._new_backoff(), self.watch_timeout_s, self.world)
                    tasks[generation] = asyncio.create_task(pump(generation, pod_reflector), name="inferencepool-pods")
                    log.info("discovery %r: following pods %s, ports %s", self, spec.label_selector, spec.ports)
                    continue
                if source != generation or pods is None:
                    continue  # a pod watch of an older spec
                if change.kind == "reset":
                    pods.reset(change.items)
                    log.info("discovery %r: listed %d pods, %d replicas", self, len(pods), len(pods.replicas()))
                elif change.item is not None:
                    (pods.put if change.kind == "put" else pods.remove)(change.item)
                yield pods.replicas()
        finally:
            for task in tasks.values():
                task.cancel()
            for task in tasks.values():
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await api_client.close()
