"""When the members of a room joined it, for rooms that show their history to a member only from then on.

In a room whose history visibility is ``joined`` (or ``invited``) a newcomer's client shows nothing said
before they came, but the bot stored all of it: a reply to them may hold only what came after
(``bot.ports.IncomingMessage.history_from``).

A member's join comes from two places, and neither trusts a clock it need not:
- **Seen arriving** (a join in the timeline, :meth:`JoinTimes.note`): it happened before it arrived, so its time
  is the later of its stamp and its arrival. Its stamp (``origin_server_ts``) is written by the member's own
  homeserver, which may write anything (a server of another federation member, a bridge).
- **Read from the room's state** (a member the bot has not seen join: they were there before it looked), once per
  room and again after a limited sync may have skipped comings and goings, one read at a time per room. A member
  who was not there before the skipped stretch joined within it: not before its start (``floor``). A state event
  that only changed a member's name or avatar stands for their join until the events behind it are read (a few
  steps back at most); one the server does not show the bot is older than the bot's own join, and so is the
  member's: the bot's join stands for it. What the first look at a room finds is taken as its stamps say.

A member the server does not list as joined has no time (the caller then shows nothing said before).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nio import AsyncClient, RoomGetStateResponse, RoomMemberEvent

from adapters.matrix_content import json_object, server_seconds

log = logging.getLogger(__name__)

HIDDEN_BEFORE_JOIN = ("joined", "invited")  # the history visibilities that do
STEPS_BACK = 3  # membership events replaced by name or avatar changes read back at most, per member
ROOMS_KEPT = 1000  # rooms whose members' joins are kept (the least recently asked go first)


@dataclass(frozen=True, slots=True)
class _Join:
    at: float  # when they joined (POSIX seconds)
    event_id: str  # the membership event that made them a member
    noted: float  # when the bot learnt it (its own clock)


@dataclass(slots=True)
class _Room:
    joins: dict[str, _Join] = field(default_factory=dict)
    read: bool = False  # every member's join is known (the state was read, and no limited sync came since)
    viewed: bool = False  # the state was read once: who is not in ``joins`` after a skipped stretch came in it
    floor: float = 0.0  # the start of the stretches limited syncs skipped since the last read (0: none)
    left: dict[str, float] = field(default_factory=dict)  # member -> when their leave arrived


def _stamp(event: dict[str, Any]) -> float | None:
    return server_seconds(event.get("origin_server_ts"))


def _rejoined(event: dict[str, Any]) -> bool:
    """Whether the membership event made its member join (not a change of name or avatar of one who was in)."""
    unsigned = json_object(event.get("unsigned"))
    before = json_object(unsigned.get("prev_content") or event.get("prev_content"))
    return before.get("membership") != "join"


def _member_joins(events: list[Any]) -> dict[str, dict[str, Any]]:
    """The state's membership events of those joined, by member."""
    return {member: event for event in events
            if isinstance(event, dict) and event.get("type") == "m.room.member"
            and json_object(event.get("content")).get("membership") == "join"
            and isinstance(member := event.get("state_key"), str) and isinstance(event.get("event_id"), str)}


class JoinTimes:
    def __init__(self, client: AsyncClient, clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.clock = clock
        self._rooms: OrderedDict[str, _Room] = OrderedDict()
        self._reads: dict[str, asyncio.Task[None]] = {}

    def _room(self, room_id: str) -> _Room:
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = _Room()
            while len(self._rooms) > ROOMS_KEPT:
                self._rooms.popitem(last=False)
        self._rooms.move_to_end(room_id)
        return room

    def note(self, room_id: str, event: RoomMemberEvent) -> None:
        """A membership event of the room's timeline, as it arrives."""
        room, now, member = self._room(room_id), self.clock(), event.state_key
        if event.membership != "join":
            room.joins.pop(member, None)
            # Kept only while a state read is under way, which may still list them (a read drops what came
            # before it began): noted at every leave, a busy room's record grew by each member who ever left.
            if room_id in self._reads:
                room.left[member] = now
        elif event.prev_membership != "join" or member not in room.joins:
            if event.prev_membership == "join":
                return  # a name change of a member not known yet: the state tells when they came
            room.joins[member] = _Join(max(_stamp(event.source) or now, now), event.event_id, now)
            room.left.pop(member, None)

    def gap(self, room_id: str, since: float) -> None:
        """A limited sync skipped the room's events from ``since`` (the bot's clock) on: its members are read
        again when next asked, and who joined meanwhile did so after ``since``."""
        room = self._rooms.get(room_id)
        if room is not None:
            room.read = False
            room.floor = min(room.floor, since) if room.floor else since

    async def joined_at(self, room_id: str, user_id: str) -> datetime | None:
        """When ``user_id`` last joined the room, or None when the server does not list them as joined."""
        room = self._room(room_id)
        if not room.read and (user_id not in room.joins or room.floor):
            await self._read_once(room_id)
            room = self._room(room_id)
        join = room.joins.get(user_id)
        return None if join is None else datetime.fromtimestamp(join.at, UTC)

    async def _read_once(self, room_id: str) -> None:
        """Read the room's state, sharing a read already under way."""
        reading = self._reads.get(room_id)
        if reading is None:
            reading = self._reads[room_id] = asyncio.create_task(self._read(room_id))
            reading.add_done_callback(lambda _: self._reads.pop(room_id, None))
        await asyncio.shield(reading)

    async def _read(self, room_id: str) -> None:
        began = self.clock()
        try:
            response = await self.client.room_get_state(room_id)
        except Exception as exc:  # (a dropped connection: the next message asks again)
            response = exc
        if not isinstance(response, RoomGetStateResponse):
            log.warning("Matrix: could not read who joined %s when: %s", room_id, response)
            return
        current = _member_joins(response.events)
        mine = current.get(self.client.user_id)
        room = self._room(room_id)
        joins: dict[str, _Join] = {}
        for member, event in current.items():
            known = room.joins.get(member)
            # (one the bot knew, or one not there when it last looked, joined after a skipped stretch began)
            floor = room.floor if room.viewed or known is not None else 0.0
            joins[member] = await self._join(room_id, event, known, floor, mine)
        # What arrived while the state was read is newer than it: leaves, and joins.
        joins = {member: join for member, join in joins.items() if room.left.get(member, 0.0) < began}
        joins |= {member: join for member, join in room.joins.items() if join.noted >= began}
        room.joins, room.read, room.viewed, room.floor = joins, True, True, 0.0
        room.left = {member: at for member, at in room.left.items() if at >= began}

    async def _join(self, room_id: str, event: dict[str, Any], known: _Join | None, floor: float,
                    mine: dict[str, Any] | None) -> _Join:
        """The member's join behind their current membership event ``event`` (``known``: as the bot knew it)."""
        now = self.clock()
        if known is not None and known.event_id == event["event_id"]:
            return known
        behind = event
        for _ in range(STEPS_BACK if not _rejoined(event) else 0):
            replaced = json_object(behind.get("unsigned")).get("replaces_state")
            if not isinstance(replaced, str):
                break
            if known is not None and replaced == known.event_id:
                return known  # a name change since the join the bot knew
            response = await self.client.room_get_event(room_id, replaced)
            earlier = getattr(getattr(response, "event", None), "source", None)
            if not isinstance(earlier, dict):
                if getattr(response, "status_code", None) in ("M_FORBIDDEN", "M_NOT_FOUND") and mine is not None:
                    # Hidden from the bot: from before its join, and so was the member's.
                    behind = {**mine, "event_id": event["event_id"]}
                break
            behind = earlier
            if _rejoined(earlier):
                break
        at = max(_stamp(behind) or now, floor, known.noted if known is not None else 0.0)
        return _Join(at, str(event["event_id"]), now)
