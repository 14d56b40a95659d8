"""KV-event feeds: sequence tracking, replay, restarts, staleness; and the ZMQ transport against
the fake replica's publisher (ipc:// and tcp://127.0.0.1, both layouts)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import zmq

from extproc.fleet.kvevents.feed import KvEventSource
from extproc.fleet.kvevents.feed_state import ReplayError
from extproc.fleet.kvevents.subscriber import Subscriptions, ZmqReplayer
from extproc.fleet.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, Message, encode_batch, seq_frame
from extproc.observe.metrics.kv_events import KvEventMetrics
from extproc_lab.replica.kv_publisher import KvEventPublisher
from tests.helpers import Clock, metric_value, wait_for


def stored(*hashes: int) -> BlockStored:
    return BlockStored(tuple(hashes), None, list(range(4 * len(hashes))), 4)


def msg(seq: int, *events, topic: str = "kv@a@m", encoding: str = "map") -> Message:
    return Message(topic, seq, encode_batch(1.0, events, 0, encoding))


class FakeReplayer:
    """Answers replays from a list of messages it was given; records the starts asked for."""

    def __init__(self, messages: Sequence[Message] = (), fail: bool = False) -> None:
        self.messages = list(messages)
        self.fail = fail
        self.asked: list[int] = []

    async def __call__(self, start: int) -> Sequence[Message]:
        self.asked.append(start)
        if self.fail:
            raise ReplayError("down")
        return [m for m in self.messages if m.seq >= start]


def matches(source: KvEventSource, *keys: int) -> dict[str, float]:
    return source.matches("m", list(keys), ["a", "b"], 0.0)


async def test_in_order_messages_apply_and_make_the_feed_live() -> None:
    source = KvEventSource(metrics=KvEventMetrics())
    source.add_feed("a")
    assert not source.is_live("a", 0.0)
    await source.receive(msg(0, stored(1, 2)))
    await source.receive(msg(1, stored(3)))
    assert source.is_live("a", 0.0)
    assert matches(source, 1, 2) == {"a": 2.0}


async def test_a_gap_is_filled_by_replay() -> None:
    history = [msg(0, stored(1)), msg(1, stored(2)), msg(2, BlockRemoved((1,))), msg(3, stored(9))]
    replayer = FakeReplayer(history)
    source = KvEventSource(metrics=KvEventMetrics())
    source.add_feed("a", replayer)
    await source.receive(history[0])
    await source.receive(history[3])  # 1 and 2 were lost
    assert replayer.asked == [1]
    assert matches(source, 1) == {} and source.index.model("m").blocks("a") == 2  # 2 and 9; 1 removed
    assert metric_value(source.metrics.gaps.labels("a")) == 1
    assert metric_value(source.metrics.replays.labels("a", "ok")) == 1


@pytest.mark.parametrize("replayer", [None, FakeReplayer(fail=True), FakeReplayer([msg(2, stored(5))])])
async def test_a_gap_that_cannot_be_filled_clears_the_replica(replayer) -> None:
    source = KvEventSource(metrics=KvEventMetrics())
    source.add_feed("a", replayer)
    await source.receive(msg(0, stored(1, 2)))
    await source.receive(msg(3, stored(7)))  # seq 1 and 2 lost; the replay (if any) lacks seq 1
    assert matches(source, 1) == {}
    assert matches(source, 7) == {"a": 1.0}
    assert metric_value(source.metrics.clears.labels("a", "gap")) == 1


async def test_sequence_going_back_is_a_restart() -> None:
    source = KvEventSource(metrics=KvEventMetrics())
    await source.receive(msg(0, stored(1)))
    await source.receive(msg(1, stored(2)))
    await source.receive(msg(0, stored(5)))  # a new engine process
    assert source.index.model("m").blocks("a") == 1 and matches(source, 5) == {"a": 1.0}
    assert metric_value(source.metrics.restarts.labels("a")) == 1


async def test_undecodable_payload_counts_and_shows_as_a_gap() -> None:
    source = KvEventSource(metrics=KvEventMetrics())
    await source.receive(msg(0, stored(1)))
    await source.receive(Message("kv@a@m", 1, b"\xc1garbage"))
    assert source.feeds["a"].last_seq == 0
    await source.receive(msg(2, stored(2)))  # no replayer: the lost batch clears the replica
    assert metric_value(source.metrics.dropped.labels("a")) == 1
    assert matches(source, 1) == {} and matches(source, 2) == {"a": 1.0}


async def test_catch_up_replays_from_zero_and_skips_duplicates() -> None:
    history = [msg(0, stored(1)), msg(1, stored(2)), msg(2, AllBlocksCleared()), msg(3, stored(1))]
    source = KvEventSource(metrics=KvEventMetrics())
    source.add_feed("a", FakeReplayer(history))
    assert await source.catch_up("a")
    assert source.is_live("a", 0.0) and matches(source, 1, 2) == {"a": 1.0}
    await source.receive(history[3])  # queued in the socket during the replay
    assert metric_value(source.metrics.restarts.labels("a")) == 0
    await source.receive(msg(4, stored(2), topic="kv@a@m"))
    assert matches(source, 1, 2) == {"a": 2.0}


async def test_silent_feed_of_a_serving_replica_goes_stale() -> None:
    clock = Clock()
    source = KvEventSource(clock=clock, metrics=KvEventMetrics(), stale_after_s=5.0)
    await source.receive(msg(0, stored(1)))
    source.note_routed("a", clock.now)
    clock.now += 4.0
    assert source.is_live("a", clock.now)
    clock.now += 2.0
    assert not source.is_live("a", clock.now)
    await source.receive(msg(1, stored(2)))
    assert source.is_live("a", clock.now)


async def test_topic_without_replica_is_dropped_when_no_replica_given() -> None:
    source = KvEventSource(metrics=KvEventMetrics())
    await source.receive(Message("other", 0, encode_batch(1.0, [stored(1)])))
    assert source.feeds == {}


# -- over ZMQ ----------------------------------------------------------------------------------


async def subscribed(publisher: KvEventPublisher | Callable[[], object], seen: Callable[[], bool]) -> None:
    """Send probes (a publisher's empty batches, or what a callable sends) until ``seen()``: a SUB
    socket misses what is sent before its subscription reaches the publisher (ZMQ's slow joiner),
    and no fixed pause is sure to cover that."""
    send = (lambda: publisher.publish([])) if isinstance(publisher, KvEventPublisher) else publisher

    def probe() -> bool:
        if seen():
            return True
        send()
        return False

    await wait_for(probe, "a subscribed socket", step_s=0.05)


def applied_since(source: KvEventSource, replica: str, seq: int) -> Callable[[], bool]:
    """Predicate: ``replica``'s feed has applied batch ``seq`` or a later one."""

    def check() -> bool:
        feed = source.feeds.get(replica)
        last = None if feed is None else feed.last_seq
        return last is not None and last >= seq

    return check


@pytest.fixture
def ipc_dir():
    with tempfile.TemporaryDirectory(prefix="kv-") as d:
        yield Path(d)


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_connect_layout_over_ipc_with_replay_of_a_lost_message(ipc_dir: Path, encoding: str) -> None:
    pub_ep, replay_ep = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay"
    publisher = KvEventPublisher(pub_ep, replay_ep, topic="kv@replica-0@m", encoding=encoding)
    publisher.start()
    publisher.publish([stored(1)])  # before the router starts: found again by the catch-up replay
    source = KvEventSource(metrics=KvEventMetrics())
    subs = Subscriptions(source)
    try:
        subs.follow("replica-0", pub_ep, replay_ep)
        await wait_for(lambda: source.is_live("replica-0", 0.0))
        assert source.matches("m", [1], ["replica-0"], 0.0) == {"replica-0": 1.0}
        await subscribed(publisher, applied_since(source, "replica-0", publisher.seq))
        gaps = metric_value(source.metrics.gaps.labels("replica-0"))  # probes sent too early leave gaps
        publisher.drop_next = 1
        publisher.publish([stored(2)])  # lost
        publisher.publish([stored(3)])
        await wait_for(lambda: source.index.model("m").blocks("replica-0") == 3)
        assert metric_value(source.metrics.gaps.labels("replica-0")) == gaps + 1
        publisher.publish([BlockRemoved((1,))])
        await wait_for(lambda: source.matches("m", [1], ["replica-0"], 0.0) == {})
    finally:
        await subs.close()
        await publisher.close()


async def test_listen_layout_over_tcp_names_replicas_by_topic() -> None:
    ctx = zmq.Context()
    probe = ctx.socket(zmq.SUB)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(0)
    ctx.term()
    endpoint = f"tcp://127.0.0.1:{port}"
    source = KvEventSource(metrics=KvEventMetrics())
    subs = Subscriptions(source)
    names = {"replica-0": "replica-0", "10.0.0.2:8000": "replica-1", "probe": "probe"}
    subs.listen(endpoint, names.get)
    publishers = [
        KvEventPublisher(endpoint, topic="kv@replica-0@m"),
        KvEventPublisher(endpoint, topic="kv@10.0.0.2:8000@m", encoding="array"),
        KvEventPublisher(endpoint, topic="kv@stranger@m"),
    ]
    try:
        await subscribed(publishers[0], applied_since(source, "replica-0", 0))
        await subscribed(publishers[1], applied_since(source, "replica-1", 0))
        # The stranger's connection is probed under a known name: its own messages count as unknown.
        probe = [b"kv@probe@m", seq_frame(0), encode_batch(1.0, [])]
        await subscribed(lambda: publishers[2].pub.send_multipart(probe), lambda: "probe" in source.feeds)
        for i, p in enumerate(publishers):
            p.publish([stored(10 + i)])
        unknown = source.metrics.dropped.labels("unknown")
        await wait_for(
            lambda: (
                source.matches("m", [10], ["replica-0"], 0.0) != {}
                and source.matches("m", [11], ["replica-1"], 0.0) != {}
                and metric_value(unknown) > 0
            )
        )
        assert set(source.feeds) == {"replica-0", "replica-1", "probe"}
        assert source.matches("m", [10], ["replica-0", "replica-1"], 0.0) == {"replica-0": 1.0}
        assert source.matches("m", [11], ["replica-0", "replica-1"], 0.0) == {"replica-1": 1.0}
        assert metric_value(unknown) == 1
    finally:
        for p in publishers:
            await p.close()
        await subs.close()


async def test_replayer_times_out_on_a_silent_endpoint(ipc_dir: Path) -> None:
    subs = Subscriptions(KvEventSource(metrics=KvEventMetrics()))
    try:
        with pytest.raises(ReplayError):
            await ZmqReplayer(subs.ctx, f"ipc://{ipc_dir}/nobody", timeout_s=0.2)(0)
    finally:
        await subs.close()


async def test_garbage_frames_never_stop_the_subscriber(ipc_dir: Path) -> None:
    pub_ep = f"ipc://{ipc_dir}/pub"
    publisher = KvEventPublisher(pub_ep, topic="kv@a@m")
    source = KvEventSource(metrics=KvEventMetrics())
    subs = Subscriptions(source)
    try:
        subs.follow("a", pub_ep)
        await subscribed(publisher, applied_since(source, "a", 0))
        publisher.pub.send_multipart([b"kv@a@m", b"short", b"x"])
        publisher.pub.send_multipart([b"one frame"])
        publisher.publish([stored(4)])
        await wait_for(lambda: source.matches("m", [4], ["a"], 0.0) == {"a": 1.0})
        assert metric_value(source.metrics.dropped.labels("a")) == 2
    finally:
        await subs.close()
        await publisher.close()


async def test_reconnect_to_the_same_engine_fills_what_was_missed() -> None:
    history = [msg(0, stored(1)), msg(1, stored(2)), msg(2, stored(3))]
    replayer = FakeReplayer(history)
    source = KvEventSource(metrics=KvEventMetrics())
    source.add_feed("a", replayer)
    await source.receive(history[0])
    await source.receive(history[1])
    await source.reconnected("a")  # seq 2 was sent while we were disconnected
    assert replayer.asked == [1] and source.feeds["a"].last_seq == 2
    assert matches(source, 1, 2, 3) == {"a": 3.0}
    assert metric_value(source.metrics.restarts.labels("a")) == 0


async def test_reconnect_to_a_new_engine_is_a_restart_and_catches_up() -> None:
    replayer = FakeReplayer([msg(0, stored(1)), msg(1, stored(2))])
    source = KvEventSource(metrics=KvEventMetrics())
    source.add_feed("a", replayer)
    await source.receive(replayer.messages[0])
    await source.receive(replayer.messages[1])
    replayer.messages = [msg(0, stored(7))]  # a new process: its own seq 0, never received live
    await source.reconnected("a")
    assert metric_value(source.metrics.restarts.labels("a")) == 1
    assert matches(source, 1) == {} and matches(source, 7) == {"a": 1.0}
    await source.receive(replayer.messages[0])  # queued live copy: a duplicate, not a restart
    await source.receive(msg(1, stored(8)))
    assert metric_value(source.metrics.restarts.labels("a")) == 1 and source.feeds["a"].last_seq == 1


async def test_restart_after_a_catch_up_is_not_taken_for_duplicates() -> None:
    replayer = FakeReplayer([msg(i, stored(i + 1)) for i in range(5)])
    source = KvEventSource(metrics=KvEventMetrics())
    source.add_feed("a", replayer)
    assert await source.catch_up("a")
    await source.receive(msg(5, stored(9)))  # live, after the replay
    await source.receive(msg(0, stored(20)))  # a new engine, seq 0 again
    assert metric_value(source.metrics.restarts.labels("a")) == 1
    assert matches(source, 20) == {"a": 1.0} and matches(source, 1) == {}


async def test_a_new_engine_seq_the_replay_covered_is_a_restart_not_a_duplicate() -> None:
    # The router caught up on the old engine's only batch (seq 0); the new engine's first batch is
    # seq 0 again, arriving live before any other: the same seq, another payload.
    source = KvEventSource(metrics=KvEventMetrics())
    source.add_feed("a", FakeReplayer([msg(0, stored(1))]))
    assert await source.catch_up("a")
    await source.receive(msg(0, stored(1)))  # the replayed batch itself, queued live: a duplicate
    assert metric_value(source.metrics.restarts.labels("a")) == 0
    await source.receive(msg(0, stored(20)))
    assert metric_value(source.metrics.restarts.labels("a")) == 1
    assert matches(source, 20) == {"a": 1.0} and matches(source, 1) == {}


# -- data-parallel ranks -----------------------------------------------------------------------


def ranked(seq: int, rank: int, *events) -> Message:
    """A batch of rank ``rank``'s engine: each rank numbers its own batches from 0."""
    return Message("kv@a@m", seq, encode_batch(1.0, events, rank))


async def test_ranks_interleave_on_one_topic_without_gaps_or_restarts() -> None:
    source = KvEventSource(metrics=KvEventMetrics())
    for seq in range(3):  # both engines of one server, connected to one listen endpoint
        await source.receive(ranked(seq, 0, stored(10 + seq)))
        await source.receive(ranked(seq, 1, stored(20 + seq)))
    m = source.metrics
    assert metric_value(m.gaps.labels("a")) == 0 and metric_value(m.restarts.labels("a")) == 0
    assert source.index.model("m").ranks("a") == [0, 1]
    assert source.index.model("m").blocks("a") == 6 and source.index.model("m").blocks("a", 1) == 3
    assert matches(source, 20) == {"a": 1} and matches(source, 12) == {"a": 1}


async def test_a_replica_matches_its_best_rank() -> None:
    source = KvEventSource(metrics=KvEventMetrics())
    await source.receive(ranked(0, 0, stored(1, 2)))
    await source.receive(ranked(0, 1, stored(1, 2, 3)))
    assert matches(source, 1, 2, 3, 4) == {"a": 3}


async def test_one_ranks_removal_clear_or_restart_leaves_anothers_copy() -> None:
    source = KvEventSource(metrics=KvEventMetrics())
    await source.receive(ranked(0, 0, stored(1, 2)))
    await source.receive(ranked(0, 1, stored(1, 2)))
    await source.receive(ranked(1, 1, BlockRemoved((1, 2))))
    assert matches(source, 1, 2) == {"a": 2}  # rank 0 still holds them
    await source.receive(ranked(2, 1, stored(5, 6)))
    await source.receive(ranked(3, 1, AllBlocksCleared()))
    assert matches(source, 5, 6) == {} and matches(source, 1, 2) == {"a": 2}
    await source.receive(ranked(4, 1, stored(7)))
    await source.receive(ranked(0, 1, stored(8)))  # rank 1's engine restarted
    assert metric_value(source.metrics.restarts.labels("a")) == 1
    assert matches(source, 7) == {} and matches(source, 8) == {"a": 1} and matches(source, 1, 2) == {"a": 2}
    await source.receive(ranked(1, 0, BlockRemoved((2,))))
    assert matches(source, 1, 2) == {"a": 1}  # now no rank holds block 2


async def test_a_gap_on_one_rank_clears_only_that_rank() -> None:
    source = KvEventSource(metrics=KvEventMetrics())  # no replayer: a lost batch cannot be had back
    await source.receive(ranked(0, 0, stored(1)))
    await source.receive(ranked(0, 1, stored(2)))
    await source.receive(ranked(2, 1, stored(3)))  # rank 1 lost its seq 1
    assert metric_value(source.metrics.gaps.labels("a")) == 1
    assert matches(source, 1) == {"a": 1} and matches(source, 2) == {} and matches(source, 3) == {"a": 1}


def test_each_rank_publishes_on_its_own_endpoint_as_vllm_offsets_them() -> None:
    from extproc.fleet.kvevents.endpoints import rank_endpoints
    from extproc.fleet.kvevents.settings import KvEventSettings
    from extproc.routing.model import Replica

    labels = {"kv_events": "tcp://10.0.0.1:5557", "kv_replay": "tcp://10.0.0.1:5558", "kv_dp": "3"}
    assert rank_endpoints(Replica("a", "10.0.0.1:8000", labels=labels), KvEventSettings()) == [
        ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        ("tcp://10.0.0.1:5558", "tcp://10.0.0.1:5559"),
        ("tcp://10.0.0.1:5559", "tcp://10.0.0.1:5560"),
    ]
    discovered = Replica("b", "10.0.0.2:8000")
    assert rank_endpoints(discovered, KvEventSettings(port=5557, data_parallel_size=2)) == [
        ("tcp://10.0.0.2:5557", None),
        ("tcp://10.0.0.2:5558", None),
    ]
    ipc = Replica("c", "127.0.0.1:8000", labels={"kv_events": "ipc:///tmp/x", "kv_dp": "2"})
    assert rank_endpoints(ipc, KvEventSettings()) == [("ipc:///tmp/x", None), ("ipc:///tmp/x_dp1", None)]
    assert rank_endpoints(Replica("d", "127.0.0.1:8000"), KvEventSettings(data_parallel_size=2)) == []


async def test_connect_layout_reads_every_rank_with_its_own_replay(ipc_dir: Path) -> None:
    from extproc.fleet.kvevents.endpoints import rank_endpoints
    from extproc.fleet.kvevents.settings import KvEventSettings
    from extproc.routing.model import Replica

    labels = {"kv_events": f"ipc://{ipc_dir}/pub", "kv_replay": f"ipc://{ipc_dir}/replay", "kv_dp": "2"}
    ranks = rank_endpoints(Replica("a", "127.0.0.1:8000", labels=labels), KvEventSettings())
    publishers = [
        KvEventPublisher(pub, replay, "kv@a@m", data_parallel_rank=r) for r, (pub, replay) in enumerate(ranks)
    ]
    for p in publishers:
        p.start()
    publishers[0].publish([stored(1, 2)])  # before the router starts: each rank's catch-up finds them
    publishers[1].publish([stored(1, 2, 3)])
    source = KvEventSource(metrics=KvEventMetrics())
    subs = Subscriptions(source)
    try:
        for rank, (pub, replay) in enumerate(ranks):
            subs.follow("a", pub, replay, rank=rank)
        await wait_for(lambda: matches(source, 1, 2, 3) == {"a": 3})
        publishers[1].drop_next = 1  # rank 1 loses a batch: its own replay socket answers
        publishers[1].publish([BlockRemoved((3,))])
        publishers[1].publish([stored(9)])
        publishers[0].publish([stored(7)])
        await wait_for(lambda: matches(source, 9) == {"a": 1} and matches(source, 7) == {"a": 1})
        assert matches(source, 1, 2, 3) == {"a": 2}  # rank 1 removed block 3; rank 0 never held it
        assert metric_value(source.metrics.gaps.labels("a")) == 1
        assert metric_value(source.metrics.restarts.labels("a")) == 0
        assert metric_value(source.metrics.clears.labels("a", "gap")) == 0
        subs.unfollow("a", 1)  # the server now runs one engine: rank 1's entries go, rank 0's stay
        assert matches(source, 9) == {} and matches(source, 1, 2) == {"a": 2}
    finally:
        for p in publishers:
            await p.close()
        await subs.close()
