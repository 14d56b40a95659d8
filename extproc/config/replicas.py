"""``replicas:`` entries and the ``--replica`` flag's ``NAME=HOST:PORT[,LABEL=VALUE...]``, both held
as :class:`~extproc.routing.model.Replica`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from extproc.base.validation import Section, field_error, option
from extproc.config.errors import ConfigError
from extproc.config.held import held_as
from extproc.routing.model import Replica

_ENDPOINT = r"^[a-z]+://."


REPLICA_KV_FIELDS = ("kv_events", "kv_replay", "kv_dp")
"""A ``replicas:`` entry's KV-event fields: the labels a ``--replica`` flag carries them in."""


class ReplicaEntry(Section):
    """One item of ``replicas:``."""

    name: str = Field(description="in cluster mode, the replica's Envoy cluster")
    address: str = Field(description="HOST:PORT of its OpenAI server (and /metrics)")
    weight: float = option(1.0, "share of the ring, e.g. 2 for twice the GPUs", gt=0)
    labels: dict[str, str] = option({}, "labels pools and classes select on")
    kv_events: str | None = option(
        None, "its engines' KV-event publisher (vLLM --kv-events-config endpoint, tcp://HOST:PORT)", pattern=_ENDPOINT
    )
    kv_replay: str | None = option(None, "its engines' replay endpoint (replay_endpoint)", pattern=_ENDPOINT)
    kv_dp: int | None = option(
        None, "engines behind it (--data-parallel-size; default kv_events.data_parallel_size)", ge=1
    )

    @field_validator("address")
    @classmethod
    def _host_port(cls, address: str) -> str:
        check_address(address)
        return address

    @model_validator(mode="after")
    def _kv_labels(self) -> ReplicaEntry:
        for key in REPLICA_KV_FIELDS:
            value = getattr(self, key)
            if value is not None and key in self.labels and self.labels[key] != str(value):
                raise field_error(ReplicaEntry, key, f"{value!r}, but labels.{key} says {self.labels[key]!r}", value)
        if self.kv_replay is not None and self.kv_events is None and "kv_events" not in self.labels:
            raise field_error(ReplicaEntry, "kv_replay", "needs kv_events (the publisher it replays)", self.kv_replay)
        return self

    def replica(self) -> Replica:
        """The replica, with its KV-event fields as the labels the subscriptions read."""
        labels = dict(self.labels)
        labels.update({key: str(getattr(self, key)) for key in REPLICA_KV_FIELDS if getattr(self, key) is not None})
        return Replica(self.name, self.address, self.weight, labels)


def check_address(address: str) -> None:
    """``HOST:PORT``, or ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")


def replica_entry(replica: Replica) -> dict[str, Any]:
    """A replica as its ``replicas:`` entry spells it (its KV-event fields among its labels)."""
    return {"name": replica.name, "address": replica.address, "weight": replica.weight, "labels": dict(replica.labels)}


ReplicaItem = Annotated[Replica, held_as(ReplicaEntry, Replica, ReplicaEntry.replica, replica_entry)]


def parse_replica(spec: str) -> Replica:
    """``NAME=HOST:PORT[,LABEL=VALUE...]`` (or just ``HOST:PORT``, named after its address)."""
    head, *label_specs = spec.split(",")
    name, sep, address = head.partition("=")
    if not sep:
        name, address = head.replace(":", "_").replace(".", "-"), head
    try:
        check_address(address)
    except ValueError as exc:
        raise ConfigError(f"replica {spec!r}: {exc}") from None
    labels = {}
    for item in label_specs:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"replica {spec!r}: labels are LABEL=VALUE, got {item!r}")
        labels[key.strip()] = value.strip()
    return Replica(name=name.strip(), address=address.strip(), labels=labels)
