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
from extproc_lab.demo.processes import ProcessGroup
from extproc_lab.demo.redis_server import LocalRedis
from extproc_lab.replica.tokenizer_dir import build_tokenizer_dir

IN_CI = os.environ.get("CI", "").lower() == "true"

# Hypothesis' per-example deadline (200 ms) measures how busy this 2-core machine is, not the code:
# property tests bound their own work (max_examples, sizes) and assert behaviour, not speed.
settings.register_profile("extproc", deadline=None)
settings.load_profile("extproc")
ROOT = Path(__file__).resolve().parent.parent


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
