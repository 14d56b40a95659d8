"""Cache tiers: vLLM's offloading connectors report blocks in CPU memory and on storage
(``medium`` on ``BlockStored``/``BlockRemoved``); a block evicted from the GPU while a lower tier
holds it is still held, at its tier's weight in a match and whole where the engine's own count
is predicted."""

from __future__ import annotations

from pathlib import Path

import msgpack

from extproc.fleet.kvevents.hashing import HashAlgo, content_chain
from extproc.fleet.kvevents.index import ModelIndex
from extproc.fleet.kvevents.settings import KvEventSettings
from extproc.fleet.kvevents.tiers import TierWeights, tier_of
from extproc.fleet.kvevents.wire import BlockRemoved, BlockStored, decode_batch
from extproc.request.tokenizer import PromptTokenizer
from tests.helpers import Clock, chat_request, conversation, feed, kv_router, stored_event

# -- the decoder, on payloads shaped as vLLM 0.32's publisher sends them -------------------------


def _payload(*events: object) -> bytes:
    packed: bytes = msgpack.packb([1733350000.5, list(events), 0], use_bin_type=True)
    return packed


def test_offloading_connector_events_decode_with_their_medium() -> None:
    # As vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py builds them: a chunk's
    # per-block hashes, its tokens, the CPU or STORAGE medium, and fields we do not read.
    stored_cpu = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": 10,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "locality": "LOCAL",
    }
    removed_storage = {"type": "BlockRemoved", "block_hashes": [11, 12], "medium": "STORAGE", "group_idx": 0}
    removed_gpu = {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}
    batch = decode_batch(_payload(stored_cpu, removed_storage, removed_gpu))
    assert batch.dropped == 0
    assert batch.events == (
        BlockStored((11, 12), 10, list(range(32)), 16, "CPU"),
        BlockRemoved((11, 12), "STORAGE"),
        BlockRemoved((11,), "GPU"),
    )
    # The same in the array encoding of earlier releases, with fields appended after lora_name.
    array = ["BlockStored", [11, 12], 10, list(range(32)), 16, None, "STORAGE", None, [None, None], 0]
    (event,) = decode_batch(_payload(array, ["BlockRemoved", [11], "CPU", 0])).events[:1]
    assert isinstance(event, BlockStored) and event.medium == "STORAGE"


def test_the_connectors_placeholder_store_is_dropped_and_a_missing_medium_is_the_gpu() -> None:
    # Without self-describing events the connector stores a chunk as its key alone: no tokens,
    # block size 0. There is nothing to index; its removal names the same key.
    placeholder = {
        "type": "BlockStored",
        "block_hashes": [99],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "group_idx": 0,
    }
    legacy = {"type": "BlockRemoved", "block_hashes": [5]}  # before tiers, no medium at all
    batch = decode_batch(_payload(placeholder, legacy))
    assert batch.dropped == 1 and batch.events == (BlockRemoved((5,), "GPU"),)


def test_media_map_to_three_tiers() -> None:
    assert [tier_of(m) for m in ("GPU", "gpu", "CPU", "cpu", "STORAGE", "disk", "")] == [0, 0, 1, 1, 2, 2, 2]


# -- the index ---------------------------------------------------------------------------------


def _stored(hashes: list[int], parent: int | None = None, medium: str = "GPU", block_size: int = 4) -> BlockStored:
    return BlockStored(tuple(hashes), parent, list(range(len(hashes) * block_size)), block_size, medium)


def test_a_gpu_eviction_leaves_what_a_lower_tier_holds() -> None:
    idx = ModelIndex()
    idx.apply("a", [_stored([1, 2, 3]), _stored([1, 2], medium="CPU"), _stored([3], 2, medium="STORAGE")])
    assert idx.holdings([1, 2, 3, 4], 0.0) == {"a": (3, 3.0)}
    idx.apply("a", [BlockRemoved((1, 2, 3), "GPU")])
    # Held on any tier for all three blocks; weighed 0.8 in CPU memory, 0.25 on storage.
    length, weighted = idx.holdings([1, 2, 3, 4], 0.0)["a"]
    assert length == 3 and abs(weighted - (0.8 + 0.8 + 0.25)) < 1e-9
    assert idx.matches([1, 2, 3], 0.0) == {"a": weighted}
    # A lower tier's removal drops that tier's copy only; the GPU coming back restores the weight.
    idx.apply("a", [BlockRemoved((3,), "STORAGE"), _stored([1, 2])])
    assert idx.holdings([1, 2, 3], 0.0) == {"a": (2, 2.0)}
    idx.apply("a", [BlockRemoved((1, 2), "GPU"), BlockRemoved((1, 2), "CPU")])
    assert idx.holdings([1, 2, 3], 0.0) == {} and idx.blocks("a") == 0


def test_tier_weights_are_configurable() -> None:
    idx = ModelIndex(weights=TierWeights(cpu=0.5, storage=0.0))
    idx.apply("a", [_stored([1], medium="CPU"), _stored([2], 1, medium="STORAGE")])
    assert idx.holdings([1, 2], 0.0) == {"a": (2, 0.5)}
    settings = KvEventSettings(cpu_weight=0.75, storage_weight=0.1)
    assert settings.tier_weights == TierWeights(0.75, 0.1)
    assert KvEventSettings().tier_weights == TierWeights(0.8, 0.25)


def test_content_mode_keeps_a_blocks_key_while_a_lower_tier_holds_it() -> None:
    idx = ModelIndex(HashAlgo.CONTENT)
    tokens = list(range(12))
    keys = content_chain(tokens, 4)
    idx.apply("a", [BlockStored((101, 102), None, tokens[:8], 4), BlockStored((101, 102), None, tokens[:8], 4, "CPU")])
    idx.apply("a", [BlockRemoved((101, 102), "GPU")])
    assert idx.holdings(keys, 0.0)["a"][0] == 2
    # Its child is stored under the engine hash that only CPU memory holds now: still keyed.
    result = idx.apply("a", [BlockStored((103,), 102, tokens[8:], 4)])
    assert result.orphans == 0 and idx.holdings(keys, 0.0)["a"][0] == 3
    # And the CPU copy's removal still finds its key.
    idx.apply("a", [BlockRemoved((101, 102), "CPU")])
    assert idx.holdings(keys, 0.0) == {} and idx.blocks("a") == 1


# -- the router --------------------------------------------------------------------------------


async def test_a_pin_whose_blocks_moved_to_cpu_memory_holds_and_the_hit_is_predicted(tokenizer_dir: Path) -> None:
    clock = Clock(1000.0)
    # Storage weighs 0.25, under unpin_below's half: a judgement on the weighed match would unpin.
    router, kv = kv_router(tokenizer_dir, clock, speculative_ttl_s=0.0, check_sample_rate=1.0)
    tok = PromptTokenizer(tokenizer_dir)
    msgs = conversation(2, seed=31)
    ev = stored_event(tok, msgs)
    for name in ("r0", "r1", "r2"):
        await feed(kv, name, 0)
    first = await router.route(*chat_request(msgs, session="s"))
    pinned = first.decision.replica.name  # type: ignore[union-attr]
    offloaded = BlockStored(ev.block_hashes, ev.parent, ev.token_ids, ev.block_size, "STORAGE")
    await feed(kv, pinned, 1, ev, offloaded)
    await feed(kv, pinned, 2, BlockRemoved(ev.block_hashes, "GPU"))  # the GPU evicted all of it
    again = await router.route(*chat_request(msgs, session="s"))
    assert again.decision.reason.value == "sticky" and again.decision.replica.name == pinned  # type: ignore[union-attr]
    estimate = await router.store.lookup("s", again.features.prefix_hashes, clock.now, model="m")
    view = kv.view(estimate, again.features, ["r0", "r1", "r2"], clock.now)
    blocks = len(ev.block_hashes)
    assert view.pin_lost is None and view.prefix_matches[pinned] == int(0.25 * blocks)
    # The engine loads those blocks and counts them cached: the prediction counts them whole.
    predicted = kv.predicted_tokens(again.features, pinned, again.decision.matched_blocks, clock.now)
    assert predicted == blocks * again.features.tokens_per_block
    # Gone from storage too: now the pin is judged lost.
    await feed(kv, pinned, 3, BlockRemoved(ev.block_hashes, "STORAGE"))
    assert kv.view(estimate, again.features, ["r0", "r1", "r2"], clock.now).pin_lost == "kv_events"
