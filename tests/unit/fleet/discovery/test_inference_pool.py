"""InferencePool discovery: the pool's spec and pods to replicas (pure), and the processor following
a pool and its pods against a fake API server that speaks list+watch with selectors; membership is
asserted on a real Router."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from extproc.app.router import Router
from extproc.config import ConfigError
from extproc.config.cli_flags import add_config_flags, config_from_flags
from extproc.fleet.discovery import (
    DiscoveryLoop,
    InferencePoolDiscovery,
    InferencePoolSource,
    PodSet,
    build_discovery,
    pool_spec,
    replicas_of_pod,
)
from extproc.routing.roles import Role
from tests.conftest import make_config
from tests.fake_kube import FakeKube, pod, pool
from tests.helpers import wait_for

NS = "llm"
SELECTOR = {"app": "vllm"}


def test_a_pools_spec_is_its_selector_and_target_ports() -> None:
    spec = pool_spec(pool("p", NS, {"app": "vllm", "tier": "a"}, (8000, 8001)))
    assert spec.selector == (("app", "vllm"), ("tier", "a")) and spec.ports == (8000, 8001)
    assert spec.label_selector == "app=vllm,tier=a"
    bad_selector = pool("p", NS, {})
    with pytest.raises(ValueError, match=r"spec\.selector\.matchLabels"):
        pool_spec(bad_selector)
    no_ports = pool("p", NS, SELECTOR, ())
    with pytest.raises(ValueError, match=r"spec\.targetPorts: none given"):
        pool_spec(no_ports)
    bad_port = pool("p", NS, SELECTOR)
    bad_port["spec"]["targetPorts"] = [{"number": "http"}]
    with pytest.raises(ValueError, match=r"spec\.targetPorts: not a port number"):
        pool_spec(bad_port)


def test_only_running_ready_selected_pods_not_being_deleted_are_replicas() -> None:
    spec = pool_spec(pool("p", NS, SELECTOR))
    labels = {**SELECTOR, "llm-d.ai/role": "prefill"}
    (replica,) = replicas_of_pod(pod("a", NS, "10.0.0.1", labels), spec)
    assert (replica.name, replica.address) == ("a", "10.0.0.1:8000")
    assert replica.labels["llm-d.ai/role"] == "prefill" and replica.role is Role.PREFILL
    assert replica.labels["node"] == "node-a"
    assert replicas_of_pod(pod("b", NS, "10.0.0.2", SELECTOR, ready=False), spec) == ()
    assert replicas_of_pod(pod("c", NS, "10.0.0.3", SELECTOR, phase="Pending"), spec) == ()
    assert replicas_of_pod(pod("d", NS, "10.0.0.4", SELECTOR, deleting=True), spec) == ()
    assert replicas_of_pod(pod("e", NS, "10.0.0.5", {"app": "other"}), spec) == ()
    assert replicas_of_pod(pod("f", NS, "", SELECTOR), spec) == ()
    assert replicas_of_pod(pod("g", NS, "not-an-ip", SELECTOR), spec) == ()
    (v6,) = replicas_of_pod(pod("h", NS, "fd00::1", SELECTOR), spec)
    assert v6.address == "[fd00::1]:8000"
    ranks = replicas_of_pod(pod("dp", NS, "10.0.0.9", SELECTOR), pool_spec(pool("p", NS, SELECTOR, (8000, 8001))))
    assert [(r.name, r.address) for r in ranks] == [("dp-rank-0", "10.0.0.9:8000"), ("dp-rank-1", "10.0.0.9:8001")]
    pods = PodSet(spec)
    pods.reset([pod("b", NS, "10.0.0.2", SELECTOR), pod("a", NS, "10.0.0.1", SELECTOR)])
    assert [r.name for r in pods.replicas()] == ["a", "b"]
    pods.remove(pod("a", NS, "10.0.0.1", SELECTOR))
    assert [r.name for r in pods.replicas()] == ["b"]


def test_the_pool_flags_and_settings(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    cfg = config_from_flags(None, parser.parse_args(["--pool-name", "vllm", "--pool-namespace", NS]), environ={})
    source = cfg.discovery
    assert isinstance(source, InferencePoolSource)
    assert (source.name, source.namespace, source.debounce_s) == ("vllm", NS, 0.0)
    # The flag starts the section afresh over a file's source of another kind; the variables work too.
    path = tmp_path / "router.yaml"
    path.write_text("discovery: {type: kubernetes, service: vllm, port: 8000}\n")
    cfg = config_from_flags(path, parser.parse_args(["--pool-name", "pool-a"]), environ={})
    assert cfg.discovery == InferencePoolSource(name="pool-a")
    env = {"EXTPROC_DISCOVERY__TYPE": "inference_pool", "EXTPROC_DISCOVERY__NAME": "pool-a"}
    from_env = config_from_flags(None, parser.parse_args([]), environ=env)
    assert from_env.discovery == cfg.discovery
    assert isinstance(build_discovery(from_env.discovery), InferencePoolDiscovery)
    with pytest.raises(ConfigError, match=r"discovery\.name: Field required"):
        config_from_flags(None, parser.parse_args(["--pool-namespace", NS]), environ={})


# --- against a fake API server ------------------------------------------------------------------


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    server = await FakeKube().start()
    try:
        yield server
    finally:
        await server.stop()


def pool_source(kube: FakeKube, **kwargs: Any) -> InferencePoolDiscovery:
    from kubernetes.aio import client

    return InferencePoolDiscovery(
        "vllm",
        namespace=NS,
        configuration=client.Configuration(host=kube.url),
        backoff_initial_s=0.02,
        backoff_max_s=0.1,
        **kwargs,
    )


@contextlib.asynccontextmanager
async def following(source: InferencePoolDiscovery) -> AsyncIterator[Router]:
    router = Router(make_config())
    loop = DiscoveryLoop(source, router.fleet, debounce_s=0.0, max_delay_s=0.0)
    task = asyncio.create_task(loop.run())
    try:
        yield router
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def members(router: Router) -> dict[str, str]:
    return {rec.replica.name: rec.replica.address for rec in router.replicas.records()}


async def test_the_picker_follows_its_pool_and_the_pods_it_selects(kube: FakeKube) -> None:
    kube.put("pools", pool("vllm", NS, SELECTOR))
    kube.put("pools", pool("other", NS, {"app": "other"}))
    kube.put("pods", pod("a", NS, "10.0.0.1", {**SELECTOR, "llm-d.ai/role": "decode"}))
    kube.put("pods", pod("b", NS, "10.0.0.2", SELECTOR, ready=False))
    kube.put("pods", pod("x", NS, "10.0.0.9", {"app": "other"}))
    kube.put("pods", pod("y", "elsewhere", "10.0.1.1", SELECTOR))
    source = pool_source(kube)
    async with following(source) as router:
        await wait_for(lambda: members(router) == {"a": "10.0.0.1:8000"})
        assert [rec.replica.role for rec in router.replicas.records()] == [Role.DECODE]
        # The pool by name, the pods by the pool's selector, in the pool's namespace.
        assert ("pools", "metadata.name=vllm") in {(c, q.get("fieldSelector")) for c, q in kube.requests}
        assert {q.get("labelSelector") for c, q in kube.requests if c == "pods"} == {"app=vllm"}
        kube.put("pods", pod("b", NS, "10.0.0.2", SELECTOR))  # ready now
        await wait_for(lambda: members(router) == {"a": "10.0.0.1:8000", "b": "10.0.0.2:8000"})
        # A pod that leaves the pool (its label changed) is gone at the next event.
        kube.put("pods", pod("a", NS, "10.0.0.1", {"app": "retired"}))
        await wait_for(lambda: members(router) == {"b": "10.0.0.2:8000"})
        kube.put("pods", pod("b", NS, "10.0.0.2", SELECTOR, deleting=True))
        await wait_for(lambda: members(router) == {})
        kube.delete("pods", NS, "b")
        kube.put("pods", pod("c", NS, "10.0.0.3", SELECTOR))
        await wait_for(lambda: members(router) == {"c": "10.0.0.3:8000"})
        # The pool's selector and port change: the pods are followed again with the new ones.
        kube.put("pools", pool("vllm", NS, {"app": "other"}, (9000,)))
        await wait_for(lambda: members(router) == {"x": "10.0.0.9:9000"})
        assert source.pod_watches == 2
        # 410 Gone: both collections are listed again, changes made meanwhile are seen.
        lists = sum(1 for c, q in kube.requests if q.get("watch") != "true")
        kube.expire()
        kube.put("pods", pod("z", NS, "10.0.0.10", {"app": "other"}))
        await wait_for(lambda: "z" in members(router))
        await wait_for(lambda: sum(1 for c, q in kube.requests if q.get("watch") != "true") >= lists + 2)
        # The pool is deleted: no members until it is back.
        kube.delete("pools", NS, "vllm")
        await wait_for(lambda: members(router) == {})
        kube.put("pools", pool("vllm", NS, SELECTOR))
        await wait_for(lambda: members(router) == {"c": "10.0.0.3:8000"})


async def test_the_picker_waits_for_its_pool_keeps_members_through_errors_and_refuses_a_bad_spec(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    kube.put("pods", pod("a", NS, "10.0.0.1", SELECTOR))
    source = pool_source(kube)
    async with following(source) as router:
        await wait_for(lambda: source.spec is None and any(c == "pools" for c, _ in kube.requests))
        assert members(router) == {}
        kube.put("pools", pool("vllm", NS, SELECTOR))  # created after the picker started
        await wait_for(lambda: members(router) == {"a": "10.0.0.1:8000"})
        # The API server fails for a while: the members stay, the watches come back.
        kube.fail_next = 4
        kube.close_watches()
        await asyncio.sleep(0.3)  # real time: watches failing and resuming over HTTP to the fake API server
        assert members(router) == {"a": "10.0.0.1:8000"}
        await wait_for(lambda: kube.watches("pods") == 1 and kube.watches("pools") == 1)
        kube.put("pods", pod("b", NS, "10.0.0.2", SELECTOR))
        await wait_for(lambda: set(members(router)) == {"a", "b"})
        # A spec that cannot be followed is logged, and the pool as last followed kept.
        broken = pool("vllm", NS, SELECTOR)
        broken["spec"]["targetPorts"] = []
        kube.put("pools", broken)
        await wait_for(lambda: "spec.targetPorts: none given" in caplog.text)
        assert set(members(router)) == {"a", "b"} and source.pod_watches == 1
