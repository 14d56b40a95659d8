"""KV events: vLLM's block hashes, the event decoder and the prefix index."""

from __future__ import annotations

import hashlib
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.fleet.kvevents.hashing import (
    DEFAULT_SEED,
    EngineChain,
    HashAlgo,
    content_chain,
    event_hash,
    low64,
    none_hash,
)
from extproc.fleet.kvevents.index import ModelIndex
from extproc.fleet.kvevents.tiers import OFFLOAD_WEIGHT
from extproc.fleet.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_batch,
    encode_batch,
    split_message,
)

# -- hashing: vectors built byte by byte from the formats' specifications, not by pickle/cbor2 ----


def _pickle_str(s: str) -> bytes:
    """pickle.dumps(s, protocol=5) of a short str: PROTO 5, one FRAME, SHORT_BINUNICODE, MEMOIZE, STOP."""
    data = s.encode()
    body = b"\x8c" + bytes([len(data)]) + data + b"\x94."
    return b"\x80\x05\x95" + struct.pack("<Q", len(body)) + body


def _pickle_block(parent: bytes, tokens: list[int]) -> bytes:
    """pickle.dumps((parent, tuple(tokens), None), protocol=5) for 32-byte parent, > 3 tokens < 256."""
    body = b"C" + bytes([len(parent)]) + parent + b"\x94"  # SHORT_BINBYTES, MEMOIZE
    body += b"(" + b"".join(b"K" + bytes([t]) for t in tokens) + b"t\x94"  # MARK, BININT1..., TUPLE, MEMOIZE
    body += b"N\x87\x94."  # None, TUPLE3, MEMOIZE, STOP
    return b"\x80\x05\x95" + struct.pack("<Q", len(body)) + body


def _cbor_str(s: str) -> bytes:
    data = s.encode()
    assert len(data) < 24
    return bytes([0x60 + len(data)]) + data


def _cbor_block(parent: bytes, tokens: list[int]) -> bytes:
    """Canonical CBOR of [parent, [tokens], null] for a 32-byte parent, 4 tokens < 256."""
    items = b"".join(bytes([t]) if t < 24 else b"\x18" + bytes([t]) for t in tokens)
    return b"\x83" + b"\x58\x20" + parent + bytes([0x80 + len(tokens)]) + items + b"\xf6"


TOKENS = [1, 2, 3, 200, 7, 8, 30, 100, 9]  # two full blocks of 4, one partial token


@pytest.mark.parametrize(
    ("algo", "encode_seed", "encode_block"),
    [(HashAlgo.SHA256, _pickle_str, _pickle_block), (HashAlgo.SHA256_CBOR, _cbor_str, _cbor_block)],
)
def test_engine_chain_matches_hand_built_vectors(algo, encode_seed, encode_block) -> None:
    root = hashlib.sha256(encode_seed(DEFAULT_SEED)).digest()
    first = hashlib.sha256(encode_block(root, TOKENS[0:4])).digest()
    second = hashlib.sha256(encode_block(first, TOKENS[4:8])).digest()
    chain = EngineChain(algo)
    assert chain.root == root == none_hash(algo)
    assert chain.digests(TOKENS, 4) == [first, second]  # the partial block is not hashed
    assert chain.hashes(TOKENS, 4) == [int.from_bytes(first[-8:], "big"), int.from_bytes(second[-8:], "big")]
    # PYTHONHASHSEED replaces the fixed seed.
    assert EngineChain(algo, "0").root == hashlib.sha256(encode_seed("0")).digest()


def test_int_and_bytes_forms_agree() -> None:
    digest = hashlib.sha256(b"x").digest()
    as_int = int.from_bytes(digest, "big") & (2**64 - 1)
    assert low64(digest) == as_int == event_hash(digest) == event_hash(as_int)
    assert event_hash(-1) is None and event_hash(True) is None and event_hash("ab") is None


def test_extra_keys_and_parent_continue_the_chain() -> None:
    chain = EngineChain(HashAlgo.SHA256)
    whole = chain.digests(TOKENS, 4)
    assert chain.digests(TOKENS[4:], 4, parent=whole[0]) == whole[1:2]
    assert chain.digests(TOKENS, 4, extra_keys=("sql-lora",)) != whole


def test_content_chain_depends_on_every_earlier_block() -> None:
    a = content_chain(TOKENS, 4)
    b = content_chain([0, *TOKENS[1:]], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]
    assert content_chain(TOKENS[4:], 4, parent=a[0]) == a[1:]
    assert content_chain(TOKENS, 4, extra="lora") != a


# -- the decoder -------------------------------------------------------------------------------


def _stored(hashes, parent=None, block_size=4, medium="GPU"):
    return BlockStored(tuple(hashes), parent, list(range(len(hashes) * block_size)), block_size, medium)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_round_trip_both_encodings(encoding: str) -> None:
    events = [_stored([1, 2]), BlockRemoved((2,), "CPU"), AllBlocksCleared()]
    batch = decode_batch(encode_batch(12.5, events, 1, encoding))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 1 and batch.dropped == 0
    assert list(batch.events) == events


def test_unknown_fields_extra_positions_and_missing_optionals() -> None:
    digest = hashlib.sha256(b"d").digest()
    payload = msgpack.packb(
        [
            1.0,
            [
                # vLLM 0.33 map with optional fields and one nobody knows yet
                {"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": None, "token_ids": [1, 2],
                 "block_size": 2, "medium": "CPU", "extra_keys": [None], "group_idx": 0, "future_field": {"a": 1}},
                # an old array without medium or lora fields, and one with fields appended later
                ["BlockStored", [5], 4, [1, 2], 2],
                ["BlockRemoved", [5], "GPU", 0, "extra", "more"],
                ["AllBlocksCleared", "trailing"],
                {"type": "BlockRemoved", "block_hashes": [5]},
            ],
        ],
        use_bin_type=True,
    )  # fmt: skip
    batch = decode_batch(payload)
    assert batch.dropped == 0 and batch.data_parallel_rank is None
    first, second, third, fourth, fifth = batch.events
    assert first == BlockStored((low64(digest),), None, [1, 2], 2, "CPU")
    assert second == BlockStored((5,), 4, [1, 2], 2, "GPU")
    assert third == BlockRemoved((5,), "GPU") == fifth
    assert fourth == AllBlocksCleared()


def test_bad_events_are_counted_and_the_rest_kept() -> None:
    payload = msgpack.packb(
        [0, [["Nope"], {"type": "BlockStored"}, ["BlockStored", "x", None, [1], 1], 7,
             ["BlockStored", [1], None, [-1], 1], ["BlockStored", [1], None, [1], 0], ["AllBlocksCleared"]]]
    )  # fmt: skip
    batch = decode_batch(payload)
    # A negative token id passes the decoder (only the content-hash mode reads token ids, and
    # refuses it there: see test_content_mode_refuses_token_ids_that_are_not_uint32).
    assert batch.dropped == 5 and batch.events[-1] == AllBlocksCleared() and len(batch.events) == 2


@pytest.mark.parametrize(
    "payload", [b"", b"\xc1", msgpack.packb(1), msgpack.packb([1]), msgpack.packb(["x", []]), b"\xdd\xff\xff\xff\xff"]
)
def test_garbage_payloads_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_split_message() -> None:
    msg = split_message([b"kv@r0@m", (7).to_bytes(8, "big"), b"p"])
    assert (msg.topic, msg.seq, msg.payload) == ("kv@r0@m", 7, b"p")
    for frames in ([b"a", b"b"], [b"t", b"123", b"p"]):
        with pytest.raises(WireError):
            split_message(frames)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_decoder_never_raises_anything_but_wire_error(data: bytes) -> None:
    try:
        batch = decode_batch(data)
    except WireError:
        return
    assert batch.dropped >= 0


_TAGS = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU"])
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=40),
    _TAGS,
)
_values = st.recursive(_leaf, lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=12), c, max_size=6))


@settings(max_examples=300, deadline=None)
@given(st.lists(_values, max_size=6), st.floats(allow_nan=False, allow_infinity=False))
def test_decoder_on_structured_garbage(events: list[object], ts: float) -> None:
    batch = decode_batch(msgpack.packb([ts, events, 0], use_bin_type=True))
    assert len(batch.events) + batch.dropped == len(events)


# -- the index ---------------------------------------------------------------------------------


def test_longest_prefix_per_replica_with_tiers() -> None:
    idx = ModelIndex()
    idx.apply("a", [_stored([1, 2, 3, 4])])
    idx.apply("b", [_stored([1, 2]), _stored([3], parent=2, medium="CPU")])
    idx.apply("c", [_stored([2, 3, 4])])  # no first block: holds no prefix of the request
    assert idx.matches([1, 2, 3, 4, 5], 0.0) == {"a": 4.0, "b": 2 + OFFLOAD_WEIGHT}
    assert idx.matches([9, 1], 0.0) == {}
    idx.apply("a", [BlockRemoved((3,))])
    assert idx.matches([1, 2, 3, 4], 0.0) == {"a": 2.0, "b": 2 + OFFLOAD_WEIGHT}
    idx.apply("b", [AllBlocksCleared()])
    assert idx.matches([1, 2, 3, 4], 0.0) == {"a": 2.0}
    assert idx.blocks("b") == 0 and idx.blocks("a") == 3


def test_cpu_copy_of_a_gpu_block_keeps_the_gpu_weight_until_the_gpu_copy_goes() -> None:
    idx = ModelIndex()
    idx.apply("a", [_stored([1, 2]), _stored([1, 2], medium="CPU")])
    assert idx.matches([1, 2], 0.0) == {"a": 2.0}
    idx.apply("a", [BlockRemoved((1, 2), "GPU")])
    assert idx.matches([1, 2], 0.0) == {"a": 2 * OFFLOAD_WEIGHT}


def test_content_mode_keys_by_token_ids_and_maps_removals() -> None:
    idx = ModelIndex(HashAlgo.CONTENT)
    tokens = list(range(12))
    keys = content_chain(tokens, 4)
    idx.apply("a", [BlockStored((101, 102), None, tokens[:8], 4), BlockStored((103,), 102, tokens[8:], 4)])
    assert idx.matches(keys, 0.0) == {"a": 3.0}
    idx.apply("a", [BlockRemoved((102,))])
    assert idx.matches(keys, 0.0) == {"a": 1.0}
    result = idx.apply("a", [BlockStored((200,), 999, tokens[:4], 4)])  # parent never seen
    assert result.orphans == 1


def test_content_mode_refuses_token_ids_that_are_not_uint32() -> None:
    idx = ModelIndex(HashAlgo.CONTENT)
    for tokens in ([-1, 2], [1.5, 2], ["a", "b"], [2**40, 1]):
        result = idx.apply("a", [BlockStored((7,), None, tokens, 2)])
        assert result.orphans == 1 and idx.blocks("a") == 0


def test_speculative_credit_expires_and_yields_to_removal() -> None:
    idx = ModelIndex(speculative_ttl_s=2.0)
    idx.credit("a", [1, 2, 3], now=10.0)
    assert idx.matches([1, 2, 3], 11.0) == {"a": 3.0}
    assert idx.matches([1, 2, 3], 12.5) == {}
    idx.credit("a", [1, 2, 3], now=20.0)
    idx.apply("a", [BlockRemoved((2,))])
    assert idx.matches([1, 2, 3], 20.1) == {"a": 1.0}
    idx.credit("b", [1], now=20.0)
    idx.apply("b", [AllBlocksCleared()])
    assert "b" not in idx.matches([1], 20.1)


def test_overflowing_replica_is_cleared() -> None:
    idx = ModelIndex(max_blocks_per_replica=3)
    assert not idx.apply("a", [_stored([1, 2, 3])]).overflow
    assert idx.apply("a", [_stored([4])]).overflow
    assert idx.blocks("a") == 0 and idx.matches([1], 0.0) == {}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.lists(st.integers(0, 7), max_size=5)), max_size=30))
def test_matches_equal_a_brute_force_walk(ops: list[tuple[str, bool, list[int]]]) -> None:
    idx = ModelIndex()
    held: dict[str, set[int]] = {"a": set(), "b": set(), "c": set()}
    for replica, store, hashes in ops:
        if store:
            idx.apply(replica, [_stored(hashes)])
            held[replica].update(hashes)
        else:
            idx.apply(replica, [BlockRemoved(tuple(hashes))])
            held[replica].difference_update(hashes)
    request = list(range(8))
    expected = {}
    for replica, blocks in held.items():
        n = 0
        while n < len(request) and request[n] in blocks:
            n += 1
        if n:
            expected[replica] = float(n)
    assert idx.matches(request, 0.0) == expected
    assert all(idx.blocks(r) == len(b) for r, b in held.items())
