"""Where a replica's engines publish their KV events: its labels, else the configured ports on its
host, one endpoint per data-parallel rank as vLLM offsets them."""

from __future__ import annotations

from extproc.fleet.kvevents.settings import KvEventSettings
from extproc.routing.model import Replica


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Where data-parallel ``rank`` publishes, given rank 0's endpoint: vLLM offsets a tcp port by
    the rank and suffixes other endpoints with ``_dp<rank>``."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        head, _, port = endpoint.rpartition(":")
        return f"{head}:{int(port) + rank}" if port.isdigit() else None
    return f"{endpoint}_dp{rank}"


def rank_endpoints(replica: Replica, settings: KvEventSettings) -> list[tuple[str, str | None]]:
    """Each data-parallel rank's (publisher, replay) endpoints: ``kv_dp`` ranks (its label, else
    ``data_parallel_size``) from :func:`replica_endpoints`' rank 0."""
    pub, replay = replica_endpoints(replica, settings)
    label = replica.labels.get("kv_dp", "")
    size = int(label) if label.isdigit() and int(label) >= 1 else settings.data_parallel_size
    out = []
    for rank in range(size if pub else 0):
        rank_pub = rank_endpoint(pub, rank)
        if rank_pub is not None:
            out.append((rank_pub, rank_endpoint(replay, rank)))
    return out


def replica_endpoints(replica: Replica, settings: KvEventSettings) -> tuple[str | None, str | None]:
    """A replica's publisher and replay endpoints: its ``kv_events``/``kv_replay`` labels, else
    its host with the configured ports (discovery)."""
    pub = replica.labels.get("kv_events")
    replay = replica.labels.get("kv_replay")
    host = replica.address.rpartition(":")[0]
    if pub is None and settings.port and host:
        pub = f"tcp://{host}:{settings.port}"
    if replay is None and settings.replay_port and host and pub is not None:
        replay = f"tcp://{host}:{settings.replay_port}"
    return pub, replay
