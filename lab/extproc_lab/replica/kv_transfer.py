"""The fake replica's KV connector: both sides of vLLM's disaggregated prefill and decode.

vLLM with a KV connector (NIXL's, for instance) serves a request in two hops, which a proxy (or
llm-d's sidecar) drives:

1. to the **prefill** replica, the request with ``max_tokens`` 1, no stream, and
   ``kv_transfer_params: {"do_remote_decode": true}``: it computes the prompt and answers with
   ``kv_transfer_params`` naming where the blocks are (``remote_engine_id``, ``remote_block_ids``,
   ``remote_host``, ``remote_port``) and keeps them for the decode replica to read;
2. to the **decode** replica, the original request with those ``kv_transfer_params``: it looks
   up its own prefix cache, pulls the blocks it lacks from the prefill replica (the request waits,
   *deferred*), takes them as cached and computes only the rest. If the pull fails (the prefill
   replica is gone, unreachable, or no longer holds the blocks) it recomputes what did not arrive.

Here the pull is an HTTP call to the prefill replica's own server (``POST /kv_transfer/pull``:
which of the block ids it still holds), and the transfer time is the profile's
``kv_transfer_s_per_block`` per block fetched. Failures are injectable
(:class:`TransferFaults`, ``POST /kv_transfer/faults``): the prefill hop fails or never answers,
the decode side cannot fetch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from extproc.api.sim import PARAMS_FIELD
from extproc_lab.replica.engine import KvSource, ReplicaEngine
from extproc_lab.replica.model import Seq

log = logging.getLogger("extproc_lab.replica")

__all__ = ["PARAMS_FIELD", "KvConnector", "RemoteBlocks", "TransferFaults", "wants_prefill_only"]

PULL_PATH = "/kv_transfer/pull"

PrefillFault = Literal["ok", "fail", "hang"]
FetchFault = Literal["ok", "fail"]
PREFILL_FAULTS: tuple[PrefillFault, ...] = ("ok", "fail", "hang")
FETCH_FAULTS: tuple[FetchFault, ...] = ("ok", "fail")


@dataclass(slots=True)
class TransferFaults:
    """Injected failures: ``prefill`` "fail" answers a prefill hop with a 500, "hang" never
    answers it; ``fetch`` "fail" makes this replica's pulls fail (it then recomputes)."""

    prefill: PrefillFault = "ok"
    fetch: FetchFault = "ok"


def wants_prefill_only(params: Any) -> bool:
    """Whether ``kv_transfer_params`` ask for the prefill hop (``do_remote_decode``)."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") is True


@dataclass(frozen=True, slots=True)
class RemoteBlocks:
    """Where a request's blocks wait, as the prefill replica's ``kv_transfer_params`` said."""

    engine_id: str
    block_ids: tuple[int, ...]
    host: str
    port: int

    @classmethod
    def parse(cls, params: Any) -> RemoteBlocks | None:
        """The remote blocks of a decode hop's ``kv_transfer_params``; None when they name none
        (no ``do_remote_prefill``, or fields missing or malformed)."""
        if not isinstance(params, Mapping) or params.get("do_remote_prefill") is not True:
            return None
        ids = params.get("remote_block_ids")
        host = params.get("remote_host")
        port = params.get("remote_port")
        engine_id = params.get("remote_engine_id")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            return None
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(engine_id, str):
            return None
        return cls(engine_id, tuple(ids), host, port)


class KvConnector:
    """One replica's connector, in both roles: it exports the blocks of prefill hops and pulls
    those of decode hops. ``host``/``port`` are what it advertises (the server's address)."""

    def __init__(
        self,
        engine: ReplicaEngine,
        engine_id: str,
        *,
        fetch_timeout_s: float = 5.0,
        max_exports: int = 1 << 16,
    ) -> None:
        self.engine = engine
        self.engine_id = engine_id
        self.host = "127.0.0.1"
        self.port = 0
        self.faults = TransferFaults()
        self.fetch_timeout_s = fetch_timeout_s
        self._max_exports = max_exports
        # Block id -> prefix key, oldest first: what a pull may still ask for.
        self._exports: OrderedDict[int, int] = OrderedDict()
        self._ids = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self.exported_blocks = 0
        self.fetched_blocks = 0
        self.failed_fetches = 0

    # --- the prefill side --------------------------------------------------------------------

    def export(self, keys: Sequence[int]) -> dict[str, Any]:
        """Offer a finished prefill's blocks; returns the ``kv_transfer_params`` of its answer."""
        ids = []
        for key in keys:
            block_id = next(self._ids)
            self._exports[block_id] = key
            ids.append(block_id)
        while len(self._exports) > self._max_exports:
            self._exports.popitem(last=False)
        self.exported_blocks += len(ids)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": ids,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }

    def still_held(self, engine_id: str, block_ids: Sequence[int]) -> int:
        """How many leading ``block_ids`` this replica can still serve (0 for another engine's)."""
        if engine_id != self.engine_id:
            return 0
        pool = self.engine.cache
        n = 0
        for block_id in block_ids:
            key = self._exports.get(block_id)
            if key is None or key not in pool:
                break
            n += 1
        return n

    # --- the decode side ---------------------------------------------------------------------

    def source(self, remote: RemoteBlocks) -> KvSource:
        """What the engine awaits before admitting a decode hop: the blocks it lacks, pulled and
        transferred (their count of the prompt's leading keys), or fewer if the pull fails."""

        async def fetch(seq: Seq) -> int:
            wanted = min(len(remote.block_ids), len(seq.keys))
            if wanted == 0:
                return 0
            held = await self._pull(remote, wanted)
            missing = self.engine.model.missing_blocks(seq, held)
            profile = self.engine.profile
            await asyncio.sleep(missing * profile.kv_transfer_s_per_block * profile.time_scale)
            self.fetched_blocks += missing
            return held

        return fetch

    async def _pull(self, remote: RemoteBlocks, wanted: int) -> int:
        """Ask the prefill replica which of the first ``wanted`` blocks it still holds; 0 when it
        cannot be asked (a fault, gone, unreachable, too slow)."""
        if self.faults.fetch == "fail":
            self.failed_fetches += 1
            return 0
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.fetch_timeout_s))
        url = f"http://{remote.host}:{remote.port}{PULL_PATH}"
        body = {"engine_id": remote.engine_id, "block_ids": list(remote.block_ids[:wanted])}
        try:
            async with self._session.post(url, json=body) as response:
                response.raise_for_status()
                answer = await response.json()
            return max(0, min(wanted, int(answer["blocks"])))
        except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError) as exc:
            log.info("KV pull from %s failed (%s): recomputing", url, exc)
            self.failed_fetches += 1
            return 0

    async def close(self) -> None:
        """Close the pull client."""
        if self._session is not None:
            await self._session.close()
            self._session = None
