"""``extproc.api`` and ``extproc.api.sim``: every public name resolves, the lazy ones to the very
object their module defines, and the synchronous driver runs the router without an event loop."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import extproc.api
import extproc.api.sim
from extproc.api import Config, Replica, ReplicaMetrics, RequestFeatures
from extproc.api.sim import SyncDriver


@pytest.mark.parametrize("module", [extproc.api, extproc.api.sim])
def test_every_public_name_resolves(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    assert len(set(names)) == len(names)
    for name in names:
        assert getattr(module, name) is not None, name


def test_the_lazy_names_are_their_modules_own() -> None:
    lazy = extproc.api._LAZY
    assert set(lazy) <= set(extproc.api.__all__)
    for name, module in lazy.items():
        assert getattr(extproc.api, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError):
        extproc.api.NoSuchName  # noqa: B018


def test_the_simulator_s_imports_leave_the_server_and_envoy_alone() -> None:
    # The lazy names keep the gRPC server, the Envoy data-plane types and the Redis client out
    # of a process that only simulates (they cost it most of its start-up).
    code = (
        "import sys, extproc.api.sim;"
        "heavy = ('extproc.adapters.envoy_config', 'extproc.adapters.server.stream', 'redis');"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_driver_routes_observes_and_releases_on_a_virtual_clock() -> None:
    now = [0.0]
    replicas = (Replica("a", "sim:0"), Replica("b", "sim:1"))
    driver = SyncDriver(Config(replicas=replicas), lambda: now[0])
    assert driver.replica_count() == 2 and not driver.scraped()
    for name in ("a", "b"):
        driver.scrape(name, ReplicaMetrics(running=0, waiting=0, kv_usage=0.0), 0.5)
    assert driver.scraped()
    now[0] = 1.0
    features = RequestFeatures(path="/v1/chat/completions", session_key="s", prompt_chars=640)
    first = driver.route(features, 1.0)
    assert first.decision.replica is not None and not driver.idle()
    driver.first_token(first, 1.2)
    driver.finished(first, 1.2, 1.5, 10)
    assert driver.idle()
    again = driver.route(features, 2.0)
    assert again.decision.replica == first.decision.replica  # the session stays
    driver.finished(again, None, None, 0)
    membership = driver.set_replicas([Replica("a", "sim:0")])
    assert membership.left == ("b",) and driver.replica_count() == 1
    assert driver.reuse_blocks()[0] >= 0
