"""When members joined a room (adapters.matrix_joins), against what no single local Synapse can send: membership
events whose time another federation member's homeserver (or a bridge) wrote, and state reads overtaken by the
sync. The client is a stand-in for nio's with the same answers; the room's real behaviour is tested on Synapse in
test_matrix_hardening.py."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from nio import RoomGetEventError, RoomGetStateResponse, RoomMemberEvent, RoomMessageText

from adapters.matrix import _server_time
from adapters.matrix_joins import JoinTimes

ROOM = "!room:example.org"
BOT = "@cora:example.org"
NOW = 1_800_000_000.0  # the bot's clock, in seconds


def member(user: str, ms: int, *, prev: str | None = None, membership: str = "join",
           replaces: str | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "m.room.member", "state_key": user, "sender": user,
                             "event_id": f"${user}-{ms}", "origin_server_ts": ms,
                             "content": {"membership": membership}, "unsigned": {}}
    if prev:
        event["unsigned"]["prev_content"] = {"membership": prev}
    if replaces:
        event["unsigned"]["replaces_state"] = replaces
    return event


class Homeserver:
    """Answers state reads with ``state`` (counting them; ``gate``, when set, holds each read until it is set)."""

    def __init__(self, *state: dict[str, Any]) -> None:
        self.user_id = BOT
        self.state = list(state)
        self.reads = 0
        self.gate: asyncio.Event | None = None

    async def room_get_state(self, room_id: str) -> RoomGetStateResponse:
        self.reads += 1
        snapshot = list(self.state)
        await asyncio.sleep(0.01)
        if self.gate is not None:
            await self.gate.wait()
        return RoomGetStateResponse(snapshot, room_id)

    async def room_get_event(self, room_id: str, event_id: str) -> RoomGetEventError:
        return RoomGetEventError("Event not found.", "M_NOT_FOUND")


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


def live(joins: JoinTimes, event: dict[str, Any]) -> None:
    joins.note(ROOM, RoomMemberEvent.from_dict(event))  # type: ignore[arg-type]


async def test_a_join_seen_arriving_is_never_earlier_than_its_arrival() -> None:
    """Mallory's homeserver stamps her join 1 ms after 1970: everything the bot stored would be hers to hear."""
    clock = Clock()
    joins = JoinTimes(Homeserver(member(BOT, 1_700_000_000_000)), clock)  # type: ignore[arg-type]
    live(joins, member("@mallory:evil.example", 1, prev="invite"))
    assert await joins.joined_at(ROOM, "@mallory:evil.example") == at(NOW)


async def test_one_who_joined_in_a_skipped_stretch_joined_after_its_start() -> None:
    """A limited sync skipped Mallory's (back-dated) join: it happened after the sync before it, whatever it says;
    Ann, there before, keeps her time."""
    clock = Clock()
    server = Homeserver(member(BOT, 1_700_000_000_000), member("@ann:example.org", 1_700_000_100_000))
    joins = JoinTimes(server, clock)  # type: ignore[arg-type]
    assert await joins.joined_at(ROOM, "@ann:example.org") == at(1_700_000_100)
    server.state.append(member("@mallory:evil.example", 1, prev="invite"))
    clock.now += 60
    joins.gap(ROOM, NOW + 30)  # (the last sync before the skipped stretch)
    assert await joins.joined_at(ROOM, "@mallory:evil.example") == at(NOW + 30)
    assert await joins.joined_at(ROOM, "@ann:example.org") == at(1_700_000_100)
    # Ann left and came back within another skipped stretch, her new join back-dated: not before it began.
    server.state[1] = member("@ann:example.org", 2, prev="leave")
    joins.gap(ROOM, NOW + 90)
    assert await joins.joined_at(ROOM, "@ann:example.org") == at(NOW + 90)


async def test_messages_after_a_limited_sync_share_one_read_and_a_stranger_costs_none_more() -> None:
    server = Homeserver(member(BOT, 1_700_000_000_000),
                        *(member(f"@u{n}:example.org", 1_700_000_000_000 + n) for n in range(2000)))
    joins = JoinTimes(server, Clock())  # type: ignore[arg-type]
    await joins.joined_at(ROOM, "@u1:example.org")
    joins.gap(ROOM, NOW)
    found = await asyncio.gather(*(joins.joined_at(ROOM, f"@u{n % 50}:example.org") for n in range(30)))
    assert server.reads == 2 and all(found)
    for _ in range(20):  # not (or no longer) a member: the server said so once
        assert await joins.joined_at(ROOM, "@gone:example.org") is None
    assert server.reads == 2


async def test_a_leave_and_rejoin_arriving_while_the_state_is_read_are_not_undone_by_it() -> None:
    clock = Clock()
    server = Homeserver(member(BOT, 1_700_000_000_000), member("@bob:example.org", 1_700_000_000_000, prev="invite"))
    server.gate = asyncio.Event()
    joins = JoinTimes(server, clock)  # type: ignore[arg-type]
    reading = asyncio.create_task(joins.joined_at(ROOM, BOT))
    await asyncio.sleep(0.05)
    clock.now += 10
    live(joins, member("@bob:example.org", int((NOW + 5) * 1000), prev="join", membership="leave"))
    clock.now += 10
    live(joins, member("@bob:example.org", int((NOW + 15) * 1000), prev="leave"))
    server.gate.set()
    await reading
    assert await joins.joined_at(ROOM, "@bob:example.org") == at(NOW + 20)


async def test_a_name_change_hides_no_history_of_one_there_before_the_bot() -> None:
    """The server does not show the bot events from before its join: a member whose current membership event is a
    name change, behind which the server shows nothing, was there before the bot, and sees all it stored."""
    server = Homeserver(member(BOT, 1_700_000_000_000),
                        member("@bob:example.org", 1_700_000_500_000, prev="join", replaces="$bob-old"))
    joins = JoinTimes(server, Clock())  # type: ignore[arg-type]
    assert await joins.joined_at(ROOM, "@bob:example.org") == at(1_700_000_000)


async def test_a_leave_arriving_while_a_join_is_looked_behind_is_kept() -> None:
    walking = asyncio.Event()

    class Slow(Homeserver):
        async def room_get_event(self, room_id: str, event_id: str) -> RoomGetEventError:
            await walking.wait()
            return await super().room_get_event(room_id, event_id)

    clock = Clock()
    server = Slow(member(BOT, 1_700_000_000_000),
                  member("@bob:example.org", 1_700_000_500_000, prev="join", replaces="$bob-old"))
    joins = JoinTimes(server, clock)  # type: ignore[arg-type]
    reading = asyncio.create_task(joins.joined_at(ROOM, "@bob:example.org"))
    await asyncio.sleep(0.05)  # (the state is read; the walk behind Bob's name change waits)
    clock.now += 5
    live(joins, member("@bob:example.org", int((NOW + 5) * 1000), prev="join", membership="leave"))
    walking.set()
    assert await reading is None


async def test_a_busy_room_keeps_no_record_of_everyone_who_ever_left() -> None:
    """Thousands come and go in a public room after its state was read: the bot remembers who is in it, not each
    member who ever left (kept only while a state read is under way, which the leaves must overtake)."""
    clock = Clock()
    joins = JoinTimes(Homeserver(member(BOT, 1_700_000_000_000)), clock)  # type: ignore[arg-type]
    assert await joins.joined_at(ROOM, BOT) is not None
    for i in range(2_000):
        user = f"@visitor{i}:example.org"
        live(joins, member(user, 1_700_000_000_000 + i, prev="invite"))
        live(joins, member(user, 1_700_000_000_001 + i, prev="join", membership="leave"))
    room = joins._rooms[ROOM]
    assert list(room.joins) == [BOT]
    assert len(room.left) == 0


async def test_a_stamp_past_year_9999_counts_as_no_stamp() -> None:
    """A homeserver stamped a join (or a message) after year 9999: ``datetime.fromtimestamp`` raised "year 10000
    is out of range", so the member's every addressed message in the room went unanswered (and a message so
    stamped anywhere did). Seen arriving, the join counts from its arrival; the message is dated by the bot."""
    clock = Clock()
    joins = JoinTimes(Homeserver(member(BOT, 1_700_000_000_000)), clock)  # type: ignore[arg-type]
    live(joins, member("@mallory:evil.example", 253_402_300_800_000, prev="invite"))
    assert await joins.joined_at(ROOM, "@mallory:evil.example") == at(NOW)
    message = RoomMessageText.from_dict({"type": "m.room.message", "sender": "@mallory:evil.example",
                                         "event_id": "$m", "origin_server_ts": 10**17,
                                         "content": {"msgtype": "m.text", "body": "hi"}})
    assert _server_time(message) is None
    message.server_timestamp = 1_700_000_000_000
    assert _server_time(message) == at(1_700_000_000)


async def test_a_state_join_stamped_past_year_9999_counts_from_now() -> None:
    """The same stamp read from the room's state (a member the bot did not see join): from the bot's clock."""
    joins = JoinTimes(Homeserver(member(BOT, 1_700_000_000_000), member("@ann:far.example", 2**62)),
                      Clock())  # type: ignore[arg-type]
    assert await joins.joined_at(ROOM, "@ann:far.example") == at(NOW)
