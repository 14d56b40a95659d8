"""Decoding vLLM's KV-event batches, in both encodings vLLM has used.

A message is three frames: topic, an 8-byte big-endian sequence number, and a msgpack payload
``[ts, events, data_parallel_rank]``. Events are tagged arrays in earlier releases
(``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium, ...]``) and tagged
maps in vLLM 0.33 (``{"type": "BlockStored", ...}``, default-valued fields omitted). Fields we do
not know, or that later releases appended, are ignored; optional ones may be missing. Anything
that does not decode raises :class:`WireError` (a whole batch) or is counted in
``EventBatch.dropped`` (one event), never anything else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from extproc.fleet.kvevents.hashing import event_hash

MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
MAX_ITEMS = 4 * 1024 * 1024
"""Bounds on what one payload may claim (msgpack allocates what a header announces)."""


class WireError(ValueError):
    """A frame or payload that is not a vLLM KV-event message."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks now cached on a tier: their hashes (int form), the first one's parent, their tokens."""

    block_hashes: tuple[int, ...]
    parent: int | None
    token_ids: Sequence[int]
    block_size: int
    medium: str = "GPU"
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from a tier."""

    block_hashes: tuple[int, ...]
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine's prefix cache was reset."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One decoded payload."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    dropped: int = 0
    """Events in the batch that did not decode (unknown tags, wrong types)."""


@dataclass(frozen=True, slots=True)
class Message:
    """One ZMQ message: who published it, its sequence number, and the undecoded payload."""

    topic: str
    seq: int
    payload: bytes


def split_message(frames: Sequence[bytes]) -> Message:
    """The three frames of a published message; :class:`WireError` for anything else."""
    if len(frames) != 3:
        raise WireError(f"{len(frames)} frames, expected 3")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise WireError(f"sequence frame of {len(seq)} bytes, expected 8")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(f"payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    return Message(bytes(topic).decode("utf-8", "replace"), int.from_bytes(seq, "big", signed=True), bytes(payload))


def _hashes(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list | tuple):
        return None
    out: list[int] = []
    append = out.append
    for v in value:
        if type(v) is int and v >= 0:  # the common case, kept cheap: 200,000 blocks/s is the aim
            append(v & 0xFFFFFFFFFFFFFFFF)
        else:
            h = event_hash(v)
            if h is None:
                return None
            append(h)
    return tuple(out)


def _token_ids(value: Any) -> Sequence[int] | None:
    # Only the content-hash mode reads token ids; it checks their values where it uses them, so
    # the engine-hash path does not pay a check per token.
    return value if isinstance(value, list | tuple) else None


def _medium(value: Any) -> str | None:
    if value is None:
        return "GPU"  # releases before tiers: everything is on the GPU
    return value if isinstance(value, str) else None


def _stored(hashes: Any, parent: Any, tokens: Any, block_size: Any, medium: Any, lora_name: Any) -> BlockStored | None:
    block_hashes = _hashes(hashes)
    token_ids = _token_ids(tokens)
    tier = _medium(medium)
    if block_hashes is None or token_ids is None or tier is None:
        return None
    if type(block_size) is not int or not 0 < block_size <= 1 << 16:
        return None
    parent_hash = None if parent is None else event_hash(parent)
    if parent is not None and parent_hash is None:
        return None
    lora = lora_name if isinstance(lora_name, str) and lora_name else None
    return BlockStored(block_hashes, parent_hash, token_ids, block_size, tier, lora)


def _from_array(ev: list[Any]) -> Event | None:
    tag = ev[0] if ev else None
    n = len(ev)
    if tag == "BlockStored" and n >= 5:
        # [tag, hashes, parent, tokens, block_size, lora_id, medium, lora_name, ...]
        return _stored(ev[1], ev[2], ev[3], ev[4], ev[6] if n > 6 else None, ev[7] if n > 7 else None)
    if tag == "BlockRemoved" and n >= 2:
        hashes = _hashes(ev[1])
        medium = _medium(ev[2] if n > 2 else None)
        return None if hashes is None or medium is None else BlockRemoved(hashes, medium)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _from_map(ev: Mapping[Any, Any]) -> Event | None:
    tag = ev.get("type")
    get = ev.get
    if tag == "BlockStored":
        return _stored(
            get("block_hashes"), get("parent_block_hash"), get("token_ids"), get("block_size"), get("medium"),
            get("lora_name"),
        )  # fmt: skip
    if tag == "BlockRemoved":
        hashes = _hashes(get("block_hashes"))
        medium = _medium(get("medium"))
        return None if hashes is None or medium is None else BlockRemoved(hashes, medium)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload; :class:`WireError` when it is not a batch at all."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(f"payload of {len(payload)} bytes is over {MAX_PAYLOAD_BYTES}")
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=False,
            max_array_len=MAX_ITEMS,
            max_map_len=MAX_ITEMS,
            max_str_len=1 << 20,
            max_bin_len=1 << 20,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several types, ValueError and its own among them
        raise WireError(f"payload does not decode: {type(exc).__name__}") from None
    if isinstance(obj, dict):
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, list) or len(obj) < 2:
        raise WireError("payload is not a [ts, events, data_parallel_rank] array")
    ts, raw_events = obj[0], obj[1]
    rank = obj[2] if len(obj) > 2 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not isinstance(raw_events, list):
        raise WireError("batch has no timestamp or no event list")
    events: list[Event] = []
    dropped = 0
    for raw in raw_events:
        ev: Event | None = None
        try:
            if isinstance(raw, list):
                ev = _from_array(raw)
            elif isinstance(raw, dict):
                ev = _from_map(raw)
        except (TypeError, ValueError):
            ev = None
        if ev is None:
            dropped += 1
        else:
            events.append(ev)
    return EventBatch(float(ts), tuple(events), rank if type(rank) is int else None, dropped)


def _event_obj(ev: Event, encoding: str) -> Any:
    if isinstance(ev, BlockStored):
        parent = ev.parent
        if encoding == "array":
            return ["BlockStored", list(ev.block_hashes), parent, list(ev.token_ids), ev.block_size, None, ev.medium,
                    ev.lora_name]  # fmt: skip
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": parent,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": None,
            "medium": ev.medium,
        }
        if ev.lora_name is not None:
            out["lora_name"] = ev.lora_name
        return out
    if isinstance(ev, BlockRemoved):
        if encoding == "array":
            return ["BlockRemoved", list(ev.block_hashes), ev.medium]
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium}
    return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[Event], data_parallel_rank: int = 0, encoding: str = "map") -> bytes:
    """A payload as vLLM publishes it: ``map`` as in 0.33 (default-valued optional fields omitted),
    ``array`` as earlier releases. Hashes go out in their int form."""
    if encoding not in ("map", "array"):
        raise ValueError(f"unknown event encoding {encoding!r}")
    body = [ts, [_event_obj(ev, encoding) for ev in events], data_parallel_rank]
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def seq_frame(seq: int) -> bytes:
    """The sequence frame: 8 bytes, big-endian, signed (the replay's end marker is -1)."""
    return seq.to_bytes(8, "big", signed=True)
