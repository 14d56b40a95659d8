"""Shared fixtures and helpers."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import settings

from extproc.config import Config, Metrics
from extproc.routing import Replica
from extproc_lab.demo.processes import PORTS_ENV, ProcessGroup, share_ports
from extproc_lab.demo.redis_server import LocalRedis
from extproc_lab.replica.tokenizer_dir import build_tokenizer_dir

IN_CI = os.environ.get("CI", "").lower() == "true"

# Hypothesis' per-example deadline (200 ms) measures how busy this 2-core machine is, not the code:
# property tests bound their own work (max_examples, sizes) and assert behaviour, not speed.
settings.register_profile("extproc", deadline=None)
settings.load_profile("extproc")
ROOT = Path(__file__).resolve().parent.parent


# Each xdist worker (and what it starts) hands out ports from its own part of the range.
if (_worker := os.environ.get("PYTEST_XDIST_WORKER")) is not None:
    os.environ[PORTS_ENV] = share_ports(int(_worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


ENGINES_SCOPE = "tests/e2e: real vLLM engines"
"""The xdist scope of every test that starts real vLLM engines (see :func:`engine_scope`)."""


def engine_scope(nodeid: str) -> str | None:
    """:data:`ENGINES_SCOPE` for a test that starts real vLLM engines, else None.

    ``make test`` runs two xdist workers (``--dist loadscope``): each module's tests on one worker,
    so its module fixtures (a gateway, Redis) start once. Every test on real engines goes to one
    worker: the session's fleet (``tiny_engines``) then starts once, and the engines' forward
    passes do not share two cores with another worker's engines. The controller that schedules
    sees only node ids, so such a test says so in its id: an e2e test with ``vllm`` in its module's
    or its own name (:func:`pytest_collection_modifyitems` holds every engine test to that).
    """
    return ENGINES_SCOPE if nodeid.startswith("tests/e2e/") and "vllm" in nodeid.lower() else None


@pytest.hookimpl(optionalhook=True)  # xdist's hook: the suite also runs without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadscope``, with every real-engine test in one scope (:func:`engine_scope`)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class EngineScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return engine_scope(nodeid) or super()._split_scope(nodeid)

    return EngineScopeScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts real vLLM engines (marked ``vllm``, or using ``tiny_engines``) must be
    scheduled with the others (:func:`engine_scope`): one that is not is a collection error."""
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        on_engines = item.get_closest_marker("vllm") is not None or "tiny_engines" in item.fixturenames
        if on_engines and engine_scope(item.nodeid) is None:
            raise pytest.UsageError(
                f"{item.nodeid} starts real vLLM engines: put it in tests/e2e with vllm in its name"
            )


def require_binary(name: str) -> str:
    """The path of a binary the test needs: missing fails under CI, skips elsewhere."""
    beside = Path(sys.executable).with_name(name)
    path = str(beside) if beside.exists() else shutil.which(name)
    if path is None:
        message = f"{name} is not installed (make test installs it)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def require_engines(*models: str) -> None:
    """vLLM's CPU build and the lab's ``models``, installed if missing (``make engines``): a
    failed install fails under CI, skips elsewhere."""
    from extproc_lab.engines import install

    try:
        install.ensure(models)
    except Exception as exc:  # the install's own error, whatever it is
        message = f"vLLM's CPU build could not be installed (make engines): {exc}"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[LocalRedis]:
    """One redis-server for the run (each test uses its own key namespace), stopped by its PID."""
    require_binary("redis-server")
    # A short directory: unix socket paths are limited to about 100 bytes.
    directory = Path(tempfile.mkdtemp(prefix="extproc-redis-"))
    with ProcessGroup(directory) as procs:
        yield LocalRedis(procs, directory).start()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Hugging Face tokenizer directory (the lab's), built once a test module."""
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def replicas(n: int = 3) -> tuple[Replica, ...]:
    return tuple(Replica(f"r{i}", f"10.0.0.{i + 1}:8000") for i in range(n))


def make_config(**changes: object) -> Config:
    base: dict[str, object] = {"replicas": replicas(), "metrics": Metrics(enabled=False)}
    base.update(changes)
    return Config(**base)  # type: ignore[arg-type]


def headers_message(headers: dict[str, str], end_of_stream: bool = False) -> pb.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv), end_of_stream=end_of_stream)
    )


def body_message(body: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def response_headers_message(status: int) -> pb.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())]
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv)))


def chat_body(text: str, **extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], **extra}).encode()


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: (h.header.raw_value or h.header.value.encode()).decode() for h in mutation.set_headers}
