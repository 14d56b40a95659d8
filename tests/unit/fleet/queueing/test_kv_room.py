"""KV room: a request waits for room on its replica, and a conversation's next turn finds the
room its last turn used."""

from __future__ import annotations

import asyncio

import pytest

from extproc.fleet.queueing.kv_room import GAP_FLOOR_S, Entry, KvRoom
from extproc.fleet.queueing.room_gate import RoomGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _room(grace_s: float = 0.1, patience_s: float = 1.0) -> tuple[KvRoom, Clock]:
    clock = Clock()
    return KvRoom(clock, grace_s, patience_s), clock


def _entry(room: KvRoom, session: str | None, tokens: int, replica: str = "r0") -> Entry:
    return Entry(replica, session, tokens, room.clock())


def _full_with_a_waiter(room: KvRoom) -> tuple[Entry, Entry]:
    """r0 (4,096 tokens) holds s1's and s2's 2,000 tokens; s3's wait: s1's turn and s3's entry."""
    turn1, other, waiter = _entry(room, "s1", 2000), _entry(room, "s2", 2000), _entry(room, "s3", 2000)
    assert room.enter(turn1, 4096) and room.enter(other, 4096)
    assert not room.enter(waiter, 4096)
    return turn1, waiter


async def _go(gate: RoomGate, replica: str, session: str | None, tokens: int, capacity: int) -> Entry:
    return await gate.enter(Entry(replica, session, tokens, gate.room.clock()), capacity)


def test_a_request_waits_while_its_replica_s_kv_is_claimed_and_goes_when_room_frees() -> None:
    room, _ = _room(grace_s=0)
    a, b, c = _entry(room, None, 1500), _entry(room, None, 1500), _entry(room, None, 1500)
    assert room.enter(a, 4096) and room.enter(b, 4096)
    assert not room.enter(c, 4096)  # 4,500 tokens would not fit in 4,096
    assert room.waiting() == 1
    assert room.leave(a) == [c]
    assert c.inside and room.waiting() == 0


def test_an_idle_replica_takes_a_request_larger_than_its_kv_and_an_unknown_capacity_holds_nothing() -> None:
    room, _ = _room()
    assert room.enter(_entry(room, None, 9000), 4096)
    assert room.enter(_entry(room, None, 9000, replica="unknown"), 0)
    assert room.enter(_entry(room, None, 9000, replica="unknown"), 0)


def test_a_conversation_s_next_turn_goes_ahead_of_what_waits_into_the_room_its_turn_left() -> None:
    room, clock = _room(grace_s=0.1, patience_s=1.0)
    turn1, newcomer = _full_with_a_waiter(room)
    clock.now += 0.2
    assert room.leave(turn1) == []  # its room is kept for s1, not given to s3
    clock.now += 0.01
    turn2 = _entry(room, "s1", 2090)
    assert room.enter(turn2, 4096)  # ahead of s3, which still waits
    assert not newcomer.inside


def test_kept_room_lapses_and_goes_to_the_waiter() -> None:
    room, clock = _room(grace_s=0.1, patience_s=1.0)
    turn1, waiter = _full_with_a_waiter(room)
    assert room.leave(turn1) == []
    assert room.kept_for("s1") == 0.1  # no gap known yet: all of grace
    clock.now += 0.11
    assert room.expire_kept("r0") == [waiter]


def test_room_is_kept_a_few_times_the_conversation_s_own_gap_between_turns() -> None:
    room, clock = _room(grace_s=5.0)
    first = _entry(room, "s1", 100)
    room.enter(first, 4096)
    room.leave(first)
    clock.now += 0.02  # the next turn came 20 ms after the last ended
    second = _entry(room, "s1", 100)
    room.enter(second, 4096)
    assert room.kept_for("s1") == pytest.approx(max(GAP_FLOOR_S, 0.08))
    room.leave(second)
    clock.now += 3.0  # a slow turn: its next wait is longer, within grace
    third = _entry(room, "s1", 100)
    room.enter(third, 4096)
    assert room.kept_for("s1") == 5.0
    room.leave(third)
    clock.now += 6.0  # longer than grace: keeping room for it would only idle it
    fourth = _entry(room, "s1", 100)
    room.enter(fourth, 4096)
    assert room.kept_for("s1") == 0.0
    room.leave(fourth)
    assert room.enter(_entry(room, "s2", 4096), 4096)  # nothing is kept for s1


def test_what_waited_past_patience_goes_before_kept_room() -> None:
    room, clock = _room(grace_s=0.5, patience_s=1.0)
    turn1, other = _entry(room, "s1", 2000), _entry(room, "s2", 2000)
    room.enter(turn1, 4096)
    room.enter(other, 4096)
    waiter = _entry(room, "s3", 2000)
    room.enter(waiter, 4096)
    clock.now += 1.0  # the waiter has waited its patience
    assert room.leave(turn1) == [waiter]  # the kept room is not kept from it
    turn2 = _entry(room, "s1", 2100)
    assert not room.enter(turn2, 4096)  # s1's next turn now waits its own turn


def test_a_waiter_that_gives_up_leaves_and_one_forced_goes_over_the_room() -> None:
    room, _ = _room(grace_s=0)
    a = _entry(room, None, 3000)
    room.enter(a, 4096)
    gone, forced = _entry(room, None, 3000), _entry(room, None, 3000)
    room.enter(gone, 4096)
    room.enter(forced, 4096)
    assert room.abandon(gone) == []
    room.force(forced)
    assert forced.inside and room.waiting() == 0
    assert room.leave(a) == [] and room.leave(forced) == []
    assert room.leave(forced) == []  # given back once


def test_the_gate_holds_on_the_event_loop_and_sends_a_request_anyway_after_its_limit() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = RoomGate(loop.time, grace_s=0.05, patience_s=1.0, max_wait_s=0.3, share=1.0)
        first = await _go(gate, "r0", "s1", 3000, 4096)
        second = asyncio.ensure_future(_go(gate, "r0", "s2", 3000, 4096))
        await asyncio.sleep(0.05)  # second is waiting for room
        assert not second.done()
        gate.leave(first)
        await asyncio.sleep(0.1)  # s1's room lapses after its grace: second goes
        assert second.done() and second.result().inside
        stuck = asyncio.ensure_future(_go(gate, "r0", "s3", 3000, 4096))
        started = loop.time()
        entry = await stuck  # nothing leaves: its limit sends it anyway
        assert entry.inside and loop.time() - started >= 0.29

    asyncio.run(scenario())


def test_a_waiter_whose_client_goes_away_frees_its_place() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = RoomGate(loop.time, grace_s=0.0, patience_s=1.0, max_wait_s=5.0, share=1.0)
        first = await _go(gate, "r0", None, 3000, 4096)
        waiting = asyncio.ensure_future(_go(gate, "r0", None, 3000, 4096))
        behind = asyncio.ensure_future(_go(gate, "r0", None, 500, 4096))
        await asyncio.sleep(0.01)  # both wait
        waiting.cancel()
        await asyncio.sleep(0.01)  # the cancelled waiter left: the small one fits beside the first
        assert behind.done() and gate.room.waiting() == 0
        gate.leave(first)

    asyncio.run(scenario())


def test_blocks_two_requests_share_are_counted_once_as_the_engine_holds_them() -> None:
    room, _ = _room(grace_s=0)
    system = tuple(range(25))  # 25 blocks of 16 tokens: a 400-token system prompt both begin with

    def request(own: int) -> Entry:
        blocks = (*system, *range(own, own + 70))  # and 1,120 tokens of their own
        return Entry("r0", None, 1600, room.clock(), blocks, 16)

    first, second, third = request(1000), request(2000), request(3000)
    assert room.enter(first, 4096) and room.enter(second, 4096)  # 400 + 2 x 1,200 of their own
    assert room.enter(third, 4096)  # 400 + 3 x 1,200 = 4,000: the three fit, as in the engine
    fourth = request(4000)
    assert not room.enter(fourth, 4096)
    # The system prompt's blocks are still held by the other two: only the first's own room frees.
    assert room.leave(first) == [fourth]
    assert not room.enter(request(5000), 4096)


def test_a_next_turn_grown_past_its_kept_room_is_next_in_line() -> None:
    room, _ = _room(grace_s=0.1, patience_s=1.0)
    turn1, other = _entry(room, "s1", 2000), _entry(room, None, 2000)  # other: no conversation to keep room for
    room.enter(turn1, 4096)
    room.enter(other, 4096)
    newcomer = _entry(room, "s3", 1000)
    room.enter(newcomer, 4096)
    room.leave(turn1)
    turn2 = _entry(room, "s1", 2200)  # its history grew: 2,000 + 2,200 do not fit
    assert not room.enter(turn2, 4096)
    assert room.leave(other) == [turn2, newcomer]  # it goes first, the newcomer beside it


def test_a_waiter_cancelled_just_after_its_grant_gives_its_room_back() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = RoomGate(loop.time, grace_s=0.0, patience_s=1.0, max_wait_s=5.0, share=1.0)
        first = await _go(gate, "r0", None, 3000, 4096)
        waiting = asyncio.ensure_future(_go(gate, "r0", None, 3000, 4096))
        await asyncio.sleep(0.01)  # it waits
        waiting.cancel()  # its client goes away ...
        gate.leave(first)  # ... and, before its task runs again, room is granted to it
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await asyncio.wait_for(_go(gate, "r0", None, 4000, 4096), 0.1)  # nothing is left claimed

    asyncio.run(scenario())


def _new(room: KvRoom, session: str, tokens: int, among: tuple[str, ...] = ("r0", "r1")) -> Entry:
    entry = Entry("", session, tokens, room.clock())
    entry.among = frozenset(among)
    return entry


def _fill(room: KvRoom, replica: str, tokens: int = 3000) -> Entry:
    entry = _entry(room, None, tokens, replica)
    assert room.enter(entry, 4096)
    return entry


def test_a_new_conversation_waits_for_whichever_replica_frees_room_first() -> None:
    room, _ = _room(grace_s=0)
    on_r0, on_r1 = _fill(room, "r0"), _fill(room, "r1")
    new = _new(room, "s1", 2000)
    assert room.would_wait(new, "r0", 4096) and room.would_wait(new, "r1", 4096)
    assert not room.enter_any(new)
    assert room.waiting() == 1 and new.replica == ""
    assert room.leave(on_r1) == [new]  # r1 freed first: it goes there, not to r0
    assert new.inside and new.replica == "r1"
    assert room.leave(on_r0) == []


def test_waiters_decided_on_a_replica_and_new_conversations_take_its_room_in_the_order_they_came() -> None:
    room, clock = _room(grace_s=0)
    on_r0 = _fill(room, "r0", 3500)
    _fill(room, "r1", 3500)
    first = _new(room, "s1", 1000)
    assert not room.enter_any(first)
    clock.now += 0.1
    follow_up = _entry(room, "s0", 2000, "r0")  # decided on r0: its history is there
    assert not room.enter(follow_up, 4096)  # behind the new conversation that came first
    clock.now += 0.1
    second = _new(room, "s2", 1000)
    assert not room.enter_any(second)
    assert room.would_wait(_new(room, "s3", 10), "r0", 4096)  # others wait for r0: a newcomer too
    assert room.leave(on_r0) == [first, follow_up, second]  # 1,000 + 2,000 + 1,000 fit in 4,096
    assert first.replica == second.replica == "r0"


def test_a_new_conversation_waits_only_for_the_replicas_it_may_go_to() -> None:
    room, _ = _room(grace_s=0)
    _fill(room, "r0")
    on_r1 = _fill(room, "r1")
    new = _new(room, "s1", 2000, among=("r0",))
    assert not room.enter_any(new)
    assert room.leave(on_r1) == []  # room on r1 is not room for it
    assert room.waiting() == 1


def test_a_new_conversation_that_gives_up_lets_the_one_behind_it_take_the_room() -> None:
    room, _ = _room(grace_s=0)
    on_r0 = _fill(room, "r0", 2000)
    big, small = _new(room, "s1", 3000, among=("r0",)), _new(room, "s2", 1000, among=("r0",))
    assert not room.enter_any(big)
    assert not room.enter_any(small)  # first come first served: behind the big one, though it fits
    assert room.abandon(big) == [small]
    assert small.inside and room.waiting() == 0
    room.leave(on_r0)


def test_the_gate_gives_a_new_conversation_the_first_room_or_nothing_after_its_limit() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = RoomGate(loop.time, grace_s=0.0, patience_s=1.0, max_wait_s=0.2, share=1.0)
        await _go(gate, "r0", None, 3000, 4096)
        on_r1 = await _go(gate, "r1", None, 3000, 4096)
        waiting = asyncio.ensure_future(gate.enter_any(_new(gate.room, "s1", 2000)))
        await asyncio.sleep(0.01)  # it waits for either
        gate.leave(on_r1)
        entry = await asyncio.wait_for(waiting, 0.1)
        assert entry.inside and entry.replica == "r1"
        started = loop.time()
        late = await gate.enter_any(_new(gate.room, "s2", 3000))  # r0 and r1 stay full
        assert not late.inside and loop.time() - started >= 0.19
        assert gate.room.waiting() == 0  # it no longer waits: its decision sends it anyway

    asyncio.run(scenario())


def test_a_new_conversation_that_waited_its_patience_goes_before_a_next_turn_s_kept_room() -> None:
    room, clock = _room(grace_s=0.5, patience_s=1.0)
    turn1, other = _entry(room, "s1", 2000), _entry(room, None, 2000)
    room.enter(turn1, 4096)
    room.enter(other, 4096)
    new = _new(room, "s2", 2000, among=("r0",))
    assert not room.enter_any(new)
    assert room.leave(turn1) == []  # the room is kept for s1's next turn
    clock.now += 1.0  # the new conversation has waited its patience
    turn2 = _entry(room, "s1", 2000)
    assert not room.enter(turn2, 4096)  # it goes after the new conversation
    assert room.expire_kept("r0") == [new]


def test_kept_room_waits_for_a_next_turn_that_arrived_while_the_router_decides_it() -> None:
    room, clock = _room(grace_s=0.1, patience_s=1.0)
    turn1, waiter = _full_with_a_waiter(room)
    assert room.leave(turn1) == []
    clock.now += 0.09
    assert room.arrived("s1") == ["r0"]  # s1's next turn is here, not yet decided
    clock.now += 0.05  # past the moment kept at its end
    assert room.expire_kept("r0") == []  # still kept: its turn is on its way to it
    assert room.enter(_entry(room, "s1", 2090), 4096)
    assert not waiter.inside


def test_a_conversation_s_gap_is_measured_to_its_arrival_not_to_its_decision() -> None:
    room, clock = _room(grace_s=0.1)
    first = _entry(room, "s1", 100)
    room.enter(first, 4096)
    room.leave(first)
    clock.now += 0.01
    room.arrived("s1")
    clock.now += 0.3  # the router took its time deciding it: not the conversation's think time
    second = _entry(room, "s1", 200)
    room.enter(second, 4096)
    assert room.kept_for("s1") == GAP_FLOOR_S  # 4 x 10 ms, at least the floor; not 0 (think time)
    assert room.arrived("s9") == []  # nothing kept for a conversation never seen


def test_the_gate_lets_an_arrived_turn_s_room_go_once_its_longer_wait_is_over() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate = RoomGate(loop.time, grace_s=0.2, patience_s=5.0, max_wait_s=5.0, share=1.0)
        turn1 = await _go(gate, "r0", "s1", 2000, 4096)
        await _go(gate, "r0", "s2", 2000, 4096)
        waiter = asyncio.ensure_future(_go(gate, "r0", "s3", 2000, 4096))
        await asyncio.sleep(0)  # the waiter is in line
        gate.leave(turn1)  # s1's room kept 0.2 s
        await asyncio.sleep(0.15)  # its next turn comes late in that moment
        gate.arrived("s1")  # and then never reaches the room (refused, say): kept to 0.35 s
        await asyncio.sleep(0.1)  # past the moment kept at its end, within the longer wait
        assert not waiter.done()
        entry = await asyncio.wait_for(waiter, 1.0)  # the longer wait over, the room goes on
        assert entry.inside

    asyncio.run(scenario())


def test_room_is_kept_at_least_as_late_as_next_turns_sent_at_once_come_here() -> None:
    room, clock = _room(grace_s=0.25)
    for i in range(20):  # next turns sent at once: most after 10 ms, two after 90 ms
        turn = _entry(room, f"s{i}", 100)
        room.enter(turn, 4096)
        room.leave(turn)
        clock.now += 0.09 if i in (3, 11) else 0.01
        room.arrived(f"s{i}")
    slow = _entry(room, "thinker", 100)
    room.enter(slow, 4096)
    room.leave(slow)
    clock.now += 2.0  # think time: no measure of how late a turn sent at once comes
    room.arrived("thinker")
    assert room.floor_s == pytest.approx(0.09)
    assert room.kept_for("s0") == pytest.approx(0.09)  # its own 10 ms x 4 would lapse before many come
    assert room.kept_for("thinker") == 0.0
