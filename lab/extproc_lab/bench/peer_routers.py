"""The peer routers, run for real beside ours: installed into venvs of their own, started on loopback.

``sglang-router``, ``vllm-router`` and ``smg`` (the SGLang gateway's successor, Shepherd Model
Gateway) are Rust routers published on PyPI. Each gets its own venv
under a cache folder (``~/.cache/extproc/peer-routers`` unless told otherwise), created with the
running Python and pip the first time it is needed; nothing of theirs is imported here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from extproc_lab.demo import load
from extproc_lab.demo.gateway import LocalGateway
from extproc_lab.demo.processes import free_port, wait_for_port

HOST = "127.0.0.1"
PEERS_DIR_ENV = "EXTPROC_PEERS_DIR"
CHAT_PATH = "/v1/chat/completions"
_INSTALL_TIMEOUT_S = 900


@dataclass(frozen=True, slots=True)
class PeerRouter:
    """One peer router: its package, version, the policy it is run with and how to start it."""

    name: str
    package: str
    version: str
    policy: str
    summary: str

    def venv(self, peers_dir: Path) -> Path:
        """The venv this router lives in."""
        return peers_dir / f"{self.package}-{self.version}"

    def argv(self, peers_dir: Path, port: int, metrics_port: int, workers: Sequence[str]) -> list[str]:
        """The command line that serves on ``HOST:port`` in front of ``workers`` (base URLs)."""
        bin_dir = self.venv(peers_dir) / "bin"
        common = [
            "--host",
            HOST,
            "--port",
            str(port),
            "--worker-urls",
            *workers,
            "--policy",
            self.policy,
            "--prometheus-host",
            HOST,
            "--prometheus-port",
            str(metrics_port),
        ]
        if self.package == "sglang-router":
            # Its defaults, stated: route to the least loaded worker only when the spread of
            # in-flight requests exceeds 64 and 1.5x; otherwise to the best prefix match.
            thresholds = ["--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5"]
            return [str(bin_dir / "python"), "-m", "sglang_router.launch_router", *common, *thresholds,
                    "--log-level", "warn"]  # fmt: skip
        if self.package == "smg":
            return [str(bin_dir / "smg"), "launch", *common, "--log-level", "warn"]
        return [str(bin_dir / "vllm-router"), *common, "--log-level", "warning"]

    def env(self) -> dict[str, str]:
        """Environment for the router: any tokenizer download it attempts stays on loopback."""
        return {"HF_ENDPOINT": f"http://{HOST}:9", "HF_HUB_OFFLINE": "1", "RUST_LOG": "warn"}

    def installed(self, peers_dir: Path) -> bool:
        """Whether this router's venv is complete."""
        return (self.venv(peers_dir) / ".installed").exists()

    def install(self, peers_dir: Path) -> None:
        """Create the venv and pip-install the pinned release (raises RuntimeError on failure)."""
        venv = self.venv(peers_dir)
        venv.parent.mkdir(parents=True, exist_ok=True)
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"{self.package}=={self.version}"],
        ]
        for argv in steps:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S, check=False)
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
                raise RuntimeError(f"installing {self.package}=={self.version} failed: {' '.join(argv)}\n{tail}")
        (venv / ".installed").write_text(f"{self.package}=={self.version}\n")


PEER_ROUTERS = {
    "sglang_router": PeerRouter(
        "sglang_router", "sglang-router", "0.3.2", "cache_aware", "SGLang router 0.3.2, cache_aware"
    ),
    "vllm_router": PeerRouter(
        "vllm_router", "vllm-router", "0.1.17", "consistent_hash", "vLLM router 0.1.17, consistent_hash"
    ),
    "smg": PeerRouter("smg", "smg", "1.13.0", "cache_aware", "smg 1.13.0 (Shepherd Model Gateway), cache_aware"),
}
"""Every peer router any benchmark runs, and the one list ``make peers`` (so ``make test``) installs."""


def default_peers_dir() -> Path:
    """``$EXTPROC_PEERS_DIR``, else ``$XDG_CACHE_HOME/extproc/peer-routers``, else under ``~/.cache``."""
    if os.environ.get(PEERS_DIR_ENV):
        return Path(os.environ[PEERS_DIR_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "extproc" / "peer-routers"


def wait_serving(url: str, timeout_s: float = 60.0) -> None:
    """Wait until a chat request through ``url`` answers 200 (peers register workers lazily)."""
    body = load.chat_body(("gateway replica prefix cache session token " * 7)[:256], max_tokens=1)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        req = urllib.request.Request(url + CHAT_PATH, data=body, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    return
                last = f"status {resp.status}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not serve a chat request within {timeout_s:.0f}s ({last})")


def start_peer(gw: LocalGateway, peer: PeerRouter, peers_dir: Path, install: bool = True) -> str:
    """Install (if ``install`` allows) and start a peer router in front of the gateway's replicas
    (a process of the gateway's group, so it ends with it); its URL once it serves."""
    if not peer.installed(peers_dir):
        if not install:
            raise RuntimeError(f"{peer.package} {peer.version} not installed in {peers_dir} (--no-install)")
        peer.install(peers_dir)
    port, metrics_port = free_port(), free_port()
    workers = [f"http://{r.address}" for r in gw.members]
    proc = gw.procs.start(peer.name, peer.argv(peers_dir, port, metrics_port, workers), env=peer.env())
    url = f"http://{HOST}:{port}"
    try:
        wait_for_port(HOST, port, timeout_s=60, proc=proc)
        wait_serving(url)
    except (RuntimeError, TimeoutError) as exc:
        raise RuntimeError(f"{peer.name}: {exc}\n{gw.procs.log_tail(peer.name)}") from None
    return url


def install_all(peers_dir: Path, progress: Callable[[str], None] = print) -> None:
    """Install every peer router of ``PEER_ROUTERS`` not yet in ``peers_dir`` (a no-op when all are)."""
    for peer in PEER_ROUTERS.values():
        if peer.installed(peers_dir):
            continue
        started = time.monotonic()
        peer.install(peers_dir)
        progress(f"installed {peer.package}=={peer.version} in {peers_dir} ({time.monotonic() - started:.0f} s)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m extproc_lab.bench.peer_routers [--dir DIR]``: install every peer router."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, help=f"where (default: ${PEERS_DIR_ENV} or ~/.cache/extproc/peer-routers)")
    args = p.parse_args(argv)
    try:
        install_all(args.dir or default_peers_dir())
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
