"""When the members of a room joined it, for rooms that show their history to a member only from then on.

In a room whose history visibility is ``joined`` (or ``invited``) a newcomer's client shows nothing said
before they came, but the bot stored all of it: a reply to them may hold only what came after
(``bot.ports.IncomingMessage.history_from``). A member's join is the ``origin_server_ts`` of the membership
event that made them a member. The room's state gives the current membership events, read once per room
(and again for a member it does not know yet); the join events the timeline brings keep it current. A state
event that only changed a member's name or avatar replaced their join: the one before it is read, a few
steps back at most; beyond that its own (later) time stands, which only hides more.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nio import AsyncClient, RoomGetStateResponse, RoomMemberEvent

from adapters.matrix_content import json_object, keep

log = logging.getLogger(__name__)

HIDDEN_BEFORE_JOIN = ("joined", "invited")  # the history visibilities that do
STEPS_BACK = 3  # membership events replaced by name or avatar changes read back at most, per member
ROOMS_KEPT = 1000  # rooms whose members' joins are kept (the least recently asked go first)


def _stamp(event: dict[str, Any]) -> float | None:
    value = event.get("origin_server_ts")
    return value / 1000 if isinstance(value, int) and value > 0 else None


def _rejoined(event: dict[str, Any]) -> bool:
    """Whether the membership event made its member join (not a change of name or avatar of one who was in)."""
    unsigned = json_object(event.get("unsigned"))
    before = json_object(unsigned.get("prev_content") or event.get("prev_content"))
    return before.get("membership") != "join"


@dataclass(slots=True)
class _Room:
    joins: dict[str, float]  # member -> when they joined (POSIX seconds)
    # Members whose current membership event changed their name or avatar, its time standing for their join
    # until they are asked about (then the events before it are read).
    unsure: dict[str, dict[str, Any]] = field(default_factory=dict)


class JoinTimes:
    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._rooms: OrderedDict[str, _Room] = OrderedDict()

    def note(self, room_id: str, event: RoomMemberEvent) -> None:
        """A membership event of the room's timeline (rooms not read yet are read when first asked)."""
        room = self._rooms.get(room_id)
        if room is None:
            return
        if event.membership != "join":
            room.joins.pop(event.state_key, None)
            room.unsure.pop(event.state_key, None)
        elif event.prev_membership != "join" and (stamp := _stamp(event.source)) is not None:
            room.joins[event.state_key] = stamp
            room.unsure.pop(event.state_key, None)

    def forget(self, room_id: str) -> None:
        """Read the room's members again when next asked (a limited sync may have skipped their comings and goings)."""
        self._rooms.pop(room_id, None)

    async def joined_at(self, room_id: str, user_id: str) -> datetime | None:
        """When ``user_id`` last joined the room, or None when the server cannot say."""
        room = self._rooms.get(room_id)
        if room is None or user_id not in room.joins:
            room = await self._read(room_id) or room
            if room is None:
                return None
            keep(self._rooms, room_id, room, ROOMS_KEPT)
        else:
            self._rooms.move_to_end(room_id)
        if (event := room.unsure.pop(user_id, None)) is not None:
            room.joins[user_id] = await self._join_of(room_id, event) or room.joins[user_id]
        stamp = room.joins.get(user_id)
        return None if stamp is None else datetime.fromtimestamp(stamp, UTC)

    async def _read(self, room_id: str) -> _Room | None:
        response = await self.client.room_get_state(room_id)
        if not isinstance(response, RoomGetStateResponse):
            log.warning("Matrix: could not read who joined %s when: %s", room_id, response)
            return None
        room = _Room({})
        for event in response.events:
            if (isinstance(event, dict) and event.get("type") == "m.room.member"
                    and json_object(event.get("content")).get("membership") == "join"
                    and isinstance(member := event.get("state_key"), str)
                    and (stamp := _stamp(event)) is not None):
                room.joins[member] = stamp
                if not _rejoined(event):
                    room.unsure[member] = event
        return room

    async def _join_of(self, room_id: str, event: dict[str, Any]) -> float | None:
        """The time of the join behind ``event`` (a member's current membership event, a change of name or
        avatar): the events it replaced, read back ``STEPS_BACK`` at most."""
        for _ in range(STEPS_BACK):
            replaced = json_object(event.get("unsigned")).get("replaces_state")
            if not isinstance(replaced, str):
                return None
            response = await self.client.room_get_event(room_id, replaced)
            earlier = getattr(getattr(response, "event", None), "source", None)
            if not isinstance(earlier, dict) or _stamp(earlier) is None:
                return None
            if _rejoined(earlier):
                return _stamp(earlier)
            event = earlier
        return None
