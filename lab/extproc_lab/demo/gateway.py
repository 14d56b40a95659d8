"""A local gateway on loopback: replicas (fake ones, or real vLLM engines with ``engine="vllm"``),
the processor and real Envoy, as processes."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from extproc.api import GatewaySpec, Replica, render_yaml
from extproc_lab.demo.processes import ProcessGroup, envoy_binary, free_port, wait_for_port
from extproc_lab.engines.fleet import EngineSettings, VllmFleet

HOST = "127.0.0.1"
ENGINES = ("fake", "vllm")


def replica_flag(replica: Replica, kv_events: str | None = None, kv_replay: str | None = None) -> str:
    """``NAME=HOST:PORT[,LABEL=VALUE...][,kv_events=ENDPOINT[,kv_replay=ENDPOINT]]`` as
    ``extproc serve --replica`` takes it."""
    labels = "".join(f",{k}={v}" for k, v in replica.labels.items())
    events = f",kv_events={kv_events}" if kv_events else ""
    replay = f",kv_replay={kv_replay}" if kv_events and kv_replay else ""
    return f"{replica.name}={replica.address}{labels}{events}{replay}"


@dataclass
class LocalGateway:
    """Start with ``with LocalGateway(replicas=4) as gw:``; ``gw.url`` goes through our routing,
    ``gw.round_robin_url`` through Envoy's own round robin over the same replicas."""

    replicas: int = 4
    mode: str = "cluster"
    profile: str = "demo"
    time_scale: float | None = None
    processor_args: tuple[str, ...] = ()
    observe_responses: bool = True
    full_duplex: bool = False
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    log_dir: Path | None = None
    members: list[Replica] = field(default_factory=list)
    processors: int = 1  # several share one Redis store (pass --store in processor_args)
    # Envoy's worker threads (`--concurrency`): one, unless a benchmark scales Envoy with the processor.
    envoy_concurrency: int = 1
    # More GatewaySpec fields for Envoy (route_timeout_s, processor_tls, ...), for fault and TLS tests.
    envoy_options: dict[str, Any] = field(default_factory=dict)
    # More `extproc replica` flags per replica name, e.g. {"replica-0": ("--lora-adapters", "a,b")}.
    replica_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # "fake": `extproc replica` processes; "vllm": real vLLM CPU engines (extproc_lab.engines), the
    # processor configured for them as a user would: the model's directory as its tokenizer, each
    # engine's KV-event publisher, kv_events.block_size the engines' block size.
    engine: str = "fake"
    engine_settings: EngineSettings = field(default_factory=EngineSettings)
    # With real engines: also give the processor the engines' KV events (else the estimate only).
    kv_events: bool = True
    # HOST:PORT of an OTLP/gRPC collector: Envoy traces every request there, the processor its
    # decisions (`serve --tracing-endpoint`), joined to Envoy's spans, and real engines their
    # requests (vLLM's --otlp-traces-endpoint), under the context Envoy sends them.
    tracing_collector: str | None = None
    # Edits the rendered Envoy config before Envoy starts (a test's deliberately broken filter).
    envoy_yaml_edit: Callable[[str], str] | None = None
    # Fake replicas served behind the fake of llm-d's routing sidecar (`extproc replica
    # --sidecar-port`): the member's address is the sidecar's, the replica's own port another.
    sidecars: tuple[str, ...] = ()
    # Real engines already running (a test session's shared fleet): the gateway routes to the
    # first `replicas` of them and leaves them running when it stops; `engine` and
    # `engine_settings` are the fleet's.
    engines: VllmFleet | None = None

    def __post_init__(self) -> None:
        if self.engines is not None:
            self.engine, self.engine_settings = "vllm", self.engines.settings
            if self.replicas > len(self.engines.members):
                raise ValueError(f"{self.replicas} replicas wanted of a fleet of {len(self.engines.members)}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; known: {', '.join(ENGINES)}")
        self._tmp = None if self.log_dir else tempfile.TemporaryDirectory(prefix="extproc-gw-")
        self.dir = self.log_dir or Path(self._tmp.name if self._tmp else ".")
        self.dir.mkdir(parents=True, exist_ok=True)  # written to before any process starts there
        self.procs = ProcessGroup(self.dir)
        self.envoy_port = free_port()
        self.round_robin_port = free_port()
        self.admin_port = free_port()
        self.processor_port = free_port()
        self.metrics_port = free_port()
        # (gRPC port, metrics port) of processors 1.. ; processor 0 uses the two above.
        self.extra_processor_ports = [(free_port(), free_port()) for _ in range(self.processors - 1)]
        self.members = [
            Replica(f"replica-{i}", f"{HOST}:{free_port()}", labels=self.labels.get(f"replica-{i}", {}))
            for i in range(self.replicas)
        ]
        if self.engines is not None:
            self.members = [
                dataclasses.replace(r, labels=self.labels.get(r.name, r.labels)) for r in self.engines.members
            ]
            self.members = self.members[: self.replicas]
        if self.tracing_collector and self.engine_settings.traces_endpoint is None:
            self.engine_settings = dataclasses.replace(self.engine_settings, traces_endpoint=self.tracing_collector)
        self.backend_ports = {name: free_port() for name in self.sidecars}
        self.fleet = (
            self.engines
            if self.engines is not None
            else VllmFleet(settings=self.engine_settings, procs=self.procs, members=self.members)
            if self.engine == "vllm"
            else None
        )

    @property
    def url(self) -> str:
        """Base URL through Envoy with our processor."""
        return f"http://{HOST}:{self.envoy_port}"

    @property
    def round_robin_url(self) -> str:
        """Base URL through Envoy's plain round robin (no processor)."""
        return f"http://{HOST}:{self.round_robin_port}"

    @property
    def metrics_url(self) -> str:
        """The processor's /metrics."""
        return f"http://{HOST}:{self.metrics_port}/metrics"

    @property
    def metrics_urls(self) -> list[str]:
        """Every processor's /metrics, processor 0 first."""
        ports = [self.metrics_port, *(m for _, m in self.extra_processor_ports)]
        return [f"http://{HOST}:{p}/metrics" for p in ports]

    @property
    def processor_addresses(self) -> list[str]:
        """Every processor's ext_proc address, processor 0 first."""
        return [f"{HOST}:{p}" for p in (self.processor_port, *(g for g, _ in self.extra_processor_ports))]

    @property
    def admin_addresses(self) -> list[str]:
        """Every processor's admin API (``extproc admin --server``), processor 0 first: its ext_proc
        port, where ``extproc serve`` serves it by default (no ``--admin-listen`` here)."""
        return self.processor_addresses

    @property
    def processor_workers(self) -> int:
        """The ``--workers`` of each processor (``processor_args``), 1 without."""
        args = list(self.processor_args)
        for i, arg in enumerate(args):
            if arg.startswith("--workers="):
                return int(arg.partition("=")[2])
            if arg == "--workers" and i + 1 < len(args):
                return int(args[i + 1])
        return 1

    @property
    def worker_metrics_urls(self) -> list[str]:
        """Processor 0's workers' /metrics, worker 0 first (each serves its own, on the port plus its index)."""
        return [f"http://{HOST}:{self.metrics_port + i}/metrics" for i in range(self.processor_workers)]

    def processor_name(self, index: int = 0) -> str:
        """The process name of processor ``index`` (``processor``, ``processor-1``, ...)."""
        return "processor" if index == 0 else f"processor-{index}"

    def replica_url(self, name: str) -> str:
        """A replica's own base URL (bypassing Envoy)."""
        for r in self.members:
            if r.name == name:
                return f"http://{r.address}"
        raise KeyError(name)

    def backend_url(self, name: str) -> str:
        """A replica's own base URL: behind a sidecar, the replica's rather than the sidecar's."""
        port = self.backend_ports.get(name)
        return f"http://{HOST}:{port}" if port is not None else self.replica_url(name)

    def replica_argv(self, replica: Replica) -> list[str]:
        """The ``extproc replica`` command line of one member (the engine's, with real engines)."""
        if self.fleet is not None:
            return self.fleet.argv(replica)
        port = replica.address.rpartition(":")[2]
        sidecar: list[str] = []
        if replica.name in self.backend_ports:
            sidecar, port = ["--sidecar-port", port], str(self.backend_ports[replica.name])
        argv = [
            sys.executable,
            "-m",
            "extproc",
            "replica",
            "--name",
            replica.name,
            "--port",
            port,
            "--profile",
            self.profile,
        ]
        if self.time_scale is not None:
            argv += ["--time-scale", str(self.time_scale)]
        return argv + sidecar + list(self.replica_args.get(replica.name, ()))

    def start_replica(self, replica: Replica) -> None:
        """Start (or restart) one replica and wait for /health (a real engine: on the same ports)."""
        if self.fleet is not None:
            self.fleet.restart(replica.name)
            return
        self.procs.start(replica.name, self.replica_argv(replica))
        self.procs.wait_healthy(replica.name, f"http://{replica.address}/health")

    def start_replicas(self, wait: bool = True) -> None:
        """Start every member at once (their start-ups overlap), then, with ``wait``, :meth:`wait_replicas`.

        Each starts from :meth:`replica_argv`, not :meth:`start_replica`: a subclass that starts
        some replicas differently overrides the former to have them here too."""
        if self.fleet is not None:
            self.fleet.start(wait=wait)
            return
        for replica in self.members:
            self.procs.start(replica.name, self.replica_argv(replica))
        if wait:
            self.wait_replicas()

    def wait_replicas(self, timeout_s: float = 60.0) -> None:
        """Wait for every member's /health."""
        if self.fleet is not None:
            self.fleet.wait(timeout_s=max(timeout_s, self.engine_settings.startup_timeout_s))
            return
        for replica in self.members:
            self.procs.wait_healthy(replica.name, f"http://{replica.address}/health", timeout_s)

    def start_processor(self, index: int = 0) -> None:
        """Start (or restart) processor ``index`` and wait for its port."""
        port, metrics_port = (
            (self.processor_port, self.metrics_port) if index == 0 else self.extra_processor_ports[index - 1]
        )
        name = self.processor_name(index)
        argv = [
            sys.executable,
            "-m",
            "extproc",
            "serve",
            "--listen",
            f"{HOST}:{port}",
            "--mode",
            self.mode,
            "--metrics-listen",
            f"{HOST}:{metrics_port}",
            *[f"--replica={replica_flag(r, *self._kv_endpoints(r))}" for r in self.members],
            *self._engine_processor_args(),
            # Envoy traces every request and decides for both: the processor follows its parent.
            *(
                [f"--tracing-endpoint={self.tracing_collector}", "--tracing-sampler=parent_based"]
                if self.tracing_collector
                else []
            ),
            *self.processor_args,
        ]
        proc = self.procs.start(name, argv)
        try:
            wait_for_port(HOST, port, proc=proc)
            # The port answers once the first worker serves; each worker serves its /metrics just
            # before its ext_proc port, so traffic waits for all of them (or it all reaches one).
            workers = self.processor_workers if index == 0 else 1
            for i in range(workers if workers > 1 else 0):
                wait_for_port(HOST, metrics_port + i, proc=proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n{self.procs.log_tail(name)}") from None

    def _kv_endpoints(self, replica: Replica) -> tuple[str | None, str | None]:
        """An engine's KV-event publisher and replay endpoint (none for fake replicas)."""
        if self.fleet is None or not self.kv_events:
            return None, None
        return self.fleet.kv_endpoint(replica.name), self.fleet.replay_endpoint(replica.name)

    def _engine_processor_args(self) -> list[str]:
        """What a user sets for real engines: the model's own tokenizer and the engines' block
        size (a config file: no flag carries it). Nothing for fake replicas."""
        if self.fleet is None:
            return []
        config = self.dir / "router-engines.yaml"
        config.write_text(f"kv_events:\n  block_size: {self.engine_settings.block_size}\n")
        return ["--config", str(config), f"--tokenizer={self.engine_settings.served_name}={self.fleet.model_dir}"]

    def _tracing_options(self) -> dict[str, Any]:
        """Envoy's own tracing to ``tracing_collector`` (every request: GatewaySpec's default),
        continuing a client's sampled parent as the processor does (its sampler parent_based)."""
        if not self.tracing_collector:
            return {}
        return {"tracing_collector": self.tracing_collector, "tracing_client_parent": True}

    def start_envoy(self) -> None:
        """Start Envoy with a config rendered for these replicas and wait for its listeners."""
        spec = GatewaySpec(
            replicas=self.members,
            processor=f"{HOST}:{self.processor_port}",
            mode=self.mode,
            listen=f"{HOST}:{self.envoy_port}",
            admin=f"{HOST}:{self.admin_port}",
            round_robin_listen=f"{HOST}:{self.round_robin_port}",
            observe_responses=self.observe_responses,
            full_duplex=self.full_duplex,
            extra_processors=tuple(f"{HOST}:{p}" for p, _ in self.extra_processor_ports),
            # As `extproc envoy-config` renders it for a processor with several workers.
            processor_streams_per_connection=1 if self.processor_workers > 1 else None,
            **{**self._tracing_options(), **self.envoy_options},  # a test's options win
        )
        path = self.dir / "envoy.yaml"
        rendered = render_yaml(spec)
        path.write_text(self.envoy_yaml_edit(rendered) if self.envoy_yaml_edit is not None else rendered)
        argv = [
            envoy_binary(),
            "-c",
            str(path),
            "--log-level",
            "warn",
            "--concurrency",
            str(self.envoy_concurrency),
            # No hot restart, so no shared-memory base id that another Envoy on the host (another
            # test run, a developer's gateway) could already hold.
            "--disable-hot-restart",
        ]
        proc = self.procs.start("envoy", argv)
        try:
            wait_for_port(HOST, self.envoy_port, proc=proc)
            wait_for_port(HOST, self.round_robin_port, proc=proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n{self.procs.log_tail('envoy')}") from None

    def start(self) -> LocalGateway:
        """Start everything."""
        try:
            if self.fleet is not None and self.engines is None:
                self.start_replicas()  # at once: an engine takes tens of seconds to start
            for replica in self.members if self.fleet is None else ():
                self.start_replica(replica)
            for index in range(self.processors):
                self.start_processor(index)
            self.start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every process this gateway started."""
        if self.fleet is not None and self.engines is None:
            self.fleet.stop()
        self.procs.stop_all()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalGateway:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
