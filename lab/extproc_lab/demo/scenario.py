"""Run a scenario of ``envoy/`` for real: its shipped ``envoy.yaml``, moved onto free loopback ports.

The files under ``envoy/`` are rendered for fixed addresses (Envoy on 10000, the processor on
9002 or ``/run/extproc/extproc.sock``, replicas on 8001-8003). A verify script must not take
those ports on a shared machine, and must prove the file a user reads rather than a sibling
rendered for the occasion: :func:`relocate` rewrites every address of the shipped config to a
free port (or a temporary socket path), and fails on any address it was not told about, so
nothing in the config can reach a fixed port by accident.

The verify scripts (``envoy/<scenario>/verify.py``) use :class:`ScenarioGateway` and the small
HTTP helpers here; each exits 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from extproc.api import Replica
from extproc_lab.demo.gateway import HOST, LocalGateway
from extproc_lab.demo.processes import envoy_binary, free_port, wait_for_port

# What the shipped files are rendered for (tests/unit/adapters/envoy_config/test_envoy_config.py renders
# them with these).
SHIPPED_REPLICAS = (
    Replica("replica-0", "127.0.0.1:8001"),
    Replica("replica-1", "127.0.0.1:8002"),
    Replica("replica-2", "127.0.0.1:8003"),
)
SHIPPED_LISTEN_PORT = 10000
SHIPPED_ADMIN_PORT = 9901
SHIPPED_PROCESSOR_PORT = 9002
CHAT = "/v1/chat/completions"


def relocate(config: Any, ports: Mapping[int, int], pipes: Mapping[str, str] | None = None) -> Any:
    """A copy of ``config`` with each ``socket_address`` port and ``pipe`` path mapped.

    Raises KeyError for a port or path without a mapping.
    """
    pipes = pipes or {}
    if isinstance(config, list):
        return [relocate(item, ports, pipes) for item in config]
    if not isinstance(config, dict):
        return config
    moved = {key: relocate(value, ports, pipes) for key, value in config.items()}
    if "socket_address" in moved:
        address = dict(moved["socket_address"])
        port = int(address["port_value"])
        if port not in ports:
            raise KeyError(f"no free port given for {address['address']}:{port}")
        address["port_value"] = ports[port]
        moved["socket_address"] = address
    if "pipe" in moved:
        path = moved["pipe"]["path"]
        if path not in pipes:
            raise KeyError(f"no path given for pipe {path}")
        moved["pipe"] = {**moved["pipe"], "path": pipes[path]}
    return moved


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


@dataclass
class ScenarioGateway(LocalGateway):
    """Fake replicas, the processor and Envoy with a shipped scenario config, on free ports.

    ``replicas`` must match the shipped config (3); ``extra_replicas`` start more replicas that
    only the processor knows (for ORIGINAL_DST, which reaches pods Envoy was never told about).
    """

    config_path: Path = Path("envoy.yaml")
    unix_socket: bool = False
    replicas: int = len(SHIPPED_REPLICAS)
    extra_replicas: int = 0
    router_config: str = ""  # YAML for the processor's --config (health settings, say)
    unknown_to_envoy: list[Replica] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.replicas != len(SHIPPED_REPLICAS):
            raise ValueError(f"the shipped configs name {len(SHIPPED_REPLICAS)} replicas")
        super().__post_init__()
        self.unknown_to_envoy = [
            Replica(f"replica-{self.replicas + i}", f"{HOST}:{free_port()}") for i in range(self.extra_replicas)
        ]
        # The processor learns of them from the command line; Envoy's config never names them.
        self.processor_args = (
            *self.processor_args,
            *(f"--replica={r.name}={r.address}" for r in self.unknown_to_envoy),
        )
        # A short path: unix socket paths are limited to about 100 bytes.
        self.socket_path = str(self.dir / "extproc.sock")
        if self.router_config:
            path = self.dir / "router.yaml"
            path.write_text(self.router_config)
            self.processor_args = (*self.processor_args, "--config", str(path))

    @property
    def processor_address(self) -> str:
        """Where the processor listens."""
        return f"unix:{self.socket_path}" if self.unix_socket else f"{HOST}:{self.processor_port}"

    @property
    def processor_addresses(self) -> list[str]:
        """The processor's ext_proc address (and so its admin API's), a unix socket or a port."""
        return [self.processor_address]

    @property
    def admin_url(self) -> str:
        """Envoy's admin interface."""
        return f"http://{HOST}:{self.admin_port}"

    def _replica_argv(self, replica: Replica) -> list[str]:
        argv = [sys.executable, "-m", "extproc", "replica", "--name", replica.name]
        argv += ["--port", replica.address.rpartition(":")[2], "--profile", self.profile]
        if self.time_scale is not None:
            argv += ["--time-scale", str(self.time_scale)]
        return argv

    def start_processor(self, index: int = 0) -> None:
        """Start (or restart) the processor, on a unix socket when the scenario says so."""
        if not self.unix_socket:
            super().start_processor(index)
            return
        with contextlib.suppress(FileNotFoundError):
            Path(self.socket_path).unlink()
        argv = [sys.executable, "-m", "extproc", "serve", "--listen", f"unix:{self.socket_path}"]
        argv += ["--mode", self.mode, "--metrics-listen", f"{HOST}:{self.metrics_port}"]
        argv += [f"--replica={r.name}={r.address}" for r in self.members]
        argv += list(self.processor_args)
        proc = self.procs.start(self.processor_name(index), argv)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"processor exited with {proc.returncode}\n{self.procs.log_tail('processor')}")
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as sock:
                sock.connect(self.socket_path)
                return
            time.sleep(0.05)
        raise TimeoutError(f"nothing listening on {self.socket_path}")

    def start_envoy(self) -> None:
        """Start Envoy with the shipped config, relocated onto this gateway's ports."""
        shipped = yaml.safe_load(self.config_path.read_text())
        ports = {
            SHIPPED_LISTEN_PORT: self.envoy_port,
            SHIPPED_ADMIN_PORT: self.admin_port,
            SHIPPED_PROCESSOR_PORT: self.processor_port,
        }
        ports.update({_port(s.address): _port(r.address) for s, r in zip(SHIPPED_REPLICAS, self.members, strict=True)})
        pipes = {"/run/extproc/extproc.sock": self.socket_path}
        path = self.dir / "envoy.yaml"
        path.write_text(yaml.safe_dump(relocate(shipped, ports, pipes), sort_keys=False))
        argv = [envoy_binary(), "-c", str(path), "--log-level", "warn", "--concurrency", "1"]
        argv.append("--disable-hot-restart")  # no shared-memory base id to collide with another Envoy
        proc = self.procs.start("envoy", argv)
        try:
            wait_for_port(HOST, self.envoy_port, proc=proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{exc}\n{self.procs.log_tail('envoy')}") from None

    def start(self) -> ScenarioGateway:
        """Start everything; the replicas in parallel (each takes a moment to import)."""
        try:
            every = [*self.members, *self.unknown_to_envoy]
            for replica in every:
                self.procs.start(replica.name, self._replica_argv(replica))
            for replica in every:
                self.procs.wait_healthy(replica.name, f"http://{replica.address}/health")
            self.start_processor()
            self.start_envoy()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> ScenarioGateway:
        return self.start()


@dataclass(frozen=True, slots=True)
class Answer:
    """What a client saw: the status and the replica that answered (``x-replica-name``)."""

    status: int
    replica: str


def chat(url: str, text: str, session: str | None = None, headers: Mapping[str, str] | None = None) -> Answer:
    """POST one chat completion and return the status and the replica that answered."""
    body = {"model": "demo-model", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    request = urllib.request.Request(url + CHAT, data=json.dumps(body).encode(), method="POST")
    request.add_header("content-type", "application/json")
    if session:
        request.add_header("x-session-id", session)
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return Answer(response.status, response.headers.get("x-replica-name", ""))
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers.get("x-replica-name", "") if exc.headers else "")


def get_text(url: str) -> str:
    """GET a page as text."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text: str = response.read().decode()
        return text


def conversation(history: str, turn: int) -> str:
    """The prompt of a conversation's turn: the growing history, as a chat client resends it."""
    return history + "".join(f" turn {t} question and answer" for t in range(turn + 1))


@dataclass
class Checks:
    """Named checks of a verify script; :meth:`exit_code` is 0 when all passed."""

    scenario: str
    results: list[tuple[str, bool, str]] = field(default_factory=list)

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        """Record (and print) one check."""
        self.results.append((name, passed, detail))
        mark = "ok  " if passed else "FAIL"
        print(f"[{mark}] {self.scenario}: {name}" + (f" ({detail})" if detail else ""), flush=True)
        return passed

    def run(self, name: str, probe: Callable[[], tuple[bool, str]]) -> bool:
        """Run ``probe`` (returning passed and a detail) as one check; an exception fails it."""
        try:
            passed, detail = probe()
        except Exception as exc:  # a verify script reports every check, whatever breaks
            passed, detail = False, f"{type(exc).__name__}: {exc}"
        return self.check(name, passed, detail)

    def exit_code(self) -> int:
        """0 when every check passed, else 1."""
        failed = [name for name, passed, _ in self.results if not passed]
        print(f"{self.scenario}: {len(self.results) - len(failed)}/{len(self.results)} checks passed", flush=True)
        return 1 if failed or not self.results else 0


# Probes shared by the verify scripts: each returns (passed, detail) for Checks.run.


def probe_sticky(url: str, tag: str, sessions: int = 6, turns: int = 4, min_replicas: int = 2) -> tuple[bool, str]:
    """Every turn of a conversation lands on one replica, and conversations spread over replicas."""
    seen: dict[str, set[str]] = {}
    statuses: set[int] = set()
    for i in range(sessions):
        history = f"{tag} conversation {i} " + "background document text " * 60
        answers = [chat(url, conversation(history, t), session=f"{tag}-{i}") for t in range(turns)]
        statuses |= {a.status for a in answers}
        seen[f"{tag}-{i}"] = {a.replica for a in answers}
    holders = {next(iter(v)) for v in seen.values() if len(v) == 1}
    passed = statuses == {200} and all(len(v) == 1 for v in seen.values()) and len(holders) >= min_replicas
    return passed, f"statuses {sorted(statuses)}, replicas per session {[len(v) for v in seen.values()]}, " + (
        f"{len(holders)} replicas hold sessions"
    )


def probe_forged_headers(url: str, replicas: Sequence[Replica], tag: str = "forged") -> tuple[bool, str]:
    """Routing headers a client sets are ignored: a pinned conversation stays where it is pinned
    even when the client names another replica, and a bogus name is no error."""
    moved = []
    statuses = set()
    for i in range(6):
        history = f"{tag} conversation {i} " + "background document text " * 40
        pinned = chat(url, conversation(history, 0), session=f"{tag}-{i}")
        other = next(r for r in replicas if r.name != pinned.replica)
        forged = {"x-target-cluster": other.name, "x-gateway-destination-endpoint": other.address}
        answers = [chat(url, conversation(history, t), session=f"{tag}-{i}", headers=forged) for t in (1, 2)]
        statuses |= {pinned.status, *(a.status for a in answers)}
        moved += [a.replica for a in answers if a.replica != pinned.replica]
    bogus = {"x-target-cluster": "no-such-cluster", "x-gateway-destination-endpoint": "192.0.2.1:1"}
    bogus_status = chat(url, "bogus", headers=bogus).status
    passed = statuses == {200} and not moved and bogus_status == 200
    return passed, f"statuses {sorted(statuses)}, {len(moved)} turns moved by a forged header, bogus -> {bogus_status}"


def probe_fails_open(gw: ScenarioGateway, tag: str = "open") -> tuple[bool, str]:
    """With the processor killed, Envoy's default route serves every request (round robin)."""
    gw.procs.kill(gw.processor_name())
    during = [chat(gw.url, f"{tag} {i}", session=tag) for i in range(9)]
    gw.start_processor()
    after = [chat(gw.url, f"{tag} again {i}", session=f"{tag}-after") for i in range(5)]
    passed = (
        all(a.status == 200 for a in during + after)
        and len({a.replica for a in during}) > 1  # one session spread: nobody routed it
        and len({a.replica for a in after}) == 1  # sticky again once the processor is back
    )
    return passed, f"processor down: {sorted({a.replica for a in during})}; back: {sorted({a.replica for a in after})}"


def processor_decisions(gw: ScenarioGateway) -> float:
    """The processor's ``extproc_decisions_total``, summed over reasons and models."""
    total = 0.0
    for line in get_text(gw.metrics_url).splitlines():
        if line.startswith("extproc_decisions_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def in_rotation(gw: ScenarioGateway, replica: str) -> bool | None:
    """Whether the processor has ``replica`` in its rotation (None: not reported)."""
    for line in get_text(gw.metrics_url).splitlines():
        if line.startswith(f'extproc_replica_in_rotation{{replica="{replica}"}} '):
            return float(line.rsplit(" ", 1)[1]) == 1.0
    return None


def envoy_health_flags(gw: ScenarioGateway, cluster: str, address: str) -> str:
    """The health flags Envoy's admin reports for one host of one cluster (``healthy`` when none)."""
    for line in get_text(f"{gw.admin_url}/clusters").splitlines():
        if line.startswith(f"{cluster}::{address}::health_flags::"):
            return line.rsplit("::", 1)[1]
    return "absent"


def probe_replica_death(gw: ScenarioGateway, tag: str = "death") -> tuple[bool, str]:
    """Kill the replica holding the most conversations mid-way: no client sees an error, and once
    the processor has ejected it its conversations are pinned elsewhere and sticky again."""
    histories = {f"{tag}-{i}": f"{tag} conversation {i} " + "background document text " * 60 for i in range(6)}
    pinned = {s: chat(gw.url, conversation(h, 0), session=s).replica for s, h in histories.items()}
    victim = max(set(pinned.values()), key=list(pinned.values()).count)
    gw.procs.kill(victim)
    # At once, before the processor can know: Envoy's retries (or health checks) must cover it.
    during = [chat(gw.url, conversation(h, t), session=s) for t in (1, 2) for s, h in histories.items()]
    ejected = wait_until(lambda: in_rotation(gw, victim) is False)
    after = {s: [chat(gw.url, conversation(h, t), session=s) for t in (3, 4, 5)] for s, h in histories.items()}
    answers = during + [a for v in after.values() for a in v]
    errors = [a.status for a in answers if a.status != 200]
    moved_sticky = all(len({a.replica for a in after[s]}) == 1 for s in histories if pinned[s] == victim)
    passed = not errors and victim not in {a.replica for a in answers} and ejected and moved_sticky
    return passed, (
        f"killed {victim} holding {list(pinned.values()).count(victim)} conversations; {len(answers)} requests after, "
        f"errors {errors}; ejected by the processor: {ejected}; its conversations sticky again: {moved_sticky}"
    )


def probe_unknown_replicas_reached(gw: ScenarioGateway, tag: str = "unknown") -> tuple[bool, str]:
    """Replicas that only the processor knows are reached (ORIGINAL_DST connects to any address)."""
    unknown = {r.name for r in gw.unknown_to_envoy}
    answers = [chat(gw.url, f"{tag} topic {i} " * 40, session=f"{tag}-{i}") for i in range(16)]
    reached = sum(a.replica in unknown for a in answers)
    passed = bool(unknown) and all(a.status == 200 for a in answers) and reached > 0
    return passed, f"{reached}/{len(answers)} new conversations on {sorted(unknown)}, which Envoy's config never names"
