"""Real vLLM engines on loopback: N CPU engines started at once, each with its KV-event publisher.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` from the venv of
:mod:`extproc_lab.engines.install`, serving a model directory built there, on a free
127.0.0.1 port, publishing KV-cache events on a ZMQ PUB socket it binds (``tcp://*:PORT``: vLLM
binds only for a wildcard host; the subscriber connects to ``tcp://127.0.0.1:PORT``) and answering
replays on a ROUTER socket beside it. Engines are
started together (their start-ups overlap: about 25 s alone, about a minute for four on two cores),
waited for on ``/health`` within a bound, and ended by their process group's id. One engine can
be killed and started again on the same ports, as a crashed pod coming back.

The flags are those that work on vLLM's CPU build 0.32: eager mode (no compilation), float32,
``--block-size`` a multiple of 32, ``--num-gpu-blocks-override`` to make the cache small enough
to fill, prompt token details in the usage (``cached_tokens``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from extproc.api import Replica
from extproc_lab.demo.processes import ProcessGroup, free_port
from extproc_lab.engines import install

HOST = "127.0.0.1"
SERVED_MODEL = "demo-model"
ENGINE_SERVICE = "vllm-engine"
"""The engines' ``service.name`` in their traces (vLLM's own default: ``unknown_service:python``)."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """How every engine of a fleet is started."""

    model: str = "tiny"
    """A model size of :mod:`extproc_lab.engines.build_model` (``tiny``, ``small``)."""
    served_name: str = SERVED_MODEL
    block_size: int = 32
    num_blocks: int | None = None
    """KV blocks per engine (``--num-gpu-blocks-override``); None: what 1 GiB of KV space holds."""
    max_model_len: int = 2048
    kv_events: bool = True
    startup_timeout_s: float = 240.0
    extra_args: tuple[str, ...] = ()
    traces_endpoint: str | None = None
    """HOST:PORT of an OTLP/gRPC collector: each request's span (``--otlp-traces-endpoint``), under
    the ``traceparent`` the engine is sent, as service :data:`ENGINE_SERVICE`."""
    base_dir: Path | None = None
    """Where the venv and models live (default: ``~/.cache/extproc``)."""
    responses_store: bool = False
    """Keep Responses API answers (``VLLM_ENABLE_RESPONSES_API_STORE``, off in vLLM by default: a
    ``previous_response_id`` is then a 404), in the engine's own memory, never freed."""

    def check(self) -> None:
        """``ValueError`` for settings vLLM's CPU build refuses."""
        if self.block_size < 32 or self.block_size % 32:
            raise ValueError("vLLM's CPU build takes a block size that is a multiple of 32")
        if self.num_blocks is not None and self.num_blocks * self.block_size <= self.max_model_len:
            raise ValueError("num_blocks x block_size must exceed max_model_len (one full-length request)")


def engine_env(settings: EngineSettings | None = None) -> dict[str, str]:
    """Environment for an engine: the CPU backend with a small KV space and one thread, the engine
    core in the server's own process (one PID, faster start), and no hub access; with traces, the
    service's name."""
    traced = settings is not None and settings.traces_endpoint is not None
    stored = settings is not None and settings.responses_store
    return {
        **({"OTEL_SERVICE_NAME": ENGINE_SERVICE} if traced else {}),
        **({"VLLM_ENABLE_RESPONSES_API_STORE": "1"} if stored else {}),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # POST /reset_prefix_cache (the demo empties caches between policies); loopback only.
        "VLLM_SERVER_DEV_MODE": "1",
    }


@dataclass
class VllmFleet:
    """Real engines: ``with VllmFleet(replicas=2) as fleet:``; ``fleet.members`` are their
    :class:`Replica` entries (name, ``127.0.0.1:port``) and :meth:`kv_endpoint` their publishers.

    Given ``procs`` and ``members`` (as :class:`~extproc_lab.demo.gateway.LocalGateway` does), the
    engines are processes of that group on those addresses; otherwise the fleet makes its own."""

    replicas: int = 2
    settings: EngineSettings = field(default_factory=EngineSettings)
    procs: ProcessGroup | None = None
    members: list[Replica] = field(default_factory=list)
    log_dir: Path | None = None

    def __post_init__(self) -> None:
        self.settings.check()
        self._tmp = None
        if self.procs is None:
            if self.log_dir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="extproc-vllm-")
                self.log_dir = Path(self._tmp.name)
            self.procs = ProcessGroup(self.log_dir)
        if not self.members:
            self.members = [Replica(f"replica-{i}", f"{HOST}:{free_port()}") for i in range(self.replicas)]
        self.kv_ports = {r.name: free_port() for r in self.members}
        self.replay_ports = {r.name: free_port() for r in self.members}
        self._model_dir: Path | None = None

    @property
    def group(self) -> ProcessGroup:
        """The process group the engines belong to."""
        assert self.procs is not None
        return self.procs

    @property
    def model_dir(self) -> Path:
        """The model directory the engines serve (also the router's tokenizer); built on first use."""
        if self._model_dir is None:
            self._model_dir = install.ensure((self.settings.model,), self.settings.base_dir)[self.settings.model]
        return self._model_dir

    def member(self, name: str) -> Replica:
        """A member by name."""
        for r in self.members:
            if r.name == name:
                return r
        raise KeyError(name)

    def url(self, name: str) -> str:
        """An engine's own base URL."""
        return f"http://{self.member(name).address}"

    def kv_endpoint(self, name: str) -> str | None:
        """Where a subscriber connects for an engine's KV events (None without events)."""
        return f"tcp://{HOST}:{self.kv_ports[name]}" if self.settings.kv_events else None

    def replay_endpoint(self, name: str) -> str | None:
        """Where a subscriber asks an engine to replay its buffered batches (a DEALER connects to
        its ROUTER): how the router tells, after reconnecting, a restarted engine from one that
        merely lost a connection."""
        return f"tcp://{HOST}:{self.replay_ports[name]}" if self.settings.kv_events else None

    def argv(self, replica: Replica) -> list[str]:
        """The command line of one engine."""
        s = self.settings
        port = replica.address.rpartition(":")[2]
        argv = [
            str(install.vllm_python(s.base_dir)),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            s.served_name,
            "--host",
            HOST,
            "--port",
            port,
            "--enable-prefix-caching",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-model-len",
            str(s.max_model_len),
            "--enable-prompt-tokens-details",
            "--block-size",
            str(s.block_size),
            # The engine's name in every answer's system_fingerprint, as the fake replica does: a
            # client can tell which engine answered whatever router is in front.
            "--fingerprint-mode",
            "custom",
            "--fingerprint-value",
            replica.name,
            "--disable-uvicorn-access-log",
            "--uvicorn-log-level",
            "warning",
        ]
        if s.num_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(s.num_blocks)]
        if s.kv_events:
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.kv_ports[replica.name]}",
                "replay_endpoint": f"tcp://*:{self.replay_ports[replica.name]}",
            }
            argv += ["--kv-events-config", json.dumps(config)]
        if s.traces_endpoint is not None:
            argv += ["--otlp-traces-endpoint", s.traces_endpoint]
        return argv + list(s.extra_args)

    def start(self, names: list[str] | None = None, wait: bool = True) -> VllmFleet:
        """Start the engines (all, or ``names``) at once; with ``wait``, until each answers /health."""
        chosen = [self.member(n) for n in names] if names else self.members
        try:
            for replica in chosen:
                self.group.start(replica.name, self.argv(replica), env=engine_env(self.settings))
            if wait:
                self.wait([r.name for r in chosen])
        except BaseException:
            for replica in chosen:
                self.stop_engine(replica.name)
            raise
        return self

    def wait(self, names: list[str] | None = None, timeout_s: float | None = None) -> None:
        """Poll every engine's /health until all answer 200; an engine that exits or stays silent
        past ``timeout_s`` (the settings' start-up bound) raises RuntimeError with its log's end."""
        pending = list(names or [r.name for r in self.members])
        bound = timeout_s or self.settings.startup_timeout_s
        deadline = time.monotonic() + bound
        while pending:
            for name in list(pending):
                proc = self.group.procs.get(name)
                if proc is None or proc.poll() is not None:
                    code = None if proc is None else proc.returncode
                    raise RuntimeError(f"engine {name} exited ({code}) while starting\n{self.group.log_tail(name)}")
                with contextlib.suppress(OSError), urllib.request.urlopen(self.url(name) + "/health", timeout=1) as r:
                    if r.status == 200:
                        pending.remove(name)
            if pending and time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}\n{self.group.log_tail(n, 10)}" for n in pending)
                raise RuntimeError(f"engines {pending} not healthy after {bound:.0f}s\n{tails}")
            if pending:
                time.sleep(0.5)

    def stop_engine(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> None:
        """End one engine's whole process group (the engine and anything it spawned), by its id."""
        proc = self.group.procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout_s)
            except Exception:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout_s)
        # Whatever it left in its group (its session id is its PID).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def kill(self, name: str) -> None:
        """SIGKILL one engine at once (a crash)."""
        self.stop_engine(name, signal.SIGKILL)

    def restart(self, name: str, wait: bool = True) -> None:
        """Start a stopped or killed engine again on the same HTTP and KV-event ports."""
        self.stop_engine(name)
        self.start([name], wait=wait)

    def stop(self) -> None:
        """End every engine: all are told at once (each takes a few seconds to shut down)."""
        for replica in self.members:
            proc = self.group.procs.get(replica.name)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for replica in reversed(self.members):
            self.stop_engine(replica.name)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> VllmFleet:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
